"""`inkling-compiled profile`: a fixed decode workload under torch.profiler (or nsys).

Writes `trace.json` (Chrome / Perfetto) and `summary.png` + `summary.json`: time per layer and per conv
stream, and metadata prep against graph replay. The CPU conv kernels record `sconv S @ layer L` ranges
themselves, replays included; eager steps also have `layer L` ranges. Compiled replays run no Python
per layer, so their `inkling::` op events are also labelled from the graph census: a replay calls its
custom ops in graph order, and the census knows the layer and stream of each call. Each labelled op
gets `[layer L stream]` in its name, and a `layer L` span is added from the first to the last op of
that layer; those spans are marked `"synthetic": true` in their args.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch

from .nvtx import DOMAIN, nvtx_range, profile_ranges

REPLAY = "replay bucket"
PREPARE = "prepare decode"


def run_workload(engine, batch: int, steps: int, prompt_len: int = 32) -> None:
    from .sampling import SamplingParams

    for i in range(batch):
        engine.add_request([3 + (i + j) % 250 for j in range(prompt_len)],
                           SamplingParams(max_new_tokens=steps + 3, ignore_eos=True))
    engine.step()  # prefill
    engine.step()  # first decode, outside the measured range
    with nvtx_range("profile"):
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()


def census_labels(engine, bucket: int) -> list[tuple[str, int | None, str | None]]:
    """(op, layer, stream) of each custom-op call of the bucket's decode graph, in graph order."""
    from .graphs import CompiledStep, GraphRecorder, census
    from .runner import DecodeStep

    # A second, eager-backend trace of the same step: cheap, and it leaves the engine's graphs alone.
    recorder = GraphRecorder("eager")
    probe = CompiledStep(DecodeStep(engine.model, engine.worker.backend), engine.worker.backend.prepare_padding,
                            device=engine.device, buckets=(bucket,), compile_backend=recorder)
    probe.warm_bucket(bucket)
    return [(c["op"], c["layer"], c["stream"]) for c in census(recorder.graphs[0])["custom_calls"]]


def label_trace(events: list[dict], labels: list[tuple[str, int | None, str | None]]) -> list[dict]:
    """Names each replay's inkling:: op events after the census; adds synthetic per-layer spans."""
    replays = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(REPLAY)]
    ops = sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("inkling::")),
                 key=lambda e: e["ts"])
    added = []
    for replay in replays:
        start, end = replay["ts"], replay["ts"] + replay["dur"]
        inside = [e for e in ops if start <= e["ts"] <= end and e.get("tid") == replay.get("tid")]
        spans: dict[int, list[float]] = {}
        for event, (op, layer, stream) in zip(inside, labels):
            if event["name"] != op:
                break  # order diverged: leave the rest unlabelled rather than mislabel it
            if layer is None:
                continue
            event["name"] = f"{op} [layer {layer}{' ' + stream if stream else ''}]"
            lo, hi = spans.get(layer, [event["ts"], event["ts"] + event["dur"]])
            spans[layer] = [min(lo, event["ts"]), max(hi, event["ts"] + event["dur"])]
        for layer, (lo, hi) in sorted(spans.items()):
            added.append({"ph": "X", "name": f"layer {layer}", "ts": lo, "dur": hi - lo, "pid": replay.get("pid"),
                          "tid": replay.get("tid"), "cat": "inkling", "args": {"synthetic": True}})
    return events + added


def summarize(events: list[dict]) -> dict:
    """Total microseconds per layer, per conv stream, and prep vs replay/forward, inside the measured
    `profile` range (the decode steps; prefill and warm-up are outside it)."""
    per_layer: dict[str, float] = defaultdict(float)
    per_stream: dict[str, float] = defaultdict(float)
    phases: dict[str, float] = defaultdict(float)
    window = next((e for e in events if e.get("ph") == "X" and e.get("name") == "profile"), None)
    lo, hi = (window["ts"], window["ts"] + window["dur"]) if window else (float("-inf"), float("inf"))
    kernel_ranges = any(str(e.get("name", "")).startswith("sconv ") for e in events)
    for e in events:
        if e.get("ph") != "X" or not lo <= e.get("ts", lo) <= hi:
            continue
        name = str(e.get("name", ""))
        if name.startswith("layer ") and name.split()[1].isdigit() and len(name.split()) == 2:
            per_layer[name] += e["dur"]
        if kernel_ranges and name.startswith("sconv "):  # "sconv S @ layer L", recorded by the CPU kernels
            per_stream[name.split()[1]] += e["dur"]
        elif not kernel_ranges and name.startswith("inkling::sconv") and "[layer" in name:
            per_stream[name.rstrip("]").rsplit(" ", 1)[-1]] += e["dur"]
        if name.startswith(PREPARE):
            phases["prepare"] += e["dur"]
        elif name.startswith(REPLAY) or name.startswith("decode "):
            phases["decode compute"] += e["dur"]
    key = lambda kv: int(kv[0].split()[1])  # noqa: E731
    return {"per_layer_us": dict(sorted(per_layer.items(), key=key)), "per_stream_us": dict(per_stream),
            "phases_us": dict(phases)}


def plot_summary(summary: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (title, data) in zip(axes, (("time per layer (us)", summary["per_layer_us"]),
                                        ("conv time per stream (us)", summary["per_stream_us"]),
                                        ("prep vs compute (us)", summary["phases_us"]))):
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
    labels = census_labels(engine, engine.worker.decoder.bucket_for(batch)) if engine.worker.decoder is not None else []
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
    summary.update(batch=batch, steps=steps, compiled=engine.worker.decoder is not None)
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
