"""Ops of the `inkling` torch.library namespace (installed as `inkling_compiled.custom_ops`).

Every write into the conv-state pool or the KV cache goes through one of these ops, each declaring
the slice it mutates, with a fake kernel for tracing, a plain-torch reference kernel and, on CPU, a
C++ kernel (`csrc/`); `reference.py` holds the conv math the kernels are tested against.
"""

from . import attention, barrier, kv, linear, moe, sampling, sconv  # noqa: F401  (defines the ops)
from .attention import paged_attention
from .barrier import wait_layer
from .kv import kv_write
from .linear import linear
from .library import native_kernels
from .moe import moe_experts
from .sampling import top_k_top_p
from .sconv import sconv_decode, sconv_extend

native_kernels()

__all__ = ["sconv_decode", "sconv_extend", "kv_write", "paged_attention", "moe_experts", "wait_layer", "top_k_top_p", "linear",
           "native_kernels"]
