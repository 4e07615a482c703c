"""The Triton (CUDA) kernels against the reference kernels: under TRITON_INTERPRET=1 on CPU tensors
(conftest sets it where there is no GPU), natively on a GPU.

Each case has padded rows (the dummy slot 0 / page 0 that padding writes), state or caches with
non-contiguous slot strides, and, for the ops whose tensors follow the model's dtype (KV writes,
attention, experts), bf16 as well as fp32. bf16 results are held to the reference run in fp32 on the
same bf16 inputs: the kernels compute in fp32 and round once on store. The conv state and the sampled
logits are fp32 whatever the model dtype, so those ops run in fp32 only.
"""

import importlib
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from inkling_compiled.custom_ops import KERNELS
from inkling_compiled.custom_ops.attention import extend_attention_reference, paged_attention_reference
from inkling_compiled.custom_ops.moe import moe_experts_reference

from cached_chunks import cached_chunk_case

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = {name: kernels["CUDA"] for name, kernels in KERNELS.items()}


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def ids(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def strided_slots(state: torch.Tensor) -> torch.Tensor:
    """The same values in a tensor whose slot stride is not the contiguous one (every other slot of a
    bigger buffer), as a pool slice can be."""
    wide = torch.full((state.shape[0] * 2, *state.shape[1:]), float("nan"), dtype=state.dtype, device=state.device)
    view = wide[::2]
    view.copy_(state)
    assert not view.is_contiguous()
    return view


def close(got, want, dtype):
    if dtype == torch.float32:
        return torch.allclose(got.float(), want.float(), atol=2e-5, rtol=1e-5)
    return torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)  # one bf16 rounding of the result


@pytest.mark.parametrize("K, D, T_d", [(3, 40, 2), (4, 200, 5)])
def test_sconv_verify_and_commit(K, D, T_d):
    g = torch.Generator().manual_seed(K + T_d)
    state, w = strided_slots(randn(6, K - 1, D, g=g)), randn(D, K, g=g)
    idx = ids([3, 1, 5, 0])  # a padded row on the dummy slot
    x = randn(4 * T_d, D, g=g)
    want_windows, got_windows = torch.zeros(6, T_d, K - 1, D, device=DEVICE), torch.zeros(6, T_d, K - 1, D, device=DEVICE)
    before = state.clone()
    want = KERNELS["sconv_verify"]["reference"](x, state, w, idx, want_windows)
    got = CUDA["sconv_verify"](x, state, w, idx, got_windows)
    assert torch.equal(state, before) and close(got, want, torch.float32)
    assert torch.equal(got_windows, want_windows)
    # the commit, over a pool stream of two layers, rows accepting different counts (and one skipped)
    pools = [[before.clone(), before + 1] for _ in range(2)]
    saved = [got_windows, got_windows * 2]
    slots, steps = ids([3, 1, 5]), ids([T_d - 1, 0, -1], dtype=torch.int64)
    KERNELS["commit_conv_windows"]["reference"](pools[0], saved, slots, steps)
    CUDA["commit_conv_windows"](pools[1], saved, slots, steps)
    assert all(torch.equal(a, b) for a, b in zip(*pools)) and not torch.equal(pools[0][0][3], before[3])


@pytest.mark.parametrize("K, D", [(3, 40), (4, 200)])
def test_sconv_decode(K, D):
    g = torch.Generator().manual_seed(K)
    state, w, x = randn(6, K - 1, D, g=g), randn(D, K, g=g), randn(5, D, g=g)
    idx = ids([3, 1, 5, 0, 0])  # two padded rows on the dummy slot
    want_state = state.clone()
    want = KERNELS["sconv_decode"]["reference"](x, want_state, w, idx)
    got_state = strided_slots(state)
    got = CUDA["sconv_decode"](x, got_state, w, idx)
    live = 3
    assert close(got[:live], want[:live], torch.float32)
    assert torch.allclose(got_state[1:], want_state[1:], atol=0, rtol=0)  # the live windows shift exactly


@pytest.mark.parametrize("K, D", [(3, 40), (4, 200)])
def test_sconv_extend_with_history(K, D):
    g = torch.Generator().manual_seed(10 + K)
    lens = [1, 5, 2, 3, 1]  # shorter and longer than the window
    qsl = ids([0, *torch.tensor(lens).cumsum(0).tolist()])
    x, state, w = randn(sum(lens), D, g=g), randn(7, K - 1, D, g=g), randn(D, K, g=g)
    init = torch.tensor([True, False, True, True, False], device=DEVICE)
    idx = ids([2, 4, 5, 1, 0])  # the last row is padding on the dummy slot
    want_state = state.clone()
    want = KERNELS["sconv_extend"]["reference"](x, want_state, w, qsl, init, idx)
    got_state = strided_slots(state)
    got = CUDA["sconv_extend"](x, got_state, w, qsl, init, idx)
    assert close(got, want, torch.float32)
    assert torch.equal(got_state, want_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_skips_negative_locations(dtype):
    g = torch.Generator().manual_seed(20)
    k_cache, v_cache = randn(12, 2, 8, g=g, dtype=dtype), randn(12, 2, 8, g=g, dtype=dtype)
    k, v = randn(5, 2, 8, g=g, dtype=dtype), randn(5, 2, 8, g=g, dtype=dtype)
    loc = ids([7, -1, 3, -1, 0], dtype=torch.int64)  # -1: a ring skips it; 0: a padded row's dummy
    want_k, want_v = k_cache.clone(), v_cache.clone()
    KERNELS["kv_write"]["reference"](want_k, want_v, k, v, loc)
    got_k, got_v = strided_slots(k_cache), strided_slots(v_cache)
    CUDA["kv_write"](got_k, got_v, k, v, loc)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def fp32(args):
    return [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tau", [False, True])
def test_paged_attention(dtype, tau):
    g = torch.Generator().manual_seed(30)
    B, nh, nkv, hd, E, page, pages = 5, 6, 2, 8, 11, 4, 9
    q, table = randn(B, nh, hd, g=g, dtype=dtype), randn(B, nh, E, g=g, dtype=dtype)
    k_cache, v_cache = randn(40 * page, nkv, hd, g=g, dtype=dtype), randn(40 * page, nkv, hd, g=g, dtype=dtype)
    # A table wider than any row needs (several splits, most of them past a row's length).
    block_table = torch.randint(1, 40, (6, pages), generator=g, dtype=torch.int32).to(DEVICE)
    block_table[0] = 0
    cache_indices, seq_lens = ids([2, 0, 4, 1, 0]), ids([1, 1, 17, 36, 1])  # rows 1 and 4: padding
    scale = (torch.rand(B, generator=g) + 1).to(DEVICE) if tau else None
    args = [q, k_cache, v_cache, table, scale, block_table, cache_indices, seq_lens, page, E]
    want = paged_attention_reference(*fp32(args))
    got = CUDA["paged_attention"](*args[:1], strided_slots(k_cache), strided_slots(v_cache), *args[3:])
    assert got.dtype == dtype and close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_attention(dtype):
    g = torch.Generator().manual_seed(40)
    B, nh, nkv, hd, E, W, slots = 5, 4, 2, 16, 6, 5, 4
    q, table = randn(B, nh, hd, g=g, dtype=dtype), randn(B, nh, E, g=g, dtype=dtype)
    k_ring, v_ring = randn(slots * W, nkv, hd, g=g, dtype=dtype), randn(slots * W, nkv, hd, g=g, dtype=dtype)
    positions = ids([0, 3, 4, 12, 0], dtype=torch.int64)  # rings filling up, full, and a padded row
    cache_indices = ids([1, 2, 3, 1, 0])
    args = [q, k_ring, v_ring, table, positions, cache_indices, W, E]
    want = KERNELS["ring_attention"]["reference"](*fp32(args))
    got = CUDA["ring_attention"](*args)
    assert got.dtype == dtype and close(got, want, dtype)


def packed_chunks(g, chunks, histories, nkv, group, hd, dtype, tau, extent=20):
    """Sequence b: histories[b] cached keys, then chunks[b] new tokens (queries and keys)."""
    T, S = sum(chunks), sum(chunks) + sum(histories)
    qsl = ids([0, *itertools.accumulate(chunks)], dtype=torch.int64)
    ksl = ids([0, *itertools.accumulate(c + h for c, h in zip(chunks, histories))], dtype=torch.int64)
    q = randn(T, nkv * group, hd, g=g, dtype=dtype)
    k, v = randn(S, nkv, hd, g=g, dtype=dtype), randn(S, nkv, hd, g=g, dtype=dtype)
    table = (randn(T, nkv * group, extent, g=g) * 2).to(dtype)
    scale = (torch.rand(T, generator=g) + 0.5).to(DEVICE) if tau else None
    return [q, k, v, table, scale, qsl, ksl]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 24])
def test_extend_attention(dtype, window):
    """Chunks of 1 to 300 tokens (many query blocks, a block of one) over histories crossing the window
    and the relative extent (20), GQA 1, 3 (a padded head group) and 8, head dims 8 and 16; then NaN in
    every other sequence's keys and values, and in a sliding sequence's keys before every query's window,
    changes nothing."""
    g = torch.Generator().manual_seed(50 + window)
    for nkv, group, hd, longest in [(2, 3, 8, 45), (1, 8, 16, 45), (1, 1, 16, 300)]:  # the interpreter is slow
        args = packed_chunks(g, [1, 7, longest, 33], [0, 50, 5, 19], nkv, group, hd, dtype, tau=window == 0)
        want = extend_attention_reference(*fp32(args), window, 20)
        got = CUDA["extend_attention"](*args, window, 20)
        assert got.dtype == dtype and close(got, want, dtype), (nkv, group)
    if window == 0:  # the log scale read through its stride (a slice of a wider tensor)
        wide = torch.zeros(2 * args[4].shape[0], device=DEVICE)
        wide[::2] = args[4]
        assert torch.equal(CUDA["extend_attention"](*args[:4], wide[::2], *args[5:], window, 20), got)
    # Sequence 1 (50 cached keys, 7 queries) keeps its keys; its first query sees back to key 50-window+1.
    (k0, k1), (q0, q1) = args[6][1:3].tolist(), args[5][1:3].tolist()
    seen_from = k0 + (50 - window + 1 if window else 0)
    k, v = args[1].clone(), args[2].clone()
    for t in (k, v):
        t[:seen_from], t[k1:] = float("nan"), float("nan")
    again = CUDA["extend_attention"](args[0], k, v, *args[3:], window, 20)
    assert torch.equal(again[q0:q1], got[q0:q1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, ring_size", [(0, 0), (8, 11)])
def test_cached_extend_attention(dtype, window, ring_size):
    """Each row's history read in the kernel through a shuffled block table or its slot's ring (every
    other cache entry NaN), chunks of 1 to 30 over 0 to 40 cached keys, GQA 1 and 3: as the reference,
    and the chunks' keys written after the history was read."""
    g = torch.Generator().manual_seed(70 + window)
    for nkv, group in [(1, 1), (2, 3)]:
        case = cached_chunk_case(g, [3, 1, 30, 9], [0, 5, 40, 17], nkv, group, 8, window=window,
                                 ring_size=ring_size, dtype=dtype, device=DEVICE)
        args = case["args"]
        want = KERNELS["cached_extend_attention"]["reference"](*fp32([a.clone() if torch.is_tensor(a) else a
                                                                     for a in args]))
        got = CUDA["cached_extend_attention"](*args)
        assert got.dtype == dtype and close(got, want, dtype), (nkv, group)
        loc = case["locations"].to(DEVICE)
        kept = loc >= 0
        assert torch.equal(args[3][loc[kept]].cpu(), case["k"][kept.cpu()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])  # the loader keeps wide outputs column-major
def test_moe_experts(dtype, tokens, layout):
    g = torch.Generator().manual_seed(tokens)
    E, k, H, I = 8, 3, 48, 40
    x = randn(tokens, H, g=g, dtype=dtype)
    expert_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, k, generator=g).to(dtype).to(DEVICE)
    gate_up, down = randn(E, 2 * I, H, g=g, dtype=dtype) / 7, randn(E, H, I, g=g, dtype=dtype) / 7
    if layout == "column-major":
        gate_up, down = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (gate_up, down))
    args = [x, expert_ids, weights, gate_up, down]
    want = moe_experts_reference(*fp32(args))
    got = CUDA["moe_experts"](*args)
    assert got.dtype == dtype and close(got, want, dtype)


def int8_rows(*shape, g):
    """Random int8 weights (every value in [-127, 127]) and one positive scale per row."""
    q = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    return q.to(DEVICE), (torch.rand(shape[:-1], generator=g) / 1000 + 1e-4).to(DEVICE)  # weights below 0.14


def dequantized(q, scale):  # the rule of quantize.py, written out: w = q * scale per row
    return q.float() * scale.float()[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_moe_experts_int8(dtype, tokens, layout):
    g = torch.Generator().manual_seed(100 + tokens)
    E, k, H, I = 8, 3, 48, 40
    x = randn(tokens, H, g=g, dtype=dtype)
    expert_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(DEVICE)
    expert_ids[0, 1] = -1  # another rank's expert: adds nothing
    weights = torch.rand(tokens, k, generator=g).to(dtype).to(DEVICE)
    (gate_up, gu_scale), (down, down_scale) = int8_rows(E, 2 * I, H, g=g), int8_rows(E, H, I, g=g)
    if layout == "column-major":
        gate_up, down = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (gate_up, down))
    want = moe_experts_reference(x.float(), expert_ids, weights.float(), dequantized(gate_up, gu_scale),
                                 dequantized(down, down_scale))
    got = CUDA["moe_experts_int8"](x, expert_ids, weights, gate_up, gu_scale, down, down_scale)
    assert got.dtype == dtype and close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 40, 48), (5, 70, 33), (37, 130, 200)])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_linear_int8(dtype, rows, out_features, in_features, layout):
    g = torch.Generator().manual_seed(rows)
    x = randn(rows, in_features, g=g, dtype=dtype)
    q, scale = int8_rows(out_features, in_features, g=g)
    if layout == "column-major":
        q = q.t().contiguous().t()
    want = x.float() @ dequantized(q, scale).t()
    got = CUDA["linear_int8"](x, q, scale)
    assert got.dtype == dtype and got.shape == want.shape and close(got, want, dtype)


def test_moe_alignment_is_static_and_never_looks_at_data():
    """What makes the expert kernels capturable: the alignment runs on tensors without data (fake
    tensors), so it has no host sync and its shapes follow from (tokens, k, experts) alone."""
    from inkling_compiled.custom_ops.gpu.moe import BM, align_pairs

    with FakeTensorMode():
        pair_of, block_expert = align_pairs(torch.randint(0, 8, (5, 3)), 8)
    # (one block of padding per expert, and per the bin of skipped choices, negative ids)
    assert block_expert.shape == (-(-15 // BM) + 9,) and pair_of.shape == (block_expert.shape[0] * BM,)


def test_moe_alignment_groups_every_pair_by_expert():
    from inkling_compiled.custom_ops.gpu.moe import BM, align_pairs

    expert_ids = ids([[3, 0], [3, 1], [0, 3], [5, 3]], dtype=torch.int64)
    pair_of, block_expert = align_pairs(expert_ids, 8)
    P, flat = 8, expert_ids.reshape(-1).tolist()
    rows = pair_of.view(-1, BM).tolist()
    served = sorted(p for row in rows for p in row if p < P)
    assert served == list(range(P))  # every pair exactly once
    for row, e in zip(rows, block_expert.tolist()):
        live = [p for p in row if p < P]
        assert (e == -1) == (not live) and all(flat[p] == e for p in live)  # one expert per block


@pytest.mark.parametrize("vocab", [300, 2500])
def test_top_k_top_p_without_a_sort_equals_the_sorting_reference(vocab):
    """Exactly equal, ties included: bf16-rounded logits give many equal values at the cut-offs."""
    g = torch.Generator().manual_seed(vocab)
    scaled = randn(8, vocab, g=g) * 3
    scaled[5] = torch.randn(vocab, generator=g).bfloat16().float().round().to(DEVICE)
    scaled[6, :10] = 5.0  # ten-way tie at the top
    top_k = ids([0, 5, 0, 40, 1, 7, 12, vocab + 3], dtype=torch.int64)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.3, 0.8, 0.95, 0.6], device=DEVICE)
    want = KERNELS["top_k_top_p"]["reference"](scaled, top_k, top_p)
    got = CUDA["top_k_top_p"](scaled, top_k, top_p)
    assert torch.equal(got, want)


def test_top_k_top_p_edge_rows():
    """Signed zeros (one value to the reference), a value one ulp below a negative cut, all-equal rows,
    -inf entries, the huge values a tiny temperature gives, and unfiltered rows of a real vocabulary."""
    below = torch.nextafter(torch.tensor(-1.0), torch.tensor(-2.0)).item()
    rows = [([3.0, 0.0, -0.0, -2.0], 2, 0.99), ([1.0, -1.0, below, -5.0], 0, 0.8), ([0.5] * 4, 2, 0.3),
            ([2.0, float("-inf"), 1.0, float("-inf")], 3, 0.9), ([4e6, -3e6, 1e6, 4e6 - 0.5], 0, 0.5)]
    scaled = torch.tensor([r[0] for r in rows], device=DEVICE)
    top_k = ids([r[1] for r in rows], dtype=torch.int64)
    top_p = torch.tensor([r[2] for r in rows], device=DEVICE)
    assert torch.equal(CUDA["top_k_top_p"](scaled, top_k, top_p),
                       KERNELS["top_k_top_p"]["reference"](scaled, top_k, top_p))
    g = torch.Generator().manual_seed(1)
    vocab = randn(3, 4000, g=g) * 3
    unfiltered = CUDA["top_k_top_p"](vocab, ids([0, 0, 0], dtype=torch.int64), torch.ones(3, device=DEVICE))
    assert torch.equal(unfiltered, vocab)


class StubKernel:
    """Stands in for a Triton kernel: launching it does nothing (fake tensors have no memory)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("op", ["sconv_decode", "sconv_extend", "sconv_verify", "commit_conv_windows", "kv_write",
                                "paged_attention", "ring_attention", "extend_attention", "moe_experts",
                                "moe_experts_int8", "linear_int8", "top_k_top_p"])
def test_launchers_never_look_at_their_data(op, monkeypatch):
    """Capturable means no host sync and nothing sized by data: each launcher, its kernels stubbed out,
    runs on fake tensors (which have no data to look at)."""
    module = importlib.import_module(f"inkling_compiled.custom_ops.gpu.{CUDA[op].__name__.split('.')[0]}")
    for name in [n for n in vars(module) if n.endswith("_kernel")]:
        monkeypatch.setattr(module, name, StubKernel())
    g = torch.Generator().manual_seed(5)
    i32 = dict(dtype=torch.int32)
    state, w = torch.randn(4, 2, 8, generator=g), torch.randn(8, 3, generator=g)
    cache = torch.randn(32, 2, 8, generator=g)
    args = {
        "sconv_decode": (torch.randn(2, 8, generator=g), state, w, torch.tensor([1, 0], **i32)),
        "sconv_extend": (torch.randn(5, 8, generator=g), state, w, torch.tensor([0, 2, 5], **i32),
                         torch.tensor([True, False]), torch.tensor([1, 2], **i32)),
        "sconv_verify": (torch.randn(6, 8, generator=g), state, w, torch.tensor([1, 0], **i32), torch.zeros(4, 3, 2, 8)),
        "commit_conv_windows": ([torch.randn(4, 2, 8, generator=g)], [torch.randn(4, 3, 2, 8, generator=g)],
                                torch.tensor([1, 2], **i32), torch.tensor([0, 2])),
        "kv_write": (cache, cache.clone(), torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g),
                     torch.tensor([3, -1, 9])),
        "paged_attention": (torch.randn(2, 4, 8, generator=g), cache, cache.clone(), torch.randn(2, 4, 6, generator=g),
                            torch.ones(2), torch.tensor([[0, 0], [1, 2]], **i32), torch.tensor([1, 0], **i32),
                            torch.tensor([7, 1], **i32), 4, 6),
        "ring_attention": (torch.randn(2, 4, 8, generator=g), cache, cache.clone(), torch.randn(2, 4, 6, generator=g),
                           torch.tensor([9, 0]), torch.tensor([1, 0], **i32), 4, 6),
        "extend_attention": (torch.randn(5, 4, 8, generator=g), cache[:9], cache[:9].clone(),
                             torch.randn(5, 4, 6, generator=g), torch.ones(5), torch.tensor([0, 3, 5]),
                             torch.tensor([0, 6, 9]), 4, 6),
        "moe_experts": (torch.randn(3, 8, generator=g), torch.tensor([[0, 2], [2, 1], [0, 1]]),
                        torch.rand(3, 2, generator=g), torch.randn(3, 12, 8, generator=g),
                        torch.randn(3, 8, 6, generator=g)),
        "moe_experts_int8": (torch.randn(3, 8, generator=g), torch.tensor([[0, 2], [2, 1], [0, 1]]),
                             torch.rand(3, 2, generator=g), torch.zeros(3, 12, 8, dtype=torch.int8), torch.ones(3, 12),
                             torch.zeros(3, 8, 6, dtype=torch.int8), torch.ones(3, 8)),
        "linear_int8": (torch.randn(3, 8, generator=g), torch.zeros(5, 8, dtype=torch.int8), torch.ones(5)),
        "top_k_top_p": (torch.randn(3, 10, generator=g), torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 0.5])),
    }[op]
    with FakeTensorMode() as mode:
        CUDA[op](*tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, args))


def test_every_kernel_compiles_for_the_h200():
    """The interpreter runs Python, not Triton's compiler: compile every launch ahead of time for
    sm_90 with the installed triton (no GPU needed), as the GPU will."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "tools" / "aot_triton.py"), "--arch", "90", "--jobs", "2"],
                          env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    total = done.stdout.strip().splitlines()[-1]
    assert total.endswith(" 0 failed") and int(total.split()[0]) >= 50, total  # every variant, both shards
