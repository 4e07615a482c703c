"""A warm start past Dynamo: the compiled step saved whole, so that a new process skips tracing.

Inductor's cache already spares a new process the C++ build, but Dynamo still traces the step anew
(about 2.5 s of an 8 s warm start on `small`). Here the first compile goes through torch's AOT entry
point instead (`OptimizedModule._aot_compile`: Dynamo's graph, its guards and inductor's code, made
serialisable), and the result is written to `<compile cache>/dynamo/<key>.bin`; a later process whose
key is the same loads it and runs without tracing anything (`PackagedForward`: the guards, checked once
a call, then Dynamo's code that gathers the inputs and calls inductor's; or, for inputs the caller says are
the same as at an earlier call, inductor's code on the arguments bound then). The key is the caller's (model, weight
layout, dtype, pool layout, pinned torch state, sources) plus what this layer knows (torch, Python, the
C++ wrapper, inductor's instruction set, thread count and configuration), so a changed model, machine,
torch or option finds no file. Nothing else goes in it: the graph is the same for every pool size and
batch range (both symbolic), and a packaged step does not guard on which engine it belongs to.
Parameters and pool tensors are inputs, read from the live step at every call: nothing of the weights
is stored.

The API is experimental in torch 2.13; three of its gaps are handled here. Guards are rebuilt at load
from tensors that lost Dynamo's dimension marks, so the step's metadata must carry no marks once a
package is loaded (its slices need them only to be traced: the caller stops marking). Guards record
the dispatch keys of the mode they were built in, so loading runs under inference mode, as every call
does. And torch's loader gives the rebuilt code no globals (`_deserialize` below). Anything that goes
wrong, a package that refuses its first inputs included, is logged and the step is traced instead.
"""

from __future__ import annotations

import dis
import hashlib
import logging
import os
import pickle
import sys
import threading
import types
from pathlib import Path

import torch

log = logging.getLogger("inkling_compiled")

FORMAT = 1  # bump when what is saved, or how, changes


def supported() -> bool:
    """Whether this torch can save and load a compiled module (2.13 on; a GPU machine's older torch not)."""
    module = torch._dynamo.eval_frame.OptimizedModule
    return (hasattr(module, "_aot_compile") and hasattr(module, "_load_aot_compiled_module")
            and bool(getattr(torch._dynamo.config, "enable_aot_compile", False))
            and not torch._inductor.config.force_disable_caches)


def machine_key() -> tuple:
    """What inductor's generated code depends on beyond the graph: the instruction set it picks (which
    ATEN_CPU_CAPABILITY can lower), the thread count it is built for, and its own configuration."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    config = torch._inductor.config.save_config_portable()
    return (str(pick_vec_isa()), torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(),
            sorted((k, repr(v)) for k, v in config.items()))


def package_path(cache_dir: Path, *parts: object) -> Path:
    """`<cache_dir>/dynamo/<hash of parts>.bin`, the parts joined with this layer's own."""
    key = repr((FORMAT, torch.__version__, sys.version, machine_key(), *parts))
    return Path(cache_dir) / "dynamo" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.bin"


def source_hash(*modules) -> str:
    """A hash of every .py file beside the given modules (what Dynamo traces is our code)."""
    digest = hashlib.sha256()
    for module in modules:
        root = Path(module.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def load(compiled, path: Path) -> bool:
    """Makes `compiled` run the package at `path`; False (logged if the file was there) otherwise."""
    if not path.is_file():
        return False
    try:
        with torch.inference_mode():
            _deserialize(compiled, path.read_bytes())
        return True
    except Exception as e:  # a stale or damaged file: compile as usual
        log.warning("could not load the compiled step from %s (%s: %s); compiling it", path, type(e).__name__, e)
        return False


def _deserialize(compiled, data: bytes) -> None:
    """`compiled._load_aot_compiled_module(data)`, with the traced method's module as the globals its code
    may name (torch's own loader passes none, and then fails on code that names `torch`)."""
    from torch._dynamo import convert_frame
    from torch._dynamo.aot_compile import AOTCompiledFunction
    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext, compile_context

    model = compiled._orig_mod
    f_globals = type(model).forward.__globals__
    functions = []
    for blob in pickle.loads(data):
        with compile_context(CompileContext(convert_frame.get_compile_id({}))), get_metrics_context():
            functions.append(AOTCompiledFunction.deserialize(blob, f_globals))
    compiled.forward = PackagedForward(model, functions)


class PackagedForward:
    """What a packaged step's forward runs: the first compiled function whose guards pass, its guards
    checked once. torch's own `AOTCompiledModel` checks them twice a call (once to choose the function,
    once more inside it), and a step's guards run cold, after the kernels have swept the caches: some
    45 us a check on `small`. A refusal raises what torch's does (`is_guard_failure`).

    A caller whose step reads the same tensors at every call of a kind (a decode bucket's kept metadata
    slices, the fixed weights and pool) passes an object that stands for them, `inputs`. The first call
    with it runs the guards and Dynamo's code as usual and keeps the arguments that code handed
    inductor's; a later call with the same object calls inductor's code on them directly, past the
    guards and the gathering of a few hundred tensors from the module (about 170 us a step on `small`,
    run cold) and, where the recorded call shows it may, past AOTAutograd's wrapper too (`GraphCall`;
    `FrameCall` calls the wrapper). A different object, or none, takes the guarded path. The object is a promise:
    while it is the same, so is everything the guards check (the engine's keys are the slices a kind of
    step keeps per batch size, or an extend step per shape, and what its guards watch, the metadata's kind
    and draft count, is fixed per kind). A frame found unfit to bind is run the usual way from then on,
    without a second look."""

    BOUND_LIMIT = 64  # bound calls kept (one per batch bucket and step kind, one per extend shape kept)

    def __init__(self, model, functions: list):
        self.model, self.functions = model, functions
        # The frame's locals as the guards see them: the module alone, the same object at every call.
        self._checks = [(f._artifacts.guard_manager, f.prepare_f_locals(model), f.fn) for f in functions]
        self._bound: dict[int, FrameCall | GraphCall] = {}
        self._unbindable: set = set()  # frames (`fn`) that do more than call their graph and return

    def __call__(self, inputs: object | None = None):
        if inputs is not None:
            bound = self._bound.get(id(inputs))
            if bound is not None and bound.inputs is inputs:
                return bound()
        for guards, f_locals, fn in self._checks:
            if guards.check(f_locals):
                return fn(self.model) if inputs is None or fn in self._unbindable else self._bind(inputs, fn)
        guards, f_locals, _ = self._checks[0]
        raise RuntimeError(f"GuardManager check failed, reason: {guards.check_verbose(f_locals)}")

    def _bind(self, inputs: object, fn):
        """Runs `fn` with its call into inductor's code recorded, and keeps that call for `inputs` when
        the frame does nothing else with its result than hand back its leading outputs."""
        names = [n for n in fn.__code__.co_names if n.startswith("__compiled_fn")]
        if len(names) != 1 or not _only_returns_graph_outputs(fn.__code__):
            self._unbindable.add(fn)
            return fn(self.model)  # more than one graph, or work after it (side effects): nothing to bind
        compiled_fn, calls = fn.__globals__[names[0]], []

        def record(*args):
            versions, grad = _versions(args), torch.is_grad_enabled()
            with _GraphCallRecorder() as graph_calls:
                outputs = compiled_fn(*args)
            calls.append((args, outputs, graph_calls, versions, torch.is_grad_enabled() != grad))
            return outputs

        recording = types.FunctionType(fn.__code__, {**fn.__globals__, names[0]: record}, fn.__name__,
                                       fn.__defaults__, fn.__closure__)
        result = recording(self.model)
        # the frame's result must be the graph's outputs, or their leading part, in order
        if len(calls) == 1 and isinstance(result, tuple) and len(result) <= len(calls[0][1]) \
                and all(r is o for r, o in zip(result, calls[0][1])):
            args, outputs, graph_calls, versions, grad_changed = calls[0]
            if len(self._bound) >= self.BOUND_LIMIT:
                self._bound.clear()
            graph_call = None if grad_changed else GraphCall.bind(inputs, graph_calls, args, outputs, len(result), versions)
            self._bound[id(inputs)] = graph_call or FrameCall(inputs, compiled_fn, args, len(result))
        else:
            self._unbindable.add(fn)
        return result

    def serialize(self) -> bytes:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        return pickle.dumps([AOTCompiledFunction.serialize(f).serialized_data for f in self.functions])


# What Dynamo's code may do after the graph's call for a bound call to stand in for it: pick outputs
# and return them. Anything else (an attribute or global set from the outputs, a call) is work a bound
# call would skip.
_RETURNING_OPS = frozenset({"STORE_FAST", "DELETE_FAST", "LOAD_FAST", "LOAD_CONST", "BINARY_SUBSCR", "BUILD_TUPLE",
                            "BUILD_LIST", "LIST_EXTEND", "SWAP", "COPY", "POP_TOP", "NOP", "CACHE",
                            "EXTENDED_ARG", "RETURN_VALUE", "RETURN_CONST", "LOAD_SMALL_INT"})


def _only_returns_graph_outputs(code: types.CodeType) -> bool:
    """Whether the frame's code, from the graph's outputs on (`graph_out_*`), only picks and returns them
    (a subscript is `BINARY_SUBSCR` up to Python 3.13, a `BINARY_OP` of `[]` from 3.14)."""
    instructions = list(dis.get_instructions(code))
    start = next((i for i, ins in enumerate(instructions)
                  if ins.opname == "STORE_FAST" and str(ins.argval).startswith("graph_out")), None)
    return start is not None and all(ins.opname in _RETURNING_OPS or (ins.opname == "BINARY_OP" and ins.argrepr == "[]")
                                     for ins in instructions[start:])


class FrameCall:
    """Dynamo's call into AOTAutograd's wrapper, with the arguments Dynamo's code gathered for it once
    (tensors and sizes), and how many of its outputs the frame hands back. `inputs` is kept, so that its
    id names no other object."""

    __slots__ = ("inputs", "compiled_fn", "args", "outputs")

    def __init__(self, inputs: object, compiled_fn, args: tuple, outputs: int):
        self.inputs, self.compiled_fn, self.args, self.outputs = inputs, compiled_fn, args, outputs

    def __call__(self) -> tuple:
        return tuple(self.compiled_fn(*self.args)[:self.outputs])


class GraphCall:
    """Inductor's compiled graph called directly, below AOTAutograd's runtime wrapper and, where the graph
    is C++-wrapper code, below its Python entry too: about 70 us less Python a step on `small`, half the
    Python calls (the wrapper's prologue, grad-mode and profiler switches, inductor's autotune-cache
    bookkeeping, and the entry's type check of every argument and its new tensor for every size).

    Only where the recorded call proves the wrapper adds nothing a replay needs (`bind`): one graph call,
    whose outputs the wrapper handed back as they were, every one (no input-mutation copies, no alias
    regenerated from its base, no effect tokens), and no change of grad mode. What the wrapper did to
    tensors outside its outputs is redone as it was seen: the version counters it bumped (the inputs
    the graph writes, for autograd's checks) and the dimension marks it left on the outputs (Dynamo's
    hint to a later compile that takes them)."""

    __slots__ = ("inputs", "graph", "args", "outputs", "bumped", "marks", "entry")

    def __init__(self, inputs: object, graph, args: list, outputs: int, bumped: tuple, marks: tuple, entry):
        self.inputs, self.graph, self.args, self.outputs = inputs, graph, args, outputs
        self.bumped, self.marks, self.entry = bumped, marks, entry

    @classmethod
    def bind(cls, inputs: object, graph_calls: list, args: tuple, outputs, kept: int,
             versions_before: dict) -> GraphCall | None:
        """The graph-level call that stands for this frame-level one, or None where it cannot be proven."""
        if len(graph_calls) != 1 or not isinstance(outputs, (list, tuple)):
            return None
        graph, graph_args, graph_outputs = graph_calls[0]
        if not isinstance(graph_outputs, (list, tuple)) or len(graph_outputs) != len(outputs) \
                or any(g is not o for g, o in zip(graph_outputs, outputs)):
            return None
        if not all(isinstance(a, torch.Tensor) or type(a) is int for a in graph_args):
            return None
        entry = _cpp_entry(graph.current_callable)
        if entry is not None:  # the entry turns each size into a 0-d CPU tensor at every call: once is enough
            graph_args = [a if isinstance(a, torch.Tensor) else torch.tensor(a, device="cpu") for a in graph_args]
        tensors = {id(a): a for a in args if isinstance(a, torch.Tensor)}
        bumped = tuple(tensors[k] for k, v in _versions(list(tensors.values())).items()
                       if k in versions_before and v != versions_before[k])
        marks = tuple((i, set(o._dynamo_propagated_dynamic_indices)) for i, o in enumerate(outputs)
                      if isinstance(o, torch.Tensor) and hasattr(o, "_dynamo_propagated_dynamic_indices"))
        return cls(inputs, graph, graph_args, kept, bumped, marks, entry)

    def __call__(self) -> tuple:
        if self.bumped:
            torch._C._increment_version(self.bumped)
        if torch.autograd.profiler._is_profiler_enabled:  # the graph's own call adds its profiler range
            outputs = self.graph(list(self.args))
        elif self.entry is not None:  # what the C++ wrapper's Python entry does, for tensors alone
            aoti = torch._C._aoti
            outputs = aoti.alloc_tensors_by_stealing_from_void_ptrs(
                self.entry.cell_contents(aoti.unsafe_alloc_void_ptrs_from_tensors(self.args)))
        else:
            outputs = self.graph.current_callable(list(self.args))  # (it clears the list it is given)
        for i, dims in self.marks:
            outputs[i]._dynamo_propagated_dynamic_indices = set(dims)
        return tuple(outputs[:self.outputs])


def _cpp_entry(callable_):
    """The cell that holds the C++ entry, where `callable_` is the Python entry of inductor's C++-wrapper
    module as torch generates it: it hands `inductor_entry` (the cell's content) handles to its arguments,
    each a tensor or a size made a CPU tensor, and takes the outputs' handles back. None for anything
    else. The cell is read at each call, so that a wrapper put there (`tools/host_split.py` times the
    entry so) is followed."""
    code, cells = getattr(callable_, "__code__", None), getattr(callable_, "__closure__", None)
    if code is None or not cells or len(cells) != 1:
        return None
    names = set(code.co_names)
    known = {"unsafe_alloc_void_ptrs_from_tensors", "alloc_tensors_by_stealing_from_void_ptrs"} <= names
    entry = getattr(callable_, "__globals__", {}).get("inductor_entry")
    return cells[0] if known and entry is not None and cells[0].cell_contents is entry else None


def _versions(values) -> dict[int, int]:
    """The version counter of every tensor among `values` that has one (inference tensors have none)."""
    return {id(v): v._version for v in values if isinstance(v, torch.Tensor) and not v.is_inference()}


class _GraphCallRecorder:
    """Records, on this thread, each call of an inductor graph (`CompiledFxGraph`) made inside the block:
    the graph, its arguments as given (the entry clears its list) and its outputs. Binding is rare (once
    per bucket and step kind, and per extend shape seen twice): the class's call is swapped for the block
    under a lock, and calls on other threads pass through untouched."""

    _lock = threading.Lock()

    def __enter__(self) -> list:
        from torch._inductor.output_code import CompiledFxGraph

        self._lock.acquire()
        self.calls, self.cls, self.original = [], CompiledFxGraph, CompiledFxGraph.__call__
        thread, calls, original = threading.get_ident(), self.calls, self.original

        def recording_call(graph, graph_args):
            if threading.get_ident() != thread:
                return original(graph, graph_args)
            given = list(graph_args)
            out = original(graph, graph_args)
            calls.append((graph, given, out))
            return out

        CompiledFxGraph.__call__ = recording_call
        return self.calls

    def __exit__(self, *exc) -> None:
        self.cls.__call__ = self.original
        self._lock.release()


def compile_and_save(compiled, path: Path) -> None:
    """Compiles `compiled` (its inputs already prepared) through the AOT entry point and saves the result;
    a failure to save is logged, the compiled step still runs."""
    from torch._dynamo.aot_compile import ModelInput

    # torch.compile(dynamic=False) turns Dynamo's automatic dynamic shapes off, but the AOT entry point does
    # not pass that on: a size that differed in an earlier compile of the step's code in this process
    # (another model's) would become a symbol, one more input per call and slower code, in a package
    # that then serves every later process. Only the sizes the caller marks are symbols.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        compiled._aot_compile([ModelInput((), {}, [torch.inference_mode()])])
    compiled.forward = PackagedForward(compiled._orig_mod, compiled.forward.compiled_results)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(compiled.forward.serialize())
        os.replace(partial, path)  # whole or absent, for a process loading it at the same time
    except Exception as e:
        partial.unlink(missing_ok=True)
        log.warning("could not save the compiled step to %s (%s: %s)", path, type(e).__name__, e)


def is_guard_failure(error: BaseException) -> bool:
    """Whether a packaged step refused its inputs (torch raises a plain RuntimeError for it)."""
    return isinstance(error, RuntimeError) and "GuardManager check failed" in str(error)
