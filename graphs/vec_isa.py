"""Inductor's instruction-set probe, once per machine instead of once per process.

To pick the vector ISA of its C++ code, inductor checks each one the CPU's flags list by building a
test program and loading it in a child process, at every start: 2-3 s of a warm start that loads
everything else from caches, and some 9 s of a start with a new compile cache (the test programs are
built again). Its outcome depends on the CPU, the compiler and torch only, so it is recorded once per
machine, beside the kernel choices (`<INKLING_CACHE_DIR>/vec-isa/<key>.json`; the key hashes those
three), not in inductor's compile cache. When every ISA the flags list passed
(the usual case), later processes set `torch._inductor.config.cpp.vec_isa_ok = True`: inductor then
takes the flags' list as it is, which is the same pick without the base probe (the AVX-512 bf16, VNNI
and AMX variants still run checks of their own; on this machine the call went from 2.3 s to 0.5 s). The first process sets it
too, after probing, so that the package key (which holds inductor's configuration) is the same in both.
Where an ISA failed, or a user set `vec_isa_ok`, nothing is changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger("inkling_compiled")


def _machine(compiler: str) -> str:
    """What the probe's outcome depends on: the CPU's flags, the compiler (path, size, mtime), torch."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    compiler = shutil.which(compiler) or compiler  # the binary a bare name ("g++") resolves to
    try:
        st = os.stat(compiler)
        built_by = f"{compiler}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        built_by = compiler
    return repr((torch.__version__, flags, built_by, os.environ.get("ATEN_CPU_CAPABILITY")))


def settle(cache_dir: Path) -> None:
    """Sets `vec_isa_ok` from the recorded probe (probing and recording it the first time)."""
    config = torch._inductor.config.cpp
    if config.vec_isa_ok is not None:
        return
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.cpp_builder import get_cpp_compiler

        record = Path(cache_dir) / "vec-isa" / (
            hashlib.sha256(_machine(get_cpp_compiler()).encode()).hexdigest()[:24] + ".json")
        if record.exists():
            all_passed = json.loads(record.read_text())["all_passed"]
        else:
            cpu_has = cpu_vec_isa.x86_isa_checker()
            listed = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
                      if all(flag in cpu_has for flag in str(isa).split())]
            passed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
            all_passed = bool(listed) and listed == passed
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"listed": listed, "passed": passed, "all_passed": all_passed}))
            tmp.replace(record)
    except Exception as err:  # an inductor without these internals (another torch): probe as it always did
        log.debug("inkling-compiled: the ISA probe is not cached (%s)", err)
        return
    if all_passed:
        config.vec_isa_ok = True
