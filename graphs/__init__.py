"""Step capture per batch bucket, and what a captured step contains (installed as
`inkling_compiled.graphs`)."""

from .capture import BACKENDS, DEFAULT_BUCKETS, Buckets, CompiledStep, InputsKeys, choose_buckets
from .census import GraphRecorder, census

__all__ = ["CompiledStep", "InputsKeys", "Buckets", "choose_buckets", "BACKENDS", "DEFAULT_BUCKETS", "GraphRecorder",
           "census"]
