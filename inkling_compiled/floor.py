"""A step's floor on this machine: the rates it can read memory and multiply at a thread count
(`measure_machine`), and what a step of a config cannot avoid reading and computing (`step_cost`).
The floor is max(bytes / rate, FLOPs / matmul rate); `roofline.py` and `bench.py` report steps against it.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .cache.pool import each_layer
from .quantize import is_weight_scale

STREAM_BYTES = 512 * 2**20  # far past the last-level cache of the machines we measure on
GEMV_SHAPE = (32768, 2048)  # a 256 MB weight
GEMM_SIZE = 1024
REPEATS = 5


def best_seconds(fn, repeats: int = REPEATS) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_machine(threads: int) -> dict:
    """Bytes/s by copy, sum and GEMV, the best of them (the floor's rate), and the fp32 GEMM FLOP/s, all
    at `threads` intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(STREAM_BYTES // 4)
        dst = torch.empty_like(src)
        copy = 2 * STREAM_BYTES / best_seconds(lambda: dst.copy_(src))
        reduce = STREAM_BYTES / best_seconds(src.sum)
        src = dst = None  # freed before the next buffer
        w, x = torch.full(GEMV_SHAPE, 0.5), torch.full((1, GEMV_SHAPE[1]), 0.25)
        gemv = w.numel() * 4 / best_seconds(lambda: F.linear(x, w))
        w = None
        a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
        matmul = 2 * GEMM_SIZE**3 / best_seconds(lambda: torch.mm(a, b))
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "copy_gb_s": copy / 1e9, "reduce_gb_s": reduce / 1e9, "gemv_gb_s": gemv / 1e9,
            "bandwidth_gb_s": max(copy, reduce, gemv) / 1e9, "matmul_gflop_s": matmul / 1e9}


RATES = ("copy_gb_s", "reduce_gb_s", "gemv_gb_s", "bandwidth_gb_s", "matmul_gflop_s")


def best_rates(measurements: list[dict]) -> dict:
    """Several `measure_machine` results at one thread count (taken between the timed steps of a run)
    as one: each rate at its best, so that no step is set against a floor measured in a slow moment of
    a noisy machine; also how many there were and the lowest bandwidth among them."""
    best = {"threads": measurements[0]["threads"], "measurements": len(measurements),
            "lowest_bandwidth_gb_s": min(m["bandwidth_gb_s"] for m in measurements)}
    return best | {rate: max(m[rate] for m in measurements) for rate in RATES}


def step_cost(model, pool, tokens: int, rows: int, context: int) -> dict:
    """The bytes a step of `tokens` tokens over `rows` sequences at `context` tokens must read, and the
    FLOPs it must do (decode: tokens = rows)."""
    config = model.config
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    reached = experts * (1 - (1 - top_k / experts) ** tokens) if experts else 0.0
    weight_bytes = flops_per_token = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight"):
            weight_bytes += tokens * p.shape[-1] * p.element_size()  # one row per token
        elif ".experts." in name:  # a routed bank [E, ...] (or its int8 scales): the experts the tokens reach
            weight_bytes += nbytes / experts * reached
            if not is_weight_scale(name):
                flops_per_token += 2 * p.numel() / experts * top_k
        elif ".mtp." not in name:  # the MTP head is not part of these steps
            weight_bytes += nbytes
            if p.dim() >= 2 and not is_weight_scale(name):
                flops_per_token += 2 * p.numel()
    per_row_state = sum(2 * t[0].numel() * t.element_size() for t in each_layer(pool.conv.values()))  # r + w
    kv_rows = sum(min(context, pool.ring_size) * t[0].numel() * t.element_size() for t in each_layer(pool.sliding_kv))
    kv_rows += sum(context * t[0].numel() * t.element_size() for t in each_layer(pool.global_kv))
    return {"bytes": weight_bytes + rows * (per_row_state + kv_rows), "flops": tokens * flops_per_token,
            "experts_reached": reached}


def draft_cost(model, head, depths: int, rows: int, tokens_per_row: int) -> dict:
    """The bytes an MTP draft step of `depths` depths over `rows` rows of `tokens_per_row` tokens must read,
    and the FLOPs it must do: each depth's own weights (its MLP is dense) over every token, and the lm_head
    once per depth (each depth's draft reads it, or the head's int8 copy of it) over one token a row. The
    head's keys and conv windows (a few KB a row) are left out."""
    own = [p for layer in head.layers[:depths] for p in layer.parameters()]
    shared = list((head.draft_lm_head or model.lm_head).parameters())
    return {"bytes": sum(p.numel() * p.element_size() for p in own) + depths * sum(
                p.numel() * p.element_size() for p in shared),
            "flops": 2 * rows * (tokens_per_row * sum(p.numel() for p in own if p.dim() >= 2)
                                 + depths * sum(p.numel() for p in shared if p.dim() >= 2))}
