"""The short-conv kernels on the CPU: `inkling::sconv_verify` over B rows of T tokens against
`inkling::sconv_decode` over the same B*T tokens as rows of their own (the same multiply-adds; verify
also saves each token's window), and the plain-torch reference of verify.

    OMP_NUM_THREADS=1 python tools/bench_sconv.py [--shapes 8x3x256 8x4x256 1x3x256 8x3x128 32x3x512] [--K 4]

Each shape is BxTxD (rows, tokens a row, channels). Prints microseconds a call, the best of five
timings of 2,000 calls. A verify step of the shipped checkpoint at batch 8, K=2 runs 8x3x256 and
8x3x128 once per layer and stream (32 calls), and its MTP draft step 8x4x256 and 8x4x128 per depth.
"""

import argparse
import time

import torch

from inkling_compiled.custom_ops import KERNELS


def best_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8x3x256", "8x4x256", "1x3x256", "8x3x128", "32x3x512"])
    ap.add_argument("--K", type=int, default=4, help="conv taps (the checkpoints' conv_kernel_size)")
    args = ap.parse_args()
    K = args.K
    print(f"threads {torch.get_num_threads()}, K={K}")
    print("| rows x tokens x channels | sconv_verify us | sconv_decode of B*T rows us | reference verify us |")
    print("|---|---|---|---|")
    for shape in args.shapes:
        B, T, D = map(int, shape.split("x"))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(B * T, D, generator=g)
        w = torch.randn(D, K, generator=g)
        state = torch.randn(B + 1, K - 1, D, generator=g)
        slots = torch.arange(B, dtype=torch.int32)
        windows = torch.zeros(B, T, K - 1, D)
        verify = best_us(lambda: torch.ops.inkling.sconv_verify(x, state, w, slots, windows))
        reference = best_us(lambda: KERNELS["sconv_verify"]["reference"](x, state, w, slots, windows), calls=200)
        rows_state = torch.randn(B * T + 1, K - 1, D, generator=g)
        rows = torch.arange(B * T, dtype=torch.int32)
        decode = best_us(lambda: torch.ops.inkling.sconv_decode(x, rows_state, w, rows))
        print(f"| {shape} | {verify:.1f} | {decode:.1f} | {reference:.1f} |")


if __name__ == "__main__":
    main()
