"""How far the compiled decode step is from this machine's limits: `inkling-compiled roofline`.

Measures the machine once (weight-streaming bandwidth: the best of a few one-thread sums over a buffer
far larger than the caches; matmul throughput: a large fp32 GEMM), then for each batch works out what
a decode step of the config cannot avoid:

- bytes: every weight the step multiplies by (attention, convs, dense MLPs, shared experts, router,
  lm_head), the embedding rows of the batch, the routed experts the batch reaches (E * (1 - (1 - k/E)^B)
  per MoE layer: the expected number under uniform routing), and the conv windows and KV the rows read
  at the given context length;
- FLOPs: two per multiply-add of every token with the weights it uses (its k experts, not all E).

The floor is max(bytes / bandwidth, FLOPs / matmul rate); achieved / floor is how close the engine's
measured decode step gets (1.0 = at the hardware limit). Nothing here asserts a speed.
"""

from __future__ import annotations

import statistics
import time

import torch

from .cache.pool import each_layer

STREAM_BYTES = 512 * 2**20  # far past the last-level cache
GEMM_SIZE = 1024


def measure_bandwidth(repeats: int = 5) -> float:
    """Bytes per second one thread reads from memory (best of `repeats` sums over a large buffer)."""
    buf = torch.ones(STREAM_BYTES // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return STREAM_BYTES / best


def measure_matmul(repeats: int = 5) -> float:
    """fp32 FLOP/s of a large square GEMM (the best of `repeats`)."""
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * GEMM_SIZE**3 / best


def step_cost(model, pool, batch: int, context: int) -> dict:
    """The bytes a decode step of `batch` rows at `context` tokens must read, and the FLOPs it must do."""
    config = model.config
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    reached = experts * (1 - (1 - top_k / experts) ** batch) if experts else 0.0
    weight_bytes = flops_per_token = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if "embed_tokens" in name:
            weight_bytes += batch * p.shape[-1] * p.element_size()  # one row per token
        elif ".experts." in name:  # a routed bank [E, ...]: the experts the batch reaches
            weight_bytes += nbytes / experts * reached
            flops_per_token += 2 * p.numel() / experts * top_k
        else:
            weight_bytes += nbytes
            if p.dim() >= 2:
                flops_per_token += 2 * p.numel()
    per_row_state = sum(2 * t[0].numel() * t.element_size() for t in each_layer(pool.conv.values()))  # r + w
    kv_rows = sum(min(context, pool.ring_size) * t[0].numel() * t.element_size() for t in each_layer(pool.sliding_kv))
    kv_rows += sum(context * t[0].numel() * t.element_size() for t in each_layer(pool.global_kv))
    return {"bytes": weight_bytes + batch * (per_row_state + kv_rows), "flops": batch * flops_per_token,
            "experts_reached": reached}


def roofline(config_name: str, batches: list[int], context: int = 128, new_tokens: int = 64) -> list[dict]:
    """Per batch: floor and achieved decode tokens/s of the compiled engine on a seeded checkpoint."""
    import tempfile
    from pathlib import Path

    from .bench import _prompts, bench_engine
    from .engine import Engine
    from .tiny import build_tiny_checkpoint

    bandwidth, matmul = measure_bandwidth(), measure_matmul()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / config_name, config_name)
        prompt_len = max(1, context - new_tokens)
        engine = Engine.from_pretrained(path, max_batch_size=max(batches), progress=False,
                                        prefill_chunk_tokens=max(batches) * prompt_len)
        for batch in batches:
            cost = step_cost(engine.model, engine.worker.pool, batch, prompt_len + new_tokens // 2)  # mean context
            floor_s = max(cost["bytes"] / bandwidth, cost["flops"] / matmul)
            achieved = bench_engine(engine, _prompts(batch, prompt_len, seed=batch), new_tokens)
            rows.append({"config": config_name, "batch": batch, "bound": "memory" if cost["bytes"] / bandwidth >=
                         cost["flops"] / matmul else "compute", "mbytes_per_step": cost["bytes"] / 1e6,
                         "mflop_per_step": cost["flops"] / 1e6, "experts_reached": cost["experts_reached"],
                         "floor_step_ms": 1e3 * floor_s, "step_ms": achieved["step_ms"],
                         "floor_tok_s": batch / floor_s, "tok_s": achieved["tok_s"],
                         "of_floor": floor_s * 1e3 / achieved["step_ms"],
                         "bandwidth_gb_s": bandwidth / 1e9, "matmul_gflop_s": matmul / 1e9})
    return rows


def roofline_table(rows: list[dict]) -> str:
    head = (f"machine: {statistics.fmean(r['bandwidth_gb_s'] for r in rows):.1f} GB/s weight streaming, "
            f"{statistics.fmean(r['matmul_gflop_s'] for r in rows):.1f} GFLOP/s fp32 matmul (one thread)\n\n"
            "| config | batch | bound | MB/step | MFLOP/step | experts reached | floor ms/step | ms/step | "
            "floor tok/s | tok/s | achieved / floor |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['config']} | {r['batch']} | {r['bound']} | {r['mbytes_per_step']:.1f} | {r['mflop_per_step']:.1f} | "
        f"{r['experts_reached']:.1f} | {r['floor_step_ms']:.2f} | {r['step_ms']:.2f} | {r['floor_tok_s']:.1f} | "
        f"{r['tok_s']:.1f} | {r['of_floor']:.2f} |" for r in rows) + "\n"
