"""From a checkpoint folder to a ready model: config, tensors, dtype policy, device."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import read_text_tensors
from .config import InklingConfig
from .model import InklingForCausalLM, keeps_fp32

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """None picks fp32 on CPU (bf16 matmuls are slow there) and bf16 elsewhere."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: choose one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"unsupported dtype {dtype}: only float32 and bfloat16")
    return dtype


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None
               ) -> tuple[InklingForCausalLM, str | None]:
    """Builds the model on the meta device and assigns each checkpoint tensor as it is read.

    Returns the model (eval mode, no grads) and the loader's skipped-tensor report.
    """
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    config = InklingConfig.from_file(Path(path))
    rows = config.logits_vocab_size

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "lm_head.weight" and t.shape[0] != rows:
            t = t[:rows]
        # Always a fresh, allocator-aligned tensor: safetensors hands out views into the mmap at
        # arbitrary alignment, and SIMD kernels round differently on differently aligned data.
        out = torch.empty(t.shape, dtype=torch.float32 if keeps_fp32(name) else dtype, device=device)
        return out.copy_(t)

    tensors, report = read_text_tensors(path, config, convert)
    with torch.device("meta"):
        model = InklingForCausalLM(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval(), report
