"""The code's layering, checked on the parsed source: who may import whom, one definition of the
conv streams, and kernels chosen by dispatch key rather than by branching on the device."""

import ast
from pathlib import Path

import pytest

from inkling_compiled.config import InklingConfig
from inkling_compiled.streams import POOL_STREAMS, StreamTable
from inkling_compiled.tiny import TINY_CONFIGS

ROOT = Path(__file__).resolve().parent.parent
# source folder -> installed package name (setup.py's package_dir)
PACKAGES = {"inkling_compiled": "inkling_compiled", "custom_ops": "inkling_compiled.custom_ops",
            "graphs": "inkling_compiled.graphs"}


def module_files() -> dict[str, Path]:
    files = {}
    for folder, package in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join((package, *parts))] = f
    return files


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules a module imports (relative imports resolved, `from X import sub` as X.sub)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for a in node.names:  # `from X import sub` is an edge to X.sub when that is a module, else to X
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known}


def reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.fixture(scope="module")
def import_graph():
    files = module_files()
    # The top-level package's __init__ (the public API) is left out: it runs first whatever is imported.
    known = set(files) - {"inkling_compiled"}
    return {name: imports_of(name, path, known) for name, path in files.items() if name in known}


def test_import_graph_sees_real_edges(import_graph):
    """The checks below are only as good as this graph: it must see relative and absolute imports."""
    assert "inkling_compiled.model" in import_graph["inkling_compiled.engine"]  # from .model import ...
    assert "inkling_compiled.streams" in import_graph["inkling_compiled.cache.pool"]
    assert "inkling_compiled.graphs.census" in import_graph["inkling_compiled.graphs.dump"]
    assert "inkling_compiled.custom_ops.library" in import_graph["inkling_compiled.custom_ops.kv"]


def test_the_pool_imports_nothing_from_the_model(import_graph):
    for name in [n for n in import_graph if n.startswith("inkling_compiled.cache")]:
        assert "inkling_compiled.model" not in reachable(name, import_graph), name


def test_the_pool_never_reaches_up(import_graph):
    """The pool stores; the step backend, the scheduler, the worker and the engine sit above it."""
    above = {f"inkling_compiled.{m}" for m in ("backend", "contexts", "metadata", "scheduler", "worker", "engine",
                                                "runner")}
    reached = reachable("inkling_compiled.cache.pool", import_graph)
    assert not reached & above, reached & above


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycles(import_graph):
    """Lazy imports (inside functions) count too: the graph is read from every import statement."""
    assert find_cycle(import_graph) is None, " -> ".join(find_cycle(import_graph))


def test_the_cycle_check_sees_a_cycle(import_graph):
    """A lazy import of the engine from the pool, added to the real graph, is reported as a cycle."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    graph = {name: set(edges) for name, edges in import_graph.items()}
    graph["inkling_compiled.cache.pool"].add("inkling_compiled.engine")
    cycle = find_cycle(graph)
    assert cycle is not None and "inkling_compiled.engine" in cycle and "inkling_compiled.cache.pool" in cycle


LEAVES = {f"inkling_compiled.{m}" for m in ("config", "errors", "paths", "streams", "kv_layout", "checks",
                                                          "attention")}


def test_graphs_only_look_down(import_graph):
    """graphs/ reaches the leaf modules and itself, nothing else (README, "Where things live")."""
    for name in [n for n in import_graph if n.startswith("inkling_compiled.graphs")]:
        outside = {m for m in reachable(name, import_graph) if not m.startswith("inkling_compiled.graphs")}
        assert outside <= LEAVES, (name, outside - LEAVES)


def test_leaves_import_only_leaves(import_graph):
    for name in LEAVES:
        assert reachable(name, import_graph) <= LEAVES, (name, reachable(name, import_graph) - LEAVES)


STREAM_DEFINITIONS = {"K_STREAM", "V_STREAM", "ATTN_STREAM", "MLP_STREAM", "STREAM_NAMES", "MODEL_STREAMS",
                      "POOL_STREAMS", "CONV_STREAMS", "SCONV_MODULES"}


def test_streams_are_defined_in_one_module():
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            names |= {e.id for t in targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)}
            if names & STREAM_DEFINITIONS:
                assert name == "inkling_compiled.streams", f"{path}:{node.lineno} defines {names & STREAM_DEFINITIONS}"


def test_no_kernel_branches_on_the_device():
    for path in (ROOT / "custom_ops").glob("*.py"):
        source = path.read_text()
        assert ".device.type" not in source and "is_cuda" not in source, path


@pytest.mark.parametrize("name", ["tiny", "tiny-k3"])
def test_stream_table_matches_the_layer_types(name):
    raw = TINY_CONFIGS[name]
    config = InklingConfig.from_dict({"model_type": "inkling_text", **raw})
    table = StreamTable(config)
    sliding = tuple(i for i, t in enumerate(config.layer_types) if t == "hybrid_sliding")
    full = tuple(i for i, t in enumerate(config.layer_types) if t == "hybrid")
    every = tuple(range(config.num_hidden_layers))
    assert table.layers == {"k_sliding": sliding, "v_sliding": sliding, "k_global": full, "v_global": full,
                            "attn": every, "mlp": every}
    assert set(table.layers) <= set(POOL_STREAMS)
    swa = raw["swa_num_key_value_heads"] * raw["swa_head_dim"]
    glob = raw["num_key_value_heads"] * raw["head_dim"]
    assert table.widths == {"k_sliding": swa, "v_sliding": swa, "k_global": glob, "v_global": glob,
                            "attn": raw["hidden_size"], "mlp": raw["hidden_size"]}


def test_stream_table_leaves_out_streams_no_layer_uses():
    raw = {**TINY_CONFIGS["tiny"], "layer_types": ["hybrid"] * 4}
    table = StreamTable(InklingConfig.from_dict({"model_type": "inkling_text", **raw}))
    assert set(table.layers) == {"k_global", "v_global", "attn", "mlp"}
    assert table.locate(2, 0) == ("k_global", 2) and table.kv_locate(3) == (False, 3)
