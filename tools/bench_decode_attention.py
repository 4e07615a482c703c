"""The CPU decode attention kernels alone, at `small`'s heads: a sliding layer (`ring_attention`: 8 query
heads over 4 kv heads, a 64-key window) and a global one (`paged_attention`: 8 over 2, pages of 16 keys
in a shuffled block table), one query a row, and the key and value bytes each reads.

    OMP_NUM_THREADS=1 python tools/bench_decode_attention.py [--batch 32] [--context 314 1000]

Prints microseconds a call and GB/s of keys and values: with --from-memory, the median of --reps calls
each timed alone after 64 MB of other data went through the caches (as in a decode step, where the
weights stream between one layer's attention and the next); without it, the best of five timings of
--reps calls back to back, whose keys stay in L2/L3 as far as they fit. The flush also evicts the
interpreter's and the dispatcher's own code and data, which a step keeps warm: --from-memory prints
what a 512-float multiply takes after the same flush, a fixed cost inside every figure it prints.
"""

import argparse
import time

import torch

from inkling_compiled.custom_ops import native_kernels

HEADS, HEAD_DIM, EXTENT = 8, 64, 256


def best_us(fn, reps: int, from_memory: bool) -> float:
    for _ in range(10):
        fn()
    if from_memory:
        other = torch.ones(16 << 20)
        each = []
        for _ in range(reps):
            other.sum()
            t0 = time.perf_counter()
            fn()
            each.append(time.perf_counter() - t0)
        return sorted(each)[len(each) // 2] * 1e6
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, nargs="+", default=[314, 1000], help="keys a global-layer row reads")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--from-memory", action="store_true", help="flush the caches before each timed call")
    args = p.parse_args()
    if not native_kernels():
        raise SystemExit("the C++ kernels did not build")
    g = torch.Generator().manual_seed(0)
    if args.from_memory:
        small = torch.randn(512, generator=g)
        print(f"a 512-float multiply after the same flush: {best_us(lambda: small * 2, args.reps, True):.1f} us")
    B = args.batch
    q, table = torch.randn(B, HEADS, HEAD_DIM, generator=g), torch.randn(B, HEADS, EXTENT, generator=g)
    slots = torch.arange(B, dtype=torch.int32)

    window, nkv = 64, 4
    k, v = (torch.randn(B * window, nkv, HEAD_DIM, generator=g) for _ in range(2))
    positions = torch.full((B,), 300, dtype=torch.long)
    us = best_us(lambda: torch.ops.inkling.ring_attention(q, k, v, table, positions, slots, window, EXTENT, window),
                 args.reps, args.from_memory)
    read = 2 * B * window * nkv * HEAD_DIM * 4
    print(f"ring_attention, batch {B}, window {window}: {us:.1f} us, {read / us / 1e3:.1f} GB/s")

    nkv, page = 2, 16
    for context in args.context:
        pages = (context + page - 1) // page
        kc, vc = (torch.randn(B * pages * page, nkv, HEAD_DIM, generator=g) for _ in range(2))
        block_table = torch.randperm(B * pages, generator=g).view(B, pages).to(torch.int32)
        tau, lens = torch.rand(B, generator=g) + 0.5, torch.full((B,), context, dtype=torch.int32)
        us = best_us(lambda: torch.ops.inkling.paged_attention(q, kc, vc, table, tau, block_table, slots, lens, page,
                                                               EXTENT), args.reps, args.from_memory)
        read = 2 * B * context * nkv * HEAD_DIM * 4
        print(f"paged_attention, batch {B}, context {context}: {us:.1f} us, {read / us / 1e3:.1f} GB/s")


if __name__ == "__main__":
    main()
