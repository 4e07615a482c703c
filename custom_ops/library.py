"""The `inkling` op namespace: schemas, and the kernels each op has per dispatch key.

Every op is defined from its schema (mutated arguments marked `(a!)`) with:

- a fake kernel (tracing, `Meta`);
- a `reference` kernel: plain torch, the definition the others are tested against; it may look at
  its data on the host (a sync), so it is for tests and for CPU when nothing faster is there;
- a `CPU` kernel: the C++ kernel of `csrc/inkling_cpu.cpp` when it builds (`native_kernels()`), else
  the reference (set INKLING_NATIVE_KERNELS=0 to force that);
- a `CUDA` kernel: capturable (no host sync, static shapes, fit for CUDA graphs). Until Triton
  kernels land these are plain torch, so tests run them on CPU tensors against the references.

`KERNELS[name]` lists what each dispatch key runs. Ops are defined with `define`/`impl` rather than
`torch.library.custom_op`, whose Python wrapper sits on every call: a decode step makes
4 x layers conv calls.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("inkling_compiled")
LIB = torch.library.Library("inkling", "DEF")
_native: bool | None = None
# The C++ file registers a CPU kernel for each of these; the others get their Python CPU kernel.
NATIVE_CPU_OPS = ("sconv_decode", "sconv_extend", "kv_write", "paged_attention", "moe_experts", "top_k_top_p",
                  "linear")

KERNELS: dict[str, dict[str, Callable]] = {}  # op name -> {"reference" | "CPU" | "CUDA": kernel}


def define(schema: str, *, fake: Callable, reference: Callable, cuda: Callable, cpu: Callable | None = None,
           tags: tuple = ()):
    """Defines `inkling::<name>` from its schema and registers its kernels; returns the op overload.

    `cpu` defaults to the reference; it serves only where the C++ kernels are not built (they register
    the CPU key themselves, see `register_python_cpu_kernels`)."""
    name = schema.split("(", 1)[0]
    LIB.define(schema, tags=tags)
    LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"inkling::{name}", fake, lib=LIB)
    KERNELS[name] = {"reference": reference, "CPU": cpu or reference, "CUDA": cuda}
    return getattr(torch.ops.inkling, name).default


def register_python_cpu_kernels(native: bool) -> None:
    """The CPU key of every op the C++ kernels do not cover (all of them when they did not build)."""
    for name, kernels in KERNELS.items():
        if not (native and name in NATIVE_CPU_OPS):
            LIB.impl(name, kernels["CPU"], "CPU")


def native_kernels() -> bool:
    """Builds (once, cached on disk) and loads the C++ CPU kernels; False if that is not possible."""
    global _native
    if _native is not None:
        return _native
    _native = False
    if os.environ.get("INKLING_NATIVE_KERNELS", "1") == "0":
        return False
    try:
        from torch.utils import cpp_extension

        from inkling_compiled.paths import default_cache_dir
        from inkling_compiled.streams import STREAM_NAMES

        build = default_cache_dir() / "extensions" / f"torch-{torch.__version__}"
        build.mkdir(parents=True, exist_ok=True)
        # -ffp-contract=off: every product and sum rounds as the references do (bit-identical convs).
        flags = ["-O3", "-ffp-contract=off", f"-DINKLING_STREAM_NAMES={','.join(STREAM_NAMES)}"]
        cpp_extension.load(name="inkling_cpu", sources=[str(Path(__file__).parent / "csrc" / "inkling_cpu.cpp")],
                           extra_cflags=flags, build_directory=str(build), is_python_module=False, verbose=False)
        _native = True
    except Exception as e:  # no compiler, no ninja, ...: the reference kernels still serve
        log.warning("inkling C++ CPU kernels unavailable, using the torch reference kernels: %s", e)
    return _native
