"""Per-step metadata prep: the in-place singleton against a naive per-conv rebuild.

    OMP_NUM_THREADS=1 python tools/bench_prep.py [--config small] [--batch 8] [--steps 300]

"singleton": `prepare_decode` fills the static buffers once per step and every conv reads the one
StepMetadata. "naive": the pattern SGLang's Inkling backend removed: every conv read builds its own
metadata object from fresh tensors (4 convs x layers objects per step). Prints time per step,
tensor allocations per step (ops that return new storage, counted with a dispatch mode) and the peak
of host memory a step allocates beyond what it started with (tracemalloc: numpy temporaries and
Python lists, which the tensor count cannot see).
"""

import argparse
import sys
import tempfile
import time
import tracemalloc

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inkling_compiled.metadata import RowSampling, StepMetadata
from inkling_compiled.engine import Engine
from inkling_compiled.tiny import build_tiny_checkpoint


class AllocationCounter(TorchDispatchMode):
    """Counts op calls that produce a tensor with storage of its own (not a view, not in place)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.count += 1
        return out


def naive_metadata(rows: list[int], slots: list[int], positions: list[int]) -> StepMetadata:
    """What a per-conv rebuild costs: every field a fresh tensor, one object per call."""
    n = len(slots)
    slot = torch.tensor(slots, dtype=torch.int32)
    pos = torch.tensor(positions, dtype=torch.int64)
    return StepMetadata(
        is_decode=True, input_ids=torch.tensor(rows, dtype=torch.int64), cache_indices=slot,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), has_initial_state=slot > 0,
        seq_lens=(pos + 1).to(torch.int32), positions=pos,
        global_kv_loc=pos.clone(), sliding_kv_loc=pos.clone(), last_token_index=torch.arange(n),
        temperature=torch.zeros(n), top_k=torch.zeros(n, dtype=torch.int64), top_p=torch.ones(n),
        seed=torch.zeros(n, dtype=torch.int64), sample_counter=torch.zeros(n, dtype=torch.int64),
        drafted=torch.zeros(n, dtype=torch.int64), checkpoint_rows=torch.zeros(0, dtype=torch.int32),
        checkpoint_ends=torch.zeros(0, dtype=torch.int64), checkpoint_boundaries=torch.zeros(0, dtype=torch.int64),
        checkpoint_indices=torch.zeros(0, dtype=torch.int64))


def host_peak_bytes(fn) -> int:
    """Bytes of host memory allocated at the busiest point of one call, above what was live before it."""
    tracemalloc.start()
    try:
        fn()  # first traced call: lazily created caches are not what a step costs
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - start


def measure(fn, steps: int) -> tuple[float, int, int]:
    fn()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    per_step_us = (time.perf_counter() - t0) / steps * 1e6
    with AllocationCounter() as counter:
        fn()
    return per_step_us, counter.count, host_peak_bytes(fn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.from_pretrained(build_tiny_checkpoint(tmp, args.config), compile=False,
                                        max_batch_size=args.batch)
    slots = list(range(1, args.batch + 1))
    positions = [40 + i for i in range(args.batch)]
    ids = [5] * args.batch
    rows = [RowSampling(0.0, 0, 1.0, 0, 0)] * args.batch
    backend, layers = engine.worker.backend, engine.config.num_hidden_layers
    context = backend.context
    reads = 4 * layers

    def singleton():
        backend.prepare_decode(ids, slots, positions, rows)
        for _ in range(reads):
            context.conv_state_metadata()

    def naive():
        backend.prepare_decode(ids, slots, positions, rows)
        for _ in range(reads):
            naive_metadata(ids, slots, positions)

    one_us, one_allocs, one_host = measure(singleton, args.steps)
    naive_us, naive_allocs, naive_host = measure(naive, args.steps)
    print(f"config={args.config} layers={layers} batch={args.batch} conv reads/step={reads}")
    print(f"singleton (in place, one object): {one_us:8.1f} us/step, {one_allocs:4d} tensor allocations/step, "
          f"{one_host:7d} B host peak/step")
    print(f"naive (object per conv read):     {naive_us:8.1f} us/step, {naive_allocs:4d} tensor allocations/step, "
          f"{naive_host:7d} B host peak/step")
    print(f"naive / singleton: {naive_us / one_us:.1f}x time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
