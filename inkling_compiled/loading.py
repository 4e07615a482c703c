"""From a checkpoint folder to a ready model: config, tensors, dtype policy, device."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import read_text_tensors
from .config import InklingConfig
from .errors import CheckpointError, OptionError
from .model import CONV_WEIGHT, FUSED_PROJECTIONS, InklingForCausalLM, keeps_fp32
from .parallel.group import TensorParallel
from .quantize import SCALE_SUFFIX, checkpoint_scheme, is_matmul_weight, is_weight_scale, quantize_rows, resolve

# The checkpoint tensors the model holds stacked (FUSED_PROJECTIONS), as name suffixes.
_FUSED_PARTS = tuple("." + part for _, parts in FUSED_PROJECTIONS.values() for part in parts)
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


def column_major(name: str, shape: tuple[int, ...], choices=None, by_shape: bool = True) -> bool:
    """Whether a matmul weight is stored transposed (W^T contiguous). Only the memory layout changes:
    names, shapes and values stay those of the checkpoint.

    On CPU with the C++ kernels, `choices` (kernel_choice.KernelChoices) says, from a measurement on
    this machine. Elsewhere by shape (`by_shape`): a GEMV with a wide output streams faster with W^T
    contiguous; without it, as stored.
    """
    if not is_matmul_weight(name, shape):
        return False
    if choices is not None:
        return choices.choice(shape[-2], shape[-1]).column_major
    return by_shape and shape[-2] > shape[-1]


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
               check_finite: bool = True, mtp_depths: int = 0, tensor_parallel: tuple[int, int, str] | None = None,
               quantization: str | None = None) -> tuple[InklingForCausalLM, str | None]:
    """Builds the model on the meta device and assigns each checkpoint tensor as it is read.

    With check_finite (the default) every tensor is checked once, as loaded, for NaN and inf: a
    checkpoint with any is refused with the names of those tensors. Returns the model (eval mode, no
    grads) and the loader's skipped-tensor report. mtp_depths > 0 also loads that many depths of the
    checkpoint's MTP head (an OptionError if it has fewer). `tensor_parallel` = (rank, world, group name)
    loads that rank's shard only (`parallel.TensorParallel`): no tensor is read past the rank's slices.

    quantization='int8' quantizes every matmul weight as it is read (`quantize.py`; under tensor
    parallelism each rank its own slices, so a row's scale is over the rank's part of it); an int8
    checkpoint loads as int8 with quantization None or 'int8', and is refused with 'none'. Either way
    no more than one tensor is ever held in a wider dtype.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    wanted = resolve(quantization)
    config = InklingConfig.from_file(Path(path))
    stored = checkpoint_scheme(path) == "int8"
    if stored and wanted == "none":
        raise OptionError(f"{Path(path)} is an int8 checkpoint: quantization='none' cannot give back its "
                          "unquantized weights (load it with quantization None or 'int8')")
    int8 = stored or wanted == "int8"
    if mtp_depths > (config.num_mtp_layers or 0):
        raise OptionError(f"{mtp_depths} MTP depth(s) asked for, but the checkpoint's config has "
                          f"{config.num_mtp_layers or 0} (num_mtp_layers / mtp_config.num_nextn_predict_layers)")
    rows = config.logits_vocab_size
    tp = TensorParallel(config, *tensor_parallel) if tensor_parallel is not None else None

    choices = None
    if device.type == "cpu" and dtype == torch.float32 and not int8:  # int8 weights stay as stored, [O, H]
        from .kernel_choice import for_this_machine

        choices = for_this_machine()
    # bf16 on CPU keeps every weight as stored, as transformers does: no C++ kernel multiplies bf16, and
    # ATen's bf16 GEMM rounds by the weight's layout on some CPUs (a transposed W moved tiny's logits by
    # 0.086 on an AVX2 EPYC, where [O, H] equals transformers bit for bit).
    by_shape = device.type != "cpu" or dtype == torch.float32

    scales: dict[str, torch.Tensor] = {}  # made by quantizing as the load goes
    bad_int8: list[str] = []

    def convert_int8(name: str, t: torch.Tensor) -> torch.Tensor:
        if is_weight_scale(name):
            out = torch.empty(t.shape, dtype=torch.float32, device=device).copy_(t)
            if not bool(((out > 0) & torch.isfinite(out)).all()):
                bad_int8.append(f"{name} (scales must be positive and finite)")
            return out
        if stored:
            if t.dtype != torch.int8:
                bad_int8.append(f"{name} (stored as {str(t.dtype).removeprefix('torch.')}, not int8)")
            return torch.empty(t.shape, dtype=torch.int8, device=device).copy_(t)
        q, scale = quantize_rows(t)
        if not bool(torch.isfinite(scale).all()):
            bad_int8.append(f"{name} (non-finite values, NaN or inf: nothing to quantize)")
        scales[name + SCALE_SUFFIX] = scale.to(device)
        return q.to(device)

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        if name.removesuffix(SCALE_SUFFIX) == "lm_head.weight" and t.shape[0] != rows:
            t = t[:rows]
        if int8 and (is_weight_scale(name) or is_matmul_weight(name, t.shape)):
            return convert_int8(name, t)
        if not t.is_floating_point() and is_matmul_weight(name, t.shape):
            bad_int8.append(f"{name} (stored as {str(t.dtype).removeprefix('torch.')}, but config.json has no "
                            "quantization_config: an int8 checkpoint is written by `inkling-compiled quantize`)")
        # Always a fresh, allocator-aligned tensor: safetensors hands out views into the mmap at
        # arbitrary alignment, and SIMD kernels round differently on differently aligned data.
        out_dtype = torch.float32 if keeps_fp32(name) else dtype
        # (a part of a stacked projection is laid out once stacked: `stored_fused`)
        if not name.endswith(_FUSED_PARTS) and column_major(name, t.shape, choices, by_shape):
            return transposed_copy(t, out_dtype)
        if device.type == "cpu" and name.endswith(CONV_WEIGHT) and t.dim() == 3:
            # [D, 1, K] held by position: the C++ conv kernels read each tap of every channel together where
            # it lies, rather than gathering them at every call
            return copy_in_memory_order(t, out_dtype, (2, 1, 0))
        return torch.empty(t.shape, dtype=out_dtype, device=device).copy_(t)

    def copy_in_memory_order(t: torch.Tensor, out_dtype: torch.dtype, order: tuple[int, ...]) -> torch.Tensor:
        """A fresh copy of t, same shape and values, whose memory runs over its dimensions in `order`
        (outermost first)."""
        fresh = torch.empty([t.shape[d] for d in order], dtype=out_dtype, device=device)
        fresh.copy_(t.permute(order))
        return fresh.permute([order.index(d) for d in range(t.dim())])

    def transposed_copy(t: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:  # (W^T contiguous)
        return copy_in_memory_order(t, out_dtype, (*range(t.dim() - 2), t.dim() - 1, t.dim() - 2))

    def stored_fused(name: str, t: torch.Tensor) -> torch.Tensor:
        if t.dtype != torch.int8 and column_major(name, t.shape, choices, by_shape):
            return transposed_copy(t, t.dtype)
        return t  # (torch.cat's own allocation: fresh and aligned)

    non_finite: list[str] = []

    def convert_checked(name: str, t: torch.Tensor) -> torch.Tensor:
        out = convert(name, t)
        # (int8 scales are checked whatever check_finite says: one that is not finite cannot be used)
        if check_finite and not is_weight_scale(name) and not bool(torch.isfinite(out).all()):
            non_finite.append(name)
        return out

    try:
        tensors, report = read_text_tensors(path, config, convert_checked, mtp_depths,
                                            tp.take if tp is not None else None, int8=stored)
        tensors.update(scales)
        fuse_projections(tensors, stored_fused)  # (a stacked shape is timed here: before the buffer goes)
        if choices is not None and any(config.is_sparse(i) for i in range(config.num_hidden_layers)):
            choices.experts(config.moe_intermediate_size, config.hidden_size)  # one kernel per expert's rows
    finally:
        if choices is not None:
            choices.release_stream()  # the timing buffer, however the load ended
    if non_finite:
        shown = ", ".join(non_finite[:8]) + (f" and {len(non_finite) - 8} more" if len(non_finite) > 8 else "")
        raise CheckpointError(f"{Path(path)}: non-finite values (NaN or inf) in {shown}; "
                              "load with check_finite=False to accept them")
    if bad_int8:
        raise CheckpointError(f"{Path(path)}: bad int8 tensors: {', '.join(bad_int8[:8])}"
                              + (f" and {len(bad_int8) - 8} more" if len(bad_int8) > 8 else ""))
    with torch.device("meta"):
        model = InklingForCausalLM(config, mtp_depths, tp)
        if int8:
            model.add_int8_scales()
    model.requires_grad_(False)  # before assigning: an int8 tensor cannot be a parameter that wants grads
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval(), report


def fuse_projections(tensors: dict[str, torch.Tensor], store) -> None:
    """Replaces each group of parts in `tensors` (and their scales, stacked the same way) by the one
    weight the model holds; `store(name, stacked)` gives it its memory layout. One group's parts are
    held twice for a moment, never the whole model's."""
    for fused, (dim, parts) in FUSED_PROJECTIONS.items():
        for prefix in [n[:-len(parts[0])] for n in tensors if n.endswith("." + parts[0])]:
            stacked = torch.cat([tensors.pop(prefix + part) for part in parts], dim=dim)
            tensors[prefix + fused] = store(prefix + fused, stacked)
            if prefix + parts[0] + SCALE_SUFFIX in tensors:
                scales = [tensors.pop(prefix + part + SCALE_SUFFIX) for part in parts]
                tensors[prefix + fused + SCALE_SUFFIX] = torch.cat(scales, dim=dim)
