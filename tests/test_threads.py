"""The C++ kernels on ATen's intra-op pool: the same result at 1, 2 and 3 threads, bit for bit, and
their references' result. Shapes are odd and large enough that every kernel splits its work (the
pool stays idle below a task's worth of work), so that uneven splits show; state a kernel mutates is
compared too. Engines at more than one thread keep their parity and their graph census."""

import pytest
import torch

from inkling_compiled.custom_ops.library import KERNELS, native_kernels
from inkling_compiled.engine import Engine
from inkling_compiled.graphs import GraphRecorder, census
from inkling_compiled.sampling import SamplingParams

from conftest import random_prompt

THREADS = (1, 2, 3)


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _cases():
    g = torch.Generator().manual_seed(11)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    for layout in ("W", "W^T"):
        w = r(1030, 333) if layout == "W" else _column_major(r(1030, 333))
        for rows in (1, 3, 5, 16):
            yield f"linear {layout} rows={rows}", "linear", (r(rows, 333), w), ()
    for layout in ("W", "W^T"):  # int8 past one block of rows: each panel widened once into a float buffer
        q = torch.randint(-127, 128, (1030, 333), generator=g, dtype=torch.int8)
        q = q if layout == "W" else _column_major(q)
        for rows in (3, 5, 16, 17, 32):
            yield f"linear_int8 {layout} rows={rows}", "linear_int8", (r(rows, 333), q, torch.rand(1030, generator=g) / 100), ()
    for layout in ("W", "W^T"):
        gate_up, down = r(7, 300, 200) / 14, r(7, 200, 150) / 12  # unit-scale activations
        if layout == "W^T":
            gate_up, down = _column_major(gate_up), _column_major(down)
        ids = torch.stack([torch.randperm(7, generator=g)[:2] for _ in range(9)])
        yield f"moe_experts {layout}", "moe_experts", (r(9, 200), ids, torch.rand(9, 2, generator=g), gate_up, down), ()
    block_table = torch.arange(3 * 80, dtype=torch.int32).reshape(3, 80)
    for dtype in (torch.float32, torch.bfloat16):
        yield f"paged_attention {dtype}", "paged_attention", (
            r(3, 8, 64).to(dtype), r(960, 2, 64).to(dtype), r(960, 2, 64).to(dtype), r(3, 8, 20).to(dtype),
            torch.rand(3, generator=g) + 1, block_table, torch.tensor([2, 0, 1], dtype=torch.int32),
            torch.tensor([301, 257, 290], dtype=torch.int32), 4, 20), ()
    for dtype in (torch.float32, torch.bfloat16):
        yield f"extend_attention {dtype}", "extend_attention", (
            r(90, 6, 64).to(dtype), r(260, 2, 64).to(dtype), r(260, 2, 64).to(dtype), r(90, 6, 30).to(dtype),
            torch.rand(90, generator=g) + 1, torch.tensor([0, 3, 90]), torch.tensor([0, 100, 260]), 0, 30), ()
    yield "ring_attention", "ring_attention", (
        r(3, 8, 64), r(3 * 211, 2, 64), r(3 * 211, 2, 64), r(3, 8, 20), torch.tensor([250, 400, 100]),
        torch.tensor([1, 2, 0], dtype=torch.int32), 200, 20, 211), ()
    R = 24  # nine checkpoints of three rows, boundaries before, inside and at the end of each row's chunk
    yield "ring_checkpoint", "ring_checkpoint", (
        r(90, 2, 64), r(90, 2, 64), r(5 * R, 2, 64), r(5 * R, 2, 64), r(3, 10 * R, 2, 64), r(3, 10 * R, 2, 64), 1,
        torch.tensor([0, 30, 50, 90], dtype=torch.int32), torch.cat([torch.arange(40, 70), torch.arange(20),
                                                                     torch.arange(100, 140)]),
        torch.tensor([2, 4, 1], dtype=torch.int32), torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2], dtype=torch.int32),
        torch.tensor([41, 56, 70, 3, 20, 100, 117, 130, 140]), torch.tensor([9, 1, 2, 3, 4, 5, 6, 7, 8]), R, 20), (4, 5)
    yield "sconv_checkpoint", "sconv_checkpoint", (  # 40 checkpoints of three rows (one without initial state)
        r(90, 700), r(5, 3, 700), r(3, 50, 3, 700), 1, torch.tensor([2, 4, 1], dtype=torch.int32),
        torch.tensor([True, False, True]), torch.tensor([0, 30, 50, 90], dtype=torch.int32),
        torch.tensor([0] * 15 + [1] * 10 + [2] * 15, dtype=torch.int32),
        torch.cat([torch.arange(1, 31, 2), torch.arange(31, 51, 2), torch.arange(52, 91, 2)[:15]]),
        torch.randperm(50, generator=g)[:40]), (2,)
    pool = r(6, 3, 5000)
    yield "sconv_decode", "sconv_decode", (r(4, 5000), pool, r(5000, 4), torch.tensor([5, 0, 3, 1], dtype=torch.int32)), (1,)
    yield "sconv_extend", "sconv_extend", (
        r(40, 3000), r(6, 3, 3000), r(3000, 4), torch.tensor([0, 17, 40], dtype=torch.int32),
        torch.tensor([True, False]), torch.tensor([4, 2], dtype=torch.int32)), (1,)
    yield "sconv_verify", "sconv_verify", (
        r(18, 2000), r(7, 3, 2000), r(2000, 4), torch.tensor([6, 0, 2, 5, 1, 3], dtype=torch.int32),
        torch.zeros(6, 3, 3, 2000)), (4,)
    yield "top_k_top_p", "top_k_top_p", (
        r(6, 5000) * 3, torch.tensor([0, 40, 0, 1, 5000, 7]), torch.tensor([1.0, 1.0, 0.7, 1.0, 0.2, 0.9])), ()
    # the samplers: greedy and sampled rows (top-k, top-p), a row at a task
    sampling = (torch.tensor([0.0, 0.8, 0.0, 1.3, 0.5, 0.0]), torch.tensor([0, 40, 0, 0, 7, 0]),
                torch.tensor([1.0, 1.0, 1.0, 0.7, 1.0, 1.0]), torch.arange(6) * 977, torch.arange(6) + 100)
    yield "sample_tokens", "sample_tokens", (r(6, 5000) * 3, *sampling, 20), ()
    logits = r(6, 3, 5000) * 3
    inputs = torch.cat([torch.zeros(6, 1, dtype=torch.long), logits.argmax(-1)[:, :-1]], dim=1)
    yield "verify_tokens", "verify_tokens", (logits, inputs, torch.tensor([2, 2, 1, 0, 2, 2]), *sampling, 20), ()


CASES = list(_cases())


def _run(op: str, args: tuple, mutated: tuple, threads: int):
    torch.set_num_threads(threads)
    args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    return _outputs(getattr(torch.ops.inkling, op).default(*args), args, mutated)


def _outputs(out, args: tuple, mutated: tuple) -> list:
    """An op's outputs (one, several, or None for an op that only writes), then the arguments it wrote."""
    outs = list(out) if isinstance(out, tuple) else [out] * (out is not None)
    return outs + [args[i] for i in mutated]


@pytest.mark.parametrize("name, op, args, mutated", CASES, ids=[c[0] for c in CASES])
def test_every_kernel_gives_the_same_bits_at_any_thread_count(name, op, args, mutated):
    assert native_kernels()
    base = _run(op, args, mutated, 1)
    for threads in THREADS[1:]:
        for got, want in zip(_run(op, args, mutated, threads), base):
            assert torch.equal(got, want), f"{name}: {threads} threads differ from one"
    # ... and the result is the reference's (an independent plain-torch definition)
    torch.set_num_threads(1)
    ref_args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    want = _outputs(KERNELS[op]["reference"](*ref_args), ref_args, mutated)
    tol = 2e-2 if base[0].dtype == torch.bfloat16 else 1e-4
    for got, ref in zip(base, want):
        assert torch.equal(got.isinf(), ref.isinf())
        assert torch.allclose(got.float().nan_to_num(neginf=0.0), ref.float().nan_to_num(neginf=0.0), atol=tol, rtol=tol)


def test_a_compiled_engine_at_two_threads_keeps_its_census_and_its_tokens(checkpoint):
    """The whole decode step compiled at two threads: one symbolic graph, no breaks, every conv stream
    an op, and the tokens and logprobs of the eager engine at one thread."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    prompts = [random_prompt(n, seed=70 + n) for n in (5, 33)]
    params = SamplingParams(max_new_tokens=8, logprobs=True, ignore_eos=True)
    torch.set_num_threads(1)
    want = Engine.from_pretrained(checkpoint("tiny"), compile=False, progress=False).generate(prompts, params)
    torch.set_num_threads(2)
    recorder = GraphRecorder("inductor")
    # cpp_wrapper off: the Python wrapper compiles in a fraction of the time, and the threads are the point
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=True, progress=False, max_batch_size=2,
                                    compile_backend=recorder, cpp_wrapper=False)
    got = engine.generate(prompts, params)
    assert len(recorder.graphs) == 2 and not torch._dynamo.utils.counters["graph_break"]  # decode, extend
    assert [census(gm)["sconv_calls"] for gm in recorder.graphs] == [4 * engine.config.num_hidden_layers] * 2
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4
    torch._dynamo.reset()


def _resident_mb() -> float:
    """Resident memory, once the C allocator has handed back what it caches (so that only memory still
    held by someone counts)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_a_prefill_sized_expert_call_leaves_no_buffers_behind():
    """The experts' working buffers stay between calls at decode sizes only: after a 4096-token call
    (about 120 MB of them) the process holds no more than a fraction of that."""
    g = torch.Generator().manual_seed(4)
    E, H, I, T = 8, 1024, 512, 4096
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) / 32, torch.randn(E, H, I, generator=g) / 22
    ids = torch.randint(0, E, (T, 2), generator=g)
    small = (torch.randn(2, H, generator=g), ids[:2], torch.rand(2, 2, generator=g), gate_up, down)
    torch.ops.inkling.moe_experts.default(*small)  # the buffers at decode size, allocator warm
    before = _resident_mb()
    out = torch.ops.inkling.moe_experts.default(torch.randn(T, H, generator=g), ids, torch.rand(T, 2, generator=g),
                                                gate_up, down)
    del out
    torch.ops.inkling.moe_experts.default(*small)
    assert _resident_mb() - before < 40


def test_the_many_row_kernel_gives_the_same_bits_at_any_thread_count_and_a_plain_products_result():
    """W^T's layout from 20 rows takes register tiles of 6 rows (4 on AVX2) over 64-term strips of the
    weight (int8 strips widened first). The rows leave every remainder tile of both builds, the 1000
    columns a last panel of two vectors and a tail of 8 past the last full vector, the 333 terms a short
    last strip; 16 and 17 rows take the chunked kernel beside them. The fp32 shape is forced onto the
    C++ kernel at every row count (unmeasured shapes take it to 16 rows only); int8 takes it to 32 rows
    whatever the choice."""
    from inkling_compiled import kernel_choice

    assert native_kernels()
    g = torch.Generator().manual_seed(12)
    w = _column_major(torch.randn(1000, 333, generator=g))
    q = _column_major(torch.randint(-127, 128, (1000, 333), generator=g, dtype=torch.int8))
    scale = torch.rand(1000, generator=g) / 100
    try:
        for threads in THREADS:
            kernel_choice._set_choice(1000, 333, True, threads, (1 << 64) - 1)
        for rows in (16, 17, 20, 21, 22, 23, 24, 25, 29, 40):
            x = torch.randn(rows, 333, generator=g)
            calls = [("linear", (x, w), x.double() @ w.double().t())]
            if rows <= 32:
                calls.append(("linear_int8", (x, q, scale), x.double() @ (q.double() * scale.double()[:, None]).t()))
            for op, args, plain in calls:
                base = _run(op, args, (), 1)[0]
                for threads in THREADS[1:]:
                    assert torch.equal(_run(op, args, (), threads)[0], base), f"{op} rows={rows}: {threads} threads"
                assert torch.allclose(base.double(), plain, atol=1e-4, rtol=1e-4), f"{op} rows={rows}"
    finally:
        kernel_choice.forget_installed()
