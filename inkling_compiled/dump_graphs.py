"""`inkling-compiled dump-graphs`: builds an engine whose decoder compiles through a `GraphDump`."""

from __future__ import annotations

from pathlib import Path

import torch

from .engine import Engine
from .graphs.dump import GraphDump


def dump_graphs(model_dir: str | Path, out_dir: str | Path, *, buckets: tuple[int, ...] | None = None,
                backend: str = "inductor", device: str = "cpu", steps: int = 3) -> dict:
    """Compiles each bucket of a fresh engine with a recording backend and writes the dump; the summary."""
    dump = GraphDump(backend)
    buckets = tuple(sorted(buckets)) if buckets else None
    torch._dynamo.reset()
    try:
        # The Python kernel-launch wrapper, not the C++ one: same graph, same buffers, readable code.
        engine = Engine.from_pretrained(model_dir, device=device, compile=True, compile_backend=dump.recorder,
                                        warmup=False, progress=False, buckets=buckets,
                                        max_batch_size=max(buckets) if buckets else 32, cpp_wrapper=False)
        return dump.write(engine.worker.decoder, out_dir, state_tensors=engine.worker.pool.state_tensors(), model=str(model_dir),
                          device=device, steps=steps)
    finally:
        torch._dynamo.reset()
