"""Ops of the `inkling` torch.library namespace (installed as `inkling_compiled.custom_ops`).

Every write into the conv-state pool or the KV cache goes through one of these ops, each declaring
the slice it mutates, with a fake kernel for tracing and a CPU kernel; `reference.py` holds the
plain-torch conv math the kernels are tested against.
"""

from . import attention, barrier, kv, moe, sconv  # noqa: F401  (registers the ops)
from .attention import paged_attention
from .barrier import wait_layer
from .kv import kv_write
from .moe import moe_experts
from .sconv import sconv_decode, sconv_extend

__all__ = ["sconv_decode", "sconv_extend", "kv_write", "paged_attention", "moe_experts", "wait_layer"]
