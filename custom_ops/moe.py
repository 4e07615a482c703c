"""Routed experts behind an op: the graph keeps static shapes, the kernel reads only chosen experts.

At batch B with top-k routing at most min(E, B*k) experts are touched; at batch 1 that is k of E
expert weight banks, which is what sets the decode floor of a bandwidth-bound step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import define, gpu_kernel
from .linear import dequantize


def moe_experts_reference(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor) -> torch.Tensor:
    """x [T, H]; expert_ids, weights [T, k]; gate_up [E, 2I, H] (rows [0, I) gate); down [E, H, I].

    out[t] = sum_j weights[t, j] * down_e(silu(gate_e x) * up_e x) with e = expert_ids[t, j]; a negative id
    is a choice this bank does not hold (another rank's expert, under expert parallelism): it adds nothing.
    """
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    w = weights.reshape(-1)
    out = torch.zeros_like(x)
    for e in flat[flat >= 0].unique().tolist():  # experts in order, each one's (token, choice) pairs in order
        pairs = (flat == e).nonzero()[:, 0]
        rows = pairs // k
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, rows, F.linear(F.silu(gate) * up, down[e]) * w[pairs, None])
    return out


moe_experts = define(
    "moe_experts(Tensor x, Tensor expert_ids, Tensor weights, Tensor gate_up, Tensor down) -> Tensor",
    fake=lambda x, expert_ids, weights, gate_up, down: torch.empty_like(x), reference=moe_experts_reference,
    cuda=gpu_kernel("moe", "moe_experts"))


def moe_experts_int8_reference(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                               gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                               down_scale: torch.Tensor) -> torch.Tensor:
    """`moe_experts` over int8 banks with one fp32 scale per row ([E, 2I] and [E, H]): each bank
    dequantized (linear.dequantize), then the fp32 recipe."""
    return moe_experts_reference(x, expert_ids, weights, dequantize(gate_up, gate_up_scale, x.dtype),
                                 dequantize(down, down_scale, x.dtype))


moe_experts_int8 = define(
    "moe_experts_int8(Tensor x, Tensor expert_ids, Tensor weights, Tensor gate_up, Tensor gate_up_scale, "
    "Tensor down, Tensor down_scale) -> Tensor",
    fake=lambda x, *rest: torch.empty_like(x), reference=moe_experts_int8_reference,
    cuda=gpu_kernel("moe", "moe_experts_int8"))
