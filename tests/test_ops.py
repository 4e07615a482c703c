"""Custom ops: opcheck, and CPU kernels bit-identical to plain per-request reference loops."""

import itertools
from pathlib import Path

import pytest
import torch

from inkling_compiled.custom_ops import KERNELS, kv_write, native_kernels, paged_attention, sconv_decode, sconv_extend
from inkling_compiled.custom_ops.library import NATIVE_CPU_OPS
from inkling_compiled.custom_ops.attention import paged_attention_reference
from inkling_compiled.custom_ops.kv import kv_write_reference
from inkling_compiled.custom_ops.moe import moe_experts_reference
from inkling_compiled.custom_ops.sconv import sconv_decode_reference, sconv_extend_reference

from cached_chunks import cached_chunk_case
from forced_build import run_in_build

# Each kernel test runs on the dispatched op (the C++ kernel on CPU when it built) and on the
# plain-torch reference kernel.
IMPLS = {
    "op": dict(decode=sconv_decode, extend=sconv_extend, kv=kv_write),
    "reference": dict(decode=sconv_decode_reference, extend=sconv_extend_reference, kv=kv_write_reference),
}


def test_native_kernels_are_in_use():
    assert native_kernels(), "the C++ CPU kernels should build on a machine with a compiler"
    assert "inkling_cpu.cpp" in torch._C._dispatch_dump("inkling::sconv_decode")


def test_importing_builds_nothing_and_the_first_call_swaps_the_cpp_kernels_in(tmp_path):
    """Import and `--help` never wait for a compiler: until a covered op is first called on CPU, its CPU
    key holds a stand-in from library.py; the call itself then runs on the C++ kernel."""
    import subprocess
    import sys

    script = (
        "import torch, inkling_compiled.cli as cli, inkling_compiled.custom_ops.library as lib\n"
        "cli.build_parser()\n"
        "before = lib._native, 'library.py' in torch._C._dispatch_dump('inkling::linear').split('CPU:')[1]\n"
        "y = torch.ops.inkling.linear(torch.ones(1, 8), torch.ones(3, 8))\n"
        "print(before, lib._native, 'inkling_cpu.cpp' in torch._C._dispatch_dump('inkling::linear'), y.tolist())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["(None,", "True)", "True", "True", "[[8.0,", "8.0,", "8.0]]"]


def test_a_build_started_ahead_is_the_one_the_first_call_loads():
    import subprocess
    import sys

    script = (
        "import torch, inkling_compiled.custom_ops.library as lib\n"
        "lib.build_in_background()\n"
        "future = lib._build\n"
        "lib.build_in_background()  # started once\n"
        "built = future.result(timeout=300)\n"
        "before = lib._native\n"
        "torch.ops.inkling.linear(torch.ones(1, 8), torch.ones(3, 8))\n"
        "print(before, lib._native, lib._build is future, lib._library == built)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["None", "True", "True", "True"]


def test_a_library_that_does_not_load_leaves_the_python_kernels_serving():
    import subprocess
    import sys

    script = (
        "import torch, inkling_compiled.custom_ops.library as lib\n"
        "def refuse(path):\n"
        "    raise OSError('cannot load ' + path)\n"
        "torch.ops.load_library = refuse\n"
        "x, w = torch.ones(2, 8), torch.ones(3, 8)\n"
        "first, second = torch.ops.inkling.linear(x, w), torch.ops.inkling.linear(x, w)\n"
        "print(lib._native, first.sum().item(), second.sum().item())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "48.0", "48.0"]
    assert "did not load" in done.stderr


def test_the_extension_folder_is_keyed_by_source_flags_torch_and_interpreter(monkeypatch):
    from inkling_compiled.custom_ops import library

    here = library.extension_dir()
    assert here == library.extension_dir()
    monkeypatch.setattr(library.sys, "executable", "/some/other/venv/bin/python")
    assert library.extension_dir() != here
    monkeypatch.undo()
    monkeypatch.setattr(library, "_build_flags", lambda: ["-O2"])
    assert library.extension_dir() != here


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_every_instruction_set_build_of_the_matmul_matches_f_linear(isa):
    """The loader picks the widest build this CPU runs; the others are forced here (and the row limit
    raised so every row count takes the kernel), each against F.linear; the int8 kernels (their own row
    limit) against the dequantized weights."""
    script = (
        "import torch, torch.nn.functional as F\n"
        "from inkling_compiled.custom_ops.library import cpu_isa\n"
        "g = torch.Generator().manual_seed(0)\n"
        "worst = 0.0\n"
        "for o, h in [(96, 40), (37, 19), (64, 48), (50, 130), (40, 40)]:  # 130: W^T read in three slices\n"
        "    for column_major in (False, True):\n"
        "        w = torch.randn(o, h, generator=g)\n"
        "        w = w.t().contiguous().t() if column_major else w\n"
        "        for rows in (1, 2, 3, 4, 5, 9, 17, 20, 21, 22, 23, 40):  # 20 and up: the many-row tiles of W^T\n"
        "            x = torch.randn(rows, h, generator=g)\n"
        "            worst = max(worst, (torch.ops.inkling.linear(x, w) - F.linear(x, w)).abs().max().item())\n"
        "from inkling_compiled.attention import attend_ring\n"
        "for hd in (16, 20, 64):  # the decode attention's dot and axpy: full vectors and a tail\n"
        "    q, k, v = (torch.randn(n, 2, hd, generator=g) for n in (3, 24, 24))\n"
        "    args = (torch.randn(3, 2, 9, generator=g), torch.tensor([2, 9, 30]), torch.tensor([1, 2, 0], dtype=torch.int32), 8, 9)\n"
        "    got = torch.ops.inkling.ring_attention(q, k, v, *args)\n"
        "    worst = max(worst, (got - attend_ring(q, k, v, *args)).abs().max().item())\n"
        "from inkling_compiled.custom_ops.attention import extend_attention_reference\n"
        "for hd, group, window in ((16, 3, 0), (20, 8, 40), (64, 1, 0), (16, 2, 5)):  # tiles (idle lanes, a tail), per query\n"
        "    q, table = torch.randn(40, 2 * group, hd, generator=g), torch.randn(40, 2 * group, 9, generator=g)\n"
        "    k, v = torch.randn(60, 2, hd, generator=g), torch.randn(60, 2, hd, generator=g)\n"
        "    args = (q, k, v, table, torch.rand(40, generator=g) + 0.5, torch.tensor([0, 3, 40]), torch.tensor([0, 13, 60]), window, 9)\n"
        "    got = torch.ops.inkling.extend_attention(*args)\n"
        "    worst = max(worst, (got - extend_attention_reference(*args)).abs().max().item())\n"
        "q = torch.randint(-127, 128, (300, 130), generator=g, dtype=torch.int8)  # int8 weights: both layouts\n"
        "s = torch.rand(300, generator=g) / 100\n"
        "for w in (q, q.t().contiguous().t()):\n"
        "    for rows in (1, 3, 5, 17, 32):\n"
        "        x = torch.randn(rows, 130, generator=g)\n"
        "        got = torch.ops.inkling.linear_int8(x, w, s)\n"
        "        worst = max(worst, (got - x @ (w.float() * s[:, None]).t()).abs().max().item())\n"
        "from inkling_compiled.custom_ops.moe import moe_experts_reference  # the int8 experts\n"
        "gu, dn = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for shape in ((4, 40, 24), (4, 24, 20)))\n"
        "gs, ds = torch.rand(4, 40, generator=g) / 100, torch.rand(4, 24, generator=g) / 100\n"
        "x, ids, wts = torch.randn(5, 24, generator=g), torch.tensor([[0, 1], [1, 3], [2, 0], [3, 2], [0, 3]]), torch.rand(5, 2, generator=g)\n"
        "got = torch.ops.inkling.moe_experts_int8(x, ids, wts, gu, gs, dn, ds)\n"
        "want = moe_experts_reference(x, ids, wts, gu.float() * gs[..., None], dn.float() * ds[..., None])\n"
        "worst = max(worst, (got - want).abs().max().item())\n"
        "print(cpu_isa(), worst)")
    (worst,) = run_in_build(isa, script)
    assert float(worst) < 1e-4


def registered(op: str, key: str) -> str:
    """Where the dispatcher's kernel for (op, key) was registered, e.g. '.../kv.py:28'."""
    line = next(x for x in torch._C._dispatch_dump(f"inkling::{op}").splitlines() if x.startswith(f"{key}:"))
    return line.split("registered at ", 1)[1].split(" ::")[0]


@pytest.mark.parametrize("op", sorted(KERNELS))
def test_each_op_has_its_kernels_per_dispatch_key(op):
    """CPU: the C++ kernel for the ops it covers, Python otherwise; CUDA: the op's Triton launcher (cuBLAS
    for `linear`, the host wait for `wait_layer`, the samplers' torch math, which a GPU step inlines
    instead of calling the op); no catch-all registration that would hand one kernel to every device."""
    assert set(KERNELS[op]) == {"reference", "CPU", "CUDA"}
    assert native_kernels()  # loaded on the first call of any native op: this test may run first
    cpu = registered(op, "CPU")
    assert ("inkling_cpu.cpp" in cpu) == (op in NATIVE_CPU_OPS), cpu
    assert registered(op, "CUDA").startswith(str(Path(__file__).resolve().parent.parent / "custom_ops"))
    if op in ("sample_tokens", "verify_tokens"):
        assert KERNELS[op]["CUDA"] is KERNELS[op]["reference"]
    elif op not in ("linear", "wait_layer"):
        assert KERNELS[op]["CUDA"].__name__.endswith(f".{op}")  # gpu/<module>.py's launcher, loaded on first call
    dump = torch._C._dispatch_dump(f"inkling::{op}")
    assert "CompositeExplicitAutograd:" not in dump and "CompositeImplicitAutograd:" not in dump


def conv_one_sequence(history, xs, w):
    """Reference: one sequence, its K-1 history then its tokens; same accumulation order as the kernels."""
    K = w.shape[1]
    full = torch.cat([history, xs])  # [K-1 + n, D]
    out = []
    for t in range(K - 1, full.shape[0]):
        acc = full[t] * w[:, K - 1]
        for back in range(1, K):
            acc = acc + full[t - back] * w[:, K - 1 - back]
        out.append(acc)
    return (torch.stack(out) if out else None), full[-(K - 1):]


def make_pool(slots, K, D, seed):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(3, slots, K - 1, D, generator=g)  # [layers, slots, K-1, D] like one pool stream
    return pool, g


def conv_weight(D: int, K: int, g, by_position: bool) -> torch.Tensor:
    """w [D, K], or with by_position=True the same shape held tap by tap ([K, D] in memory), as the loader
    holds the convs on CPU (the kernels read it in place)."""
    return torch.randn(K, D, generator=g).t() if by_position else torch.randn(D, K, generator=g)


def conv_input(tokens: int, D: int, g, strided: bool) -> torch.Tensor:
    """x [tokens, D], or with strided=True a view whose rows lie apart, as k and v of a stacked q/k/v/r
    projection's output do (the kernels read them in place)."""
    if not strided:
        return torch.randn(tokens, D, generator=g)
    x = torch.randn(tokens, D + 7, generator=g)[:, 3:3 + D]
    assert not x.is_contiguous() or tokens < 2
    return x


@pytest.mark.parametrize("by_position", [False, True], ids=["taps", "taps-by-position"])
@pytest.mark.parametrize("strided", [False, True], ids=["rows", "strided-rows"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("K", [2, 3, 4])
def test_sconv_decode_is_bit_identical_to_reference(K, impl, strided, by_position):
    sconv_decode = IMPLS[impl]["decode"]
    D, slots = 24, 9
    pool, g = make_pool(slots, K, D, seed=K)
    state = pool[1]  # a view, as the backend hands it
    before = pool.clone()
    x = conv_input(4, D, g, strided)
    w = conv_weight(D, K, g, by_position)
    idx = torch.tensor([3, 7, 1, 5], dtype=torch.int32)
    y = sconv_decode(x, state, w, idx)
    for row, slot in enumerate(idx.tolist()):
        want_y, want_window = conv_one_sequence(before[1, slot], x[row:row + 1], w)
        assert torch.equal(y[row], want_y[0])
        assert torch.equal(pool[1, slot], want_window)
    untouched = [s for s in range(slots) if s not in idx.tolist()]
    assert torch.equal(pool[1, untouched], before[1, untouched])
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2])


@pytest.mark.parametrize("by_position", [False, True], ids=["taps", "taps-by-position"])
@pytest.mark.parametrize("strided", [False, True], ids=["rows", "strided-rows"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("K", [2, 3, 4])
def test_sconv_extend_is_bit_identical_to_reference(K, impl, strided, by_position):
    sconv_extend = IMPLS[impl]["extend"]
    D, slots = 16, 8
    pool, g = make_pool(slots, K, D, seed=10 + K)
    state = pool[2]
    before = pool.clone()
    lens = [5, 1, 0, 2, 7]  # includes sequences shorter than K-1 and an empty one
    his = torch.tensor([True, True, False, False, True])
    idx = torch.tensor([2, 5, 6, 1, 4], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = conv_input(sum(lens), D, g, strided)
    w = conv_weight(D, K, g, by_position)
    y = sconv_extend(x, state, w, qsl, his, idx)
    for b, slot in enumerate(idx.tolist()):
        history = before[2, slot] if his[b] else torch.zeros(K - 1, D)
        xs = x[qsl[b]:qsl[b + 1]]
        want_y, want_window = conv_one_sequence(history, xs, w)
        if len(xs):
            assert torch.equal(y[qsl[b]:qsl[b + 1]], want_y)
        assert torch.equal(pool[2, slot], want_window)
    assert torch.equal(pool[2, [0, 3, 7]], before[2, [0, 3, 7]])


def test_extend_from_scratch_equals_a_plain_loop_per_sequence():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 8, generator=g), torch.randn(8, 4, generator=g)
    state = torch.zeros(3, 3, 8)
    y = sconv_extend(x, state, w, torch.tensor([0, 6, 11], dtype=torch.int32), torch.tensor([False, False]),
                     torch.tensor([1, 2], dtype=torch.int32))
    for start, end in ((0, 6), (6, 11)):
        want, _ = conv_one_sequence(torch.zeros(3, 8), x[start:end], w)
        assert torch.equal(y[start:end], want)


def test_decode_after_extend_continues_the_sequence():
    """extend(a) then decode(b) gives the same outputs as extend(a ++ b)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 8, generator=g), torch.randn(8, 3, generator=g)
    one = torch.tensor([1], dtype=torch.int32)
    s1, s2 = torch.zeros(2, 2, 8), torch.zeros(2, 2, 8)
    full = sconv_extend(x, s1, w, torch.tensor([0, 7], dtype=torch.int32), torch.tensor([False]), one)
    part = sconv_extend(x[:5], s2, w, torch.tensor([0, 5], dtype=torch.int32), torch.tensor([False]), one)
    steps = [sconv_decode(x[t:t + 1], s2, w, one) for t in (5, 6)]
    assert torch.allclose(torch.cat([part] + steps), full, atol=1e-6)
    assert torch.equal(s1, s2)


@pytest.mark.parametrize("impl", IMPLS)
def test_kv_write_skips_negative_locations(impl):
    kv_write = IMPLS[impl]["kv"]
    kc, vc = torch.zeros(6, 2, 3), torch.zeros(6, 2, 3)
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    kv_write(kc, vc, k, v, torch.tensor([4, -1, 0]))
    assert torch.equal(kc[4], k[0]) and torch.equal(kc[0], k[2]) and torch.equal(vc[4], v[0])
    assert kc[[1, 2, 3, 5]].abs().sum() == 0


def test_kv_write_refuses_a_row_past_the_cache_before_writing_any():
    kc, vc = torch.zeros(6, 2, 3), torch.zeros(6, 2, 3)
    with pytest.raises(RuntimeError, match="goes to cache row 6 of 6"):
        torch.ops.inkling.kv_write(kc, vc, torch.randn(3, 2, 3), torch.randn(3, 2, 3), torch.tensor([4, 0, 6]))
    with pytest.raises(RuntimeError, match="one location per key and value row"):
        torch.ops.inkling.kv_write(kc, vc, torch.randn(3, 2, 3), torch.randn(2, 2, 3), torch.tensor([4, 0, 1]))
    assert kc.abs().sum() == 0 and vc.abs().sum() == 0


def op_samples():
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(2, 6, 3, 8, generator=g)
    w = torch.randn(8, 4, generator=g)
    idx = torch.tensor([1, 4], dtype=torch.int32)
    yield torch.ops.inkling.sconv_decode.default, (torch.randn(2, 8, generator=g), pool[1], w, idx)
    yield torch.ops.inkling.sconv_extend.default, (
        torch.randn(5, 8, generator=g), pool[0], w, torch.tensor([0, 3, 5], dtype=torch.int32),
        torch.tensor([True, False]), idx)
    yield torch.ops.inkling.sconv_verify.default, (torch.randn(6, 8, generator=g), pool[1], w, idx,
                                                   torch.zeros(3, 3, 3, 8))
    yield torch.ops.inkling.commit_conv_windows.default, ([t.clone() for t in pool], [t.clone() for t in torch.randn(2, 3, 3, 3, 8, generator=g)],
                                                          idx, torch.tensor([2, -1]))
    yield torch.ops.inkling.kv_write.default, (
        torch.zeros(8, 2, 4), torch.zeros(8, 2, 4), torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g),
        torch.tensor([5, -1, 2]))
    block_table = torch.tensor([[0, 0], [1, 2], [3, 0]], dtype=torch.int32)
    yield torch.ops.inkling.linear.default, (torch.randn(2, 8, generator=g), torch.randn(6, 8, generator=g))
    yield torch.ops.inkling.top_k_top_p.default, (
        torch.randn(3, 10, generator=g), torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 0.5]))
    yield torch.ops.inkling.wait_layer.default, ([pool[0], pool[1]], 0, 2)
    for window, tau in ((0, torch.rand(5, generator=g) + 1), (4, None)):
        yield torch.ops.inkling.extend_attention.default, (
            torch.randn(5, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g),
            torch.randn(5, 4, 6, generator=g), tau, torch.tensor([0, 3, 5]), torch.tensor([0, 6, 9]), window, 6)
    yield torch.ops.inkling.sconv_checkpoint.default, (
        torch.randn(5, 8, generator=g), pool[0], torch.zeros(2, 4, 3, 8), 1, idx, torch.tensor([True, False]),
        torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2, 5]),
        torch.tensor([1, 3]))
    yield torch.ops.inkling.ring_checkpoint.default, (
        torch.randn(5, 2, 4, generator=g), torch.randn(5, 2, 4, generator=g), torch.randn(18, 2, 4, generator=g),
        torch.randn(18, 2, 4, generator=g), torch.zeros(2, 12, 2, 4), torch.zeros(2, 12, 2, 4), 1,
        torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([7, 8, 9, 0, 1]), torch.tensor([1, 2], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([9, 2]), torch.tensor([0, 1]), 6, 4)
    yield torch.ops.inkling.moe_experts.default, (
        torch.randn(3, 8, generator=g), torch.tensor([[0, 2], [2, 1], [0, 1]]), torch.rand(3, 2, generator=g),
        torch.randn(3, 12, 8, generator=g), torch.randn(3, 8, 6, generator=g))
    i8 = dict(low=-127, high=128, generator=g, dtype=torch.int8)
    yield torch.ops.inkling.moe_experts_int8.default, (
        torch.randn(3, 8, generator=g), torch.tensor([[0, 2], [2, 1], [0, 1]]), torch.rand(3, 2, generator=g),
        torch.randint(size=(3, 12, 8), **i8), torch.rand(3, 12, generator=g), torch.randint(size=(3, 8, 6), **i8),
        torch.rand(3, 8, generator=g))
    yield torch.ops.inkling.linear_int8.default, (torch.randn(2, 8, generator=g), torch.randint(size=(6, 8), **i8),
                                                  torch.rand(6, generator=g))
    yield torch.ops.inkling.paged_attention.default, (
        torch.randn(2, 4, 8, generator=g), torch.randn(16, 2, 8, generator=g), torch.randn(16, 2, 8, generator=g),
        torch.randn(2, 4, 6, generator=g), torch.rand(2, generator=g) + 1, block_table,
        torch.tensor([1, 2], dtype=torch.int32), torch.tensor([7, 3], dtype=torch.int32), 4, 6)
    yield torch.ops.inkling.ring_attention.default, (
        torch.randn(3, 4, 8, generator=g), torch.randn(15, 2, 8, generator=g), torch.randn(15, 2, 8, generator=g),
        torch.randn(3, 4, 6, generator=g), torch.tensor([2, 9, 0]), torch.tensor([1, 2, 0], dtype=torch.int32), 5, 6)


@pytest.mark.parametrize("op, args", list(op_samples()), ids=lambda x: str(x) if not isinstance(x, tuple) else "")
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("column_major", [False, True])
def test_linear_matches_f_linear(rows, column_major):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    if column_major:  # the loader's layout for wide outputs
        w = w.t().contiguous().t()
    x = torch.randn(rows, 40, generator=g)
    assert torch.allclose(torch.ops.inkling.linear(x, w), torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)


def test_native_paged_attention_moe_and_filter_match_their_references():
    from inkling_compiled.custom_ops.sampling import top_k_top_p_reference

    g = torch.Generator().manual_seed(5)
    for op, ref, args in [
        (torch.ops.inkling.top_k_top_p.default, top_k_top_p_reference, (
            torch.randn(6, 50, generator=g) * 3, torch.tensor([0, 5, 0, 1, 50, 7]),
            torch.tensor([1.0, 1.0, 0.7, 1.0, 0.2, 0.9]))),
        (paged_attention, paged_attention_reference, list(op_samples())[-2][1]),
        (torch.ops.inkling.ring_attention.default, KERNELS["ring_attention"]["reference"], list(op_samples())[-1][1]),
        (torch.ops.inkling.moe_experts.default, moe_experts_reference, (
            torch.randn(7, 16, generator=g), torch.randint(0, 5, (7, 2), generator=g), torch.rand(7, 2, generator=g),
            torch.randn(5, 24, 16, generator=g), torch.randn(5, 16, 12, generator=g))),
    ]:
        got, want = op(*args), ref(*args)
        assert torch.equal(got.isinf(), want.isinf())
        assert torch.allclose(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["op", "reference", "CUDA"])
def test_paged_attention_reads_only_its_pages(kernel):
    """Keys and values on pages outside a row's table, or past its length, must not change its output,
    not even when they are NaN (a hidden key's probability is 0, and 0 * NaN is NaN)."""
    paged_attention = {"op": torch.ops.inkling.paged_attention.default, **KERNELS["paged_attention"]}[kernel]
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(16, 1, 4, generator=g), torch.randn(16, 1, 4, generator=g)
    args = dict(table=torch.randn(1, 2, 5, generator=g), tau=None,
                block_table=torch.tensor([[0, 0], [2, 1]], dtype=torch.int32),
                cache_indices=torch.tensor([1], dtype=torch.int32), seq_lens=torch.tensor([6], dtype=torch.int32),
                page_size=4, rel_extent=5)
    q = torch.randn(1, 2, 4, generator=g)
    out = paged_attention(q, kc, vc, **args)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[0:4] = 99.0  # page 0: not in the row's table
    kc2[6:8] = -99.0  # page 1 past the 6th key (page 2 holds keys 0-3, page 1 keys 4-5)
    vc2[0:4] = 5.0
    assert torch.equal(paged_attention(q, kc2, vc2, **args), out)
    for cache in (kc2, vc2):
        cache[0:4] = float("nan")
        cache[6:8] = float("nan")
    assert torch.equal(paged_attention(q, kc2, vc2, **args), out)


@pytest.mark.parametrize("kernel", ["op", "reference", "CUDA"])
def test_ring_attention_reads_only_the_rows_own_ring(kernel):
    """Another slot's ring, even NaN, never reaches a row (a row's own unwritten entries are zero: the
    pool clears a slot's rings when it hands the slot out, tested with the pool)."""
    attend_ring = {"op": torch.ops.inkling.ring_attention.default, **KERNELS["ring_attention"]}[kernel]
    g = torch.Generator().manual_seed(4)
    W, slots = 4, 3
    kr, vr = torch.randn(slots * W, 1, 4, generator=g), torch.randn(slots * W, 1, 4, generator=g)
    q, table = torch.randn(2, 2, 4, generator=g), torch.randn(2, 2, W, generator=g)
    positions, cache_indices = torch.tensor([1, 6]), torch.tensor([1, 2], dtype=torch.int32)
    out = attend_ring(q, kr, vr, table, positions, cache_indices, W, W)
    for ring in (kr, vr):
        ring[:W] = float("nan")  # slot 0, the dummy padded rows write
    assert torch.equal(attend_ring(q, kr, vr, table, positions, cache_indices, W, W), out)


# Decode attention with every grouping of query heads over a kv head that the kernels block
# differently (1, 2, 3, 4, 5 and 8 heads a kv head; head_dim 64 and 128 in registers, 20 in loops), on
# ring and paged keys, each against the float64 reference; prints the build and the worst error.
GROUPED_ATTENTION_SCRIPT = """
import torch
from inkling_compiled.custom_ops import KERNELS, native_kernels
from inkling_compiled.custom_ops.library import cpu_isa
native_kernels()
def wide(args):
    return [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
g = torch.Generator().manual_seed(12)
worst = 0.0
for hd in (64, 128, 20):
    for nkv, group in ((2, 1), (2, 2), (1, 3), (2, 4), (1, 5), (1, 8)):
        nh, B, window, page = nkv * group, 3, 24, 8
        q, table = torch.randn(B, nh, hd, generator=g), torch.randn(B, nh, 30, generator=g)
        kr, vr = (torch.randn(4 * window, nkv, hd, generator=g) for _ in range(2))
        ring = (q, kr, vr, table, torch.tensor([5, 40, 23]), torch.tensor([2, 0, 3], dtype=torch.int32), window, 30)
        kc, vc = (torch.randn(12 * page, nkv, hd, generator=g) for _ in range(2))
        paged = (q, kc, vc, table, torch.rand(B, generator=g) + 0.5,
                 torch.randperm(12, generator=g)[:9].view(B, 3).to(torch.int32),
                 torch.tensor([2, 0, 1], dtype=torch.int32), torch.tensor([1, 24, 13], dtype=torch.int32), page, 30)
        for op, args in (("ring_attention", ring), ("paged_attention", paged)):
            got = getattr(torch.ops.inkling, op)(*args)
            want = KERNELS[op]["reference"](*wide(args))
            worst = max(worst, (got.double() - want).abs().max().item())
print(cpu_isa(), worst)
"""


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
def test_decode_attention_matches_its_reference_for_every_head_grouping(isa):
    """The decode kernels read each key and value row once for a block of the query heads that share
    it (up to 4 at a time, then 2, then 1): every grouping, in every build, against float64 math."""
    if isa == "native":
        namespace = {}
        exec(GROUPED_ATTENTION_SCRIPT.replace("print(cpu_isa(), worst)", ""), namespace)
        worst = namespace["worst"]
    else:
        (worst,) = run_in_build(isa, GROUPED_ATTENTION_SCRIPT)
    assert float(worst) < 1e-5


@pytest.mark.parametrize("kernel", ["op", "reference", "CUDA"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_moe_reads_only_the_chosen_experts(kernel, rows):
    """At batch B with top-k the kernel touches min(E, B*k) expert banks and no other: the unchosen
    ones are NaN here, and a kernel that read them (even times a zero weight) would return NaN."""
    moe = {"op": torch.ops.inkling.moe_experts.default, **KERNELS["moe_experts"]}[kernel]
    g = torch.Generator().manual_seed(rows)
    E, k, H, I = 8, 2, 16, 12
    x = torch.randn(rows, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])
    w = torch.rand(rows, k, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    want = moe(x, ids, w, gate_up, down)
    chosen = set(ids.flatten().tolist())
    unchosen = [e for e in range(E) if e not in chosen]
    gate_up[unchosen], down[unchosen] = float("nan"), float("nan")
    got = moe(x, ids, w, gate_up, down)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    # and the chosen ones are really read: poisoning one of them shows up
    gate_up[ids[0, 0]] = float("nan")
    assert torch.isnan(moe(x, ids, w, gate_up, down)[0]).all()


@pytest.mark.parametrize("kernel", ["op", "reference", "CUDA"])
def test_moe_skips_negative_expert_ids(kernel):
    """Expert parallelism hands a rank's bank the choices of other ranks as id -1: they add nothing and
    read nothing. Oracle: a plain loop over (token, choice) pairs."""
    moe = {"op": torch.ops.inkling.moe_experts.default, **KERNELS["moe_experts"]}[kernel]
    g = torch.Generator().manual_seed(7)
    E, k, H, I, T = 3, 2, 16, 12, 6
    x = torch.randn(T, H, generator=g)
    ids = torch.tensor([[0, -1], [-1, -1], [2, 0], [-1, 2], [0, 2], [-1, 0]])
    w = torch.rand(T, k, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    gate_up[1], down[1] = float("nan"), float("nan")  # chosen by nobody: must never be read
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e >= 0:
                h = gate_up[e] @ x[t]
                want[t] += w[t, j] * (down[e] @ (torch.nn.functional.silu(h[:I]) * h[I:]))
    got = moe(x, ids, w, gate_up, down)
    assert torch.isfinite(got).all() and torch.equal(got[1], torch.zeros(H))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_native_silu_and_softmax_hold_far_from_zero():
    """The C++ kernels' vectorised exp (the experts' SiLU, the decode softmax) against float64 math over
    the whole fp32 range of its inputs, clamps included: gates from -120 to 120 through an identity
    expert, and attention scores spread over hundreds (probabilities down to e^-100 and below)."""
    H = 40  # two full vectors of 16 and a tail
    gates = torch.linspace(-120.0, 120.0, 3 * H).view(3, H)
    gates[0, :8] = torch.tensor([-88.72, -88.6, -88.4, -1e19, -1e38, 88.4, 88.6, 1e15])  # e^-g overflows in fp32
    eye = torch.eye(H)
    gate_up, down = torch.cat([eye, eye]).unsqueeze(0), eye.unsqueeze(0)
    got = torch.ops.inkling.moe_experts(gates, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), gate_up, down)
    g64 = gates.double()
    want = g64 * torch.sigmoid(g64) * g64  # silu(gate) * up, up = gate
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-30)

    g = torch.Generator().manual_seed(11)
    W, slots, nh, hd = 24, 2, 4, 64  # 24 keys: one block of four-key dots short of a full vector
    kr, vr = torch.randn(slots * W, 2, hd, generator=g), torch.randn(slots * W, 2, hd, generator=g)
    q, table = torch.randn(2, nh, hd, generator=g) * 40, torch.randn(2, nh, W, generator=g) * 30
    args = (q, kr, vr, table, torch.tensor([30, 7]), torch.tensor([1, 0], dtype=torch.int32), W, W)
    got = torch.ops.inkling.ring_attention(*args)
    want = KERNELS["ring_attention"]["reference"](*(a.double() if torch.is_tensor(a) and a.is_floating_point() else a
                                                   for a in args))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)



def _packed_chunks(g, chunks, histories, nkv, group, hd=16, extent=20, dtype=torch.float32, tau=True):
    """Random packed prefill chunks: sequence b has histories[b] cached keys, then chunks[b] new tokens."""
    nh, T = nkv * group, sum(chunks)
    S = sum(chunks) + sum(histories)
    qsl = torch.tensor([0] + list(itertools.accumulate(chunks)))
    ksl = torch.tensor([0] + list(itertools.accumulate(c + h for c, h in zip(chunks, histories))))
    args = [torch.randn(T, nh, hd, generator=g), torch.randn(S, nkv, hd, generator=g),
            torch.randn(S, nkv, hd, generator=g), torch.randn(T, nh, extent, generator=g) * 2]
    args = [a.to(dtype) for a in args]
    return args + [torch.rand(T, generator=g) + 0.5 if tau else None, qsl, ksl]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 24, 40])
def test_extend_attention_matches_its_reference_on_packed_chunks(dtype, window):
    """Chunks of 1 to 300 tokens over histories that cross the window and the relative extent (20),
    GQA ratios 1 to 8, the global layers' log scale and the sliding layers' window (40 with 8 heads a
    kv head goes in tiles, the other windows per query)."""
    g = torch.Generator().manual_seed(13 + window)
    for nkv, group in [(1, 1), (2, 3), (1, 8)]:
        args = _packed_chunks(g, [1, 7, 300, 33], [0, 50, 5, 19], nkv, group, dtype=dtype, tau=window == 0)
        got = torch.ops.inkling.extend_attention(*args, window, 20)
        want = KERNELS["extend_attention"]["reference"](*args, window, 20)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_extend_attention_reads_only_its_sequence_and_window():
    """Another sequence's keys and values, and a sliding layer's keys past every query's window, are
    never read: NaN there leaves the output unchanged (a hidden key's probability is 0, and 0 * NaN
    is NaN)."""
    g = torch.Generator().manual_seed(21)
    q, k, v, table, _, qsl, ksl = _packed_chunks(g, [6, 40], [30, 70], 2, 2, tau=False)
    window = 16
    out = torch.ops.inkling.extend_attention(q, k, v, table, None, qsl, ksl, window, 20)
    k2, v2 = k.clone(), v.clone()
    k2[:36], v2[:36] = float("nan"), float("nan")  # sequence 0: all of it
    first_seen = 70 - window + 1  # sequence 1's first query sits at key 70 and sees back to here
    k2[36:36 + first_seen], v2[36:36 + first_seen] = float("nan"), float("nan")
    got = torch.ops.inkling.extend_attention(q, k2, v2, table, None, qsl, ksl, window, 20)
    assert torch.equal(got[6:], out[6:])


def test_extend_attention_refuses_start_locations_that_do_not_fit():
    g = torch.Generator().manual_seed(22)
    q, k, v, table, tau, qsl, ksl = _packed_chunks(g, [4, 4], [0, 2], 1, 2)
    with pytest.raises(RuntimeError, match="queries but"):
        torch.ops.inkling.extend_attention(q, k, v, table, tau, torch.tensor([0, 6, 8]), torch.tensor([0, 4, 10]), 0, 20)
    with pytest.raises(RuntimeError, match="cover q and k"):
        torch.ops.inkling.extend_attention(q, k, v, table, tau, qsl, torch.tensor([0, 4, 9]), 0, 20)


@pytest.mark.parametrize("kernel", ["op", "reference"])
@pytest.mark.parametrize("window, ring_size", [(0, 0), (8, 8), (8, 11)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_extend_attention_reads_the_history_the_cache_holds(kernel, window, ring_size, dtype):
    """Chunks of 1 to 30 tokens over histories of 0 to 40 keys (crossing pages, the window and the
    relative extent), GQA 1 to 4, paged (a shuffled block table) and in rings of the window or more:
    the same as `extend_attention` over the same sequences given as packed keys, though every cache
    entry outside the rows' histories is NaN (so none is read), and the chunks' keys are written where
    `kv_write` would put them afterwards."""
    g = torch.Generator().manual_seed(31 + window + ring_size)
    op = torch.ops.inkling.cached_extend_attention if kernel == "op" else KERNELS["cached_extend_attention"]["reference"]
    for (nkv, group), histories, chunks in itertools.product([(1, 1), (2, 2), (1, 4)], ([0, 5, 40, 17], [0, 0, 0, 0]),
                                                            ([3, 1, 30, 9], [3, 0, 30, 9])):  # a row with no tokens
        case = cached_chunk_case(g, chunks, histories, nkv, group, 16, window=window, ring_size=ring_size,
                                 dtype=dtype)
        got = op(*case["args"])
        want = KERNELS["extend_attention"]["reference"](*case["packed"])
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        k_cache, v_cache, loc = case["args"][3], case["args"][4], case["locations"]
        kept = loc >= 0
        assert torch.equal(k_cache[loc[kept]], case["k"][kept]) and torch.equal(v_cache[loc[kept]], case["v"][kept])
        if window:
            assert not kept.all()  # the long chunk pushes its first keys out of the ring


# Rows of one token with a history (a decoding row in a mixed step) read the cache in place, as a decode
# step does; the rest are gathered: [1, 1] and [3, 6] tokens over histories of 4 and 9.
ONE_TOKEN, GATHERED = [1, 1], [3, 6]


@pytest.mark.parametrize("chunks, window, edit, message", [
    (GATHERED, 0, lambda a: a.__setitem__(9, torch.tensor([3, 7], dtype=torch.int32)), "slot 7"),
    (GATHERED, 0, lambda a: a.__setitem__(11, a[11] + 1000), "reads cache row"),
    (GATHERED, 0, lambda a: a.__setitem__(11, a[11].long() + 2 ** 32), "reads cache row"),  # int64: never narrowed
    (GATHERED, 8, lambda a: a.__setitem__(9, torch.tensor([3, 9], dtype=torch.int32)), "slot 9"),
    (GATHERED, 0, lambda a: a.__setitem__(7, torch.tensor([0, 2, 8], dtype=torch.int32)), "cover the chunk's 9 tokens"),
    (GATHERED, 0, lambda a: a.__setitem__(8, a[8] + 10 ** 12), "position 1000000000004, past the 16 its block table reaches"),
    (GATHERED, 8, lambda a: a.__setitem__(2, a[2][:2]), "k and v of one shape"),
    (GATHERED, 0, lambda a: a[10].__setitem__(4, a[3].shape[0]), "goes to cache row"),
    (GATHERED, 8, lambda a: a.__setitem__(6, torch.ones(3)), "one tau per query"),
    (ONE_TOKEN, 0, lambda a: a.__setitem__(11, a[11] + 1000), "reads cache row"),
    (ONE_TOKEN, 0, lambda a: a.__setitem__(9, torch.tensor([3, 7], dtype=torch.int32)), "slot 7"),
    (ONE_TOKEN, 8, lambda a: a.__setitem__(9, torch.tensor([3, 9], dtype=torch.int32)), "slot 9"),
    # its own position one past what the block table reaches (its history within it): the next slot's page
    (ONE_TOKEN, 0, lambda a: a.__setitem__(8, torch.tensor([4, a[11].shape[1] * 4])), "has no page for position 12")])
def test_cached_extend_attention_refuses_a_history_outside_the_cache_by_name(chunks, window, edit, message):
    """A row whose slot has no pages or ring, a block table pointing past the cache, start locations
    that miss the chunk, a position past what the block table reaches, values short of the keys, a key
    bound past the cache or a tau of the wrong length is an error naming it, not a read or write out of
    bounds; the chunk's keys are not written either."""
    g = torch.Generator().manual_seed(37)
    args = cached_chunk_case(g, chunks, [4, 9], 2, 2, 8, window=window)["args"]
    edit(args)
    caches = [args[3].clone(), args[4].clone()]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.inkling.cached_extend_attention(*args)
    for cache, before in zip(args[3:5], caches):
        torch.testing.assert_close(cache, before, rtol=0, atol=0, equal_nan=True)


def test_cached_extend_attention_opcheck():
    g = torch.Generator().manual_seed(5)
    for window in (0, 8):
        torch.library.opcheck(torch.ops.inkling.cached_extend_attention.default,
                              cached_chunk_case(g, [3, 6], [4, 9], 2, 2, 8, window=window)["args"])


@pytest.mark.parametrize("kernel", ["op", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sconv_checkpoint_saves_each_boundarys_window_as_a_plain_loop_does(kernel, dtype):
    """Three rows (one without initial state) and four checkpoints: boundaries one token into a chunk
    (the window is mostly the slot's), deep inside, and at the chunk's end; the other saved entries are
    left alone. fp32 conv inputs, the windows and checkpoints in `dtype` (a bf16 pool's)."""
    g = torch.Generator().manual_seed(41)
    K1, D = 3, 5
    x, state = torch.randn(20, D, generator=g), torch.randn(6, K1, D, generator=g).to(dtype)
    saved = torch.randn(2, 8, K1, D, generator=g).to(dtype)  # [layers, checkpoints, K-1, D]: layer 1's are written
    slots, has_initial = torch.tensor([4, 1, 2], dtype=torch.int32), torch.tensor([True, False, True])
    qsl = torch.tensor([0, 6, 15, 20], dtype=torch.int32)
    rows, ends, indices = torch.tensor([0, 0, 1, 2], dtype=torch.int32), torch.tensor([1, 6, 9, 17]), torch.tensor([3, 7, 1, 5])
    want = saved.clone()
    for r, e, i in zip(rows.tolist(), ends.tolist(), indices.tolist()):
        before = state[slots[r]].float() if has_initial[r] else torch.zeros(K1, D)
        inputs = torch.cat([before, x[qsl[r]:e]])
        want[1, i] = inputs[-K1:].to(dtype)
    op = torch.ops.inkling.sconv_checkpoint if kernel == "op" else KERNELS["sconv_checkpoint"]["reference"]
    got = saved.clone()
    op(x, state, got, 1, slots, has_initial, qsl, rows, ends, indices)
    assert torch.equal(got, want)
    empty = torch.empty(0, dtype=torch.int64)
    op(x, state, got, 1, slots, has_initial, qsl, empty.int(), empty, empty)
    assert torch.equal(got, want)


@pytest.mark.parametrize("edit, message", [
    (lambda a: a.update(indices=torch.tensor([1, 8])), "checkpoint index 8 out of range"),
    (lambda a: a.update(rows=torch.tensor([0, 2], dtype=torch.int32)), "names row 2"),
    (lambda a: a.update(slots=torch.tensor([6, 0], dtype=torch.int32)), "slot 6 out of range"),
    (lambda a: a.update(layer=2), "layer 2 out of range")])
def test_sconv_checkpoint_refuses_what_is_out_of_range_by_name(edit, message):
    """A checkpoint slot past the saved ones, a row the chunk does not have, a window slot past the pool
    or a layer past the stack is an error naming it, not a read or write out of bounds; a valid
    checkpoint beside the bad one is not written either."""
    g = torch.Generator().manual_seed(43)
    args = dict(rows=torch.tensor([0, 1], dtype=torch.int32), slots=torch.tensor([5, 0], dtype=torch.int32),
                indices=torch.tensor([1, 2]), layer=1)
    edit(args)
    saved = torch.full((2, 8, 3, 4), 7.0)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.inkling.sconv_checkpoint(torch.randn(9, 4, generator=g), torch.randn(6, 3, 4, generator=g), saved,
                                           args["layer"], args["slots"], torch.tensor([True, True]),
                                           torch.tensor([0, 4, 9], dtype=torch.int32), args["rows"],
                                           torch.tensor([2, 6]), args["indices"])
    assert bool((saved == 7.0).all())


@pytest.mark.parametrize("ring_size, dtype", [(8, torch.float32), (11, torch.float32), (11, torch.bfloat16)])
def test_ring_checkpoint_saves_the_window_before_each_boundary_as_a_plain_loop_does(ring_size, dtype):
    """Positions before the chunk come from the row's ring, the rest from the chunk's keys; entries of
    positions outside the window (or before 0) are zero, laid out as a slot's ring holds them."""
    g = torch.Generator().manual_seed(42 + ring_size)
    W, R, nkv, hd = 8, ring_size, 2, 4
    k, v = torch.randn(30, nkv, hd, generator=g).to(dtype), torch.randn(30, nkv, hd, generator=g).to(dtype)
    k_ring = torch.randn(5 * R, nkv, hd, generator=g).to(dtype)
    v_ring = torch.randn(5 * R, nkv, hd, generator=g).to(dtype)
    qsl, slots = torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32)
    positions = torch.cat([torch.arange(20, 30), torch.arange(0, 20)])  # row 0 continues at 20, row 1 starts
    rows, boundaries, indices = (torch.tensor([0, 0, 1, 1], dtype=torch.int32), torch.tensor([21, 30, 5, 16]),
                                 torch.tensor([2, 0, 3, 1]))
    k_saved = torch.randn(3, 4 * R, nkv, hd, generator=g).to(dtype)
    v_saved = torch.randn(3, 4 * R, nkv, hd, generator=g).to(dtype)
    want = [k_saved.clone(), v_saved.clone()]
    for r, b, i in zip(rows.tolist(), boundaries.tolist(), indices.tolist()):
        first, start = int(positions[qsl[r]]), int(qsl[r])
        for saved, chunk, ring in zip(want, (k, v), (k_ring, v_ring)):
            saved[2, i * R:(i + 1) * R] = 0  # layer 2's; the others stay as they were
            for p in range(max(0, b - W), b):
                saved[2, i * R + p % R] = ring[slots[r] * R + p % R] if p < first else chunk[start + p - first]
    got = [k_saved.clone(), v_saved.clone()]
    torch.ops.inkling.ring_checkpoint(k, v, k_ring, v_ring, *got, 2, qsl, positions, slots, rows, boundaries, indices, R,
                                      W)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("edit, message", [
    (lambda a: a.update(indices=torch.tensor([2, 4])), "checkpoint index 4 out of range"),
    (lambda a: a.update(rows=torch.tensor([1, 2], dtype=torch.int32)), "names row 2"),
    (lambda a: a.update(slots=torch.tensor([9, 0], dtype=torch.int32)), "slot 9 out of range"),
    (lambda a: a.update(layer=3), "layer 3 out of range"),
    (lambda a: a.update(positions=torch.tensor([5])), "1 positions for a chunk of 6 tokens")])
def test_ring_checkpoint_refuses_what_is_out_of_range_by_name(edit, message):
    """A checkpoint slot past the saved rows, a row the chunk does not have, a slot past the rings, a
    layer past the stack or positions short of the chunk is an error naming it, not a read or write out
    of bounds; a valid checkpoint before the bad one is not written either."""
    R, g = 4, torch.Generator().manual_seed(3)
    args = dict(rows=torch.tensor([1, 0], dtype=torch.int32), slots=torch.tensor([1, 0], dtype=torch.int32),
                indices=torch.tensor([2, 1]), layer=0, positions=torch.tensor([5, 6, 7, 0, 1, 2]))
    edit(args)
    saved = [torch.full((1, 4 * R, 1, 2), 7.0) for _ in range(2)]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.inkling.ring_checkpoint(*(torch.randn(*shape, generator=g) for shape in ((6, 1, 2),) * 2),
                                          *(torch.randn(2 * R, 1, 2, generator=g) for _ in range(2)), *saved,
                                          args["layer"], torch.tensor([0, 3, 6], dtype=torch.int32), args["positions"],
                                          args["slots"], args["rows"], torch.tensor([3, 6]), args["indices"], R, 3)
    assert all(bool((s == 7.0).all()) for s in saved)
