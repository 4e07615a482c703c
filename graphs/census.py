"""What a compiled step contains: a recording Dynamo backend and an op census of FX graphs.

The census counts every call in a graph by op name and labels each `inkling::` custom-op call with the
layer and conv stream it belongs to (read from the node's module stack), so a test or a dump can say
"layer 2, stream v: one sconv_decode" rather than "16 calls somewhere".
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable

import torch

from inkling_compiled.streams import SCONV_MODULES, STREAM_NAMES

SCONV_OPS = ("sconv_decode", "sconv_extend", "sconv_verify")
_LAYER = re.compile(r"layers[\[.](\d+)")
_STREAM_OF_MODULE = dict(zip(SCONV_MODULES, STREAM_NAMES))


def op_name(target) -> str | None:
    """'inkling::sconv_decode', 'aten::mm', ... for an FX call target; None for Python builtins."""
    if isinstance(target, torch._ops.OpOverload):
        return target.name().split(".")[0]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop::{target.name()}"
    return None


def _where(node: torch.fx.Node) -> tuple[int | None, str | None]:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]
    layer = stream = None
    for path in paths:  # outermost first: the last match is the innermost module
        if m := _LAYER.search(path):
            layer = int(m.group(1))
        stream = _STREAM_OF_MODULE.get(path.rsplit(".", 1)[-1], stream)
    return layer, stream


def census(gm: torch.fx.GraphModule) -> dict:
    """{'ops': {name: count}, 'custom_calls': [{'op', 'layer', 'stream'}, ...], 'sconv_calls': n}."""
    ops: Counter[str] = Counter()
    calls = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = op_name(node.target) if node.op == "call_function" else f"method::{node.target}"
        if name is None:
            name = f"python::{getattr(node.target, '__name__', str(node.target))}"
        ops[name] += 1
        if name.startswith("inkling::"):
            layer, stream = _where(node)
            calls.append({"op": name, "layer": layer, "stream": stream})
    sconv = sum(1 for c in calls if c["op"].split("::")[1] in SCONV_OPS)
    return {"ops": dict(sorted(ops.items())), "custom_calls": calls, "sconv_calls": sconv}


class GraphRecorder:
    """A Dynamo backend that keeps every FX graph it is handed, then compiles it with `inner`.

    With track_addresses, each call of graph i also records the data_ptr of every tensor input
    (`addresses[i]`, one list per call; None for a size) and its sizes (`sizes[i]`, the symbolic batch
    of each call): a graph serving several buckets must keep each bucket's inputs in place, which is
    what "static input" has to mean for CUDA graphs (they record one graph per bucket).
    """

    def __init__(self, inner: str | Callable = "eager", track_addresses: bool = False):
        self.inner = inner
        self.track_addresses = track_addresses
        self.graphs: list[torch.fx.GraphModule] = []
        self.addresses: list[list[list[int | None]]] = []
        self.sizes: list[list[tuple[int, ...]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        inner = self.inner
        if isinstance(inner, str):
            from torch._dynamo.backends.registry import lookup_backend

            inner = lookup_backend(inner)
        compiled = inner(gm, example_inputs)
        if not self.track_addresses:
            return compiled
        calls: list[list[int | None]] = []
        sizes: list[tuple[int, ...]] = []
        self.addresses.append(calls)
        self.sizes.append(sizes)

        def run(*args):
            calls.append([a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args])
            sizes.append(tuple(a for a in args if isinstance(a, int)))
            return compiled(*args)

        return run
