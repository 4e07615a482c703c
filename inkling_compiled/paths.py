"""Where inkling-compiled keeps what it builds once: C++ kernels, inductor's cache, the demo checkpoint."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$INKLING_CACHE_DIR`, else `$XDG_CACHE_HOME/inkling-compiled`, else `~/.cache/inkling-compiled`."""
    base = os.environ.get("INKLING_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inkling-compiled")
    return Path(base)
