"""Named ranges for nsys (NVTX) and torch.profiler: off unless asked for, and then free.

`INKLING_NVTX=1` (or `enable()`) emits NVTX ranges in the `inkling` domain; `profile_ranges(True)`
(what `inkling-compiled profile` does) emits torch.profiler `record_function` ranges instead. Off,
`nvtx_range` returns one shared null context after two bool checks: no nvtx call is made. Inside a
compiled region it always returns the null context (a range call there would break the graph), so
layer and stream ranges exist on eager steps and at graph capture, while replays are covered by the
ranges the runner opens around them.
"""

from __future__ import annotations

import contextlib
import os

import torch

_NULL = contextlib.nullcontext()
_enabled = os.environ.get("INKLING_NVTX", "0") == "1"
_profiling = False
DOMAIN = "inkling"

# The ranges around compiled replays, each followed by its bucket and rows: `profile` finds a replay's op
# events by these names and labels them from the census of that step's graph.
DECODE_REPLAY = "replay bucket"
VERIFY_REPLAY = "verify replay bucket"
DRAFT_REPLAY = "draft replay bucket"


def enabled() -> bool:
    return _enabled


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def profile_ranges(on: bool = True) -> None:
    global _profiling
    _profiling = on


def nvtx_range(name: str):
    if torch.compiler.is_compiling() or not (_enabled or _profiling):
        return _NULL
    if _profiling:
        return torch.profiler.record_function(name)
    import nvtx

    return nvtx.annotate(name, domain=DOMAIN)
