"""Where an MTP (or plain) decode step of a checkpoint goes, without a profiler's per-op cost: each phase
timed around its own call (the verify, decode and draft replays, the draft step's host work, the target's
prep per step kind; the commits happen inside the replays), per step, over the checkpoint's held-out prompts.

    OMP_NUM_THREADS=1 python tools/spec_step_split.py [--model DIR] [--batch 8] [-K 2] [--plain] [--runs 3]
                                                      [--draft-quantization int8]

Prints the last run's tokens/s and, per phase, its calls and microseconds a call. Phases nest: `draft
host` is `draft` less its replay; `verify replay` and `decode replay` are inside `worker step`.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from typing import Callable

import torch

from inkling_compiled import Engine, SamplingParams
from inkling_compiled.bench import held_out_prompts
from inkling_compiled.tiny import trained_checkpoint


class PhaseTimer:
    """Wraps named methods of live objects with a timer (the instance attribute shadows the method)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj, method: str, label: str | Callable[..., str]) -> None:
        """`label` names the phase, or is called with the call's arguments to name it."""
        inner = getattr(obj, method)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                name = label(*args, **kwargs) if callable(label) else label
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        setattr(obj, method, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint with held_out.json (default: the shipped one)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("-K", type=int, default=2, help="draft tokens (MTP depths used)")
    ap.add_argument("--plain", action="store_true", help="plain decoding instead of MTP")
    ap.add_argument("--draft-quantization", choices=["none", "int8"], default="none",
                    help="the weights the MTP head drafts from")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="runs over the batch (the last is reported)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.batch < 1 or args.K < 1:
        ap.error("--runs, --batch and -K must be at least 1")
    torch.set_num_threads(1)
    path = args.model or str(trained_checkpoint())
    prompts = held_out_prompts(path)
    work = [prompts[i % len(prompts)] for i in range(args.batch)]
    options = dict(compile=True, max_batch_size=args.batch, buckets=(args.batch,), prefix_cache=False,
                   max_model_len=max(map(len, prompts)) + args.new_tokens + args.K + 1, progress=False)
    if not args.plain:
        options.update(speculative="mtp", num_speculative_tokens=args.K, draft_quantization=args.draft_quantization)
    engine = Engine.from_pretrained(path, **options)
    timer = PhaseTimer()
    worker = engine.worker
    timer.wrap(engine, "step", "engine step")
    timer.wrap(worker, "execute", "worker step")
    # a verify or decode step's prep apart from the prefill's
    timer.wrap(worker.runner, "prepare", lambda plan: f"{plan.kind.value} prep")
    for label, step in (("verify replay", worker.verifier), ("decode replay", worker.decoder)):
        if step is not None:
            timer.wrap(step, "run", label)
    drafter = engine.drafter
    if drafter is not None:
        timer.wrap(drafter, "_draft", "draft")
        if drafter.compiled is not None:
            timer.wrap(drafter.compiled, "run", "draft replay")
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for _ in range(args.runs):
        timer.clear()
        for prompt in work:
            engine.add_request(prompt, params)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - t0
    steps = timer.calls["engine step"]
    print(f"{'plain' if args.plain else f'mtp K={args.K}'} batch {args.batch}: {steps} steps, "
          f"{args.batch * args.new_tokens / seconds:.1f} tok/s (prefill included)")
    if "draft" in timer.seconds:
        timer.seconds["draft host"] = timer.seconds["draft"] - timer.seconds.get("draft replay", 0.0)
        timer.calls["draft host"] = timer.calls["draft"]
    for label, total in sorted(timer.seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {label:15s} {timer.calls[label]:4d} calls  {total / timer.calls[label] * 1e6:9.1f} us a call")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
