"""A step's sampler on CPU: the `sample_tokens` / `verify_tokens` ops (C++) against their torch math
compiled by inductor (what a CPU step ran before the ops), per step shape, greedy and sampled rows.

    OMP_NUM_THREADS=1 python tools/bench_sampler.py [--vocab 2000 4096] [--rows 1 8 32] [--calls 500]

Prints microseconds a call (the compiled function's Python wrapper included, a few microseconds) and
old / op. Decode rows are [rows, vocab]; verify rows [rows, 3, vocab] (K = 2), two real drafts each.
"""

import argparse
import time

import torch

from inkling_compiled.custom_ops import KERNELS, native_kernels

TOP_N = 20  # the step's MAX_TOP_LOGPROBS


def per_call(fn, args, calls: int) -> float:
    for _ in range(max(10, calls // 10)):
        fn(*args)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[2000, 4096])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if not native_kernels():
        ap.error("the C++ kernels are not in use (INKLING_NATIVE_KERNELS=0 or no compiler): nothing to compare")
    compiled = {op: torch.compile(KERNELS[op]["reference"], dynamic=False) for op in ("sample_tokens", "verify_tokens")}
    print("| step | rows | vocab | rows sample | torch math compiled us | op us | compiled / op |")
    print("|---|---|---|---|---|---|---|")
    for V in args.vocab:
        for B in args.rows:
            for temperature in (0.0, 0.8):
                g = torch.Generator().manual_seed(B)
                params = (torch.full((B,), temperature), torch.zeros(B, dtype=torch.long), torch.ones(B),
                          torch.randint(0, 2**32, (B,), generator=g), torch.zeros(B, dtype=torch.long))
                logits = torch.randn(B, V, generator=g) * 3
                cases = [("decode", "sample_tokens", (logits, *params, TOP_N))]
                logits = torch.randn(B, 3, V, generator=g) * 3
                inputs = torch.cat([torch.zeros(B, 1, dtype=torch.long), logits.argmax(-1)[:, :-1]], dim=1)
                cases.append(("verify", "verify_tokens", (logits, inputs, torch.full((B,), 2), *params, TOP_N)))
                for step, op, op_args in cases:
                    old = per_call(compiled[op], op_args, args.calls)
                    new = per_call(getattr(torch.ops.inkling, op), op_args, args.calls)
                    print(f"| {step} | {B} | {V} | {'all' if temperature else 'none'} | {old:.1f} | {new:.1f} | "
                          f"{old / new:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
