"""What one verify step's metadata prep costs on the host: `StepBuffers.prepare_verify` for a batch of
rows with K drafts each, on the tiny config's pool (the prep does not depend on the model's widths).

    OMP_NUM_THREADS=1 python tools/bench_verify_prep.py [--batches 1 8] [--drafts 2]

Prints microseconds a call, the best of five timings of 2,000 calls. An MTP step prepares three of
these at K = 2 (the target's verify step and one per draft depth).
"""

import argparse
import time

import torch

from inkling_compiled.cache import StatePool
from inkling_compiled.config import InklingConfig
from inkling_compiled.metadata import GREEDY_PAD, StepBuffers
from inkling_compiled.tiny import TINY_CONFIGS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--drafts", type=int, default=2)
    args = p.parse_args()
    config = InklingConfig.from_dict({"model_type": "inkling_text", **TINY_CONFIGS["tiny"]})
    B_max = max(args.batches)
    pool = StatePool(config, max_slots=B_max, num_pages=4 * B_max + 1, page_size=4, max_pages_per_seq=4,
                     dtype=torch.float32, spec_draft_tokens=args.drafts)
    buffers = StepBuffers(config, pool.block_table_host, page_size=4, max_batch_size=B_max, max_tokens=64,
                          draft_tokens=args.drafts)
    for B in args.batches:
        rows = list(range(1, B + 1))  # slot 0 is the dummy
        step = ([list(range(args.drafts + 1))] * B, rows, [5] * B, [99] * B, [args.drafts] * B, [GREEDY_PAD] * B)
        for _ in range(200):
            buffers.prepare_verify(*step)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                buffers.prepare_verify(*step)
            best = min(best, (time.perf_counter() - t0) / 2000)
        print(f"prepare_verify, batch {B}, K={args.drafts}: {best * 1e6:.1f} us")


if __name__ == "__main__":
    main()
