"""Graph dumps: everything a compiled step (decode, or verify) is made of, as diffable text.

Per compiled graph (`bucket-<B>/`, B the first bucket it served): the Dynamo graph, the post-grad
graph (inductor) or the AOT forward graph (aot_eager), the inductor output code, the guards, an op
census (custom-op calls labelled with layer and stream, aten op counts, pool-sized copies flagged) and
the static-input table. At the top: `capture.md`, `summary.md` and `summary.json`, one row per bucket
naming the graph folder that serves it (one symbolic graph serves every bucket by default). Object
ids and addresses are replaced by placeholders so that two dumps of the same engine are byte-identical;
`diff_dumps` compares two of them.

`GraphDump` is handed its decoder and the pool's state tensors by its caller (the `dump-graphs`
command builds the engine: `inkling_compiled/dump_graphs.py`).
"""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import torch

from .census import GraphRecorder, census

_GUARD_LOGGER = "torch._dynamo.guards.__guards"
_IDS = re.compile(r"\b\d{9,}\b")
_ADDRS = re.compile(r"0x[0-9a-fA-F]{6,}")


_STEP_INSTANCE = re.compile(r"(\.instance == )\d+")  # the step's per-process number (runner.DecodeStep)
_VOLATILE_LINES = re.compile(r"^.*Guard eval latency.*\n?", re.MULTILINE)
_GLOBAL_COUNTERS = re.compile(r"(__[A-Za-z_]+?___)\d+")  # Dynamo's per-process global names


def stable_text(text: str) -> str:
    """Replaces object ids, addresses and per-process counters and drops timings, which change run to run."""
    text = _STEP_INSTANCE.sub(r"\1N", _GLOBAL_COUNTERS.sub(r"\1N", _VOLATILE_LINES.sub("", text)))
    return _ADDRS.sub("<addr>", _IDS.sub("<id>", text))


class _PostGradRecorder:
    """An inductor post-grad custom pass that keeps the graph text (and changes nothing)."""

    def __init__(self):
        self.graphs: list[str] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append(str(graph))

    def uuid(self):
        return None  # no caching: the pass must see every compile


def pool_shapes(state_tensors: list[torch.Tensor]) -> set[tuple[int, ...]]:
    """Shapes of every pool/cache tensor (one per layer), and the same flattened: what a copy of them
    would have. Shapes, not bare element counts: an unrelated activation can match a count by chance (a
    bucket-1 `[2, 1, 64]` against a 128-element ring, say)."""
    return {tuple(t.shape) for t in state_tensors} | {(t.numel(),) for t in state_tensors}


def _dims(text: str) -> tuple[int, ...] | None:
    parts = [x for x in text.replace(" ", "").rstrip(",").split(",") if x]
    return tuple(int(x) for x in parts) if all(x.isdigit() for x in parts) else None


def pool_symbols(gm: torch.fx.GraphModule) -> set[str]:
    """The symbols standing for the pool's sizes in a graph (and in the code inductor writes for it): the
    symbolic leading dims of its pool inputs, which Dynamo names after their source (`..._pool_...`)."""
    found = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        example = node.meta.get("example_value")
        if "pool" in node.name and isinstance(example, torch.Tensor):
            found |= {str(d) for d in example.shape if isinstance(d, torch.SymInt)}
    return found


def _is_pool_shape(text: str, pool_shapes: set[tuple[int, ...]], symbols: set[str]) -> bool:
    """Whether a shape written in graph code is a pool tensor's: equal, or one of the pool's size symbols
    followed by the static dims of a pool tensor (a batch's symbol is not among them)."""
    if _dims(text) in pool_shapes:
        return True
    parts = [x for x in text.replace(" ", "").rstrip(",").split(",") if x]
    rest = _dims(",".join(parts[1:])) if len(parts) > 1 and parts[0] in symbols else None
    return rest is not None and any(len(shape) == len(parts) and shape[1:] == rest for shape in pool_shapes)


def pool_copies_in_code(code: str, pool_shapes: set[tuple[int, ...]], symbols: set[str] = frozenset()) -> list[str]:
    """Pool- or cache-shaped buffers allocated (`symbols`: the pool's size symbols, see `pool_symbols`),
    and any clone/copy_, in inductor code's call()."""
    body = code[code.find("def call("):] if "def call(" in code else code
    found = [f"empty_strided(({dims}))" for dims in re.findall(r"empty_strided_\w+\(\((.*?)\)", body)
             if _is_pool_shape(dims, pool_shapes, symbols)]
    found += [m.group(0) for m in re.finditer(r"\.clone\(|aten\.copy_|\.copy_\(", body)]
    return found


_ANNOTATED = re.compile(r'"\w+\[([\w, ]*)\]')
_FUNCTIONALIZED_BASE = re.compile(r"= auto_functionalized\w*\[([1-9]\d*)\]")


def pool_copies_in_graph(gm_text: str, pool_shapes: set[tuple[int, ...]], symbols: set[str] = frozenset()) -> list[str]:
    """Nodes of a readable FX graph (shape-annotated) that copy a pool-shaped tensor: copy_/clone, and
    the mutated bases an un-reinplaced auto_functionalized op returns (it clones them to run)."""
    found = []
    for line in gm_text.splitlines():
        if "aten.copy_" not in line and "aten.clone" not in line and not _FUNCTIONALIZED_BASE.search(line):
            continue
        m = _ANNOTATED.search(line)
        if m and _is_pool_shape(m.group(1), pool_shapes, symbols):
            found.append(line.strip()[:160])
    return found


def static_inputs(gm: torch.fx.GraphModule, calls: list[list[int | None]]) -> list[dict]:
    """Every tensor input of the graph: name, shape, dtype, and whether its address held across calls."""
    rows = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        example = node.meta.get("example_value")
        if not isinstance(example, torch.Tensor):
            continue
        seen = {c[i] for c in calls if i < len(c)}
        stable = "n/a" if len(calls) < 2 else "yes" if len(seen) == 1 else "no"
        rows.append({"source": node.name, "shape": list(example.shape),
                     "dtype": str(example.dtype).replace("torch.", ""), "stable": stable})
    return rows


def aten_counts(graph_text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in re.findall(r"torch\.ops\.aten\.(\w+)", graph_text):
        counts[f"aten::{op}"] = counts.get(f"aten::{op}", 0) + 1
    return dict(sorted(counts.items()))


class GraphDump:
    """Records what a `CompiledStep` compiles, bucket by bucket, and writes the dump.

    Build the decoder with `compile_backend=dump.recorder` and warmup=False, then call `write`.
    """

    def __init__(self, backend: str = "inductor"):
        from torch._dynamo.backends.common import aot_autograd

        self.backend = backend
        self.aot_graphs: list[str] = []
        inner = aot_autograd(fw_compiler=self._record_aot) if backend == "aot_eager" else backend
        self.recorder = GraphRecorder(inner, track_addresses=True)

    def _record_aot(self, gm, example_inputs):
        self.aot_graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    def write(self, decoder, out_dir: str | Path, *, state_tensors: list[torch.Tensor], model: str,
              device: str = "cpu", steps: int = 3) -> dict:
        """Compiles each of the decoder's buckets, replays it `steps` times, writes the files; the summary."""
        from torch._dynamo.utils import counters, get_compilation_metrics

        backend, recorder = self.backend, self.recorder
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        post_grad = _PostGradRecorder()
        shapes = pool_shapes(state_tensors)
        guard_log = io.StringIO()
        handler = logging.StreamHandler(guard_log)
        logger = logging.getLogger(_GUARD_LOGGER)
        logger.addHandler(handler)
        torch._logging.set_logs(guards=True)
        # The guards go to the dump's files only: not up to torch's stderr handler.
        propagate, logger.propagate = logger.propagate, False
        summary = {"model": model, "step": decoder.kind, "backend": backend, "device": device,
                   "buckets": {}}
        try:
            for bucket in decoder.buckets:
                first_graph, first_metric = len(recorder.graphs), len(get_compilation_metrics())
                counters.clear()
                guard_log.seek(0)
                guard_log.truncate()
                codes: list[str] = []
                # run_and_get_code resets Dynamo first: only for a bucket no graph serves yet, or a bucket the
                # symbolic graph already covers would be compiled again.
                covered = decoder.symbolic_batch is not None and bucket in decoder.symbolic_batch and any(
                    b in decoder.symbolic_batch for b in decoder.graph_of)
                with torch._inductor.config.patch(post_grad_custom_post_pass=post_grad, fx_graph_cache=False):
                    if backend == "inductor" and not covered:
                        from torch._inductor.utils import run_and_get_code

                        _, codes = run_and_get_code(decoder.warm_bucket, bucket)
                    else:
                        decoder.warm_bucket(bucket)
                graphs = recorder.graphs[first_graph:]
                compiles_after_warmup = len(get_compilation_metrics())
                for _ in range(steps):  # replays refill the buffers in place: nothing may recompile or move
                    decoder.prepare_padding(bucket)
                    decoder.run(bucket)
                timing = {"graph_breaks": sum(counters["graph_break"].values()),
                          "recompiles": len(get_compilation_metrics()) - compiles_after_warmup,
                          "compile_s": round(decoder.compile_seconds[bucket], 3),
                          "dynamo_frames": len(get_compilation_metrics()) - first_metric}
                if not graphs:  # served by the symbolic graph an earlier bucket compiled: its census holds
                    home = next(b for b in decoder.buckets if decoder.graph_of.get(b) == decoder.graph_of[bucket])
                    summary["buckets"][str(bucket)] = {**summary["buckets"][str(home)], **timing, "graphs": 0}
                    continue
                gm = graphs[0]
                c = census(gm)
                post_text = post_grad.graphs[-1] if backend == "inductor" and post_grad.graphs else (
                    self.aot_graphs[-1] if backend == "aot_eager" and self.aot_graphs else "")
                copies, symbols = [], pool_symbols(gm)
                for code in codes:
                    copies += pool_copies_in_code(code, shapes, symbols)
                if backend == "aot_eager":
                    copies += pool_copies_in_graph(post_text, shapes, symbols)
                inputs = static_inputs(gm, recorder.addresses[first_graph])
                c["ops"] = {**c["ops"], **aten_counts(post_text)}
                record = {
                    **timing, "graphs": len(graphs), "graph_folder": f"bucket-{bucket}",
                    "sconv_calls": c["sconv_calls"], "pool_copies": len(copies), "ops": c["ops"],
                    "static_inputs": len(inputs), "unstable_inputs": sum(r["stable"] == "no" for r in inputs),
                }
                if device == "cuda":
                    record["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
                    record["partitions"] = sum(len(re.findall(r"def partition_\d+", code)) for code in codes)
                summary["buckets"][str(bucket)] = record
                _write_bucket(out / f"bucket-{bucket}", gm, post_text, codes, guard_log.getvalue(), c, copies,
                              inputs, backend)
        finally:
            logger.removeHandler(handler)
            logger.propagate = propagate
            torch._logging.set_logs()
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        (out / "summary.md").write_text(summary_markdown(summary))
        (out / "capture.md").write_text(capture_table(summary))
        return summary


def _write_bucket(folder: Path, gm, post_text: str, codes: list[str], guards: str, c: dict, copies: list[str],
                  inputs: list[dict], backend: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dynamo_graph.txt").write_text(stable_text(gm.print_readable(print_output=False)))
    label = {"inductor": "post_grad_graph.txt", "aot_eager": "aot_graph.txt"}.get(backend)
    if label:
        (folder / label).write_text(stable_text(post_text))
    if codes:
        (folder / "output_code.py").write_text(stable_text("\n\n# ---- next module ----\n\n".join(codes)))
    (folder / "guards.txt").write_text(stable_text(guards))
    lines = ["# custom-op calls, in graph order", *(f"{x['op']}  layer={x['layer']}  stream={x['stream']}"
                                                  for x in c["custom_calls"]),
             "", "# op counts", *(f"{n:6d}  {op}" for op, n in c["ops"].items()),
             "", f"# pool- or cache-sized copies: {len(copies)}", *copies]
    (folder / "census.txt").write_text("\n".join(lines) + "\n")
    table = ["| source | shape | dtype | address stable |", "|---|---|---|---|"]
    table += [f"| `{r['source']}` | {r['shape']} | {r['dtype']} | {r['stable']} |" for r in inputs]
    (folder / "static_inputs.md").write_text("\n".join(table) + "\n")


def capture_table(summary: dict) -> str:
    rows = ["| bucket | graph | compile s | new graphs | graph breaks | recompiles |", "|---|---|---|---|---|---|"]
    for b, r in sorted(summary["buckets"].items(), key=lambda kv: int(kv[0])):
        rows.append(f"| {b} | {r['graph_folder']} | {r['compile_s']:.2f} | {r['graphs']} | {r['graph_breaks']} | "
                    f"{r['recompiles']} |")
    return "\n".join(rows) + "\n"


def summary_markdown(summary: dict) -> str:
    step = summary["step"][:1].upper() + summary["step"][1:]  # "Decode", "Verify", "MTP draft"
    head = (f"# {step} graphs of {Path(summary['model']).name} ({summary['backend']} backend, {summary['device']})\n\n"
            "| bucket | graph | new graphs | breaks | recompiles | compile s | sconv calls | pool copies | inkling ops | "
            "aten ops |\n|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for b, r in sorted(summary["buckets"].items(), key=lambda kv: int(kv[0])):
        ink = sum(n for op, n in r["ops"].items() if op.startswith("inkling::"))
        aten = sum(n for op, n in r["ops"].items() if op.startswith("aten::"))
        rows.append(f"| {b} | {r['graph_folder']} | {r['graphs']} | {r['graph_breaks']} | {r['recompiles']} | {r['compile_s']:.2f} | "
                    f"{r['sconv_calls']} | {r['pool_copies']} | {ink} | {aten} |")
    return head + "\n".join(rows) + "\n"


def diff_dumps(a: str | Path, b: str | Path) -> list[str]:
    """What changed from dump A to dump B: buckets, op counts, copies, graph/break counts, guards."""
    sa = json.loads((Path(a) / "summary.json").read_text())["buckets"]
    sb = json.loads((Path(b) / "summary.json").read_text())["buckets"]
    changes = [f"bucket {k}: only in {a}" for k in sorted(set(sa) - set(sb), key=int)]
    changes += [f"bucket {k}: only in {b}" for k in sorted(set(sb) - set(sa), key=int)]
    for k in sorted(set(sa) & set(sb), key=int):
        ra, rb = sa[k], sb[k]
        for field in ("graph_folder", "graphs", "graph_breaks", "recompiles", "sconv_calls", "pool_copies"):
            if ra[field] != rb[field]:
                changes.append(f"bucket {k}: {field} {ra[field]} -> {rb[field]}")
        for op in sorted(set(ra["ops"]) | set(rb["ops"])):
            na, nb = ra["ops"].get(op, 0), rb["ops"].get(op, 0)
            if na != nb:
                verb = "added" if na == 0 else "removed" if nb == 0 else "count"
                changes.append(f"bucket {k}: {op} {verb} {na} -> {nb}")
        ga, gb = (Path(p) / f"bucket-{k}" / "guards.txt" for p in (a, b))
        if ga.is_file() and gb.is_file():
            la, lb = set(ga.read_text().splitlines()), set(gb.read_text().splitlines())
            changes += [f"bucket {k}: guard removed: {g.strip()}" for g in sorted(la - lb)][:20]
            changes += [f"bucket {k}: guard added: {g.strip()}" for g in sorted(lb - la)][:20]
    return changes
