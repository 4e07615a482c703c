"""One compiled decode graph per batch-size bucket, over the step's static buffers.

The whole step (embedding, every layer, final norm, lm_head, sampling and logprobs) is
`torch.compile(fullgraph=True, dynamic=False)`: a graph break is an error, and each bucket is its own
static-shape graph. On CUDA the inductor backend runs with `mode="reduce-overhead"` (CUDA graphs); on
CPU it is plain inductor. Warm-up compiles every bucket; after it, a recompile is an error that names
the guard that failed.

This layer knows nothing of the engine: its caller hands it the step as a module (everything the step
reads reached through that module, so it is all static) and a callback that prepares an all-padding
batch of a given size, which is what warm-up runs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from inkling_compiled.checks import is_int
from inkling_compiled.errors import CompileError, OptionError
from inkling_compiled.paths import default_cache_dir

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)
BACKENDS = ("inductor", "eager", "aot_eager", "tensorrt")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


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


def default_compile_cache_dir() -> Path:
    return default_cache_dir() / "inductor"


class CompiledDecoder:
    """`step()` compiled once per bucket; `run()` replays the bucket the buffers were last prepared for."""

    def __init__(self, step: nn.Module, prepare_padding: Callable[[int], object], *, device: torch.device | str,
                 buckets: tuple[int, ...], compile_backend="inductor", mode: str | None = None,
                 cache_dir: str | Path | None = None, cpp_wrapper: bool | None = None):
        self.step, self.prepare_padding = step, prepare_padding
        self.buckets = buckets
        self.compiler = resolve_backend(compile_backend)
        device = torch.device(device)
        if mode is None and compile_backend == "inductor" and device.type == "cuda":
            mode = "reduce-overhead"
        self.mode = mode
        self.cache_dir = Path(cache_dir) if cache_dir else Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or
                                                                 default_compile_cache_dir())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)
        # Each bucket is a recompile of the same frame (and every engine in the process shares that
        # frame's cache); leave room for all of them.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(buckets) + 8)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 16 * len(buckets) + 64)
        if mode is not None and mode not in MODES:
            raise OptionError(f"unknown compile mode {mode!r}: choose one of {', '.join(MODES)} (or None)")
        if cpp_wrapper and mode is not None:
            raise OptionError("cpp_wrapper=True and a compile mode cannot go together (torch.compile takes one)")
        kwargs = {"fullgraph": True, "dynamic": False, "backend": self.compiler}
        if mode is not None:
            kwargs["mode"] = mode
        # On CPU, inductor's C++ wrapper replaces the Python code that launches each kernel, which is a
        # large share of a small model's step. (torch.compile takes a mode or options, not both.)
        if cpp_wrapper is None:
            cpp_wrapper = compile_backend == "inductor" and device.type == "cpu" and mode is None
        self.cpp_wrapper = bool(cpp_wrapper)
        if self.cpp_wrapper:
            kwargs["options"] = {"cpp_wrapper": True}
        self.compiled = torch.compile(step, **kwargs)
        self.compile_seconds: dict[int, float] = {}
        self.warmed_up = False

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} rows exceed the largest bucket {self.largest}; split the batch first")

    def warmup(self, progress: bool = True) -> dict[int, float]:
        """Compiles every bucket on an all-padding batch (only the dummy slot and page are written)."""
        show = progress and sys.stderr.isatty()
        for i, b in enumerate(self.buckets):
            if show:
                sys.stderr.write(f"\rcompiling decode graphs [{'#' * i}{'.' * (len(self.buckets) - i)}] bucket {b}")
                sys.stderr.flush()
            self.warm_bucket(b)
        if show:
            sys.stderr.write("\r" + " " * 60 + "\r")
        self.warmed_up = True
        return dict(self.compile_seconds)

    def warm_bucket(self, bucket: int) -> float:
        """Compiles (or loads from cache) one bucket's graph on an all-padding batch; seconds taken."""
        self.prepare_padding(bucket)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.compiled()
        self.compile_seconds[bucket] = time.perf_counter() - t0
        return self.compile_seconds[bucket]

    def run(self) -> tuple[torch.Tensor, ...]:
        """Replays the graph for the bucket the buffers were prepared for; outputs are copies the caller owns."""
        with torch.inference_mode():
            if not self.warmed_up:
                outputs = self.compiled()
            else:
                try:
                    with torch._dynamo.config.patch(error_on_recompile=True):
                        outputs = self.compiled()
                except torch._dynamo.exc.RecompileError as e:
                    raise CompileError(f"decode step would recompile after warm-up: {e}") from None
        # CUDA-graph outputs live in graph-owned memory that the next replay overwrites.
        return tuple(t.clone() for t in outputs) if self.mode == "reduce-overhead" else outputs
