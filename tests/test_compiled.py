"""The compiled decode step: structure (cheap backends, every bucket), generated code and addresses
(inductor), parity with the eager engine, the HiCache barrier, bucket overflow, errors."""

import threading
import time

import pytest
import torch

from inkling_compiled.engine import Engine
from inkling_compiled.errors import CompileError
from inkling_compiled.graphs import DEFAULT_BUCKETS, GraphRecorder, census
from inkling_compiled.graphs.dump import pool_copies_in_code, pool_shapes, pool_symbols
from inkling_compiled.sampling import SamplingParams
from inkling_compiled.spec import Drafter
from inkling_compiled.step_plan import StepKind
from inkling_compiled.streams import STREAM_NAMES

from conftest import PARITY_CONFIGS, PARITY_LENGTHS, has_symbolic_batch, random_prompt

GREEDY = SamplingParams(max_new_tokens=10, logprobs=True, ignore_eos=True)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def compiled_engine(checkpoint, name, **kw):
    """These tests are about the decode graph: the extend graph (tests/test_chunked_prefill.py) is left out
    unless a test asks for it."""
    kw.setdefault("progress", False)
    kw.setdefault("compile_extend", False)
    return Engine.from_pretrained(checkpoint(name), compile=True, **kw)


# ---- structure on cheap backends -------------------------------------------------------------------

def _full_sconv_census(gm, config) -> None:
    layers = config.num_hidden_layers
    c = census(gm)
    assert c["sconv_calls"] == 4 * layers
    sconv = [(x["layer"], x["stream"]) for x in c["custom_calls"] if x["op"] == "inkling::sconv_decode"]
    assert sorted(sconv) == sorted((layer, s) for layer in range(layers) for s in STREAM_NAMES)
    assert c["ops"]["inkling::kv_write"] == layers
    # Projection calls: q, k, v and r stacked, and o; gate and up stacked, and down, for a dense MLP and
    # for each shared expert; the lm_head. Each call costs a few microseconds beyond its bytes.
    sparse = sum(config.is_sparse(i) for i in range(layers))
    assert c["ops"]["inkling::linear"] == 2 * layers + 2 * (layers - sparse) + 2 * config.n_shared_experts * sparse + 1
    assert c["ops"].get("inkling::sconv_extend", 0) == 0
    assert c["ops"].get("inkling::wait_layer", 0) == 0  # no HiCache barrier unless asked for


@pytest.mark.parametrize("name, inner", [("tiny", "eager"), ("tiny-k3", "eager"), ("tiny", "aot_eager")])
def test_one_symbolic_graph_serves_every_bucket_no_breaks_and_a_full_sconv_census(name, inner, checkpoint):
    """Default buckets 1..32: one graph with a symbolic batch serves them all, and any batch size up
    to the largest bucket runs on it without a recompile."""
    recorder = GraphRecorder(inner)
    engine = compiled_engine(checkpoint, name, max_batch_size=32, compile_backend=recorder)
    assert engine.worker.decoder.buckets == DEFAULT_BUCKETS
    assert engine.worker.decoder.graphs() == [DEFAULT_BUCKETS]
    assert len(recorder.graphs) == 1 and has_symbolic_batch(recorder.graphs[0])
    assert not torch._dynamo.utils.counters["graph_break"]
    _full_sconv_census(recorder.graphs[0], engine.config)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    engine.worker.backend.prepare_padding(3)  # not a bucket: still no new graph
    tokens = engine.worker.decoder.run(4)[0]
    assert tokens.shape == (3,) and torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_batch_one_specialised_is_its_own_static_graph(checkpoint):
    recorder = GraphRecorder("eager")
    engine = compiled_engine(checkpoint, "tiny", max_batch_size=8, compile_backend=recorder, specialize_batch_one=True)
    assert engine.worker.decoder.graphs() == [(1,), (2, 4, 8)]
    assert [has_symbolic_batch(gm) for gm in recorder.graphs] == [False, True]
    for gm in recorder.graphs:
        _full_sconv_census(gm, engine.config)


def test_graph_per_bucket_compiles_each_bucket_and_refuses_other_sizes(checkpoint):
    recorder = GraphRecorder("eager")
    engine = compiled_engine(checkpoint, "tiny", max_batch_size=8, compile_backend=recorder, graph_per_bucket=True)
    assert engine.worker.decoder.graphs() == [(1,), (2,), (4,), (8,)]
    assert not any(has_symbolic_batch(gm) for gm in recorder.graphs)
    for gm in recorder.graphs:
        _full_sconv_census(gm, engine.config)
    # after warm-up, a shape outside the buckets must not silently compile a new graph
    engine.worker.backend.prepare_padding(3)
    with pytest.raises(CompileError, match=r"(?s)would recompile after warm-up.*size mismatch"):
        engine.worker.decoder.run(4)


@pytest.mark.parametrize("second", [dict(name="tiny", num_pages=40), dict(name="tiny-k3")])
def test_two_engines_in_one_process_never_share_a_graph(second, checkpoint):
    """Dynamo's cache is per code object and torch.compile calls with equal options share it; the
    guards watch only the step metadata and the step's instance number. Each engine must still compile
    and run its own graphs (they bake in its model and pool), whether the second differs in pool size
    or in model."""
    second = dict(second)
    name = second.pop("name")
    first = compiled_engine(checkpoint, "tiny", max_batch_size=4, buckets=(1, 4), compile_backend="eager")
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1
    other = compiled_engine(checkpoint, name, max_batch_size=4, buckets=(1, 4), compile_backend="eager", **second)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2 and other.worker.decoder.graphs() == [(1, 4)]
    prompts = [random_prompt(4 + i, seed=40 + i) for i in range(3)]
    for engine, model in ((first, "tiny"), (other, name)):
        eager = Engine.from_pretrained(checkpoint(model), compile=False, max_batch_size=4)
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == \
            [o.token_ids for o in eager.generate(prompts, GREEDY)]


def test_lazy_engine_compiles_a_bucket_on_first_use(checkpoint):
    recorder = GraphRecorder("eager")
    engine = compiled_engine(checkpoint, "tiny", max_batch_size=8, compile_backend=recorder, warmup=False)
    assert engine.worker.decoder.graphs() == [] and not recorder.graphs
    eager = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=8)
    prompts = [random_prompt(5 + i, seed=i) for i in range(3)]
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == \
        [o.token_ids for o in eager.generate(prompts, GREEDY)]
    assert engine.worker.decoder.graphs() == [(4,)] and len(recorder.graphs) == 1  # three rows: bucket 4
    assert engine.warm_up([1]) and engine.worker.decoder.graphs() == [(1, 4)]  # served by the same graph
    assert len(recorder.graphs) == 1
    with pytest.raises(Exception, match="not all among the engine's buckets"):
        engine.warm_up([3])


def test_compile_backend_errors(checkpoint):
    with pytest.raises(CompileError, match="unknown compile backend 'fast'"):
        compiled_engine(checkpoint, "tiny", compile_backend="fast")
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(CompileError, match="needs torch-tensorrt"):
            compiled_engine(checkpoint, "tiny", compile_backend="tensorrt")


# ---- inductor: generated code, addresses, parity -------------------------------------------------------

def test_inductor_code_has_no_pool_sized_copies(checkpoint):
    from torch._inductor.utils import run_and_get_code

    # The Python launch wrapper (cpp_wrapper=False) prints the same buffers and calls as readable code;
    # traced, not loaded as a package, so that there is code to print.
    recorder = GraphRecorder("inductor")
    engine = compiled_engine(checkpoint, "tiny", max_batch_size=4, buckets=(1, 4), warmup=False, cpp_wrapper=False,
                             compile_backend=recorder)
    _, codes = run_and_get_code(engine.worker.decoder.warmup)
    assert len(codes) == 1  # one symbolic graph for both buckets
    big = pool_shapes(engine.worker.pool.state_tensors())
    symbols = pool_symbols(recorder.graphs[0])  # slots, ring rows, page rows (the block table's too)
    assert len(symbols) == 4 and all(s.startswith("u") for s in symbols)
    ring = engine.worker.pool.sliding_kv[0][0]  # one layer's ring: [(slots+1)*W, nkv, hd]
    dims = ", ".join(map(str, ring.shape))
    assert pool_copies_in_code(f"buf = empty_strided_cpu(({dims}), (8, 8, 1))", big)  # the scan can fire
    trailing = ", ".join(map(str, ring.shape[1:]))  # and on a pool's symbolic size, not on a batch's
    assert any(pool_copies_in_code(f"buf = empty_strided_cpu(({s}, {trailing}), (8, 8, 1))", big, symbols)
               for s in symbols)
    assert not pool_copies_in_code(f"buf = empty_strided_cpu((u99, {trailing}), (8, 8, 1))", big, symbols)
    for code in codes:
        body = code[code.index("def call("):]
        assert pool_copies_in_code(body, big, symbols) == []
        assert body.count("torch.ops.inkling.sconv_decode.default(") == 4 * engine.config.num_hidden_layers


def test_cpp_wrapper_checks_no_sizes_on_every_call(checkpoint, monkeypatch):
    """Inductor's run-time size and stride checks of each custom op's inputs and outputs cost 3-4 % of a
    batch-1 step in the C++ wrapper; the step is compiled without them (and with them on request)."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.delenv("TORCHINDUCTOR_SIZE_ASSERTS", raising=False)
    engine = compiled_engine(checkpoint, "tiny", max_batch_size=4, buckets=(1, 4), warmup=False, compile_package=False)
    with torch._inductor.config.patch(fx_graph_cache=False):  # generated here, so that there is code to read
        _, codes = run_and_get_code(engine.worker.decoder.warmup)
    assert len(codes) == 1 and engine.worker.decoder.cpp_wrapper
    layers = engine.config.num_hidden_layers
    assert codes[0].count('"inkling::sconv_decode"') == 4 * layers  # the decode step's C++ wrapper
    assert "assert_size_stride(" not in codes[0]
    # on request they are compiled in, and such a step never loads a package saved without them
    plain = compiled_engine(checkpoint, "tiny", max_batch_size=4, buckets=(1, 4), warmup=False).worker.decoder
    monkeypatch.setenv("TORCHINDUCTOR_SIZE_ASSERTS", "1")
    checked = compiled_engine(checkpoint, "tiny", max_batch_size=4, buckets=(1, 4), warmup=False).worker.decoder
    assert checked._options["size_asserts"] is True and plain._options["size_asserts"] is False
    assert plain.package_path is not None and checked.package_path != plain.package_path


def test_pool_sizes_are_not_baked_into_the_graph(checkpoint):
    """Another max_batch_size, num_pages or max_model_len reuses the compiled graph from inductor's cache,
    compiling nothing anew, and every layer still reads and writes its own state: tokens and logprobs equal
    the eager engine's with the same sizes (a graph that slices layers out of a stacked pool tensor with
    symbolic sizes gets this wrong from the second step on). The traced path: a packaged step (below)
    reuses its package instead."""
    prompts = [random_prompt(n, seed=n) for n in (3, 9, 15, 20)]
    compiled_engine(checkpoint, "tiny", max_batch_size=4, num_pages=40, max_model_len=64, compile_package=False)
    for sizes in (dict(max_batch_size=8, num_pages=90, max_model_len=256), dict(max_batch_size=3, num_pages=24)):
        before = dict(torch._dynamo.utils.counters["inductor"])
        compiled = compiled_engine(checkpoint, "tiny", compile_package=False, **sizes)
        after = torch._dynamo.utils.counters["inductor"]
        assert after["fxgraph_cache_miss"] == before.get("fxgraph_cache_miss", 0), sizes
        assert after["fxgraph_cache_hit"] == before.get("fxgraph_cache_hit", 0) + 1, sizes
        eager = Engine.from_pretrained(checkpoint("tiny"), compile=False, **sizes)
        for want, got in zip(eager.generate(prompts, GREEDY), compiled.generate(prompts, GREEDY)):
            assert got.token_ids == want.token_ids
            assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-4


@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_compiled_engine_matches_eager_with_continuous_batching(name, checkpoint):
    """Inductor graphs for buckets (1, 4) and the extend graph; 10 rows decode as 4 + 4 + 2 (padded): the
    overflow splits."""
    eager = Engine.from_pretrained(checkpoint(name), compile=False, max_batch_size=10)
    compiled = compiled_engine(checkpoint, name, max_batch_size=10, buckets=(1, 4), compile_extend=True)
    # the C++ wrapper built apart from the kernels (-O1 glue, -O3 kernels): half of a cold start here
    for step in (compiled.worker.decoder, compiled.worker.extender):
        assert step.cpp_wrapper and step._options["cpp_wrapper_build_separate"] is True
    prompts = [random_prompt(n, seed=3000 + n) for n in PARITY_LENGTHS]
    worst = 0.0
    for engine_outs in [(eager.generate(prompts, GREEDY), compiled.generate(prompts, GREEDY))]:
        for want, got in zip(*engine_outs):
            assert got.token_ids == want.token_ids
            worst = max(worst, max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)))
    assert worst < 1e-4

    # staggered arrivals, mixed lengths and budgets, one abort: same tokens as eager, step for step
    def drive(engine):
        final, rids = {}, []
        for step in range(120):
            if step < 12:
                rids.append(engine.add_request(random_prompt(2 + 7 * step, seed=step),
                                               SamplingParams(max_new_tokens=3 + step % 6, ignore_eos=True)))
            if step == 6:
                engine.abort(rids[2])
            final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            if step >= 12 and not engine.has_unfinished():
                break
        return [final[r] for r in rids]

    assert drive(compiled) == drive(eager)

    # seeded top-k / top-p / temperature sampling and top_logprobs, compiled against eager
    sampled = [SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=7 + i, logprobs=True,
                              top_logprobs=5, ignore_eos=True) for i in range(4)]
    sampled[1] = SamplingParams(max_new_tokens=8, temperature=1.3, seed=99, top_logprobs=3, ignore_eos=True)
    want_s, got_s = (e.generate(prompts[:4], sampled) for e in (eager, compiled))
    for want, got in zip(want_s, got_s):
        assert got.token_ids == want.token_ids
        for g_top, w_top in zip(got.top_logprobs, want.top_logprobs):
            assert [t for t, _ in g_top] == [t for t, _ in w_top]
            worst = max(worst, max(abs(a - b) for (_, a), (_, b) in zip(g_top, w_top)))
    assert worst < 1e-4
    print(f"\n{name}: compiled (inductor) vs eager max logprob diff {worst:.2e}")


def test_graph_inputs_keep_their_addresses_across_steps(checkpoint):
    """What CUDA graphs need: every tensor the graph is fed (pool, KV, metadata views, parameters) sits
    at the same address at every replay of its bucket, through real traffic with changing requests."""
    recorder = GraphRecorder("eager", track_addresses=True)
    engine = compiled_engine(checkpoint, "tiny", max_batch_size=4, buckets=(1, 4), compile_backend=recorder)
    engine.generate([random_prompt(n, seed=n) for n in (3, 9, 15)], SamplingParams(max_new_tokens=5))
    engine.generate([random_prompt(n, seed=n) for n in (4, 10, 12)], SamplingParams(max_new_tokens=5))
    engine.generate([random_prompt(5, seed=1)], SamplingParams(max_new_tokens=4))
    assert len(recorder.graphs) == 1  # buckets 1 and 4 share the symbolic graph; nothing recompiled
    (calls,), (sizes,) = recorder.addresses, recorder.sizes
    by_bucket: dict[tuple, list] = {}
    for call, size in zip(calls, sizes):
        by_bucket.setdefault(size, []).append(call)
    # The graph's size inputs: the batch (1 or 4) and the pool's sizes (fixed for the engine's life).
    varying = [values for values in zip(*by_bucket) if len(set(values)) > 1]
    assert len(by_bucket) == 2 and [set(values) for values in varying] == [{1, 4}]
    assert {(engine.worker.pool.max_slots + 1)} <= {v for size in by_bucket for v in size}
    for replays in by_bucket.values():
        assert len(replays) >= 2  # warm-up and replays
        assert all(c == replays[0] for c in replays), "a graph input moved between replays of its bucket"
        assert sum(a is not None for a in replays[0]) > 50  # it saw the pool, metadata and weights



def _static_kind(t: torch.Tensor):
    return getattr(t, "_dynamo_static_input_type", None)


def test_pool_and_metadata_are_marked_static_before_anything_compiles(checkpoint):
    """Explicit, not left to how Dynamo happens to treat tensors reached through a module: the pool,
    the block table and every metadata field (and each bucket's slices of them) are static inputs."""
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4, progress=False,
                                    speculative="ngram")
    buffers = engine.worker.backend.buffers
    tensors = {f"pool[{i}]": t for i, t in enumerate(engine.worker.pool.static_tensors())}
    for kind, md in (("decode", buffers.prepare_padding(3)), ("verify", buffers.prepare_verify_padding(3))):
        tensors.update({f"{kind} metadata.{n}": getattr(md, n) for n in md.__struct_fields__
                        if isinstance(getattr(md, n), torch.Tensor)})
    assert len(tensors) > 40
    assert [name for name, t in tensors.items() if _static_kind(t) is None] == []


@pytest.mark.parametrize("graphs", ["one", "per-bucket"])
def test_every_graph_input_is_a_static_tensor_or_a_size_symbol(graphs, checkpoint):
    """What CUDA graphs need to neither copy the cache at each replay nor refuse to capture: every tensor
    the decode graph is fed is a static input, and nothing per step reaches it as a Python value (the
    other inputs are symbols of sizes: the pool's, and the batch's in the one-graph step)."""
    inputs = []

    def record(gm, example_inputs):
        inputs.append(list(example_inputs))
        return gm.forward

    engine = compiled_engine(checkpoint, "tiny", max_batch_size=4, buckets=(2, 4), compile_backend=record,
                             graph_per_bucket=graphs == "per-bucket")
    assert len(inputs) == (2 if graphs == "per-bucket" else 1)
    assert engine.worker.pool.sliding_kv and engine.worker.pool.global_kv  # tiny has both kinds of layers
    for example in inputs:
        tensors = [x for x in example if isinstance(x, torch.Tensor)]
        others = [x for x in example if not isinstance(x, torch.Tensor)]
        assert len(tensors) > 100 and [x for x in tensors if _static_kind(x) is None] == []
        # The other inputs are symbols, one per kind of size, however many tensors have it (each is an
        # argument of every call): the pool's slots, ring rows, page rows and block-table width, and the
        # batch unless each bucket has a graph of its own.
        assert {type(x) for x in others} == {torch.SymInt}
        assert len(others) == 4 + (0 if graphs == "per-bucket" else 1), others


def _layout_questions(t: torch.Tensor) -> None:
    """Asks of a graph input what inductor asks before it captures a CUDA graph (torch 2.11 asks it of
    every input, static or not, to rule out memory overlap): is each dimension a broadcast (stride 0,
    size not 1); then, size-1 dimensions dropped, how the strides order and whether each covers the
    span of the one below. An answer that depends on a size symbol's value raises, and on a GPU the
    compile fails (seen on an H200: the block table's row stride is its symbolic width)."""
    for dim in range(t.ndim):
        if t.stride(dim) == 0 and t.size(dim) != 1:
            t = torch.ops.aten.slice(t, dim, 0, 1)
    t = t.squeeze()
    order = [d for _, d in sorted(zip(t.stride(), range(t.ndim)))]
    spans_below = [(1, 1)] + [(t.stride(d), t.size(d)) for d in order]  # the smallest stride is held to 1
    for (stride, size), dim in zip(spans_below, order):
        bool(t.stride(dim) < stride * size)


def test_every_cuda_graph_input_has_a_layout_the_compiler_can_prove(checkpoint):
    """The decode, verify and MTP draft graphs (the ones CUDA graphs capture), on the fake inputs inductor
    compiles them from: every layout question above has one answer for every size the pool's and the
    batch's symbols may take. Fails without the block table's least width (`PoolContext.block_table`)."""
    from torch._dynamo.backends.common import aot_autograd

    unprovable, asked = [], []

    def ask(gm, example_inputs):
        for i, t in enumerate(example_inputs):
            if isinstance(t, torch.Tensor):
                try:
                    _layout_questions(t)
                except torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode as e:
                    unprovable.append((i, tuple(t.shape), str(e).splitlines()[0]))
        asked.append(len(example_inputs))
        return gm.forward

    compiled_engine(checkpoint, "tiny", max_batch_size=4, buckets=(1, 4), speculative="mtp",
                    num_speculative_tokens=2, compile_backend=aot_autograd(fw_compiler=ask))
    assert len(asked) == 3  # decode, verify, draft
    assert unprovable == []


class OutputReusingBackend:
    """Returns each graph's outputs in buffers of its own that every call overwrites, as CUDA graph
    replays do, and says so (`reuses_outputs`)."""

    reuses_outputs = True

    def __init__(self):
        self.calls = 0

    def __call__(self, gm, example_inputs):
        buffers = {}

        def run(*args):
            self.calls += 1
            outs = gm.forward(*args)
            key = tuple(tuple(o.shape) for o in outs)
            if key not in buffers:
                buffers[key] = [torch.empty_like(o) for o in outs]
            for buffer, out in zip(buffers[key], outs):
                buffer.copy_(out)
            return type(outs)(buffers[key])

        return run


def test_outputs_of_replays_that_reuse_memory_survive_a_split_batch(checkpoint):
    """10 rows on buckets (1, 4) decode as 4 + 4 + 2: the first replay's outputs must not be the
    second's by the time the three are concatenated. And warm-up runs each bucket three times, so a
    CUDA graph is recorded before the first request (graph trees warm, then record, then replay)."""
    backend = OutputReusingBackend()
    compiled = compiled_engine(checkpoint, "tiny", max_batch_size=10, buckets=(1, 4), compile_backend=backend)
    assert compiled.worker.decoder.cuda_graphs and backend.calls == 3 * 2
    eager = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=10)
    prompts = [random_prompt(n, seed=4000 + n) for n in PARITY_LENGTHS]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in compiled.generate(prompts, params)] == \
        [o.token_ids for o in eager.generate(prompts, params)]

# ---- the HiCache barrier --------------------------------------------------------------------------------

class LateCounter:
    """Loads each layer's state from a host copy on a thread, layer by layer, late; records the waits."""

    def __init__(self, pool, host_copy, delay_s=0.02):
        self.pool, self.host_copy, self.delay_s = pool, host_copy, delay_s
        self.done = [threading.Event() for _ in host_copy]
        self.waits: list[tuple[int, bool]] = []  # (layer, had to block)
        self.thread = threading.Thread(target=self._load, daemon=True)

    def _load(self):
        for layer, saved in enumerate(self.host_copy):
            time.sleep(self.delay_s)
            for dst, src in zip(self.pool.layer_state(layer), saved):
                dst.copy_(src)
            self.done[layer].set()

    def wait_until(self, layer_id):
        blocked = not self.done[layer_id].is_set()
        assert self.done[layer_id].wait(timeout=30), f"layer {layer_id} never arrived"
        self.waits.append((layer_id, blocked))


class _TwoThrees(Drafter):
    def propose(self, reqs):
        return [[3, 3] for _ in reqs]


@pytest.mark.parametrize("compile, barrier, verify", [(False, True, False), (True, True, False), (True, False, False),
                                                      (True, True, True), (True, False, True)])
def test_step_never_reads_a_layer_before_its_transfer(compile, barrier, verify, checkpoint):
    """Eager: the pool's accessors wait. Compiled with the barrier: one wait_layer op per layer, inside the
    graph. Compiled without it: the step waits for every layer before the replay starts. The same for a
    speculative verify step (its graphs on the eager backend, to keep the test short)."""
    kw = dict(buckets=(1,), compile_backend="eager" if verify else "inductor") if compile else {}
    if verify:
        kw.update(speculative=_TwoThrees(), num_speculative_tokens=2)
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=compile, max_batch_size=2, layer_transfer=barrier,
                                    progress=False, **kw)
    rid = engine.add_request(random_prompt(11, seed=4), SamplingParams(max_new_tokens=5, ignore_eos=True,
                                                                       logprobs=True))
    engine.step()  # prefill
    (req,) = engine.scheduler.running
    layers = range(engine.config.num_hidden_layers)
    host_copy = [[t.clone() for t in engine.worker.pool.layer_state(i)] for i in layers]
    reference = engine.step()[0]
    # an output reads the request's lists when asked: keep what this one says before they are rewound
    want_tokens, want_logprobs = list(reference.token_ids), list(reference.logprobs)
    assert engine.stats()["verify_steps"] == int(verify)

    # rewind: restore the state, forget the step's tokens, then wipe every layer and load it back late
    for _ in range(len(want_tokens) - 1):
        req.output.pop(), req.logprobs.pop()
    for layer in layers:
        for t in engine.worker.pool.layer_state(layer):
            t.fill_(float("nan"))
    counter = LateCounter(engine.worker.pool, host_copy)
    engine.attach_layer_transfer_counter(counter)
    counter.thread.start()
    out = engine.step()[0]
    counter.thread.join()
    assert out.request_id == rid
    assert out.token_ids == want_tokens and out.logprobs == want_logprobs
    assert list(dict.fromkeys(layer for layer, _ in counter.waits)) == list(layers)  # first waits in layer order
    assert counter.waits[0][1], "the first wait should have had to block"
    if compile:  # one wait per layer: the graph's barrier, or the wait before the replay
        assert len(counter.waits) == len(layers)


def test_attaching_and_detaching_a_counter_never_recompiles(checkpoint):
    from torch._dynamo.utils import get_compilation_metrics

    class Counting:
        def __init__(self):
            self.waits = 0

        def wait_until(self, layer_id):
            self.waits += 1

    engine = compiled_engine(checkpoint, "tiny", max_batch_size=2, buckets=(1, 2), compile_backend="eager",
                             layer_transfer=True)
    compiled_frames = len(get_compilation_metrics())
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    plain = engine.generate([[5, 6, 7]], params)[0].token_ids
    counter = Counting()
    engine.attach_layer_transfer_counter(counter)
    assert engine.generate([[5, 6, 7]], params)[0].token_ids == plain
    # the eager prefill waits at each of a layer's 5 state reads (4 convs, KV); each of the 3 compiled
    # decode steps once per layer, at the graph's barrier
    layers = engine.config.num_hidden_layers
    assert counter.waits == 5 * layers + 3 * layers
    engine.attach_layer_transfer_counter(None)
    assert engine.generate([[5, 6, 7]], params)[0].token_ids == plain
    assert counter.waits == 8 * layers
    assert len(get_compilation_metrics()) == compiled_frames


def test_serving_survives_libraries_registering_pytree_nodes_after_warm_up(checkpoint):
    """Importing e.g. transformers after warm-up registers pytree nodes; no graph may guard on that."""
    import dataclasses

    engine = compiled_engine(checkpoint, "tiny", max_batch_size=2, buckets=(1, 2), compile_backend="eager")

    @dataclasses.dataclass
    class Late:
        x: int

    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    want = Engine.from_pretrained(checkpoint("tiny"), compile=False).generate([[5, 6, 7]], params)[0].token_ids
    torch.utils._pytree.register_pytree_node(Late, lambda n: ([], n.x), lambda _, x: Late(x))
    try:
        out = engine.generate([[5, 6, 7]], params)[0]
    finally:
        torch.utils._pytree._deregister_pytree_node(Late)
    assert out.token_ids == want


def test_a_batch_past_the_largest_bucket_is_one_step_of_several_replays(checkpoint):
    """Four running requests over buckets (1, 2): each step replays bucket 2 twice, counts one decode step,
    and a fault in the second replay fails the whole batch (as one forward would), none of its tokens kept."""
    engine = compiled_engine(checkpoint, "tiny", max_batch_size=4, buckets=(1, 2), compile_backend="eager")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = Engine.from_pretrained(checkpoint("tiny"), compile=False, progress=False).generate(
        [[5 + i, 6, 7] for i in range(4)], params)
    outs = engine.generate([[5 + i, 6, 7] for i in range(4)], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert engine.stats()["decode_steps"] == 3  # the first token comes from the prefill

    run, replays = engine.worker.runner.run, []

    def second_replay_fails(plan):
        if plan.kind is StepKind.DECODE:
            replays.append(plan.rows)
            if len(replays) == 2:
                raise RuntimeError("injected fault")
        return run(plan)

    engine.worker.runner.run = second_replay_fails
    rids = [engine.add_request([9, 8, 7 + i], params) for i in range(4)]
    final = {}
    while engine.has_unfinished():
        final.update((o.request_id, o) for o in engine.step())
    assert replays[:2] == [2, 2] and {final[r].finish_reason for r in rids} == {"error"}
    assert all(len(final[r].token_ids) == 1 for r in rids)  # the prefill's token only
