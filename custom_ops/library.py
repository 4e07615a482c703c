"""The `inkling` op namespace: schemas, reference kernels, fake kernels, and the native CPU kernels.

Each op is defined from its schema (mutated arguments marked `(a!)`), gets its plain-torch reference
kernel for every device (CompositeExplicitAutograd) and a fake kernel for tracing. On CPU the C++
kernels of `csrc/inkling_cpu.cpp` take over when they build (`native_kernels()`); set
INKLING_NATIVE_KERNELS=0 to run the references everywhere. Ops are defined with `define`/`impl`
rather than `torch.library.custom_op`: the call path is shorter (~15 us less per call), which matters
with 4 conv ops per layer per step.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("inkling_compiled")
LIB = torch.library.Library("inkling", "DEF")
_native: bool | None = None


def define(schema: str, reference, fake, tags: tuple = ()):
    """Defines `inkling::<name>` from its schema; returns the op overload."""
    name = schema.split("(", 1)[0]
    LIB.define(schema, tags=tags)
    LIB.impl(name, reference, "CompositeExplicitAutograd")
    torch.library.register_fake(f"inkling::{name}", fake, lib=LIB)
    return getattr(torch.ops.inkling, name).default


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

        from inkling_compiled.tiny import default_cache_dir

        build = default_cache_dir() / "extensions" / f"torch-{torch.__version__}"
        build.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name="inkling_cpu", sources=[str(Path(__file__).parent / "csrc" / "inkling_cpu.cpp")],
                           extra_cflags=["-O3", "-ffp-contract=off"], build_directory=str(build),
                           is_python_module=False, verbose=False)
        _native = True
    except Exception as e:  # no compiler, no ninja, ...: the reference kernels still serve
        log.warning("inkling C++ CPU kernels unavailable, using the torch reference kernels: %s", e)
    return _native
