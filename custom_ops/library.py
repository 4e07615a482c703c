"""The `inkling` op namespace: schemas, and the kernels each op has per dispatch key.

Every op is defined from its schema (mutated arguments marked `(a!)`) with:

- a fake kernel (tracing, `Meta`);
- a `reference` kernel: plain torch, the definition the others are tested against; it may look at
  its data on the host (a sync), so it is for tests and for CPU when nothing faster is there;
- a `CPU` kernel: the C++ kernel of `csrc/inkling_cpu.cpp`, built and swapped in on the first call
  (`register_cpu_kernels`, `native_kernels`), else the reference (INKLING_NATIVE_KERNELS=0 forces that);
- a `CUDA` kernel: a Triton launcher of `gpu/` (`gpu_kernel`), capturable (no host sync, shapes and
  grids from input shapes only, fit for CUDA graphs); under `TRITON_INTERPRET=1` tests run it on CPU
  tensors against the reference.

`KERNELS[name]` lists what each dispatch key runs. Ops are defined with `define`/`impl` rather than
`torch.library.custom_op`, whose Python wrapper sits on every call: a decode step makes
4 x layers conv calls.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("inkling_compiled")
LIB = torch.library.Library("inkling", "DEF")
_native: bool | None = None  # None until the first CPU call of a C++-covered op (or native_kernels())
_stand_ins: torch.library.Library | None = None  # the CPU registrations the C++ kernels replace
_swap_lock = threading.Lock()
_library: Path | None = None  # the loaded C++ kernels
_build: concurrent.futures.Future | None = None  # a build started ahead of the first call
_SOURCE = Path(__file__).parent / "csrc" / "inkling_cpu.cpp"
# The C++ file registers a CPU kernel for each of these; the others get their Python CPU kernel.
NATIVE_CPU_OPS = ("sconv_decode", "sconv_extend", "sconv_verify", "commit_conv_windows", "kv_write", "paged_attention",
                  "ring_attention", "extend_attention", "moe_experts", "moe_experts_int8", "top_k_top_p", "linear",
                  "linear_int8", "ring_checkpoint", "sconv_checkpoint", "cached_extend_attention", "sample_tokens",
                  "verify_tokens")

KERNELS: dict[str, dict[str, Callable]] = {}  # op name -> {"reference" | "CPU" | "CUDA": kernel}


def define(schema: str, *, fake: Callable, reference: Callable, cuda: Callable, cpu: Callable | None = None,
           tags: tuple = ()):
    """Defines `inkling::<name>` from its schema and registers its kernels; returns the op overload.

    `cpu` defaults to the reference; it serves only where the C++ kernels are not built (they register
    the CPU key themselves, see `register_cpu_kernels`)."""
    name = schema.split("(", 1)[0]
    LIB.define(schema, tags=tags)
    LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"inkling::{name}", fake, lib=LIB)
    KERNELS[name] = {"reference": reference, "CPU": cpu or reference, "CUDA": cuda}
    return getattr(torch.ops.inkling, name).default


def gpu_kernel(module: str, name: str) -> Callable:
    """The CUDA kernel `gpu.<module>.<name>` (a Triton launcher), imported on its first call: triton
    loads only in a process that runs an op on CUDA (or a test that asks for the kernel). Triton
    launches on the current device, so the call runs with its tensors' device current (the dispatcher
    sets no device for Python kernels)."""
    launcher: Callable | None = None

    def launch(*args, **kwargs):
        nonlocal launcher
        if launcher is None:
            launcher = getattr(importlib.import_module(f"{__package__}.gpu.{module}"), name)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        if device.type != "cuda":  # the interpreter, on CPU tensors
            return launcher(*args, **kwargs)
        with torch.cuda.device(device):
            return launcher(*args, **kwargs)

    launch.__name__ = launch.__qualname__ = f"{module}.{name}"
    return launch


def register_cpu_kernels() -> None:
    """At import: the CPU key of every op gets a Python kernel, and nothing is built.

    The ops the C++ file covers get a stand-in that, on the first call of any of them, builds (once per
    machine, see `native_kernels`) and loads the C++ kernels in their place, then runs the call on
    them. Importing the package or running `--help` therefore never waits for a compiler.
    INKLING_NATIVE_KERNELS=0 keeps the Python kernels for good."""
    global _stand_ins
    lazy = os.environ.get("INKLING_NATIVE_KERNELS", "1") != "0"
    if lazy:
        _stand_ins = torch.library.Library("inkling", "IMPL")
        for name in NATIVE_CPU_OPS:
            _stand_ins.impl(name, _first_call_builds(name), "CPU")
    _register_python_cpu([name for name in KERNELS if not (lazy and name in NATIVE_CPU_OPS)])


def _register_python_cpu(names) -> None:
    for name in names:
        LIB.impl(name, KERNELS[name]["CPU"], "CPU")


def _first_call_builds(name: str) -> Callable:
    def first_call(*args, **kwargs):
        native_kernels()
        return getattr(torch.ops.inkling, name).default(*args, **kwargs)

    return first_call


def native_kernels() -> bool:
    """Builds (once per machine, cached on disk) and loads the C++ CPU kernels in place of the stand-ins;
    False (and the Python kernels registered instead) if that is not possible."""
    global _native, _stand_ins, _library
    with _swap_lock:
        if _native is not None:
            return _native
        _native = False
        if _stand_ins is None:  # INKLING_NATIVE_KERNELS=0
            return False
        try:
            library = _build.result() if _build is not None else _built_extension()
        except Exception as e:  # no compiler, no ninja, ...: the Python kernels serve
            log.warning("inkling C++ CPU kernels unavailable, using the torch reference kernels: %s", e)
            library = None
        # Swap under the lock: the stand-ins go, then the C++ file registers its kernels as it loads.
        _stand_ins._destroy()
        _stand_ins = None
        if library is not None:
            try:
                torch.ops.load_library(str(library))
                _native, _library = True, library
            except Exception as e:  # a library that does not load: the Python kernels serve
                log.warning("inkling C++ CPU kernels at %s did not load, using the torch reference kernels: %s",
                            library, e)
        if not _native:
            _register_python_cpu(NATIVE_CPU_OPS)
        return _native


@contextlib.contextmanager
def reference_kernels(*ops: str):
    """Runs the named ops on their plain-torch reference kernels on CPU while the block runs (the C++
    ones serve again after): to tell a kernel's arithmetic from everything around it."""
    native_kernels()  # the C++ kernels load first, or they would register over the override
    override = torch.library.Library("inkling", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for op in ops:
                override.impl(op, KERNELS[op]["reference"], "CPU")
        yield
    finally:
        override._destroy()


def build_in_background() -> None:
    """Starts building the C++ kernels now, in a child process, if they are not built yet: the build then
    overlaps the rest of start-up (loading weights, compiling the decode graph) on another core, and the
    first kernel call waits for it."""
    global _build
    with _swap_lock:
        if _build is None and _native is None and _stand_ins is not None:
            _build = concurrent.futures.Future()
            threading.Thread(target=_build_into, args=(_build,), daemon=True, name="inkling-cpp-build").start()


def _build_into(future: concurrent.futures.Future) -> None:
    try:
        future.set_result(_built_extension())
    except Exception as e:  # reported by native_kernels(), which falls back to the Python kernels
        future.set_exception(e)


@functools.cache
def native_library():
    """The loaded C++ kernels as a ctypes library (their `extern "C"` functions), or None where they are
    not in use."""
    if not native_kernels():
        return None
    import ctypes

    return ctypes.CDLL(str(_library))


def cpu_isa() -> str | None:
    """The instruction set the C++ matmul kernels picked for this CPU ('avx512', 'avx2', 'portable'; the
    INKLING_CPU_ISA variable can force a lower one); None where the C++ kernels are not in use."""
    native = native_library()
    if native is None:
        return None
    isa = native.inkling_cpu_isa
    import ctypes

    isa.restype = ctypes.c_char_p
    return isa().decode()


def _build_flags() -> list[str]:
    from inkling_compiled.streams import STREAM_NAMES

    # -ffp-contract=off: every product and sum rounds as the references do (bit-identical convs).
    # -fopenmp: at::parallel_for is inline OpenMP; the library links libgomp.so.1, which resolves to the
    # copy torch has already loaded, so the kernels share torch's intra-op pool and its thread count.
    return ["-O3", "-ffp-contract=off", "-fopenmp", f"-DINKLING_STREAM_NAMES={','.join(STREAM_NAMES)}"]


def extension_dir() -> Path:
    """Where this source, these flags, this torch and this interpreter build their kernels: every
    checkout and venv gets its own folder, so none of them rebuilds another's."""
    from inkling_compiled.paths import default_cache_dir

    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_build_flags()).encode(), torch.__version__.encode(),
                 sys.version.encode(), sys.executable.encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return default_cache_dir() / "extensions" / f"inkling_cpu-{key.hexdigest()[:16]}"


def _built_extension() -> Path:
    """The built library, building it first (in a child process, which loads nothing here) if needed."""
    folder = extension_dir()
    library = folder / "inkling_cpu.so"
    if not library.is_file():
        sys.stderr.write("inkling-compiled: building the C++ CPU kernels (once for this checkout and "
                         f"interpreter) in {folder}\n")
        # Built in a folder of this process's own, then renamed into place: another process starting at
        # the same moment never loads a half-written library.
        scratch = folder.with_name(f"{folder.name}.build-{os.getpid()}")
        scratch.mkdir(parents=True, exist_ok=True)
        build = ("import sys; from torch.utils import cpp_extension; "
                 "cpp_extension.load(name='inkling_cpu', sources=[sys.argv[1]], build_directory=sys.argv[2], "
                 "extra_cflags=sys.argv[3:], extra_ldflags=['-fopenmp'], is_python_module=False, verbose=False)")
        done = subprocess.run([sys.executable, "-c", build, str(_SOURCE), str(scratch), *_build_flags()],
                              capture_output=True, text=True)
        if done.returncode != 0 or not (scratch / library.name).is_file():
            raise RuntimeError(f"building {_SOURCE.name} failed:\n{done.stderr[-4000:]}")
        folder.mkdir(parents=True, exist_ok=True)
        os.replace(scratch / library.name, library)
        shutil.rmtree(scratch, ignore_errors=True)
    return library
