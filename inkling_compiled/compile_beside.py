"""The decode step compiled in a second process while this one compiles the engine's other steps.

A cold start spends most of its time in Dynamo's and inductor's Python, one graph after another on one
core. The decode step's graph needs nothing of the extend or verify step's, and the compile package
(`graphs/package.py`) already lets one process load what another compiled: so an engine made by
`Engine.from_pretrained` on a machine with a second core starts a child process that builds the same
engine, compiles only its decode step and saves it, while the parent compiles its verify and extend
steps; the parent then loads the package and replays each bucket once. The two compiles overlap.

The child builds the engine from the same checkpoint and options, with what only sizes the pool made
small (a package key holds no size: `Worker.package_key`). It compiles only if its decode step's
package path is the one the parent expects, so a key that differs in any way (another torch state, an
option not carried over) means no file and the parent compiles the step itself, as it does when the
child fails. A drafter object cannot cross a process boundary: n-gram drafting with the same K stands
in for it (it sizes the pool alike and loads no weights), and when that drafter needs hidden states
everything is compiled here.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .torch_state import SETTINGS, PinnedTorchState

log = logging.getLogger("inkling_compiled")

# Options that only size the pool or the step buffers (none is in a package key): the child keeps its
# own small. Options the child must not take from the parent: it never warms up, reports or recurses.
_SIZES = {"max_batch_size": 1, "buckets": None, "num_pages": None, "state_memory_bytes": None, "host_cache_bytes": 0}
_CHILD = {"warmup": False, "progress": False, "parallel_compile": False}
# The child's program (not `-m` this module: the package imports it first, and runpy warns of that).
_CHILD_MAIN = ("import sys; from inkling_compiled.compile_beside import main; "
               "from inkling_compiled.engine import Engine; sys.exit(main(sys.argv[1:], Engine))")
# How long the parent waits for the child before compiling the step itself.
TIMEOUT_S = 900.0


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def child_options(options: dict) -> dict | None:
    """The engine options a child is built with, as JSON values; None when they cannot be carried over
    (a drafter that needs hidden states, or a value JSON cannot hold)."""
    out = {**options, **_SIZES, **_CHILD}
    speculative = out.get("speculative")
    if speculative is not None and not isinstance(speculative, str):
        if getattr(speculative, "needs_hidden", False):
            return None
        out["speculative"] = "ngram"  # sizes the pool as any drafter with the same K does
    if out.get("compile_cache_dir") is not None:
        out["compile_cache_dir"] = str(out["compile_cache_dir"])
    try:
        json.dumps(out)
    except (TypeError, ValueError):
        return None
    return out


def torch_settings() -> dict:
    """The torch state the engine pins its steps to (`torch_state.SETTINGS`), as JSON values."""
    values = dict(PinnedTorchState().values)
    values["default_dtype"] = str(values["default_dtype"]).removeprefix("torch.")
    return values


def apply_torch_settings(values: dict) -> None:
    values = {**values, "default_dtype": getattr(torch, values["default_dtype"])}
    for name, (_, put) in SETTINGS.items():
        put(tuple(values[name]) if isinstance(values[name], list) else values[name])


class StepBeside:
    """How to build the engine again in a child: `start` launches the child for a step whose package is not
    saved yet, and the returned handle's `wait` says whether the package is there to load."""

    def __init__(self, path: str | Path, load: dict, options: dict):
        self.request = {"path": str(path), "load": load, "options": options}

    @classmethod
    def for_checkpoint(cls, path, *, device, dtype, check_finite: bool, quantization, options: dict
                       ) -> "StepBeside | None":
        """None where a child cannot help: one core, or options that cannot be carried over."""
        carried = child_options(options)
        if carried is None or cores() < 2:
            return None
        dtype = None if dtype is None else str(dtype).removeprefix("torch.")
        load = {"device": str(device), "dtype": dtype, "check_finite": check_finite, "quantization": quantization}
        return cls(path, load, carried)

    def start(self, decoder) -> "_Child | None":
        """A child compiling the package of `decoder` (the engine's decode `CompiledStep`), or None when
        there is nothing for one to do (no package for this step, or one saved or loaded)."""
        target = decoder.package_path
        if target is None or decoder.loaded or decoder.graph_of or Path(target).is_file():
            return None
        request = {**self.request, "expect": str(target), "torch": torch_settings()}
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        err = tempfile.TemporaryFile(mode="w+")  # not a pipe: a chatty child never blocks on a full one
        proc = subprocess.Popen([sys.executable, "-c", _CHILD_MAIN, json.dumps(request)], env=env,
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
        return _Child(proc, Path(target), err)


class _Child:
    def __init__(self, proc: subprocess.Popen, target: Path, err):
        self.proc, self.target, self.err = proc, target, err

    def wait(self, timeout: float = TIMEOUT_S) -> bool:
        """Whether the child saved the package (else it is logged and the caller compiles the step)."""
        try:
            self.proc.wait(timeout=timeout)
            reason = None
        except subprocess.TimeoutExpired:
            self.stop()
            reason = f"no answer within {timeout:g} s"
        if self.proc.returncode == 0 and self.target.is_file():
            return True
        if reason is None:
            self.err.seek(0)
            lines = [line for line in self.err.read().strip().splitlines() if line.strip()]
            reason = next((line for line in reversed(lines) if "package would be" in line), lines[-1] if lines
                          else "no output")
        log.warning("the compile in a second process failed (exit %s: %s); compiling the step here",
                    self.proc.returncode, reason[:300])
        return False

    def stop(self) -> None:
        """Ends the child if it still runs (an error or interrupt in the parent) and closes its log."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def main(argv: list[str], engine_class) -> int:
    """The child: build the engine (`engine_class`, handed in so that this module imports nothing above
    it), compile its decode step into the expected package, exit."""
    request = json.loads(argv[0])
    apply_torch_settings(request["torch"])
    engine = engine_class.from_pretrained(request["path"], compile=True, **request["load"], **request["options"])
    decoder = engine.worker.decoder
    found = None if decoder is None else str(decoder.package_path)
    if found != request["expect"]:
        print(f"this engine's decode package would be {found}, not {request['expect']}", file=sys.stderr)
        return 2
    with engine.worker.torch_state.pinned():
        decoder.warmup()
    return 0 if decoder.packaged else 1

