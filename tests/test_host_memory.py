"""glibc's malloc keeps a prefill's freed buffers (inkling_compiled/host_memory.py)."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc only")

ROUND = (
    "import resource, torch\n"
    "from inkling_compiled.host_memory import keep_freed_memory\n"
    "kept = keep_freed_memory()\n"
    "def round():\n"
    "    blocks = [torch.ones(2 << 20) for _ in range(6)]  # 48 MB in blocks of 8 MB, every page written\n"
    "    del blocks\n"
    "round()\n"
    "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "round()\n"
    "print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")


def run(script: str, keep: str, *args: str) -> list[str]:
    env = dict(os.environ, INKLING_KEEP_FREED_MEMORY=keep)
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def test_buffers_freed_and_allocated_again_cost_no_page_faults():
    """A prefill's worth of large buffers (48 MB in blocks of 8 MB), freed and allocated again, comes back
    from the heap: by default glibc hands most of it back to the kernel and faults it in again (12,262
    pages on the Xeon VM); with the engine's thresholds at most a block's worth (2,048). Opting out
    leaves glibc's defaults."""
    kept, faults = run(ROUND, "1")
    assert kept == "True" and int(faults) < 6000, faults
    assert run(ROUND, "0")[0] == "False"


def test_a_cpu_engine_sets_the_thresholds(checkpoint):
    script = ("import sys\n"
              "from inkling_compiled import host_memory\n"
              "from inkling_compiled.engine import Engine\n"
              "before = host_memory.thresholds_set()\n"
              "Engine.from_pretrained(sys.argv[1], compile=False, progress=False)\n"
              "print(before, host_memory.thresholds_set())\n")
    assert run(script, "1", str(checkpoint("tiny"))) == ["False", "True"]  # the opt-out: the test above
