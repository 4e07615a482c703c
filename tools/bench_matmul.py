"""The projections' small-M matmul: our C++ kernel (what `inkling::linear` and the experts use where the
measured choice says; forced here for every row count) against ATen's GEMM (MKL), per weight shape,
layout and rows.

    OMP_NUM_THREADS=1 python tools/bench_matmul.py [--rows 1 2 4 8 16 32] [--isa avx512|avx2|portable]
                                                   [--from-memory MB] [--threads N] [--shapes OxH ...]
                                                   [--best-of B]

Prints microseconds per call, ours / ATen (below 1.0 = ours is faster) and the rate at which our
kernel reads the weight. By default one weight of a few MB, read from cache; `--from-memory 512`
cycles through copies of it filling 512 MB, more than the caches hold, so that every call streams
its weight from memory, as a decode step does.

`--int8` times `inkling::linear_int8` on int8 weights (the same MB of copies, four times as many)
against ATen's GEMM on the fp32 weights: up to 32 rows the op is the C++ kernel reading int8, past
that it dequantizes and calls the GEMM, which is where this table shows the kernel stops paying.
"""

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(512, 512), (1024, 512), (512, 1024), (4000, 512)]  # the `small` config's projections and lm_head
BATCH_CALLS = 20  # calls a batch of --best-of


def timed(fn, weights: list[torch.Tensor], n: int = 200, best_of: int = 0) -> float:
    """Microseconds per call of fn(w), cycling through `weights`: the mean of n calls, or with `best_of` B
    the best of B batches of 20 calls (steadier where the machine's speed drifts within seconds)."""
    for w in weights[:10]:
        fn(w)
    batches, calls = (best_of, BATCH_CALLS) if best_of else (1, max(n, len(weights)))
    best, i = float("inf"), 0
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(weights[i % len(weights)])
            i += 1
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both kernels")
    p.add_argument("--shapes", nargs="+", default=None, metavar="OxH", help="weights [O, H] (default: the small config's)")
    p.add_argument("--isa", choices=["avx512", "avx2", "portable"], help="force the kernel's instruction set")
    p.add_argument("--from-memory", type=int, default=0, metavar="MB",
                   help="cycle through copies of each weight filling MB megabytes (0: one weight, in cache)")
    p.add_argument("--int8", action="store_true", help="the int8 weight-only op against ATen on fp32 weights")
    p.add_argument("--best-of", type=int, default=0, metavar="B",
                   help=f"each time the best of B batches of {BATCH_CALLS} calls (default: the mean of 200 calls)")
    args = p.parse_args()
    if os.environ.get("INKLING_FEW_ROWS") != "1000000":  # both are read once, when the kernels load
        env = {**os.environ, "INKLING_FEW_ROWS": "1000000", **({"INKLING_CPU_ISA": args.isa} if args.isa else {})}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    from inkling_compiled.custom_ops.library import cpu_isa

    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    print(f"threads: {args.threads}")
    print(f"C++ kernel instruction set: {cpu_isa()}")
    print(f"weights {'from memory, ' + str(args.from_memory) + ' MB of copies' if args.from_memory else 'in cache'}")
    if args.int8:
        return int8_table(shapes, args)
    print("| weight [O, H] | layout | rows | ours us | ATen us | ours / ATen | ours GB/s |\n|---|---|---|---|---|---|---|")
    for o, h in shapes:
        for column_major in (False, True):
            copies = max(1, (args.from_memory << 20) // (o * h * 4))
            weights = [torch.randn(o, h) for _ in range(copies)]
            if column_major:
                weights = [w.t().contiguous().t() for w in weights]
            for rows in args.rows:
                x = torch.randn(rows, h)
                w = weights[0]
                assert torch.allclose(torch.ops.inkling.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
                ours = timed(lambda w: torch.ops.inkling.linear(x, w), weights, best_of=args.best_of)
                aten = timed(lambda w: F.linear(x, w), weights, best_of=args.best_of)
                print(f"| {o}x{h} | {'W^T' if column_major else 'W'} | {rows} | {ours:.1f} | {aten:.1f} | "
                      f"{ours / aten:.2f} | {o * h * 4 / ours / 1e3:.1f} |")


def int8_table(shapes, args) -> None:
    from inkling_compiled.custom_ops import dequantize

    print("| weight [O, H] | layout | rows | int8 op us | fp32 ATen us | int8 / fp32 | int8 GB/s |\n|---|---|---|---|---|---|---|")
    for o, h in shapes:
        for column_major in (False, True):
            copies = max(1, (args.from_memory << 20) // (o * h * 4))
            fp32 = [torch.randn(o, h) for _ in range(copies)]
            q8 = [torch.randint(-127, 128, (o, h), dtype=torch.int8) for _ in range(copies * 4 if args.from_memory else 1)]
            if column_major:
                fp32, q8 = ([w.t().contiguous().t() for w in ws] for ws in (fp32, q8))
            scale = torch.rand(o) / 100
            for rows in args.rows:
                x = torch.randn(rows, h)
                want = F.linear(x, dequantize(q8[0], scale))
                assert torch.allclose(torch.ops.inkling.linear_int8(x, q8[0], scale), want, atol=1e-3, rtol=1e-4)
                ours = timed(lambda q: torch.ops.inkling.linear_int8(x, q, scale), q8, best_of=args.best_of)
                aten = timed(lambda w: F.linear(x, w), fp32, best_of=args.best_of)
                print(f"| {o}x{h} | {'W^T' if column_major else 'W'} | {rows} | {ours:.1f} | {aten:.1f} | "
                      f"{ours / aten:.2f} | {o * h / ours / 1e3:.1f} |")


if __name__ == "__main__":
    main()
