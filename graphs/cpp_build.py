"""The C++ wrapper and its kernels built side by side instead of one after the other.

With the wrapper built apart (`capture.separate_wrapper_build`), inductor hands one worker three builders
for a step: the wrapper (-O1), the kernels (-O3) and the link of the two, and runs them in turn. The first
two are independent compiler processes (one file each, its own temporary folder), so they can run at the
same time on a second core; only the link needs both. On `small` the wrapper takes 3.4-4.3 s a graph and
the kernels 1.1-1.3 s, so a cold start with three graphs saves about 3.5 s where there is a core to
spare. Where inductor's worker is not the one this was written for (another torch), nothing is
changed.
"""

from __future__ import annotations

import inspect
import os
from concurrent.futures import ThreadPoolExecutor

_INSTALLED = False


def _build_side_by_side(lock_path: str, cpp_builders) -> None:
    """Inductor's `_worker_compile_cpp`, with a wrapper-kernels-link triple's first two run at once."""
    from torch._inductor.codecache import LOCK_TIMEOUT
    from torch.utils._filelock import FileLock

    with FileLock(lock_path, timeout=LOCK_TIMEOUT):
        todo = [b for b in cpp_builders if not os.path.exists(b.get_target_file_path())]
        if len(cpp_builders) == 3 and len(todo) == 3:
            wrapper, kernels, link = todo
            with ThreadPoolExecutor(max_workers=1) as pool:
                beside = pool.submit(kernels.build)
                wrapper.build()
                beside.result()
            link.build()
            return
        for builder in todo:
            builder.build()


def install() -> None:
    """Puts `_build_side_by_side` in place of inductor's worker, once per process, where that worker has
    the signature it replaces."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    try:
        from torch._inductor import codecache
    except ImportError:
        return
    original = getattr(codecache, "_worker_compile_cpp", None)
    if original is None or list(inspect.signature(original).parameters) != ["lock_path", "cpp_builders"]:
        return
    codecache._worker_compile_cpp = _build_side_by_side
