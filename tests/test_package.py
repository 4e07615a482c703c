"""The compiled step saved whole (graphs/package.py): a later engine, in this process or another, loads it
and traces nothing; the key follows the graph, not the pool; every failure falls back to compiling."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from inkling_compiled.engine import Engine
from inkling_compiled.errors import CompileError
from inkling_compiled.graphs import package
from inkling_compiled.graphs.capture import INSTANCE_SOURCE, InputsKeys
from inkling_compiled.sampling import SamplingParams

from conftest import Threes, count_guard_checks, random_prompt

GREEDY = SamplingParams(max_new_tokens=8, logprobs=True, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=500 + n) for n in (3, 9, 17)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def engine(checkpoint, name="tiny", **kw):
    kw.setdefault("progress", False)
    return Engine.from_pretrained(checkpoint(name), **kw)


def traced_frames() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def assert_decodes_as_eager(compiled: Engine, checkpoint, **sizes) -> list[list[int]]:
    want = engine(checkpoint, compile=False, **sizes).generate(PROMPTS, GREEDY)
    got = compiled.generate(PROMPTS, GREEDY)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4
    return [g.token_ids for g in got]


def test_a_later_engine_loads_the_packaged_step_and_traces_nothing(checkpoint):
    """The first engine saves the step (or finds it saved); later ones, with other pool sizes and
    another batch range, load it: Dynamo traces no frame, in this process or a new one, and every one
    decodes as the eager engine does."""
    first = engine(checkpoint, max_batch_size=4)
    assert first.worker.decoder.packaged and first.worker.decoder.package_path.is_file()
    assert first.worker.decoder.graphs() == [(1, 2, 4)]
    sizes = dict(max_batch_size=8, num_pages=70, max_model_len=192)
    frames = traced_frames()
    later = engine(checkpoint, **sizes)
    assert later.worker.decoder.packaged and later.worker.decoder.package_path == first.worker.decoder.package_path
    assert traced_frames() == frames and later.worker.decoder.graphs() == [(1, 2, 4, 8)]
    tokens = assert_decodes_as_eager(later, checkpoint, **sizes)

    script = (
        "import json, sys, torch\n"
        "from inkling_compiled.engine import Engine\n"
        "from inkling_compiled.sampling import SamplingParams\n"
        f"e = Engine.from_pretrained(sys.argv[1], progress=True, **{sizes!r})\n"
        f"out = e.generate({PROMPTS!r}, SamplingParams(max_new_tokens=8, ignore_eos=True))\n"
        "print(json.dumps([e.worker.decoder.packaged, torch._dynamo.utils.counters['stats']['unique_graphs'],\n"
        "                  [o.token_ids for o in out]]))\n")
    done = subprocess.run([sys.executable, "-c", script, str(checkpoint("tiny"))], capture_output=True, text=True,
                          check=True)
    packaged, frames, new_tokens = json.loads(done.stdout.splitlines()[-1])
    assert packaged and frames == 0 and new_tokens == tokens
    # and its start-up says so: warming, not compiling
    assert "compiling" not in done.stderr and "warming the saved decode step: bucket 8" in done.stderr
    assert "(loaded from its compile package: nothing compiled)" in done.stderr


def test_the_key_follows_the_graph_not_the_pool(checkpoint):
    """One file for every pool size and batch range; another file for another model, dtype, page size,
    ring or wrapper; none where a step is not packaged (options, backends, HiCache barrier, graphs per bucket)."""
    def path(name="tiny", **kw):
        return engine(checkpoint, name, warmup=False, **kw).worker.decoder.package_path

    base = path()
    assert base is not None and base.parent.name == "dynamo"
    assert path(max_batch_size=5, num_pages=33, max_model_len=100, prefill_chunk_tokens=64) == base
    others = [path("tiny-k3"), path(dtype="bfloat16"), path(speculative="ngram"), path(cpp_wrapper=False),
              path(page_size=4)]  # the paged attention op takes the page size as a constant
    assert len({base, *others}) == 1 + len(others)
    for options in (dict(compile_package=False), dict(graph_per_bucket=True), dict(specialize_batch_one=True),
                    dict(layer_transfer=True), dict(compile_backend="aot_eager")):
        assert path(**options) is None, options


def test_the_key_follows_the_machine_the_threads_and_the_weight_layout(checkpoint):
    """Inductor's code depends on the instruction set it picks and the thread count; the graph on the
    torch state the steps are pinned to and on how the weights are laid out (from_pretrained stores wide
    projections transposed). Each gets a file of its own."""
    base = engine(checkpoint, warmup=False).worker.decoder.package_path
    script = ("import sys\nfrom inkling_compiled.engine import Engine\n"
              "print(Engine.from_pretrained(sys.argv[1], progress=False, warmup=False).worker.decoder.package_path)\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}  # no vector instructions for inductor's code
    done = subprocess.run([sys.executable, "-c", script, str(checkpoint("tiny"))], capture_output=True, text=True,
                          check=True, env=env)
    assert done.stdout.split()[-1] != str(base)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert engine(checkpoint, warmup=False).worker.decoder.package_path != base
    finally:
        torch.set_num_threads(threads)
    model = engine(checkpoint, compile=False).model
    for p in model.parameters():
        p.data = p.data.contiguous()  # the same values, every weight row-major
    assert Engine(model, progress=False, warmup=False).worker.decoder.package_path != base


def test_a_package_that_refuses_its_first_inputs_is_dropped_for_tracing(checkpoint, caplog):
    """Something the key missed: the step is traced instead, its metadata marked again, and it decodes as
    the eager engine does."""
    engine(checkpoint, max_batch_size=4)  # the package exists
    compiled = engine(checkpoint, max_batch_size=4, warmup=False)
    assert compiled.worker.decoder.packaged
    compiled.worker.backend.prepare_padding(1)
    compiled.worker.backend.metadata.seed = torch.zeros(1, dtype=torch.float64)  # not what the package was built for
    frames = traced_frames()
    with caplog.at_level(logging.WARNING, logger="inkling_compiled"):
        compiled.worker.decoder.run(1)
    assert "refused its first inputs" in caplog.text
    assert not compiled.worker.decoder.packaged and compiled.worker.decoder.package_path is None
    assert traced_frames() == frames + 1 and compiled.worker.backend.metadata.seed.dtype == torch.int64
    assert_decodes_as_eager(compiled, checkpoint, max_batch_size=4)


def test_a_damaged_package_is_not_loaded(tmp_path, caplog):
    bad = tmp_path / "dynamo" / "0.bin"
    bad.parent.mkdir()
    bad.write_bytes(b"not a package")
    compiled = torch.compile(torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING, logger="inkling_compiled"):
        assert package.load(compiled, bad) is False
        assert package.load(compiled, tmp_path / "missing.bin") is False
    assert "could not load the compiled step" in caplog.text and str(bad) in caplog.text
    assert caplog.text.count("could not load") == 1  # a missing file is not a problem


def test_a_packaged_step_refuses_metadata_it_was_not_compiled_for(checkpoint):
    """A guard failure of the package is the same CompileError as a recompile of a traced step."""
    compiled = engine(checkpoint, max_batch_size=4)
    assert compiled.worker.decoder.packaged
    compiled.worker.backend.prepare_padding(2)
    compiled.worker.backend.metadata.seed = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(CompileError, match="would recompile"):
        compiled.worker.decoder.run(2)


def test_a_packaged_replay_checks_its_guards_once(checkpoint, monkeypatch):
    """Guards run after the kernels have swept the caches, some 45 us a check on `small`: a replay pays for
    one (torch's own AOTCompiledModel checked them twice a call)."""
    compiled = engine(checkpoint, max_batch_size=4)
    assert compiled.worker.decoder.packaged
    compiled.worker.backend.prepare_padding(2)
    checks = count_guard_checks(monkeypatch)
    for _ in range(3):
        compiled.worker.decoder.run(2)
    assert len(checks) == 3


def test_decode_replays_of_a_bucket_check_the_guards_once(checkpoint, monkeypatch):
    """The runner hands a packaged step the metadata slices it keeps for a bucket: from a bucket's second
    replay on, inductor's code is called on the arguments bound at the first, past the guards and
    Dynamo's gathering of every weight, and the tokens stay those of the eager engine."""
    compiled = engine(checkpoint, max_batch_size=4)
    assert compiled.worker.decoder.packaged
    checks = count_guard_checks(monkeypatch)
    assert_decodes_as_eager(compiled, checkpoint, max_batch_size=4)  # 3 rows, then 2 and 1 as they finish
    assert 1 <= len(checks) <= 3  # a check per bucket (4, 2, 1), not per step


def test_extend_steps_of_a_shape_seen_lately_check_the_guards_once(checkpoint, monkeypatch):
    """Prompts of one length admitted one by one are extend steps of one shape: from the shape's second
    step on the runner hands the packaged extend step the slices the step buffers keep for it, which
    binds there, so from the third on inductor's code is called past the guards (as a decode bucket's),
    and the tokens stay the eager engine's."""
    compiled = engine(checkpoint, max_batch_size=4, prefix_cache=False)
    eager = engine(checkpoint, compile=False, max_batch_size=4, prefix_cache=False)
    assert compiled.worker.extender.packaged
    checks = count_guard_checks(monkeypatch)
    seen = []
    for seed in range(5):
        prompt = random_prompt(9, seed=900 + seed)
        got, want = compiled.generate([prompt], GREEDY)[0], eager.generate([prompt], GREEDY)[0]
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-4
        seen.append(len(checks))
    assert seen[0] >= 1 and seen[1] == seen[0] + 1  # the first prompt's steps, then the shape's binding
    assert seen[4] == seen[1]  # and none from the third prompt on


def test_if_the_aot_compile_fails_the_step_is_traced_with_every_guard(checkpoint, monkeypatch, caplog):
    def refuse(compiled, path):
        raise RuntimeError("unsupported by the AOT path")

    monkeypatch.setattr(package, "compile_and_save", refuse)
    monkeypatch.setattr(package, "load", lambda compiled, path: False)  # as if nothing were saved yet
    with caplog.at_level(logging.WARNING, logger="inkling_compiled"):
        compiled = engine(checkpoint, max_batch_size=4, compile_extend=False)  # the decode step's fallback
    assert "could not compile the step as a package" in caplog.text
    assert compiled.worker.decoder.package_path is None and not compiled.worker.decoder.packaged
    # the instance guard, which a packaged step leaves out, is back: traced steps share Dynamo's cache
    assert INSTANCE_SOURCE in compiled.worker.decoder.guarded_sources
    assert engine(checkpoint, warmup=False).worker.decoder.guarded_sources == ("self.backend.metadata",)
    assert_decodes_as_eager(compiled, checkpoint, max_batch_size=4)


class _PoolReader(torch.nn.Module):
    """A step in miniature: a pool whose first dimension is a symbol (as the engine's slots are), read
    through a per-step index."""

    def __init__(self, width: int, marked: bool = True):
        super().__init__()
        self.pool = torch.zeros(5, 3, width)
        if marked:  # only to be traced: a loaded package rebuilds its guards from unmarked tensors
            torch._dynamo.decorators.mark_unbacked(self.pool, 0)
        self.rows = torch.zeros(2, dtype=torch.long)

    def forward(self):
        return self.pool[self.rows].sum(1)


def test_a_package_compiled_after_another_shape_keeps_its_other_sizes_static(tmp_path):
    """Dynamo turns a size that changed between two compiles of the same code into a symbol, in the
    graph and in every later compile in the process: a package compiled after another model's (the test
    suite, a benchmark over configs) would then take its widths as inputs and run slower code than the
    same package compiled alone. Only the sizes the caller marks may be symbols."""
    with torch.inference_mode():  # as every step's tensors and calls are
        for width in (8, 16):
            package.compile_and_save(torch.compile(_PoolReader(width), fullgraph=True, dynamic=False),
                                     tmp_path / f"{width}.bin")
        for width, fits in ((16, True), (24, False)):  # the second package's width is fixed: another is refused
            reader = _PoolReader(width, marked=False)
            compiled = torch.compile(reader, fullgraph=True, dynamic=False)
            assert package.load(compiled, tmp_path / "16.bin")
            if fits:
                torch.testing.assert_close(compiled(), reader())
            else:
                with pytest.raises(RuntimeError) as refused:
                    compiled()
                assert package.is_guard_failure(refused.value)


def _bound_calls(module: torch.nn.Module, path) -> package.PackagedForward:
    """`module` compiled as a package and loaded back: its forward as the engine's steps run it."""
    package.compile_and_save(torch.compile(module, fullgraph=True, dynamic=False), path)
    compiled = torch.compile(module, fullgraph=True, dynamic=False)
    assert package.load(compiled, path)
    return compiled.forward


class _PoolRowsReader(_PoolReader):
    def forward(self):
        return (super().forward(),)  # a tuple, as a step's outputs are


def test_a_bound_call_reads_the_bound_tensors_as_they_are_now(tmp_path, monkeypatch):
    """Bound arguments are the tensors themselves: what is written into them in place is read; new tensors
    come with a new inputs object, which runs the guards and binds again."""
    checks = count_guard_checks(monkeypatch)
    with torch.inference_mode():
        reader = _PoolRowsReader(4, marked=False)
        forward = _bound_calls(reader, tmp_path / "reader.bin")
        checks.clear()  # (compiling the package checks them too)
        reader.pool.copy_(torch.randn(5, 3, 4))
        first = object()
        for rows in ([1, 2], [4, 0], [3, 3]):
            reader.rows.copy_(torch.tensor(rows))
            torch.testing.assert_close(forward(first)[0], reader.pool[reader.rows].sum(1))
        assert len(checks) == 1
        reader.rows = torch.tensor([2, 1])
        second = object()
        torch.testing.assert_close(forward(second)[0], reader.pool[[2, 1]].sum(1))
        assert len(checks) == 2


def test_inputs_keys_change_when_any_holder_changes():
    """A step whose inputs several objects hold (the MTP draft step: each depth's metadata slices and an
    input view) keeps one key per bucket while they are the same objects."""
    keys = InputsKeys()
    a, b, c = {}, {}, {}
    first = keys(1, a, b)
    assert keys(1, a, b) is first and keys(2, a, b) is not first
    assert keys(1, a, c) is not first  # one holder replaced: the bound call must not serve it
    assert keys(1, a, b) is not first  # and a key is never handed out again once replaced


class _SetsAnAttribute(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.ones(3)
        self.last = torch.zeros(3)

    def forward(self):
        self.last = self.x * 3  # Dynamo sets it from one of the graph's outputs, after the graph
        return (self.x * 2,)


def test_a_frame_that_sets_an_attribute_after_its_graph_is_not_bound(tmp_path, monkeypatch):
    """A bound call would skip what Dynamo's code does after the graph: the attribute must follow every call.
    The frame is looked at once (reading its bytecode costs milliseconds for a step's)."""
    looks = []
    real_look = package._only_returns_graph_outputs
    monkeypatch.setattr(package, "_only_returns_graph_outputs", lambda code: looks.append(1) or real_look(code))
    with torch.inference_mode():
        module = _SetsAnAttribute()
        forward = _bound_calls(module, tmp_path / "sets.bin")
        inputs = object()
        for value in (1.0, 2.0, 5.0):
            module.x.fill_(value)
            torch.testing.assert_close(forward(inputs)[0], torch.full((3,), 2 * value))
            torch.testing.assert_close(module.last, torch.full((3,), 3 * value))
    assert len(looks) == 1


class _SameOutputTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.ones(3)

    def forward(self):
        y = self.x * 2
        return y, y


def test_a_frame_that_rearranges_the_graphs_outputs_is_not_bound(tmp_path, monkeypatch):
    """Dynamo's code hands back the graph's one output twice: a bound call that cut the graph's outputs
    would drop one, so every call takes the guarded path."""
    checks = count_guard_checks(monkeypatch)
    with torch.inference_mode():
        forward = _bound_calls(_SameOutputTwice(), tmp_path / "twice.bin")
        checks.clear()
        inputs = object()
        for _ in range(3):
            out = forward(inputs)
            assert len(out) == 2 and out[0] is out[1]
            torch.testing.assert_close(out[0], torch.full((3,), 2.0))
    assert len(checks) == 3


class _Accumulator(torch.nn.Module):
    """A step that writes its pool in place, as the engine's steps write their caches, and returns rows
    of it through a per-step index whose length is a symbol (as a decode bucket's rows are)."""

    def __init__(self, marked: bool = True):
        super().__init__()
        self.pool = torch.zeros(5, 4)  # made outside inference mode: it has a version counter
        self.rows = torch.zeros(2, dtype=torch.long)
        if marked:  # only to be traced
            torch._dynamo.decorators.mark_unbacked(self.rows, 0)

    def forward(self):
        out = self.pool[self.rows] * 2
        self.pool.add_(1)
        return (out,)


def _graph_calls(monkeypatch) -> list:
    """A list that gains an entry at every call of an inductor graph through its own `__call__` (what
    AOTAutograd's runtime wrapper calls) from now on."""
    from torch._inductor.output_code import CompiledFxGraph

    calls, real_call = [], CompiledFxGraph.__call__
    monkeypatch.setattr(CompiledFxGraph, "__call__", lambda self, args: calls.append(1) or real_call(self, args))
    return calls


def test_a_bound_call_runs_inductors_code_directly_and_does_what_the_wrapper_did(tmp_path, monkeypatch):
    """Past the first call, a bound step calls inductor's compiled code itself, not AOTAutograd's
    runtime wrapper around it (some 70 us of Python a step on `small`); what that wrapper does besides,
    it still sees done: the pool written in place bumps its version counter as much a call, and the
    outputs carry the same dynamic-dimension marks, while the values are those a plain call computes."""
    package.compile_and_save(torch.compile(_Accumulator(), fullgraph=True, dynamic=False), tmp_path / "acc.bin")
    module = _Accumulator(marked=False)
    compiled = torch.compile(module, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        assert package.load(compiled, tmp_path / "acc.bin")
        forward = compiled.forward
        before = module.pool._version
        guarded = forward()[0]  # the guarded path, through the wrapper
        per_call = module.pool._version - before
        marks = guarded._dynamo_propagated_dynamic_indices
        assert per_call > 0 and marks == {0}
        key = object()
        forward(key)  # binds
        graph_calls = _graph_calls(monkeypatch)
        for step, rows in enumerate(([1, 3], [0, 0], [4, 2])):
            module.rows.copy_(torch.tensor(rows))
            want = module.pool[module.rows] * 2
            before = module.pool._version
            out = forward(key)[0]
            torch.testing.assert_close(out, want)
            assert module.pool._version - before == per_call
            assert out._dynamo_propagated_dynamic_indices == marks
        assert graph_calls == []
        torch.testing.assert_close(module.pool, torch.full((5, 4), 5.0))  # 1 + 1 (bind) + 3, all in place


def test_a_bound_call_goes_through_the_graphs_own_call_under_the_profiler(tmp_path):
    """Under torch's profiler, a bound call still shows as inductor's graph call in the trace, as an
    unbound one does."""
    package.compile_and_save(torch.compile(_Accumulator(), fullgraph=True, dynamic=False), tmp_path / "acc.bin")
    module = _Accumulator(marked=False)
    compiled = torch.compile(module, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        assert package.load(compiled, tmp_path / "acc.bin")
        key = object()
        compiled.forward(key)
        with torch.profiler.profile() as prof:
            out = compiled.forward(key)[0]
    torch.testing.assert_close(out, torch.full((2, 4), 2.0))  # the pool after one call, doubled
    assert any("Call CompiledFxGraph" in e.name for e in prof.events())


class _ReturnsAView(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.ones(4)

    def forward(self):
        return (self.x[1:], self.x * 2)  # an output that aliases an input: the wrapper remakes it from its base


def test_a_view_of_an_input_stays_a_view_through_a_bound_call(tmp_path):
    """An output that is a view of an input is made again from the input by AOTAutograd's wrapper at
    every call; a bound call must hand back the same: a view of the input as it is now, and one that
    torch knows for a view of it (inductor's own output shares the memory, but as an inference tensor of
    its own, which cannot be written outside inference mode)."""
    package.compile_and_save(torch.compile(_ReturnsAView(), fullgraph=True, dynamic=False), tmp_path / "view.bin")
    module = _ReturnsAView()
    compiled = torch.compile(module, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        assert package.load(compiled, tmp_path / "view.bin")
        key = object()
        for value in (1.0, 3.0, 7.0):
            view, doubled = compiled.forward(key)
            module.x.fill_(value)
            torch.testing.assert_close(view, torch.full((3,), value))  # reads x as it is now
            assert view.data_ptr() == module.x.data_ptr() + module.x.element_size()
            assert view._base is module.x and not view.is_inference()
            module.x.fill_(value)


def test_the_isa_probe_runs_once_per_machine(tmp_path, monkeypatch):
    """The first settle probes and records; a later one reads the record and never probes, and sets
    `vec_isa_ok` only where every ISA the CPU's flags list passed; a user's own setting is kept."""
    from torch._inductor import cpu_vec_isa

    from inkling_compiled.graphs import vec_isa

    cpp = torch._inductor.config.cpp
    with torch._inductor.config.patch({"cpp.vec_isa_ok": None}):  # restored after, whatever settle set
        vec_isa.settle(tmp_path)
        (record,) = (tmp_path / "vec-isa").iterdir()
        probed = json.loads(record.read_text())
        assert probed["passed"] == [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
        assert cpp.vec_isa_ok is (True if probed["all_passed"] else None)

        def no_probe():
            raise AssertionError("probed again")

        monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", no_probe)
        for all_passed, want in ((True, True), (False, None)):
            record.write_text(json.dumps({**probed, "all_passed": all_passed}))
            cpp.vec_isa_ok = None
            vec_isa.settle(tmp_path)
            assert cpp.vec_isa_ok is want
        cpp.vec_isa_ok = False  # a user's choice
        vec_isa.settle(tmp_path)
        assert cpp.vec_isa_ok is False


def test_the_isa_probe_is_recorded_in_the_machine_cache_not_the_compile_cache(tmp_path, monkeypatch):
    """A compiled step settles the probe against INKLING_CACHE_DIR (beside the kernel choices), so a
    new inductor cache does not probe again."""
    from inkling_compiled.graphs import capture, vec_isa

    seen = []
    monkeypatch.setenv("INKLING_CACHE_DIR", str(tmp_path / "machine"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the step points it there
    monkeypatch.setattr(vec_isa, "settle", seen.append)
    capture.CompiledStep(torch.nn.Identity(), lambda rows: None, device="cpu", buckets=(1,),
                         cache_dir=tmp_path / "inductor")
    assert seen == [tmp_path / "machine"]


class _TimedBuilder:
    """A stand-in for inductor's CppBuilder: its build takes a while, notes when, and writes its target."""

    def __init__(self, path, log, seconds=0.3):
        self.path, self.log, self.seconds = path, log, seconds

    def get_target_file_path(self):
        return str(self.path)

    def build(self):
        import time

        start = time.monotonic()
        time.sleep(self.seconds)
        self.path.write_text("built")
        self.log.append((self.path.name, start, time.monotonic()))


def test_the_wrapper_and_its_kernels_build_side_by_side_and_the_link_after_both(tmp_path):
    from inkling_compiled.graphs import cpp_build

    log = []
    wrapper, kernels, link = (_TimedBuilder(tmp_path / name, log) for name in ("wrapper.o", "kernels.o", "step.so"))
    cpp_build._build_side_by_side(str(tmp_path / "lock"), (wrapper, kernels, link))
    when = {name: (start, end) for name, start, end in log}
    assert set(when) == {"wrapper.o", "kernels.o", "step.so"}
    assert when["kernels.o"][0] < when["wrapper.o"][1] and when["wrapper.o"][0] < when["kernels.o"][1]  # overlap
    assert when["step.so"][0] >= max(when["wrapper.o"][1], when["kernels.o"][1])  # the link needs both
    log.clear()
    cpp_build._build_side_by_side(str(tmp_path / "lock"), (wrapper, kernels, link))  # all there: nothing runs
    assert log == []
    (tmp_path / "step.so").unlink()
    cpp_build._build_side_by_side(str(tmp_path / "lock"), (wrapper, kernels, link))  # only what is missing
    assert [name for name, _, _ in log] == ["step.so"]


def test_the_side_by_side_build_is_the_worker_inductor_runs():
    from torch._inductor import codecache

    from inkling_compiled.graphs import capture, cpp_build

    if not capture.separate_wrapper_build():
        pytest.skip("this torch builds the wrapper with its kernels")
    assert codecache._worker_compile_cpp is cpp_build._build_side_by_side


def test_a_speculative_engine_saves_its_verify_step_beside_the_decode_step(checkpoint):
    """The verify step is saved whole too, its key the decode step's plus K and whether a drafter needs
    hidden states: a later engine with other pool sizes loads both and traces nothing while it
    verifies, with plain decoding's tokens and logprobs; another K has a file of its own."""
    spec = dict(speculative=Threes(), num_speculative_tokens=2, compile_extend=False)  # decode and verify
    first = engine(checkpoint, max_batch_size=4, **spec)
    decoder, verifier = first.worker.decoder, first.worker.verifier
    assert verifier.packaged and verifier.package_path.is_file() and verifier.package_path != decoder.package_path
    assert verifier.graphs() == [(1, 2, 4)]
    frames = traced_frames()
    later = engine(checkpoint, max_batch_size=4, num_pages=70, **spec)
    assert later.worker.verifier.loaded and later.worker.verifier.package_path == verifier.package_path
    got = later.generate(PROMPTS, GREEDY)
    assert traced_frames() == frames and later.stats()["verify_steps"] > 0
    want = engine(checkpoint, compile=False).generate(PROMPTS, GREEDY)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4
    other = engine(checkpoint, max_batch_size=4, speculative=Threes(), num_speculative_tokens=3, warmup=False)
    assert other.worker.verifier.package_path != verifier.package_path


def test_the_extend_step_is_saved_and_loaded_beside_the_decode_step(checkpoint, caplog):
    """The extend graph is saved whole too (its key the decode step's and "extend"): a later engine with
    other pool sizes loads it, prefills and takes prefix checkpoints without tracing, as the eager
    engine does. A package that refuses its first inputs is dropped for tracing, its slices marked
    again, and still prefills as eager does."""
    first = engine(checkpoint, max_batch_size=4)
    extender = first.worker.extender
    assert extender.packaged and extender.package_path.is_file()
    assert extender.package_path != first.worker.decoder.package_path
    frames = traced_frames()
    sizes = dict(max_batch_size=8, num_pages=70, max_model_len=192)
    later = engine(checkpoint, **sizes)
    assert later.worker.extender.loaded and not later.worker.backend.buffers.symbolic_extend
    assert_decodes_as_eager(later, checkpoint, **sizes)
    assert traced_frames() == frames

    refused = engine(checkpoint, max_batch_size=4, warmup=False)
    assert refused.worker.extender.loaded
    refused.worker.backend.buffers.prepare_extend_padding()
    refused.worker.backend.metadata.seed = torch.zeros(1, dtype=torch.float64)  # not what the package was built for
    with caplog.at_level(logging.WARNING, logger="inkling_compiled"):
        refused.worker.extender.run(1)
    assert "refused its first inputs" in caplog.text and not refused.worker.extender.packaged
    assert refused.worker.backend.buffers.symbolic_extend and traced_frames() == frames + 1
    assert_decodes_as_eager(refused, checkpoint, max_batch_size=4)


def test_engines_with_and_without_the_prefix_cache_keep_extend_packages_of_their_own(checkpoint):
    """Without the prefix cache the pool's checkpoint tensors have no rows, a size (and a stride) a saved
    extend graph would keep: its key says whether there are checkpoints, so neither kind of engine loads
    the other's (the decode step, which never reads them, stays shared), and each prefills as the eager
    engine does, prefix hits included."""
    without = engine(checkpoint, max_batch_size=2, prefix_cache=False)
    cached = engine(checkpoint, max_batch_size=4)
    assert without.worker.extender.package_path != cached.worker.extender.package_path
    assert without.worker.decoder.package_path == cached.worker.decoder.package_path
    system = random_prompt(20, seed=60)
    prompts = [system + random_prompt(4, seed=61 + i) for i in range(3)]
    want = engine(checkpoint, compile=False, max_batch_size=4).generate(prompts, GREEDY)
    for compiled in (without, cached):
        got = compiled.generate(prompts[:1], GREEDY) + compiled.generate(prompts[1:], GREEDY)
        assert [g.cached_tokens for g in got] == ([0, 0, 0] if compiled is without else [0, 16, 16])
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4


# ---- the decode step compiled in a second process (compile_beside.py) ----------------------------------


def test_the_decode_step_compiles_in_a_second_process_while_this_one_compiles_the_extend_step(
        checkpoint, tmp_path, monkeypatch, capsys):
    """With a cold compile cache, a child process compiles and saves the decode step while the engine
    compiles its extend step; the engine then loads the child's package (it traces only the extend step
    itself) and decodes as the eager engine does."""
    from inkling_compiled import compile_beside

    if compile_beside.cores() < 2:
        pytest.skip("one core: the decode step compiles in this process")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    frames = traced_frames()
    compiled = engine(checkpoint, max_batch_size=4, progress=True)
    decoder, extender = compiled.worker.decoder, compiled.worker.extender
    assert compiled.worker.decoder_compiled_beside and decoder.loaded and decoder.package_path.is_file()
    assert decoder.package_path.is_relative_to(tmp_path) and decoder.graphs() == [(1, 2, 4)]
    assert extender.packaged and not extender.loaded  # compiled here, beside the child
    assert traced_frames() == frames + 1
    err = capsys.readouterr().err
    assert "compiling the decode step in a second process" in err and "warming the saved decode step" in err
    assert_decodes_as_eager(compiled, checkpoint, max_batch_size=4)


def test_a_child_that_cannot_make_the_expected_package_leaves_the_step_to_this_process(
        checkpoint, tmp_path, caplog):
    """The child builds the engine again and compiles only if its package path is the one asked for; when
    it is not (a key that differs), it exits without compiling and the parent is told to compile."""
    from inkling_compiled import compile_beside

    class Step:  # what `start` reads of a CompiledStep
        package_path, loaded, graph_of = tmp_path / "elsewhere.bin", False, {}

    beside = compile_beside.StepBeside(checkpoint("tiny"), dict(device="cpu", dtype=None, check_finite=True,
                                                                  quantization=None),
                                       compile_beside.child_options({"max_batch_size": 4}))
    child = beside.start(Step())
    with caplog.at_level(logging.WARNING, logger="inkling_compiled"):
        assert child.wait(timeout=300) is False
    child.stop()
    assert child.proc.returncode == 2 and "compiling the step here" in caplog.text
    assert "elsewhere.bin" in caplog.text and not Step.package_path.exists()
    Step.package_path.write_bytes(b"saved")  # already there: nothing for a child to do
    assert beside.start(Step()) is None


def test_the_child_takes_the_options_that_shape_the_graph_and_small_sizes():
    from inkling_compiled import compile_beside
    from inkling_compiled.errors import OptionError

    carried = compile_beside.child_options(dict(max_batch_size=32, num_pages=900, page_size=8, dtype="bfloat16",
                                                speculative=Threes(), num_speculative_tokens=3, progress=True))
    assert carried["page_size"] == 8 and carried["num_speculative_tokens"] == 3
    assert carried["speculative"] == "ngram"  # a drafter object: the n-gram drafter sizes the pool alike
    assert carried["max_batch_size"] == 1 and carried["num_pages"] is None
    assert not carried["warmup"] and not carried["progress"] and not carried["parallel_compile"]

    class NeedsHidden(Threes):
        needs_hidden = True

    assert compile_beside.child_options(dict(speculative=NeedsHidden())) is None
    assert compile_beside.child_options(dict(seed=object())) is None
    with pytest.raises(OptionError, match="parallel_compile"):
        Engine.from_pretrained("no/such/folder", parallel_compile="yes")
