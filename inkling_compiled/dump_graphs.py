"""`inkling-compiled dump-graphs`: builds an engine whose steps compile through a `GraphDump`."""

from __future__ import annotations

from pathlib import Path

import torch

from .engine import Engine
from .graphs.dump import GraphDump


def dump_graphs(model_dir: str | Path, out_dir: str | Path, *, buckets: tuple[int, ...] | None = None,
                backend: str = "inductor", device: str = "cpu", steps: int = 3, draft_tokens: int = 0,
                drafter: str = "ngram", draft_quantization: str | None = None) -> dict:
    """Compiles each bucket of a fresh engine with a recording backend and writes the dump; the summary.
    With `draft_tokens`, the engine also has a verify step for that many drafts (`drafter`: "ngram", or
    "mtp", the checkpoint's MTP head), dumped the same way under `out_dir/verify` (its summary under the
    summary's "verify"); with "mtp", the draft step too, under `out_dir/draft` (the summary's "draft"), from
    the weights `draft_quantization` names."""
    dump = GraphDump(backend)
    buckets = tuple(sorted(buckets)) if buckets else None
    spec = dict(speculative=drafter, num_speculative_tokens=draft_tokens, draft_quantization=draft_quantization) \
        if draft_tokens else {}
    torch._dynamo.reset()
    try:
        # The Python kernel-launch wrapper, not the C++ one: same graph, same buffers, readable code.
        engine = Engine.from_pretrained(model_dir, device=device, compile=True, compile_backend=dump.recorder,
                                        warmup=False, progress=False, buckets=buckets,
                                        max_batch_size=max(buckets) if buckets else 32, cpp_wrapper=False, **spec)
        worker = engine.worker
        def written_in_place(pool) -> list[torch.Tensor]:  # so that a copy of any of them is flagged
            return [*pool.state_tensors(), *pool.draft_windows()]  # a verify step's saved windows too

        written = dict(state_tensors=written_in_place(worker.pool), model=str(model_dir), device=device, steps=steps)
        summary = dump.write(worker.decoder, out_dir, **written)
        if draft_tokens:
            summary["verify"] = dump.write(worker.verifier, Path(out_dir) / "verify", **written)
        if draft_tokens and drafter == "mtp":
            head = engine.drafter
            summary["draft"] = dump.write(head.compiled, Path(out_dir) / "draft",
                                          **{**written, "state_tensors": written_in_place(head.pool)})
        return summary
    finally:
        torch._dynamo.reset()
