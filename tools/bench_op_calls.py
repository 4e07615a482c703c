"""What one op call costs inside a compiled step: 100 chained calls of `inkling::linear` (a custom op,
which inductor's C++ wrapper reaches through the dispatcher's boxed path) against 100 of ATen's linear
(which it calls through its C shim), both on a 1x16 @ 16x16 product, so the call is nearly all there is.

    OMP_NUM_THREADS=1 python tools/bench_op_calls.py [--python-wrapper]

Prints microseconds per call, the best of five timings of 200 runs each.
"""

import argparse
import time

import torch
import torch._inductor.config as inductor_config

from inkling_compiled.custom_ops import native_kernels


def per_call_us(fn, x: torch.Tensor, calls: int) -> float:
    compiled = torch.compile(fn, fullgraph=True)
    for _ in range(5):
        compiled(x)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            compiled(x)
        best = min(best, (time.perf_counter() - t0) / 200)
    return best / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python-wrapper", action="store_true", help="inductor's Python wrapper instead of its C++ one")
    args = p.parse_args()
    torch.set_num_threads(1)
    native_kernels()
    inductor_config.cpp_wrapper = not args.python_wrapper
    weights = [torch.randn(16, 16) for _ in range(100)]

    def custom(x):
        for w in weights:
            x = torch.ops.inkling.linear(x, w)
        return x

    def aten(x):
        for w in weights:
            x = torch.nn.functional.linear(x, w) * 0.5  # the multiply keeps inductor from folding the chain
        return x

    x = torch.randn(1, 16)
    wrapper = "Python" if args.python_wrapper else "C++"
    print(f"inductor's {wrapper} wrapper: inkling::linear {per_call_us(custom, x, 100):.2f} us a call, "
          f"ATen linear and a multiply {per_call_us(aten, x, 100):.2f} us")


if __name__ == "__main__":
    main()
