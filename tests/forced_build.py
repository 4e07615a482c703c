"""Running a script under one of the C++ kernels' builds that this CPU would not pick itself."""

import os
import subprocess
import sys


def run_in_build(isa: str, script: str) -> list[str]:
    """Runs `script` in a subprocess with the kernels' build forced to `isa` (and the few-row kernel's row
    limit raised, so every row count takes it); the words after the first it prints, which must be the
    build that ran (`cpu_isa()`): the one asked, or the portable one on a CPU without it."""
    env = {**os.environ, "INKLING_CPU_ISA": isa, "INKLING_FEW_ROWS": "64"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    chosen, *rest = done.stdout.split(maxsplit=1)
    assert chosen in (isa, "portable")
    return rest
