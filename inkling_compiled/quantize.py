"""Weight-only int8: which tensors are quantized, the rounding rule, and quantized checkpoints.

Every projection, routed and shared expert bank and the lm_head is stored as int8 values q with one
fp32 scale per output row (symmetric): scale = max |w| / 127 over the row, q = round(w / scale) with
ties to even, so that w ~ q * scale and the row's largest magnitude lands on +-127. Norms, conv taps,
the router, embeddings and biases load as they would without int8 (the engine's dtype). An all-zero row (a padded vocabulary
row) gets scale 1: its q is zero whatever the scale, and a zero scale is what a broken checkpoint has.

A quantized checkpoint (`inkling-compiled quantize IN OUT`, `checkpoint.write_quantized`) stores each
such tensor as int8 under its own name plus an fp32 `<name>_scale` ([..., rows]), and says so in
config.json's `quantization_config` ({"quant_method": "inkling-int8", ...}); `loading.load_model`
recognises it without being asked.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import CheckpointError, OptionError

METHOD = "inkling-int8"
SCALE_SUFFIX = "_scale"
SCHEME = {"quant_method": METHOD, "bits": 8, "symmetric": True, "granularity": "per output row",
          "rounding": "half to even", "scale_suffix": SCALE_SUFFIX,
          "quantized": "projections, routed and shared experts, lm_head (the weights x @ W^T reads)"}
CHOICES = ("none", "int8")


def is_matmul_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor is a matmul weight `[..., out, in]` (used as x @ W^T): what int8 quantizes, and
    what the loader may store transposed."""
    if name.endswith(SCALE_SUFFIX):
        return False
    is_matmul = name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")) or name == "lm_head.weight"
    return (is_matmul or ".shared_experts." in name) and len(shape) >= 2


def is_weight_scale(name: str) -> bool:
    """Whether a tensor is an int8 weight's scales (`<matmul weight>_scale`; not `mlp.global_scale`)."""
    return name.endswith(SCALE_SUFFIX) and is_matmul_weight(name[:-len(SCALE_SUFFIX)], (1, 1))


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scale fp32 [..., rows]) of a weight [..., rows, in], by the rule above."""
    w32 = w.to(torch.float32, copy=True)  # the one wider copy: divided, rounded and clamped in place
    scale = w32.abs().amax(dim=-1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = w32.div_(scale.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def resolve(quantization: str | None) -> str | None:
    """None (what the checkpoint is), 'none' or 'int8'; anything else is an OptionError."""
    if quantization is None or quantization in CHOICES:
        return quantization
    raise OptionError(f"unsupported quantization {quantization!r}: choose one of {', '.join(CHOICES)}")


def checkpoint_scheme(path: str | Path) -> str | None:
    """'int8' if the checkpoint's config.json says its weights are quantized by this scheme, None if it
    has no `quantization_config`; a CheckpointError for any other scheme."""
    config = Path(path) / "config.json"
    try:
        block = json.loads(config.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None  # the config's own reader reports what is wrong with it
    if block is None:
        return None
    if not isinstance(block, dict) or block.get("quant_method") != METHOD:
        method = block.get("quant_method") if isinstance(block, dict) else block
        raise CheckpointError(f"{config}: quantization_config names {method!r}, which this engine does not read "
                              f"(it reads {METHOD!r} checkpoints, written by `inkling-compiled quantize`)")
    differ = [f"{k}={block[k]!r}" for k in ("bits", "symmetric", "scale_suffix") if k in block and block[k] != SCHEME[k]]
    if differ:
        raise CheckpointError(f"{config}: an {METHOD!r} quantization_config with {', '.join(differ)}: this engine "
                              f"reads bits=8, symmetric=True, scale_suffix={SCALE_SUFFIX!r} only")
    return "int8"
