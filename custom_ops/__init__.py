"""Ops of the `inkling` torch.library namespace (installed as `inkling_compiled.custom_ops`).

Every write into the conv-state pool or the KV cache goes through one of these ops, each declaring
the slice it mutates. Each op has a fake kernel, a plain-torch reference, a CPU kernel (C++, `csrc/`)
and a capturable CUDA kernel (Triton, `gpu/`), registered per dispatch key (`library.KERNELS`); `reference.py` holds
the conv math the kernels are tested against.
"""

from . import attention, barrier, checkpoint, kv, linear, moe, sampling, sconv  # noqa: F401  (defines the ops)
from .attention import cached_extend_attention, paged_attention, ring_attention
from .barrier import wait_layer
from .checkpoint import ring_checkpoint, sconv_checkpoint
from .kv import kv_write
from .linear import dequantize, linear, linear_int8
from .library import KERNELS, native_kernels, register_cpu_kernels
from .moe import moe_experts, moe_experts_int8
from .sampling import top_k_top_p
from .sconv import commit_conv_windows, sconv_decode, sconv_extend, sconv_verify

register_cpu_kernels()

__all__ = ["KERNELS", "sconv_decode", "sconv_extend", "sconv_verify", "commit_conv_windows", "kv_write", "paged_attention", "ring_attention", "moe_experts",
           "wait_layer", "top_k_top_p", "linear", "linear_int8", "moe_experts_int8", "dequantize", "native_kernels",
           "sconv_checkpoint", "ring_checkpoint", "cached_extend_attention"]
