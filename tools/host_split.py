"""Where a decode step's time goes outside the weight-reading kernels, split by layer: the engine around
the runner (scheduling, outputs), the runner around the replay (metadata prep), the replay's Python
around inductor's C++ entry (guards, Dynamo's and AOTAutograd's code, or a bound call), and the C++
entry itself (inductor's wrapper and every kernel). Also the median engine step, and how many Python
calls a step makes (a noise-free proxy of the host's work).

    OMP_NUM_THREADS=1 python tools/host_split.py [--config small] [--batch 1] [--steps 300] [--threads 1]
        [--quantization int8] [--size-asserts]

Timers wrap the layers' methods (a few microseconds of their own per step); the C++ entry is found in
the cpp-wrapper module inductor generated for the step, so the split needs the default CPU path (inductor,
C++ wrapper). The host runs cold after the kernels sweep the caches: compare splits in turns, one process
after another, on a machine whose speed drifts.
"""

import argparse
import collections
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from inkling_compiled import runner as runner_module
from inkling_compiled.engine import Engine
from inkling_compiled.graphs import capture
from inkling_compiled.sampling import SamplingParams
from inkling_compiled.tiny import build_tiny_checkpoint
from step_latency import python_calls  # (tools/ is this script's folder, first on sys.path)

spent: collections.Counter = collections.Counter()


def timed(key: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t0
    return wrapper


def time_cpp_entries() -> int:
    """Wraps the C++ entry of every cpp-wrapper module inductor has loaded; how many it wrapped."""
    from torch._inductor.codecache import PyCodeCache

    wrapped = 0
    for module in PyCodeCache.modules:
        call = getattr(module, "call", None)
        if hasattr(module, "inductor_entry") and call is not None and call.__closure__:
            cell = call.__closure__[0]
            cell.cell_contents = timed("entry", cell.cell_contents)
            wrapped += 1
    return wrapped


def time_steps(engine: Engine, steps: int) -> list[float]:
    """Seconds of each of `steps` engine steps; refuses to time steps after the rows have ended (at
    max_model_len), which would be empty."""
    each = []
    for _ in range(steps):
        if not engine.has_unfinished():
            raise SystemExit(f"--steps {steps} outlasts the rows: they end after {len(each)} steps at "
                             f"max_model_len={engine.max_model_len}")
        t0 = time.perf_counter()
        engine.step()
        each.append(time.perf_counter() - t0)
    return each


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quantization", choices=["none", "int8"], default="none")
    p.add_argument("--size-asserts", action="store_true",
                   help="compile inductor's per-call size and stride checks in (TORCHINDUCTOR_SIZE_ASSERTS=1)")
    args = p.parse_args()
    if args.size_asserts:
        os.environ["TORCHINDUCTOR_SIZE_ASSERTS"] = "1"
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / args.config, args.config)
        engine = Engine.from_pretrained(path, device="cpu", max_batch_size=32, progress=False, compile_extend=False,
                                        quantization=None if args.quantization == "none" else args.quantization)
    Engine.step = timed("step", Engine.step)
    runner_module.Runner.run = timed("runner", runner_module.Runner.run)
    runner_module.Runner.prepare = timed("prepare", runner_module.Runner.prepare)
    capture.CompiledStep.run = timed("replay", capture.CompiledStep.run)
    params = SamplingParams(max_new_tokens=args.steps + 30, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(list(range(3 + i, 67 + i)), params)
    for _ in range(5):  # the prefill, then the first replays (which bind)
        engine.step()
    if not time_cpp_entries():
        raise SystemExit("no C++ wrapper entry found: the split needs the default CPU path (inductor, C++ wrapper)")
    calls = python_calls(engine, 10)
    spent.clear()
    each = time_steps(engine, args.steps)
    us = {key: value / args.steps * 1e6 for key, value in spent.items()}
    print(f"{args.config}{'' if args.quantization == 'none' else ' ' + args.quantization}, batch {args.batch}, {args.threads} thread(s), {args.steps} steps: median step "
          f"{statistics.median(each) * 1e3:.3f} ms, mean {us['step'] / 1e3:.3f} ms, {calls:.0f} Python calls a step")
    print(f"  engine outside the runner {us['step'] - us['runner']:.0f} us | runner outside the replay "
          f"{us['runner'] - us['replay']:.0f} us (prep {us['prepare']:.0f}) | replay's Python outside the C++ entry "
          f"{us['replay'] - us['entry']:.0f} us | C++ entry {us['entry']:.0f} us")


if __name__ == "__main__":
    main()
