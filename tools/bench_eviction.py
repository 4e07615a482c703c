"""Eviction under a full prefix cache, as the tree grows: microseconds per evicted entry.

    OMP_NUM_THREADS=1 python tools/bench_eviction.py [--entries 1000 4000 16000] [--rounds 2000]

A pool on the tiny config with one free page fewer than the cache holds entries (one full page each,
distinct prompts, so the tree is as wide as it is large). Each round admits a new prompt's page: the
cache must evict its least recently used entry to make room, and the new entry takes its place, so
the tree keeps its size. The per-round time is `make_room` plus the insert; it should not grow with
the number of entries. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import time

import torch

from inkling_compiled.cache import StatePool
from inkling_compiled.cache.prefix import PrefixCache
from inkling_compiled.config import InklingConfig
from inkling_compiled.tiny import TINY_CONFIGS

PAGE = 4


def prompt(i: int) -> list[int]:
    return [3 + (i // 250 ** d) % 250 for d in range(PAGE)] + [1]  # one full page (and a token to prefill)


def fill(cache: PrefixCache, pool: StatePool, i: int) -> None:
    """Caches prompt i's page the way a prefill does: a request's page, kept by the cache after it ends."""
    rid = f"r{i}"
    pool.allocate(rid, PAGE)
    cache.insert(prompt(i), 1, pool.pages_of[rid], {})
    pool.free(rid)


def per_eviction_us(entries: int, rounds: int) -> float:
    config = InklingConfig.from_dict({"model_type": "inkling_text", **TINY_CONFIGS["tiny"]})
    pool = StatePool(config, max_slots=2, num_pages=entries + 1, page_size=PAGE, max_pages_per_seq=2,
                     dtype=torch.float32)
    cache = PrefixCache(pool)
    for i in range(entries):
        fill(cache, pool, i)
    assert pool.pages.num_free == 0 and len(cache.entries()) == entries
    t0 = time.perf_counter()
    for i in range(entries, entries + rounds):
        assert cache.make_room(pages=1)
        fill(cache, pool, i)
    seconds = time.perf_counter() - t0
    assert len(cache.entries()) == entries
    return seconds / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, nargs="+", default=[1000, 4000, 16000])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    first = None
    print("| entries | us per eviction | x the smallest tree |")
    print("|---|---|---|")
    for n in args.entries:
        us = per_eviction_us(n, args.rounds)
        first = first or us
        print(f"| {n} | {us:.1f} | {us / first:.2f}x |")


if __name__ == "__main__":
    main()
