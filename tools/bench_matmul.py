"""The projections' small-M matmul: our C++ kernel (what `inkling::linear` and the experts use up to
16 rows; forced here for every row count) against ATen's GEMM (MKL), per weight shape, layout and rows.

    OMP_NUM_THREADS=1 python tools/bench_matmul.py [--rows 1 2 4 8 16 32] [--isa avx512|avx2|portable]

Prints microseconds and ours / ATen (below 1.0 = ours is faster). The weights are a few MB, so this
is the cache-resident rate; `inkling-compiled roofline` measures the step against memory bandwidth.
"""

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(512, 512), (1024, 512), (512, 1024), (4000, 512)]  # the `small` config's projections and lm_head


def timed(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--isa", choices=["avx512", "avx2", "portable"], help="force the kernel's instruction set")
    args = p.parse_args()
    if os.environ.get("INKLING_FEW_ROWS") != "1000000":  # both are read once, when the kernels load
        env = {**os.environ, "INKLING_FEW_ROWS": "1000000", **({"INKLING_CPU_ISA": args.isa} if args.isa else {})}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    from inkling_compiled.custom_ops.library import cpu_isa

    torch.set_num_threads(1)
    print(f"C++ kernel instruction set: {cpu_isa()}")
    print("| weight [O, H] | layout | rows | ours us | ATen us | ours / ATen |\n|---|---|---|---|---|---|")
    for o, h in SHAPES:
        for column_major in (False, True):
            w = torch.randn(o, h)
            if column_major:
                w = w.t().contiguous().t()
            for rows in args.rows:
                x = torch.randn(rows, h)
                assert torch.allclose(torch.ops.inkling.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
                ours, aten = timed(lambda: torch.ops.inkling.linear(x, w)), timed(lambda: F.linear(x, w))
                print(f"| {o}x{h} | {'W^T' if column_major else 'W'} | {rows} | {ours:.1f} | {aten:.1f} | "
                      f"{ours / aten:.2f} |")


if __name__ == "__main__":
    main()
