"""Decode throughput over tensor-parallel sizes, and where a rank-0 step's time goes.

Every size runs the same compiled workload (`bench.bench_engine`: median of REPEATS timed runs). A
second, profiled run of a few steps splits rank 0's step into the collectives inside the graph
(all-reduces and the vocabulary gather, waits included: a slower rank shows up there), the step message
(the broadcast that hands the other ranks the step) and the rest, compute. Profiling slows a step down,
so the split is given in milliseconds of the profiled run next to the unprofiled step time.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .bench import _prompts, bench_engine
from .engine import Engine
from .sampling import SamplingParams
from .tiny import build_tiny_checkpoint

PROFILED_STEPS = 8


def step_split(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Rank 0's milliseconds per decode step in collectives, in the step message, and in all, profiled."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while (now := engine.snapshot())["waiting"] or now["prefilling"]:  # prefill outside the profile
        engine.step()
    steps = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished() and steps < PROFILED_STEPS:
            with torch.profiler.record_function("decode step"):
                engine.step()
            steps += 1
    while engine.has_unfinished():
        engine.step()
    totals = {"collectives": 0.0, "message": 0.0, "step": 0.0}
    for event in prof.key_averages():
        if event.key.startswith("_c10d_functional::"):
            totals["collectives"] += event.cpu_time_total
        elif event.key.startswith("c10d::broadcast"):
            totals["message"] += event.cpu_time_total
        elif event.key == "decode step":
            totals["step"] += event.cpu_time_total
    per_step = {k: v / 1e3 / max(steps, 1) for k, v in totals.items()}
    return {"collectives_ms": per_step["collectives"], "message_ms": per_step["message"],
            "step_ms_profiled": per_step["step"]}


def run_parallel_bench(configs: list[str], batches: list[int], sizes: list[int], prompt_len: int, new_tokens: int,
                       log=print) -> dict:
    torch.set_num_threads(1)
    results = {"threads_per_rank": 1, "prompt_len": prompt_len, "new_tokens": new_tokens, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            path = build_tiny_checkpoint(Path(tmp) / name, name)
            base: dict[int, float] = {}
            for size in sizes:
                with Engine.from_pretrained(path, max_batch_size=max(batches), max_model_len=prompt_len + new_tokens + 1,
                                            prefill_chunk_tokens=max(batches) * prompt_len, tensor_parallel_size=size,
                                            progress=False) as engine:
                    for batch in batches:
                        prompts = _prompts(batch, prompt_len, seed=batch)
                        row = {"config": name, "batch": batch, "ranks": size, **bench_engine(engine, prompts, new_tokens),
                               **step_split(engine, prompts, new_tokens)}
                        base.setdefault(batch, row["tok_s"])
                        row["vs_first"] = row["tok_s"] / base[batch]
                        results["runs"].append(row)
                        log(f"{name:>8} bs={batch:<3} ranks={size}: {row['tok_s']:8.1f} tok/s ({row['vs_first']:.2f}x), "
                            f"{row['step_ms']:.2f} ms/step; profiled {row['step_ms_profiled']:.2f} ms: collectives "
                            f"{row['collectives_ms']:.2f}, step message {row['message_ms']:.2f}")
    return results


def parallel_table(results: dict) -> str:
    head = ["config", "batch", "ranks", "tok/s", "vs first size", "ms/step", "profiled ms/step", "collectives ms",
            "step message ms", "compute ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["runs"]:
        compute = r["step_ms_profiled"] - r["collectives_ms"] - r["message_ms"]
        lines.append("| " + " | ".join([r["config"], str(r["batch"]), str(r["ranks"]), f"{r['tok_s']:.1f}",
                                        f"{r['vs_first']:.2f}x", f"{r['step_ms']:.2f}", f"{r['step_ms_profiled']:.2f}",
                                        f"{r['collectives_ms']:.2f}", f"{r['message_ms']:.2f}", f"{compute:.2f}"]) + " |")
    return "\n".join(lines)
