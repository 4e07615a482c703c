"""What admitting a prompt costs the requests already decoding: the engine step that prefills one new
prompt beside N decoding rows, against the decode step alone: the extend step eager, compiled, and
compiled in a mixed step (the decoding rows inside the prefill's forward; the other two decode first,
in a forward of their own).

    OMP_NUM_THREADS=1 python tools/bench_admission.py [--config tiny] [--prompt 64] [--decoding 7]
                                                      [--prefix-cache] [--repeats 3]

Each measurement runs in a fresh process (one engine per process: a second engine in a process steps
slower), the three in turns; each reports the median of 15 admissions and of 20 decode steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(path: str, prompt_len: int, decoding: int, prefix_cache: bool, compile_extend: bool,
            mixed_steps: bool) -> dict:
    import torch

    from inkling_compiled.engine import Engine
    from inkling_compiled.sampling import SamplingParams

    engine = Engine.from_pretrained(path, max_batch_size=32, prefix_cache=prefix_cache, progress=False,
                                    max_model_len=prompt_len + 100, compile_extend=compile_extend,
                                    mixed_steps=mixed_steps)
    params = SamplingParams(max_new_tokens=90, temperature=0.0, ignore_eos=True)
    # An admitted prompt ends with its first token, so every admission meets the same decoding rows (as a
    # steady stream of arrivals and departures does), and a step's shape repeats.
    arrival = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(3, 259, (prompt_len,), generator=g).tolist()  # fresh tokens: no prefix hits

    for _ in range(decoding):
        engine.add_request(prompt(), params)
    for _ in range(10):
        engine.step()

    def timed() -> float:
        t0 = time.perf_counter()
        engine.step()
        return time.perf_counter() - t0

    decode = [timed() for _ in range(20)]
    admit = []
    for _ in range(15):
        engine.add_request(prompt(), arrival)
        admit.append(timed())
        engine.step()
    return {"decode_ms": 1e3 * statistics.median(decode), "admission_ms": 1e3 * statistics.median(admit)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--prompt", type=int, default=64, help="tokens of the prompt admitted")
    p.add_argument("--decoding", type=int, default=7, help="requests decoding beside it")
    p.add_argument("--prefix-cache", action="store_true", help="with the prefix cache (its checkpoints taken)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        job = json.loads(args.child)
        print(json.dumps(measure(**job)))
        return
    from inkling_compiled.tiny import build_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_checkpoint(Path(tmp) / args.config, args.config))
        variants = {"eager": (False, False), "compiled": (True, False), "compiled, mixed": (True, True)}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (compiled, mixed) in variants.items():
                job = dict(path=path, prompt_len=args.prompt, decoding=args.decoding, prefix_cache=args.prefix_cache,
                           compile_extend=compiled, mixed_steps=mixed)
                done = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True,
                                      text=True, check=True)
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.config}: a {args.prompt}-token prompt admitted beside {args.decoding} decoding rows"
          f"{' (prefix cache on)' if args.prefix_cache else ''}; medians of {args.repeats} processes")
    print("| extend step | decode step alone ms | step with the admission ms | admission's extra ms |")
    print("|---|---|---|---|")
    extra = {}
    for name in variants:
        decode = statistics.median(r["decode_ms"] for r in runs[name])
        admit = statistics.median(r["admission_ms"] for r in runs[name])
        extra[name] = admit - decode
        print(f"| {name} | {decode:.2f} | {admit:.2f} | {admit - decode:.2f} |")
    print(f"compiled extend: the admission's extra time x{extra['eager'] / extra['compiled']:.2f} shorter; "
          f"mixed: x{extra['compiled'] / extra['compiled, mixed']:.2f} shorter again")


if __name__ == "__main__":
    main()
