"""Routed experts: align (token, choice) pairs into per-expert blocks on the device, then one grouped
kernel per projection that reads only the chosen experts' weights, in whatever layout the loader keeps
them (it stores wide-output matrices column-major).

Alignment is plain torch with shapes fixed by (tokens, top-k, experts): no host sync, capturable.
Every block holds BM pairs of one expert (the last block of an expert padded with a sentinel pair);
the number of blocks is the static upper bound cdiv(P, BM) + min(E, P) for P pairs, and the blocks
past the last expert's have expert -1 and read nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BM, BN, BK = 16, 64, 32
# The interpreter's bf16 tl.dot is wrong, so interpreted runs upcast the operands first; on a GPU
# bf16 operands go to the tensor cores as they are, and fp32 ones use exact ("ieee") products.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def align_pairs(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_of [blocks*BM] int64: the pair id in each block row, P for padding; block_expert [blocks]
    int32: the expert of each block, -1 past the last). Pair p is token p // k, choice p % k."""
    # A negative id (another rank's expert) goes to one more bin past the bank, whose blocks are skipped.
    flat = expert_ids.reshape(-1).long()
    flat = torch.where(flat < 0, num_experts, flat)
    P, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BM - 1) // BM * BM
    padded_end = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    sorted_expert = flat[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[sorted_expert]
    blocks = triton.cdiv(P, BM) + min(num_experts + 1, P)
    pair_of = torch.full((blocks * BM,), P, dtype=torch.int64, device=dev)
    pair_of.scatter_(0, (padded_end - padded)[sorted_expert] + rank, order)
    block_start = torch.arange(blocks, device=dev) * BM
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pair_of, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, pair_ptr, expert_ptr, act_ptr, P, k, H, I, sx, sw_e, sw_n, sw_k, sa,
                    UPCAST: tl.constexpr, QUANT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """act[block row, n] = silu(gate_e . x_token) * (up_e . x_token) for the block's pairs. QUANT: the
    bank is int8, widened in registers, and each output times its row's scale (s_ptr [E, 2I])."""
    blk, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(expert_ptr + blk)
    if e >= 0:
        r = (blk * BM + tl.arange(0, BM)).to(tl.int64)  # rows of the scratch: past 2**31 elements on long prefills
        pair = tl.load(pair_ptr + r)
        live = pair < P
        token = tl.where(live, pair // k, 0)
        n = nb * BN + tl.arange(0, BN)
        nm = n < I
        gate = tl.zeros([BM, BN], tl.float32)
        up = tl.zeros([BM, BN], tl.float32)
        w_e = w_ptr + e.to(tl.int64) * sw_e
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            xa = tl.load(x_ptr + token[:, None] * sx + kk[None, :], mask=live[:, None] & km[None, :], other=0.0)
            wg = tl.load(w_e + n[None, :] * sw_n + kk[:, None] * sw_k, mask=nm[None, :] & km[:, None], other=0.0)
            wu = tl.load(w_e + (n[None, :] + I) * sw_n + kk[:, None] * sw_k, mask=nm[None, :] & km[:, None],
                         other=0.0)
            if UPCAST:  # exact fp32 products ("ieee", not tf32)
                xa, wg, wu = xa.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
                gate += tl.dot(xa, wg, input_precision="ieee")
                up += tl.dot(xa, wu, input_precision="ieee")
            else:
                gate += tl.dot(xa, wg.to(xa.dtype))
                up += tl.dot(xa, wu.to(xa.dtype))
        if QUANT:
            s_e = s_ptr + e.to(tl.int64) * 2 * I
            gate *= tl.load(s_e + n, mask=nm, other=0.0)[None, :]
            up *= tl.load(s_e + I + n, mask=nm, other=0.0)[None, :]
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + r[:, None] * sa + n[None, :], act.to(act_ptr.dtype.element_ty), mask=nm[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, pair_ptr, expert_ptr, weight_ptr, out_ptr, P, H, I, sa, sw_e, sw_n, sw_k,
                 so, UPCAST: tl.constexpr, QUANT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    """out[pair, n] = weight[pair] * (down_e . act[block row]) for the block's live pairs (QUANT: as
    above, scales s_ptr [E, H])."""
    blk, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(expert_ptr + blk)
    if e >= 0:
        r = (blk * BM + tl.arange(0, BM)).to(tl.int64)
        pair = tl.load(pair_ptr + r)
        live = pair < P
        n = nb * BN + tl.arange(0, BN)
        nm = n < H
        acc = tl.zeros([BM, BN], tl.float32)
        w_e = w_ptr + e.to(tl.int64) * sw_e
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < I
            a = tl.load(act_ptr + r[:, None] * sa + kk[None, :], mask=live[:, None] & km[None, :], other=0.0)
            w = tl.load(w_e + n[None, :] * sw_n + kk[:, None] * sw_k, mask=nm[None, :] & km[:, None], other=0.0)
            if UPCAST:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w.to(a.dtype))
        if QUANT:
            acc *= tl.load(s_ptr + e.to(tl.int64) * H + n, mask=nm, other=0.0)[None, :]
        route_w = tl.load(weight_ptr + pair, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + pair[:, None] * so + n[None, :], acc * route_w[:, None], mask=live[:, None] & nm[None, :])


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """Signature and result of `moe.moe_experts_reference`."""
    return _experts(x, expert_ids, weights, gate_up, None, down, None)


def moe_experts_int8(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                     gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor) -> torch.Tensor:
    """Signature and result of `moe.moe_experts_int8_reference`."""
    return _experts(x, expert_ids, weights, gate_up, gate_up_scale, down, down_scale)


def _experts(x, expert_ids, weights, gate_up, gate_up_scale, down, down_scale):
    (T, H), k, (E, I2, _) = x.shape, expert_ids.shape[1], gate_up.shape
    I, P = I2 // 2, T * k
    if P == 0:
        return torch.zeros_like(x)
    assert x.stride(1) == 1, "tokens must be contiguous rows"
    pair_of, block_expert = align_pairs(expert_ids, E)
    blocks = block_expert.shape[0]
    upcast = _INTERPRETED or x.dtype == torch.float32
    act = torch.empty(blocks * BM, I, dtype=x.dtype, device=x.device)
    quant = gate_up_scale is not None  # without scales the weight stands in for the unused pointer
    _gate_up_kernel[(blocks, triton.cdiv(I, BN))](
        x, gate_up, gate_up_scale if quant else gate_up, pair_of, block_expert, act, P, k, H, I, x.stride(0),
        *gate_up.stride(), act.stride(0), UPCAST=upcast, QUANT=quant, BM=BM, BN=BN, BK=BK)
    per_pair = torch.zeros(P, H, dtype=torch.float32, device=x.device)  # skipped pairs add zeros
    _down_kernel[(blocks, triton.cdiv(H, BN))](
        act, down, down_scale if quant else down, pair_of, block_expert, weights.reshape(-1), per_pair, P, H, I,
        act.stride(0), *down.stride(), per_pair.stride(0), UPCAST=upcast, QUANT=quant, BM=BM, BN=BN, BK=BK)
    return per_pair.view(T, k, H).sum(dim=1).to(x.dtype)
