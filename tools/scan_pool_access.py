"""Static scan: pool accessors stay out of metadata prep, and nothing keeps pool views on an object.

    python tools/scan_pool_access.py [PATH ...]     (default: the package, custom_ops/ and graphs/)

Rules, checked on the parsed source (ast), so they hold for every path, not just the ones tests run:
1. No function on the metadata-prep path (named `prepare*`, `_fill*`, `_publish*`, `init_forward_metadata*`) calls a
   pool accessor (`sconv_state`, `sconv_intermediate_window`, `layer_index`, `kv_index`, `kv_cache`).
2. No assignment stores a pool accessor's result, or a subscript of a pool tensor (`conv`, `global_kv`,
   `sliding_kv`, `intermediate_conv_window`), on an attribute (`self.x = ...`, `obj.x = ...`).
Exit status 1 and one line per violation when a rule is broken.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ACCESSORS = {"sconv_state", "sconv_intermediate_window", "layer_index", "kv_index", "kv_cache"}
POOL_TENSORS = {"conv", "global_kv", "sliding_kv", "intermediate_conv_window"}
PREP_PREFIXES = ("prepare", "_fill", "_publish", "init_forward_metadata")
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PATHS = [ROOT / "inkling_compiled", ROOT / "custom_ops", ROOT / "graphs"]


def _called_name(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _reads_pool(node: ast.AST) -> str | None:
    """What in this expression yields pool storage: an accessor call or a subscript of a pool tensor."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and _called_name(sub) in ACCESSORS:
            return f"{_called_name(sub)}()"
        if isinstance(sub, ast.Subscript):
            base = sub.value
            while isinstance(base, ast.Subscript):
                base = base.value
            if isinstance(base, ast.Attribute) and base.attr in POOL_TENSORS:
                return f"{base.attr}[...]"
    return None


def scan_source(source: str, filename: str) -> list[str]:
    tree = ast.parse(source, filename)
    problems = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith(PREP_PREFIXES):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and _called_name(node) in ACCESSORS:
                    problems.append(f"{filename}:{node.lineno}: metadata prep `{fn.name}` calls pool accessor "
                                    f"`{_called_name(node)}`")
    for node in ast.walk(tree):
        targets, value = (node.targets, node.value) if isinstance(node, ast.Assign) else (
            ([node.target], node.value) if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value else ([], None))
        if value is None or not any(isinstance(t, ast.Attribute) for t in targets):
            continue
        what = _reads_pool(value)
        if what:
            attr = next(t.attr for t in targets if isinstance(t, ast.Attribute))
            problems.append(f"{filename}:{node.lineno}: stores a pool view ({what}) on attribute `{attr}`")
    return problems


def scan_paths(paths: list[Path]) -> list[str]:
    problems = []
    for path in paths:
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            problems += scan_source(f.read_text(), str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f))
    return problems


def main(argv: list[str]) -> int:
    problems = scan_paths([Path(a) for a in argv] or DEFAULT_PATHS)
    for p in problems:
        print(p)
    print(f"{len(problems)} violation(s)" if problems else "pool access scan: clean")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
