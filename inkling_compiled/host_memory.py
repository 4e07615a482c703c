"""glibc's malloc told to keep a prefill's large buffers rather than give them back to the kernel.

glibc serves a block above its mmap threshold (128 KB at first, raised as large blocks are freed, 32 MB
at most) with a fresh mapping, and hands the top of its heap back to the kernel once twice that
threshold lies free there. A prefill step allocates and frees hundreds of MB of activations (the
extend graph's intermediates, the experts' grouped rows) every time, so each prompt had every page of
them faulted in and zeroed afresh. `tools/prefill_faults.py` on the Xeon VM (32 prompts of 64 tokens on
`small`, one thread), as it is and with INKLING_KEEP_FREED_MEMORY=0, four runs in turns: 0-512 minor
page faults a prefill against 29,600-68,900; 0.96-0.98 s against 1.10-1.18 s in the quieter pair, the
others within the VM's spread; 0-100 MB more resident (1,236-1,332 MB against 1,212-1,237). The cost is
that memory: blocks up to 32 MB that used to be unmapped when freed now stay in the heap (glibc never
trims below its top), and up to TRIM_THRESHOLD of free memory stays at the top of each arena (one per
thread that allocates, up to glibc's limit), so a process may keep more than 128 MB it is not using.

A decode step allocates nothing large (its buffers are static), so this is about prefill. It is a
setting of the whole process, made once by the first CPU worker; INKLING_KEEP_FREED_MEMORY=0 leaves
glibc as it was. Other C libraries (musl) and other systems are left alone; an allocator preloaded in
glibc's place (jemalloc, tcmalloc) gets the same call, which it may accept and ignore.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

log = logging.getLogger("inkling_compiled")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this come from the heap
TRIM_THRESHOLD = 128 << 20  # free heap kept before any goes back to the kernel

_lock = threading.Lock()
_done: bool | None = None  # None: not tried yet; else whether glibc took the settings


def keep_freed_memory() -> bool:
    """Fixes glibc's mmap and trim thresholds (once per process); whether they are set now."""
    global _done
    with _lock:
        if _done is None:
            _done = _set_thresholds()
        return _done


def thresholds_set() -> bool:
    """Whether this process has set them (a CPU worker asks for it as it is built)."""
    return bool(_done)


def _set_thresholds() -> bool:
    if os.environ.get("INKLING_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own malloc: glibc's, or one preloaded in its place
    except (OSError, AttributeError) as e:
        log.debug("malloc's thresholds left as they were: %s", e)
        return False
    # mallopt returns 1 when it takes a setting; either one also stops glibc moving the thresholds itself
    took = [mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1, mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1]
    if all(took):
        log.debug("malloc keeps blocks up to %d MB on its heap and %d MB free before trimming",
                  MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    else:
        log.debug("malloc refused its thresholds (mmap %s, trim %s)", *("taken" if t else "refused" for t in took))
    return all(took)
