"""From a checkpoint folder to a ready model: config, tensors, dtype policy, device."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import read_text_tensors
from .config import InklingConfig
from .errors import CheckpointError, OptionError
from .model import InklingForCausalLM, keeps_fp32
from .parallel.group import TensorParallel

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """None picks fp32 on CPU (bf16 matmuls are slow there) and bf16 elsewhere."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise OptionError(f"unsupported dtype {dtype!r}: choose one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16):
        raise OptionError(f"unsupported dtype {dtype}: only float32 and bfloat16")
    return dtype


def resolve_device(device: str | torch.device) -> torch.device:
    """A device torch can use here, or an OptionError that says why not."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise OptionError(f"unknown device {device!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"device {str(device)!r} asked for, but this torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise OptionError(f"device {str(device)!r} is not supported: cpu or cuda")
    return device


def is_matmul_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor is a matmul weight `[..., out, in]` (used as x @ W^T) the engine may store transposed."""
    is_matmul = name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")) or name == "lm_head.weight"
    return (is_matmul or ".shared_experts." in name) and len(shape) >= 2


def column_major(name: str, shape: tuple[int, ...], choices=None) -> bool:
    """Whether a matmul weight is stored transposed (W^T contiguous). Only the memory layout changes:
    names, shapes and values stay those of the checkpoint.

    On CPU with the C++ kernels, `choices` (kernel_choice.KernelChoices) says, from a measurement on
    this machine. Elsewhere by shape: a GEMV with a wide output streams faster with W^T contiguous.
    """
    if not is_matmul_weight(name, shape):
        return False
    if choices is not None:
        return choices.choice(shape[-2], shape[-1]).column_major
    return shape[-2] > shape[-1]


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
               check_finite: bool = True, mtp_depths: int = 0, tensor_parallel: tuple[int, int, str] | None = None
               ) -> tuple[InklingForCausalLM, str | None]:
    """Builds the model on the meta device and assigns each checkpoint tensor as it is read.

    With check_finite (the default) every tensor is checked once, as loaded, for NaN and inf: a
    checkpoint with any is refused with the names of those tensors. Returns the model (eval mode, no
    grads) and the loader's skipped-tensor report. mtp_depths > 0 also loads that many depths of the
    checkpoint's MTP head (an OptionError if it has fewer). `tensor_parallel` = (rank, world, group name)
    loads that rank's shard only (`parallel.TensorParallel`): no tensor is read past the rank's slices.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    config = InklingConfig.from_file(Path(path))
    if mtp_depths > (config.num_mtp_layers or 0):
        raise OptionError(f"{mtp_depths} MTP depth(s) asked for, but the checkpoint's config has "
                          f"{config.num_mtp_layers or 0} (num_mtp_layers / mtp_config.num_nextn_predict_layers)")
    rows = config.logits_vocab_size
    tp = TensorParallel(config, *tensor_parallel) if tensor_parallel is not None else None

    choices = None
    if device.type == "cpu" and dtype == torch.float32:
        from .kernel_choice import for_this_machine

        choices = for_this_machine()

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "lm_head.weight" and t.shape[0] != rows:
            t = t[:rows]
        # Always a fresh, allocator-aligned tensor: safetensors hands out views into the mmap at
        # arbitrary alignment, and SIMD kernels round differently on differently aligned data.
        out_dtype = torch.float32 if keeps_fp32(name) else dtype
        if column_major(name, t.shape, choices):
            fresh = torch.empty(t.shape[:-2] + (t.shape[-1], t.shape[-2]), dtype=out_dtype, device=device)
            return fresh.copy_(t.transpose(-1, -2)).transpose(-1, -2)
        return torch.empty(t.shape, dtype=out_dtype, device=device).copy_(t)

    non_finite: list[str] = []

    def convert_checked(name: str, t: torch.Tensor) -> torch.Tensor:
        out = convert(name, t)
        if check_finite and not bool(torch.isfinite(out).all()):
            non_finite.append(name)
        return out

    try:
        tensors, report = read_text_tensors(path, config, convert_checked, mtp_depths,
                                            tp.take if tp is not None else None)
    finally:
        if choices is not None:
            choices.release_stream()  # the timing buffer, however the load ended
    if non_finite:
        shown = ", ".join(non_finite[:8]) + (f" and {len(non_finite) - 8} more" if len(non_finite) > 8 else "")
        raise CheckpointError(f"{Path(path)}: non-finite values (NaN or inf) in {shown}; "
                              "load with check_finite=False to accept them")
    with torch.device("meta"):
        model = InklingForCausalLM(config, mtp_depths, tp)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval(), report
