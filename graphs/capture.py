"""The compiled step (decode, or verify), over the step's static buffers: one graph serves every batch bucket.

The whole step (embedding, every layer, final norm, lm_head, sampling and logprobs) is
`torch.compile(fullgraph=True, dynamic=False)`: a graph break is an error. The batch dimension is
symbolic, so one graph serves every bucket (`specialize_batch_one=True` gives bucket 1 a static graph
of its own, `graph_per_bucket=True` every bucket). On CUDA the inductor backend runs
with `mode="reduce-overhead"`, which records one CUDA graph per bucket from that code; on CPU it is
plain inductor with its C++ launch wrapper. A bucket compiles on first use unless warmed up; after
that, a recompile is an error that names the guard that failed. Dynamo's guards watch only the per-step
metadata (`guarded_sources`): the rest of what the step reads is fixed for the decoder's life.

This layer knows nothing of the engine: its caller hands it the step as a module (everything the step
reads reached through that module, so it is all static) and a callback that prepares an all-padding
batch of a given size, which is what warm-up runs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from inkling_compiled.checks import is_int
from inkling_compiled.errors import CompileError, OptionError
from inkling_compiled.paths import default_cache_dir

from . import cpp_build, package, vec_isa

log = logging.getLogger("inkling_compiled")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)
# Dynamo's stance and its compile counter are process-wide: one decoder at a time compiles, or replays
# under the fail-on-recompile stance (a stance set by one thread would refuse another's first compile).
_DYNAMO_STATE = threading.RLock()
BACKENDS = ("inductor", "eager", "aot_eager", "tensorrt")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The source a step's guards name to tell two decoders' steps apart in Dynamo's shared cache (see
# runner.DecodeStep); only Dynamo's cache needs it.
INSTANCE_SOURCE = "self.instance"
RECORDING_CALLS = 2  # calls after a bucket's first that CUDA graph trees take to record its graph
_PLANNED_GRAPHS = 0  # graphs every decoder made in this process may compile (one per bucket at most)


def separate_wrapper_build() -> dict:
    """Inductor's option to build the C++ wrapper apart from the kernels, where this torch has it. The
    wrapper is glue (allocations and calls), but built in one file with the kernels it is compiled at
    -O3: most of a cold start's g++ time (19 of 27 s for `small`'s decode graph). Built apart, the
    wrapper gets -O1 and the kernels keep -O3; steps measured no slower (tools/step_latency.py).
    Read when a step is built: importing inductor's config costs a second that `--help` should not pay."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "cpp_wrapper_build_separate"):
        return {}
    cpp_build.install()  # and the two built side by side
    return {"cpp_wrapper_build_separate": True}


def choose_buckets(max_batch_size: int, buckets: tuple[int, ...] | list[int] | None = None) -> tuple[int, ...]:
    """Sorted buckets; by default the powers of two up to max_batch_size, plus max_batch_size itself."""
    if buckets is None:
        chosen = {b for b in DEFAULT_BUCKETS if b <= max_batch_size} | {max_batch_size}
    else:
        chosen = set(buckets) if isinstance(buckets, (tuple, list)) else set()
        if not chosen or any(not is_int(b) or not 1 <= b <= max_batch_size for b in chosen):
            raise OptionError(f"buckets must be integers in 1..max_batch_size={max_batch_size}, got {buckets!r}")
    return tuple(sorted(chosen))


def resolve_backend(name):
    """A backend name, or any Dynamo backend callable (tests pass a recorder)."""
    if callable(name):
        return name
    if name not in BACKENDS:
        raise CompileError(f"unknown compile backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "tensorrt":
        try:
            import torch_tensorrt  # noqa: F401  (registers the "tensorrt" dynamo backend)
        except ImportError as e:
            raise CompileError("compile backend 'tensorrt' needs torch-tensorrt (GPU only): "
                               "pip install 'inkling-compiled[tensorrt]'") from e
    return name


def guard_filter(sources: tuple[str, ...]) -> Callable[[list], list[bool]]:
    """Keeps Dynamo's guards on the given sources (and on global state: grad mode, dtype, the symbolic
    batch's bounds) and drops the rest. Everything else the step reads (parameters, module structure,
    the pool) is fixed for the decoder's life; checking ~1,000 guards on it cost every replay tens of us."""

    def keep(entries) -> list[bool]:
        return [not e.name or e.name.startswith(sources) for e in entries]

    return keep


def default_compile_cache_dir() -> Path:
    return default_cache_dir() / "inductor"


class Buckets:
    """The batch sizes compiled steps replay at, and the one place a batch's bucket is chosen (None:
    eager, any size, unpadded). A batch larger than the largest bucket is split first (`split`)."""

    def __init__(self, sizes: tuple[int, ...] | None):
        self.sizes = sizes

    @property
    def largest(self) -> int | None:
        return self.sizes[-1] if self.sizes else None

    def bucket_for(self, rows: int) -> int | None:
        if self.sizes is None:
            return None
        for b in self.sizes:
            if b >= rows:
                return b
        raise ValueError(f"{rows} rows exceed the largest bucket {self.largest}; split the batch first")

    def split(self, batch: list) -> list[list]:
        """The batch in pieces of at most the largest bucket (one piece when eager)."""
        size = self.largest or max(len(batch), 1)
        return [batch[i:i + size] for i in range(0, len(batch), size)]


class InputsKeys:
    """The objects that stand for a step's inputs at `CompiledStep.run`, for a step whose inputs are held by
    several objects (each depth's metadata slices, an input view): per bucket, the same key while every
    holder is the same object as at the key's making, a new one once any is another."""

    def __init__(self):
        self._keys: dict[int, tuple[tuple, object]] = {}

    def __call__(self, bucket: int, *holders: object) -> object:
        kept = self._keys.get(bucket)
        if kept is None or len(kept[0]) != len(holders) or any(a is not b for a, b in zip(kept[0], holders)):
            kept = self._keys[bucket] = (holders, object())
        return kept[1]


class CompiledStep:
    """A step (decode or verify) compiled for a set of batch buckets; `run(bucket)` replays one.

    By default the batch dimension is symbolic and one graph serves every bucket: whoever prepares the
    step's metadata marks its slices for the batch sizes in `symbolic_batch` (see
    `StepBuffers.symbolic_batch`; unbacked, since Dynamo would specialise a size of one).
    `specialize_batch_one=True` keeps bucket 1 out of it, as a static graph of its own (the
    single-row case, measured a little faster); `graph_per_bucket=True` compiles every bucket as its
    own static graph. Under CUDA graphs each bucket is still recorded as its own CUDA graph.
    """

    def __init__(self, step: nn.Module, prepare_padding: Callable[[int], object], *, device: torch.device | str,
                 buckets: tuple[int, ...], compile_backend="inductor", mode: str | None = None,
                 cache_dir: str | Path | None = None, cpp_wrapper: bool | None = None,
                 graph_per_bucket: bool = False, specialize_batch_one: bool = False,
                 guarded_sources: tuple[str, ...] | None = None, package_key: tuple | None = None,
                 kind: str = "decode"):
        self.step, self.prepare_padding = step, prepare_padding
        self.kind = kind  # what the step is called in progress lines and errors
        self.buckets = buckets
        # The batch sizes the symbolic graph serves: all of them, or all but 1 when bucket 1 gets its
        # own static graph; None when every bucket is its own static graph.
        self.symbolic_batch = None if graph_per_bucket else range(2 if specialize_batch_one else 1, buckets[-1] + 1)
        self.compiler = resolve_backend(compile_backend)
        device = torch.device(device)
        if mode is None and compile_backend == "inductor" and device.type == "cuda":
            mode = "reduce-overhead"
        self.mode = mode
        self.cache_dir = Path(cache_dir) if cache_dir else Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or
                                                                 default_compile_cache_dir())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)
        if compile_backend == "inductor" and device.type == "cpu":
            # before anything reads inductor's configuration; recorded beside the kernel choices, which are
            # per machine too, so that a new compile cache does not probe again
            vec_isa.settle(default_cache_dir())
        # Each graph is a recompile of the same frame (and every engine in the process shares that
        # frame's cache); leave room for all of them.
        # Entries of decoders made earlier in the process stay in that cache (a graph per bucket each, at
        # most), so the limits grow with every decoder made.
        global _PLANNED_GRAPHS
        _PLANNED_GRAPHS += len(buckets)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   _PLANNED_GRAPHS + 4 * len(buckets) + 8)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 2 * _PLANNED_GRAPHS + 16 * len(buckets) + 64)
        if mode is not None and mode not in MODES:
            raise OptionError(f"unknown compile mode {mode!r}: choose one of {', '.join(MODES)} (or None)")
        # On CPU, inductor's C++ wrapper replaces the Python code that launches each kernel, which is a
        # large share of a small model's step.
        if cpp_wrapper is None:
            cpp_wrapper = compile_backend == "inductor" and device.type == "cpu" and mode is None
        self.cpp_wrapper = bool(cpp_wrapper)
        # The one symbolic graph of an inductor step on CPU may be saved whole and loaded by a later process
        # (graphs/package.py): `package_key` is the caller's part of the file's key, None to never do it.
        # A packaged step runs outside Dynamo's cache, so nothing needs telling it from another
        # decoder's: its guards leave out the step's instance number, and so does its key.
        eligible = (package_key is not None and compile_backend == "inductor" and mode is None
                    and device.type == "cpu" and self.symbolic_batch is not None and self.symbolic_batch.start == 1
                    and package.supported())
        # Inductor checks the sizes and strides of the step's inputs and of every op output it did not
        # generate itself (ours and ATen's) on every call: 437 checks in `small`'s decode step, each
        # building an error message's stream in the C++ wrapper before it knows whether it needs one,
        # 3-4 % of a batch-1 step. The ops' fakes are checked against their kernels (opcheck in
        # tests/test_ops.py) and compiled steps against eager ones; TORCHINDUCTOR_SIZE_ASSERTS=1 compiles
        # the checks in again (a package of its own) to debug a kernel.
        self.size_asserts = os.environ.get("TORCHINDUCTOR_SIZE_ASSERTS") == "1"
        self.package_path = (package.package_path(self.cache_dir, package_key, self.cpp_wrapper, self.size_asserts)
                             if eligible else None)
        self.packaged = False  # whether the step runs as a package (loaded, or compiled and saved here)
        self.loaded = False  # whether that package was loaded (nothing is compiled, only warmed)
        # Called when a loaded package is dropped for tracing: whoever marks the metadata marks it again.
        self.on_unpackage: Callable[[], None] | None = None
        self._requested_sources = guarded_sources
        self.guarded_sources = guarded_sources  # what the compiled step's guards keep (None: all)
        if eligible and guarded_sources is not None:
            self.guarded_sources = tuple(s for s in guarded_sources if s != INSTANCE_SOURCE)
        self._options: dict = {"cpp_wrapper": True, **separate_wrapper_build()} if self.cpp_wrapper else {}
        if compile_backend == "inductor":
            self._options["size_asserts"] = self.size_asserts
        self._kwargs = {"fullgraph": True, "dynamic": False, "backend": self.compiler}
        if mode is not None and compile_backend == "inductor":  # torch.compile takes a mode or options, not both
            self._options = {**torch._inductor.list_mode_options(mode), **self._options}
        elif mode is not None:  # another backend's own mode: it keeps every guard
            self._kwargs["mode"], self._options, self.guarded_sources = mode, {}, None
        # Whether outputs live in memory the next replay overwrites: any mode that records CUDA graphs,
        # or a backend callable that says so (`reuses_outputs = True`, as one with static output buffers).
        self.cuda_graphs = (mode in ("reduce-overhead", "max-autotune") or bool(self._options.get("triton.cudagraphs"))
                            or bool(getattr(self.compiler, "reuses_outputs", False)))
        self.compiled = self._compile()
        self.compile_seconds: dict[int, float] = {}  # bucket -> seconds its first call took
        self.graph_of: dict[int, int] = {}  # bucket -> index of the graph that serves it (in compile order)
        self._graphs = 0
        self._symbolic_graph: int | None = None

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def graphs(self) -> list[tuple[int, ...]]:
        """The buckets each compiled graph serves, one tuple per graph, in compile order."""
        served: dict[int, list[int]] = {}
        for bucket, graph in sorted(self.graph_of.items()):
            served.setdefault(graph, []).append(bucket)
        return [tuple(served[g]) for g in sorted(served)]

    def bucket_for(self, rows: int) -> int:
        return Buckets(self.buckets).bucket_for(rows)

    def load_package(self) -> bool:
        """Loads the step saved by an earlier process with the same key, if there is one. When it returns
        True, nothing will be traced: the caller must stop marking the metadata's slices for Dynamo."""
        if self.package_path is None or self.graph_of:
            return False
        with _DYNAMO_STATE:
            self.packaged = self.loaded = package.load(self.compiled, self.package_path)
        return self.packaged

    def warmup(self, progress: Callable[..., None] | None = None, buckets: tuple[int, ...] | None = None
               ) -> dict[int, float]:
        """Compiles (or loads from the cache) the graphs of `buckets` (default all) on all-padding
        batches, which write only the dummy slot and page; seconds per bucket. `progress(message,
        done, total)` hears about each bucket before it starts."""
        todo = sorted({b for b in (self.buckets if buckets is None else buckets) if b not in self.graph_of})
        for i, b in enumerate(todo):
            if progress:
                verb = f"warming the saved {self.kind} step" if self.loaded else f"compiling the {self.kind} step"
                progress(f"{verb}: bucket {b}" if self.kind != "extend" else f"{verb} (one graph for every chunk)",
                         i, len(todo))
            self.prepare_padding(b)
            self._first_call(b)
            # CUDA graph trees run a new graph once to warm it, record it on the next call and replay it
            # from the one after: a bucket is recorded before its first request.
            for _ in range(RECORDING_CALLS if self.cuda_graphs else 0):
                self.run(b)
        return dict(self.compile_seconds)

    def warm_bucket(self, bucket: int) -> float:
        """Compiles one bucket's graph (if it is not compiled yet) on an all-padding batch; seconds taken."""
        self.warmup(buckets=(bucket,))
        return self.compile_seconds[bucket]

    def _first_call(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """A bucket's first replay, which may compile: timed, and the graph that serves it noted."""
        if self.package_path is not None:
            return self._first_packaged_call(bucket)
        with _DYNAMO_STATE:
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            with torch.inference_mode():
                outputs = self.compiled()
            self.compile_seconds[bucket] = time.perf_counter() - t0
            compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames
        if compiled:
            self.graph_of[bucket] = self._graphs
            if self.symbolic_batch is not None and bucket in self.symbolic_batch:
                self._symbolic_graph = self._graphs
            self._graphs += 1
        elif self._symbolic_graph is not None:  # a bucket the symbolic graph already covers
            self.graph_of[bucket] = self._symbolic_graph
        else:
            raise CompileError(f"bucket {bucket} ran without a graph of its own or a symbolic one to serve it")
        return outputs

    def _first_packaged_call(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The first call of a bucket on the packaged step; the very first compiles and saves the package
        unless one was loaded. If that compile fails, or a loaded package refuses its very first inputs
        (something its key missed), the step is traced the usual way from then on."""
        t0 = time.perf_counter()
        with _DYNAMO_STATE:
            if not self.packaged:
                try:
                    package.compile_and_save(self.compiled, self.package_path)
                    self.packaged = True
                except Exception as e:  # an unsupported corner of torch's AOT path: trace as usual
                    log.warning("could not compile the step as a package (%s: %s); compiling it as usual",
                                type(e).__name__, e)
                    self._unpackage()
                    return self._first_call(bucket)
            if self.graph_of:  # the package already served a bucket: a refusal now is the caller's
                outputs = self._replay(bucket)
            else:
                try:
                    with torch.inference_mode():
                        outputs = self.compiled()
                except RuntimeError as e:
                    if not package.is_guard_failure(e):
                        raise
                    log.warning("the packaged step (%s) refused its first inputs (%s); tracing it",
                                self.package_path, str(e).splitlines()[-1][:200])
                    self._unpackage()
                    if self.on_unpackage is not None:
                        self.on_unpackage()
                    return self._first_call(bucket)
        self.compile_seconds[bucket] = time.perf_counter() - t0
        self.graph_of[bucket] = self._symbolic_graph = 0
        self._graphs = 1
        return outputs

    def _compile(self):
        """The step under torch.compile (nothing is traced before its first call)."""
        options = dict(self._options)  # torch.compile takes the guard filter out of the dict it is given
        if self.guarded_sources is not None:
            options["guard_filter_fn"] = guard_filter(self.guarded_sources)
        return torch.compile(self.step, **self._kwargs, **({"options": options} if options else {}))

    def _unpackage(self) -> None:
        """From now on the step compiles the usual way, with every guard the caller asked for."""
        self.package_path, self.packaged, self.loaded, self.guarded_sources = None, False, False, self._requested_sources
        self.compiled = self._compile()

    def _replay(self, bucket: int, inputs: object | None = None) -> tuple[torch.Tensor, ...]:
        try:
            if self.packaged:  # runs outside Dynamo: no stance to set, nothing another thread's compile sees
                with torch.inference_mode():
                    return self.compiled.forward(inputs)  # package.PackagedForward, past the module's call machinery
            with _DYNAMO_STATE, torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile"):
                return self.compiled()
        except RuntimeError as e:
            if "fail_on_recompile" not in str(e) and not package.is_guard_failure(e):
                raise
            raise CompileError(f"{self.kind} step for bucket {bucket} would recompile after warm-up: {e}") from None

    def run(self, bucket: int, inputs: object | None = None) -> tuple[torch.Tensor, ...]:
        """Replays the graph of `bucket`, for which the buffers were prepared; a bucket not compiled yet
        is compiled first (lazy start-up). Outputs are tensors the caller owns. `inputs`, where the step
        reads the very same tensors at every call that passes the same object (see
        `package.PackagedForward`), lets a packaged step skip its guards and Dynamo's code from the
        second such call on."""
        outputs = self._first_call(bucket) if bucket not in self.graph_of else self._replay(bucket, inputs)
        # CUDA-graph outputs live in graph-owned memory that the next replay overwrites.
        return tuple(t.clone() for t in outputs) if self.cuda_graphs else outputs
