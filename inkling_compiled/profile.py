"""`inkling-compiled profile`: a fixed decode workload under torch.profiler (or nsys).

Writes `trace.json` (Chrome / Perfetto) and `summary.png` + `summary.json`: time per layer and per conv
stream, and metadata prep against graph replay. The CPU conv kernels record `sconv S @ layer L` ranges
themselves, replays included; eager steps also have `layer L` ranges. Compiled replays run no Python
per layer, so their `inkling::` op events are also labelled from the census of their step's graph
(decode, verify, MTP draft), which knows the layer and stream of each call (`label_trace`). Each
labelled op gets `[layer L stream]` (a draft step's `[depth L stream]`) in its name, and a `layer L`
(`depth L`) span is added from the first to the last op of that layer; those spans are marked
`"synthetic": true` in their args.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from bisect import bisect_left
from collections import Counter, defaultdict, deque
from pathlib import Path

import torch

from .nvtx import DECODE_REPLAY, DOMAIN, DRAFT_REPLAY, VERIFY_REPLAY, nvtx_range, profile_ranges

# Each step kind a workload runs: the range a compiled replay of it opens (`nvtx.py`), the range of an
# eager step of it, and the range of its metadata prep. Its per-layer times and its compute phase count
# the events inside its own ranges.
STEP_KINDS = {
    "decode": (DECODE_REPLAY, "decode ", "prepare decode"),
    "verify": (VERIFY_REPLAY, "verify ", "prepare verify"),
    "draft": (DRAFT_REPLAY, "draft ", "prepare draft"),
}
# summary.json's names: the decode step's keep the names they had before verify and draft steps were
# counted ("prepare", "decode compute", "per_layer_us").
PREP_PHASE = {"decode": "prepare", "verify": "prepare verify", "draft": "prepare draft"}
PER_LAYER = {"decode": "per_layer_us", "verify": "verify_per_layer_us", "draft": "draft_per_depth_us"}
UNIT = {"decode": "layer", "verify": "layer", "draft": "depth"}  # what a step kind's layers are called


def run_workload(engine, batch: int, steps: int, prompt_len: int = 32) -> None:
    from .errors import RequestError
    from .sampling import SamplingParams

    # A speculative step may emit K+1 tokens a row: enough for every measured step to be a full one.
    new_tokens = (steps + 3) * (1 + getattr(engine, "num_speculative_tokens", 0))
    ids = [engine.add_request([3 + (i + j) % 250 for j in range(prompt_len)],
                              SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)) for i in range(batch)]
    engine.step()  # prefill
    engine.step()  # first decode, outside the measured range
    with nvtx_range("profile"):
        for _ in range(steps):
            engine.step()
    for rid in ids:  # what is left of them would only lengthen the trace
        try:
            engine.abort(rid)
        except RequestError:  # already finished (failed, say)
            pass
    while engine.has_unfinished():
        engine.step()


def _traced_census(step, prepare_padding, device, bucket: int) -> list[tuple[str, int | None, str | None]]:
    """(op, layer, stream) of each custom-op call of `step`'s graph at `bucket`, in the graph's order: a second,
    eager-backend trace of a step built over the engine's own model and buffers (cheap, and it leaves the
    engine's graphs alone)."""
    from .graphs import CompiledStep, GraphRecorder, census

    recorder = GraphRecorder("eager")
    CompiledStep(step, prepare_padding, device=device, buckets=(bucket,), compile_backend=recorder).warm_bucket(bucket)
    return [(c["op"], c["layer"], c["stream"]) for c in census(recorder.graphs[0])["custom_calls"]]


def _bucket(step, batch: int) -> int:
    """The bucket a batch of `batch` rows replays (the largest, for a batch run in chunks)."""
    return step.bucket_for(min(batch, step.buckets[-1]))


def census_labels(engine, batch: int) -> dict[str, list[tuple[str, int | None, str | None]]]:
    """For each compiled step kind the engine replays (decode, verify, the MTP draft step), the
    (op, layer, stream) of each custom-op call of its graph at the bucket serving `batch` rows. Nothing for a
    tensor-parallel engine: a probe's trace runs its step, whose collectives would wait for ranks that
    are not stepping."""
    from .runner import DecodeStep, VerifyStep

    if getattr(engine, "ranks", None) is not None:
        return {}
    worker, labels = engine.worker, {}
    backend = worker.backend
    if worker.decoder is not None:
        labels["decode"] = _traced_census(DecodeStep(engine.model, backend), backend.prepare_padding, engine.device,
                                          _bucket(worker.decoder, batch))
    if worker.verifier is not None:
        labels["verify"] = _traced_census(VerifyStep(engine.model, backend, worker.runner.with_hidden),
                                          backend.prepare_verify_padding, engine.device,
                                          _bucket(worker.verifier, batch))
    drafter = engine.drafter
    if getattr(drafter, "compiled", None) is not None and hasattr(drafter, "probe_step"):  # the MTP drafter
        labels["draft"] = _traced_census(*drafter.probe_step(), engine.device, _bucket(drafter.compiled, batch))
    return labels


def label_trace(events: list[dict], labels: dict[str, list[tuple[str, int | None, str | None]]]) -> list[dict]:
    """Names each replay's inkling:: op events after its step kind's census (`[layer L stream]`; a draft
    step's layers are its depths, `[depth L stream]`) and adds a synthetic `layer L` span per layer."""
    def named(prefix: str) -> list[dict]:
        return sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(prefix)),
                      key=lambda e: e["ts"])

    ops = named("inkling::")
    kernel_ranges = named("sconv ")  # "sconv S @ layer L", recorded by the CPU conv kernels
    added = []
    for kind, kind_labels in labels.items():
        where = UNIT[kind]
        prefix = STEP_KINDS[kind][0]
        calls = Counter(op for op, _, _ in kind_labels)
        for replay in (e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(prefix)):
            start, end = replay["ts"], replay["ts"] + replay["dur"]
            inside = [e for e in ops if start <= e["ts"] <= end and e.get("tid") == replay.get("tid")]
            # Inductor reorders a layer's independent calls (a projection and its conv before the next
            # projection), so the n-th call of an op is matched to the census's n-th call of that op: each
            # layer's calls depend on the layer before, which keeps the layers in order.
            queues: dict[str, deque] = defaultdict(deque)
            for op, layer, stream in kind_labels:
                queues[op].append((layer, stream))
            if Counter(e["name"] for e in inside) != calls:
                continue  # not this graph's calls (a partial replay, a foreign op): label nothing
            # Within a layer the conv streams may swap too: the CPU conv kernels name their own stream.
            kernels = [e for e in kernel_ranges if start <= e["ts"] <= end and e.get("tid") == replay.get("tid")]
            spans: dict[int, list[float]] = {}
            for event in inside:
                op = event["name"]
                layer, stream = queues[op].popleft()
                if layer is None:
                    continue
                own = next((k["name"].split()[1] for k in kernels
                            if event["ts"] <= k["ts"] <= event["ts"] + event["dur"]), None)
                stream = own or stream
                event["name"] = f"{op} [{where} {layer}{' ' + stream if stream else ''}]"
                lo, hi = spans.get(layer, [event["ts"], event["ts"] + event["dur"]])
                spans[layer] = [min(lo, event["ts"]), max(hi, event["ts"] + event["dur"])]
            for layer, (lo, hi) in sorted(spans.items()):
                added.append({"ph": "X", "name": f"{where} {layer}", "ts": lo, "dur": hi - lo, "pid": replay.get("pid"),
                              "tid": replay.get("tid"), "cat": "inkling", "args": {"synthetic": True}})
    return events + added


def _step_kind(name: str) -> str | None:
    """The step kind whose forward a range is (a compiled replay, or an eager step's range), or None."""
    for kind, (replay, eager, _) in STEP_KINDS.items():
        if name.startswith(replay) or (name.startswith(eager) and name.endswith("(eager)")):
            return kind
    return None


def per_op(events: list[dict], forwards: list[tuple[dict, str]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per step kind, each op's microseconds and calls per forward: the outermost `namespace::op` events
    inside the kind's forwards (an op another op called counts in its caller), grouped by name without
    the census label, largest first; `(outside ops)` is what the forwards spent around them (inductor's own
    kernels, the graph's wrapper, the profiler's bookkeeping)."""
    by_thread: dict = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "::" in str(e.get("name", "")):
            by_thread[e.get("tid")].append(e)
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))  # a caller before the ops it calls
    starts = {tid: [e["ts"] for e in thread_ops] for tid, thread_ops in by_thread.items()}
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    counts: Counter = Counter()
    for forward, kind in forwards:
        start, end = forward["ts"], forward["ts"] + forward["dur"]
        counts[kind] += 1
        inside = 0.0
        covered = float("-inf")  # where the last outermost op ends
        thread_ops = by_thread.get(forward.get("tid"), [])
        for e in thread_ops[bisect_left(starts.get(forward.get("tid"), []), start):]:
            if e["ts"] > end:
                break
            if e["ts"] < covered:
                continue
            name = str(e["name"]).split(" [", 1)[0]
            totals[kind][name][0] += e["dur"]
            totals[kind][name][1] += 1
            inside += e["dur"]
            covered = e["ts"] + e["dur"]
        totals[kind]["(outside ops)"][0] += max(0.0, forward["dur"] - inside)
    return {kind: {name: {"us": us / counts[kind], "calls": calls / counts[kind]}
                   for name, (us, calls) in sorted(table.items(), key=lambda kv: -kv[1][0])}
            for kind, table in totals.items()}


def summarize(events: list[dict]) -> dict:
    """Total microseconds per layer of each step kind (a `layer L` range counts toward the step whose
    forward holds it), per conv stream, prep vs compute per step kind, and each kind's ops per forward
    (`per_op`), inside the measured `profile` range (the decode, verify and draft steps; prefill and
    warm-up are outside it)."""
    per_layer: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    per_stream: dict[str, float] = defaultdict(float)
    phases: dict[str, float] = defaultdict(float)
    window = next((e for e in events if e.get("ph") == "X" and e.get("name") == "profile"), None)
    lo, hi = (window["ts"], window["ts"] + window["dur"]) if window else (float("-inf"), float("inf"))
    measured = [e for e in events if e.get("ph") == "X" and lo <= e.get("ts", lo) <= hi]
    forwards = [(e, kind) for e in measured if (kind := _step_kind(str(e.get("name", "")))) is not None]
    prep = {prep: kind for kind, (_, _, prep) in STEP_KINDS.items()}
    kernel_ranges = any(str(e.get("name", "")).startswith("sconv ") for e in events)
    for e in measured:
        name = str(e.get("name", ""))
        words = name.split()
        if len(words) == 2 and words[0] in ("layer", "depth") and words[1].isdigit():  # eager, or a replay's span
            kind = next((k for f, k in forwards if f.get("tid") == e.get("tid")
                         and f["ts"] <= e["ts"] <= f["ts"] + f["dur"]), None)
            if kind is not None:  # an eager draft step's depths are decoder layers, and say so
                per_layer[kind][f"{UNIT[kind]} {words[1]}"] += e["dur"]
        if kernel_ranges and name.startswith("sconv "):  # "sconv S @ layer L", recorded by the CPU kernels
            per_stream[name.split()[1]] += e["dur"]
        elif not kernel_ranges and name.startswith("inkling::sconv") and "[" in name:
            per_stream[name.rstrip("]").rsplit(" ", 1)[-1]] += e["dur"]
        if name in prep:
            phases[PREP_PHASE[prep[name]]] += e["dur"]
    for e, kind in forwards:
        phases[f"{kind} compute"] += e["dur"]
    def ordered(kind: str) -> dict[str, float]:
        return dict(sorted(per_layer[kind].items(), key=lambda kv: int(kv[0].split()[1])))

    summary = {PER_LAYER[kind]: ordered(kind) for kind in STEP_KINDS if kind == "decode" or per_layer[kind]}
    return {**summary, "per_stream_us": dict(per_stream), "phases_us": dict(phases),
            "per_op_us": per_op(measured, forwards)}


def plot_summary(summary: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [(f"{kind} time per {UNIT[kind]} (us)", summary[key])
              for kind, key in PER_LAYER.items() if key in summary]
    panels += [("conv time per stream (us)", summary["per_stream_us"]), ("prep vs compute (us)", summary["phases_us"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, data) in zip(axes, panels):
        ax.bar(list(data), list(data.values()))
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def nsys_command(argv: list[str], out: Path) -> list[str]:
    """The nsys invocation that captures exactly the `profile` NVTX range of this workload."""
    inner = [a for a in argv if a != "--nsys"]
    return ["nsys", "profile", "--trace=nvtx,osrt,cuda", "--capture-range=nvtx",
            f"--nvtx-capture=profile@{DOMAIN}", "--env-var=INKLING_NVTX=1", "-o", str(out / "inkling"),
            sys.executable, "-m", "inkling_compiled.cli", *inner]


def profile(engine, out: Path, *, batch: int, steps: int) -> dict:
    """Runs the workload under torch.profiler; writes trace.json, summary.json and summary.png."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out.mkdir(parents=True, exist_ok=True)
    labels = census_labels(engine, batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profile_ranges(True)
    try:
        with torch_profile(activities=activities) as prof:
            run_workload(engine, batch, steps)
    finally:
        profile_ranges(False)
    raw = out / "trace.raw.json"
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    raw.unlink()
    trace["traceEvents"] = label_trace(trace["traceEvents"], labels)
    (out / "trace.json").write_text(json.dumps(trace))
    summary = summarize(trace["traceEvents"])
    summary.update(batch=batch, steps=steps, compiled=engine.worker.decoder is not None,
                   labelled=sorted(labels))  # the step kinds whose replays' ops carry layers
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["png"] = plot_summary(summary, out / "summary.png")
    return summary


def run_nsys(argv: list[str], out: Path) -> int:
    cmd = nsys_command(argv, out)
    print(shlex.join(cmd))
    if shutil.which("nsys") is None:
        print("nsys is not installed here: run the command above on a machine that has it")
        return 0
    return subprocess.call(cmd)
