"""Static scan: nothing on the CUDA path of a decode step syncs with the host or sizes a tensor by its data.

    python tools/scan_host_sync.py [PATH ...]     (default: the scope below)

The scope is every function the decode step traces (`TRACED`: the step, the model, the pool context,
the attention math, the sampler), every Triton launcher (`custom_ops/gpu/`) and the wrapper that calls
them, and every Python function an op registers as its CUDA kernel (`define(..., cuda=f)`). In it, a
call is refused if it reads data on the host (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`,
`.to("cpu")`, `int/float/bool` of a reduction or an element, a reduction as an `if`/`while` test,
`synchronize()`) or gives a shape that depends on data (`nonzero`, `argwhere`, `unique`,
`masked_select`, `bincount`, one-argument `where`). Eager-only code inside those modules (prefill over
packed spans, sequence-at-once forwards) is named in `EAGER`. What it cannot see (boolean-mask
indexing, a tensor in a Python loop's range) Dynamo's fullgraph tracing refuses in the traced code.
Exit status 1 and one line per violation when a rule is broken.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST_READS = {"item", "tolist", "cpu", "numpy"}
DATA_SHAPED = {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount"}
REDUCTIONS = {"max", "min", "sum", "any", "all", "argmax", "argmin", "prod"}
# file -> qualified names (a class covers its methods) of what the decode step traces
TRACED = {
    "inkling_compiled/runner.py": {"forward_step", "verify_step", "DecodeStep", "VerifyStep"},
    "inkling_compiled/model.py": {"*"},
    "inkling_compiled/contexts.py": {"PoolContext"},
    "inkling_compiled/attention.py": {"attend", "attend_ring"},
    "inkling_compiled/sampling.py": {"sample_with_logprobs", "verify_with_logprobs"},
    "custom_ops/sampling.py": {"sample", "uniform_noise", "unit_interval", "_mix32", "verify_drafts", "_per_token",
                               "top_logprobs", "sample_tokens_reference", "verify_tokens_reference"},
    "inkling_compiled/config.py": {"InklingConfig.log_scale", "LayerGeometry"},
    "inkling_compiled/cache/pool.py": {"StatePool.layer_index", "StatePool.kv_index", "StatePool._wait_for",
                                       "StatePool.layer_state", "StatePool.draft_windows", "each_layer"},
    "inkling_compiled/spec/mtp_step.py": {"draft_step", "DraftStep"},
    "inkling_compiled/streams.py": {"StreamTable.locate", "StreamTable.kv_locate"},
    "inkling_compiled/kv_layout.py": {"*"},
    "inkling_compiled/parallel/group.py": {"TensorParallel.all_reduce", "TensorParallel.gather_last"},
    "inkling_compiled/nvtx.py": {"*"},
    "custom_ops/gpu": {"*"},
    "custom_ops/library.py": {"gpu_kernel"},
}
EAGER = {"InklingForCausalLM.forward_sequences",
         "extend_attention_reference"}  # the prefill op's CUDA kernel until its Triton one: eager prefill only


def _called(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _is_reduction(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in REDUCTIONS


def _problem(node: ast.Call) -> str | None:
    name = _called(node)
    if isinstance(node.func, ast.Attribute) and name in HOST_READS and not node.args:
        return f"reads data on the host (.{name}())"
    if name == "to" and any(isinstance(a, ast.Constant) and a.value == "cpu"
                            for a in [*node.args, *(k.value for k in node.keywords)]):
        return 'reads data on the host (.to("cpu"))'
    if name == "synchronize":
        return "waits for the device (synchronize())"
    if name in DATA_SHAPED or (name == "where" and len(node.args) == 1 and not node.keywords):
        return f"gives a shape that depends on data ({name})"
    if isinstance(node.func, ast.Name) and name in ("int", "float", "bool") and node.args:
        inner = node.args[0]
        if _is_reduction(inner):
            return f"reads data on the host ({name}() of .{inner.func.attr}())"
        if isinstance(inner, ast.Subscript):
            return f"reads data on the host ({name}() of an element)"
    return None


def _branch_problems(fn: ast.AST):
    """(line, why) of each `if`/`while` whose test is a reduction: a host read of its result."""
    for node in ast.walk(fn):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)) and _is_reduction(node.test):
            yield node.lineno, f"branches on data on the host (`if ....{node.test.func.attr}()`)"


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and class, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qual = f"{prefix}{node.name}"
            yield qual, node
            yield from _functions(node, qual + ".")


def _cuda_kernel_names(tree: ast.AST) -> set[str]:
    """Names of functions handed to `define(..., cuda=name)` in this file."""
    return {kw.value.id for node in ast.walk(tree) if isinstance(node, ast.Call) and _called(node) == "define"
            for kw in node.keywords if kw.arg == "cuda" and isinstance(kw.value, ast.Name)}


def in_scope(qual: str, scope: set[str]) -> bool:
    if qual in EAGER or any(qual.startswith(e + ".") for e in EAGER):
        return False
    return "*" in scope or any(qual == s or qual.startswith(s + ".") for s in scope)


def scan_source(source: str, filename: str, scope: set[str]) -> list[str]:
    tree = ast.parse(source, filename)
    scope = scope | _cuda_kernel_names(tree)
    problems = []
    for qual, fn in _functions(tree):
        if isinstance(fn, ast.ClassDef) or not in_scope(qual, scope):
            continue
        nested = {id(n) for _, inner in _functions(fn) for n in ast.walk(inner)}  # scanned as their own
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and id(node) not in nested:
                why = _problem(node)
                if why:
                    problems.append(f"{filename}:{node.lineno}: `{qual}` {why}")
        problems += [f"{filename}:{line}: `{qual}` {why}" for line, why in _branch_problems(fn)
                     if not any(line in range(n.lineno, n.end_lineno + 1) for _, n in _functions(fn))]
    return problems


def scan_paths(paths: list[Path] | None = None) -> list[str]:
    """Every file of the default scope (TRACED, and the op definitions for their CUDA kernels), or the
    given files with everything in them in scope."""
    if paths:
        paths = [p.resolve() for p in paths]
        files = [(f, {"*"}) for p in paths for f in (sorted(p.rglob("*.py")) if p.is_dir() else [p])]
    else:
        files = [(f, scope) for rel, scope in TRACED.items()
                 for f in (sorted((ROOT / rel).rglob("*.py")) if (ROOT / rel).is_dir() else [ROOT / rel])]
        files += [(f, set()) for f in sorted((ROOT / "custom_ops").glob("*.py"))]
    return [p for f, scope in files
            for p in scan_source(f.read_text(), str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f), scope)]


def main(argv: list[str]) -> int:
    problems = scan_paths([Path(a) for a in argv])
    for p in problems:
        print(p)
    print(f"{len(problems)} violation(s)" if problems else "host sync scan: clean")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
