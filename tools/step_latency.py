"""Per-bucket decode-step latency (metadata prep + graph replay, and the replay alone), engine decode
tokens/s of the compiled engine, and the engine's host overhead per step at batch 1 (an engine step's
time less bucket 1's replay: scheduling, prep, outputs); used by gpu_check.sh on CUDA.

    OMP_NUM_THREADS=1 python tools/step_latency.py --device cpu [--configs tiny small] [--graphs batch-one] [--no-package]
        [--calls]   (also: Python function calls per engine step at batch 1 and 8, a noise-free proxy of host work)
    python3 tools/step_latency.py --device cuda --dtype bfloat16
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from inkling_compiled.engine import Engine
from inkling_compiled.sampling import SamplingParams
from inkling_compiled.tiny import build_tiny_checkpoint


def python_calls(engine, steps: int) -> float:
    """Python (and C) function calls each of the engine's next `steps` steps makes, counted with sys.setprofile."""
    import sys

    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    for _ in range(steps):
        sys.setprofile(count)
        engine.step()
        sys.setprofile(None)
    return calls / steps


def calls_per_step(engine, batch: int, steps: int = 20) -> float:
    """Python (and C) function calls an engine step makes in decode (`python_calls`)."""
    for i in range(batch):
        engine.add_request(list(range(3 + i, 67 + i)), SamplingParams(max_new_tokens=64, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()
    calls = python_calls(engine, steps)
    while engine.has_unfinished():
        engine.step()
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["tiny", "small"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: fp32 on CPU, bf16 on GPU")
    p.add_argument("--graphs", default="one", choices=["one", "batch-one", "per-bucket"],
                   help="one symbolic graph (default), bucket 1 specialised beside it, or one per bucket")
    p.add_argument("--no-package", action="store_true",
                   help="trace the step with Dynamo at every start instead of saving and loading it whole")
    p.add_argument("--calls", action="store_true", help="count Python function calls per engine step (batch 1, 8)")
    args = p.parse_args()
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            path = build_tiny_checkpoint(Path(tmp) / name, name)
            engine = Engine.from_pretrained(path, device=args.device, dtype=args.dtype, max_batch_size=32,
                                            progress=False, specialize_batch_one=args.graphs == "batch-one",
                                            graph_per_bucket=args.graphs == "per-bucket",
                                            compile_package=not args.no_package, compile_extend=False)
            d = engine.worker.decoder
            print(f"{name}: mode={d.mode} graphs {d.graphs()} {'packaged' if d.packaged else 'traced'}, warm-up " +
                  ", ".join(f"bs{b} {s:.1f}s" for b, s in d.compile_seconds.items()))
            replay = {}
            buffers = engine.worker.backend.buffers
            for b in d.buckets:
                def step():
                    engine.worker.backend.prepare_padding(b)
                    return d.run(b, inputs=buffers.published)  # as the runner replays it (bound after the first)

                for _ in range(3):
                    step()
                sync()
                t0, n = time.perf_counter(), 50
                for _ in range(n):
                    step()
                sync()
                ms = (time.perf_counter() - t0) / n * 1e3
                t0 = time.perf_counter()
                for _ in range(n):
                    d.run(b, inputs=buffers.published)
                sync()
                replay[b] = (time.perf_counter() - t0) / n * 1e3
                print(f"  bucket {b:>2}: prep + replay {ms:.3f} ms/step, {b / ms * 1e3:9.1f} tokens/s (padded rows); "
                      f"replay alone {replay[b]:.3f} ms")
            for batch in (1, 8, 32):
                params = SamplingParams(max_new_tokens=64, ignore_eos=True)
                for i in range(batch):
                    engine.add_request(list(range(3 + i, 67 + i)), params)
                engine.step()
                sync()
                t0, steps = time.perf_counter(), 0
                while engine.has_unfinished():
                    engine.step()
                    steps += 1
                dt = time.perf_counter() - t0
                print(f"  engine batch {batch:>2}: {batch * 63 / dt:9.1f} decode tokens/s ({dt / steps * 1e3:.2f} ms/step)")
                if batch == 1:
                    print(f"  host overhead per engine step at batch 1: {dt / steps * 1e3 - replay[1]:.3f} ms "
                          "(engine step less bucket 1's replay)")
                if args.calls and batch in (1, 8):
                    print(f"  engine batch {batch:>2}: {calls_per_step(engine, batch):.0f} Python calls per step")


if __name__ == "__main__":
    main()
