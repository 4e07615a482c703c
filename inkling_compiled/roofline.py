"""How far the compiled engine's steps are from this machine's limits: `inkling-compiled roofline`.

For each thread count it measures the machine at that count, before every timed step and once after the
last (the best of each rate over those measurements sets the floor: on a machine whose speed drifts, a
step is never set against a floor measured in a slow moment):

- the rate at which weights can be read: the best of a copy (bytes read and written), a sum and
  ATen's one-row GEMV, each over a buffer far larger than the caches;
- the fp32 matmul rate: a large GEMM;

then, for each step kind, works out what one step of the config cannot avoid, and times the engine's:

- decode: `batch` rows, one token each;
- verify: `batch` rows of 1 + num_speculative_tokens tokens (a drafter whose drafts are all accepted);
- extend: one prefill chunk of `extend_tokens` tokens.

A step must read every weight it multiplies by (attention, convs, dense MLPs, shared experts, router,
lm_head), the embedding rows of its tokens, the routed experts its tokens reach (E * (1 - (1 - k/E)^T)
per MoE layer for T tokens: the expected number under uniform routing), and the conv windows and KV its
rows read at the given context; it must do two FLOPs per multiply-add of every token with the weights
it uses (its k experts, not all E). The floor is max(bytes / rate, FLOPs / matmul rate), and
floor / measured is how close the engine gets (1.0 = at the hardware's limit). Nothing here asserts a
speed.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from .floor import best_rates, measure_machine, step_cost

STEP_KINDS = ("decode", "verify", "extend")


def _time_extend(engine, tokens: int) -> float:
    """Median seconds of one prefill step of a `tokens`-token prompt (the whole chunk in one step)."""
    from .bench import _prompts
    from .sampling import SamplingParams

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    times = []
    for seed in range(4):  # seeds no decode prompt uses: no prefix-cache hit
        engine.add_request(_prompts(1, tokens, seed=10_000 + seed)[0], params)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times[1:])  # the first also warms the extend path


@contextlib.contextmanager
def _threads_restored():
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def roofline(config_name: str, batches: list[int], context: int = 128, new_tokens: int = 64,
             threads: list[int] | None = None, kinds: tuple[str, ...] = STEP_KINDS, extend_tokens: int = 256,
             speculative_tokens: int = 2, quantization: str = "none") -> tuple[list[dict], list[dict]]:
    """(machine rows, step rows): per thread count the machine's rates, and per step kind and batch the
    floor and the compiled engine's measured step on a seeded checkpoint (its weights int8 with
    quantization='int8': the floor then counts their int8 bytes and scales)."""
    import tempfile
    from pathlib import Path

    from .bench import ReplayDrafter, _prompts, bench_engine, replay_outputs
    from .engine import Engine
    from .sampling import SamplingParams
    from .tiny import build_tiny_checkpoint

    threads = threads or sorted({1, torch.get_num_threads()})
    machines, rows = [], []
    prompt_len = max(1, context - new_tokens)
    mean_context = prompt_len + new_tokens // 2
    with tempfile.TemporaryDirectory() as tmp, _threads_restored():
        path = build_tiny_checkpoint(Path(tmp) / config_name, config_name)
        for count in threads:
            seen = []  # the machine between timings
            torch.set_num_threads(count)  # engines pin the count they are built under
            common = dict(max_batch_size=max(batches), progress=False,
                          max_model_len=max(context, extend_tokens) + speculative_tokens + 2,
                          prefill_chunk_tokens=max(max(batches) * prompt_len, extend_tokens),
                          quantization=quantization)
            plain = Engine.from_pretrained(path, **common)
            measured: list[tuple[str, int, dict, float]] = []  # (kind, batch, cost, seconds per step)
            for batch in batches:
                prompts = _prompts(batch, prompt_len, seed=batch)
                if "decode" in kinds:
                    seen.append(measure_machine(count))
                    step_ms = bench_engine(plain, prompts, new_tokens)["step_ms"]
                    cost = step_cost(plain.model, plain.worker.pool, batch, batch, mean_context)
                    measured.append(("decode", batch, cost, step_ms / 1e3))
            if "verify" in kinds:
                greedy = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
                workloads = {b: _prompts(b, prompt_len, seed=b) for b in batches}
                drafts = ReplayDrafter(replay_outputs(plain, workloads.values(), greedy))  # every draft accepted
                spec = Engine.from_pretrained(path, speculative=drafts,
                                              num_speculative_tokens=speculative_tokens, **common)
                for batch, prompts in workloads.items():
                    seen.append(measure_machine(count))
                    step_ms = bench_engine(spec, prompts, new_tokens)["step_ms"]
                    tokens = batch * (speculative_tokens + 1)
                    cost = step_cost(spec.model, spec.worker.pool, tokens, batch, mean_context)
                    measured.append(("verify", batch, cost, step_ms / 1e3))
                del spec
            if "extend" in kinds:
                seen.append(measure_machine(count))
                cost = step_cost(plain.model, plain.worker.pool, extend_tokens, 1, extend_tokens // 2)
                measured.append(("extend", 1, cost, _time_extend(plain, extend_tokens)))
            del plain
            seen.append(measure_machine(count))
            machine = best_rates(seen)
            machines.append(machine)
            rate, matmul = machine["bandwidth_gb_s"] * 1e9, machine["matmul_gflop_s"] * 1e9
            for kind, batch, cost, seconds in measured:
                floor_s = max(cost["bytes"] / rate, cost["flops"] / matmul)
                rows.append({"config": config_name + ("" if quantization == "none" else f" {quantization}"),
                             "threads": count, "step": kind, "batch": batch,
                             "bound": "memory" if cost["bytes"] / rate >= cost["flops"] / matmul else "compute",
                             "mbytes_per_step": cost["bytes"] / 1e6, "mflop_per_step": cost["flops"] / 1e6,
                             "experts_reached": cost["experts_reached"], "floor_step_ms": 1e3 * floor_s,
                             "step_ms": 1e3 * seconds, "of_floor": floor_s / seconds,
                             "bandwidth_gb_s": machine["bandwidth_gb_s"], "matmul_gflop_s": machine["matmul_gflop_s"]})
    return machines, rows


def roofline_table(machines: list[dict], rows: list[dict]) -> str:
    lines = [f"machine at {m['threads']} thread(s): {m['bandwidth_gb_s']:.1f} GB/s weight streaming (best of copy "
             f"{m['copy_gb_s']:.1f}, sum {m['reduce_gb_s']:.1f}, GEMV {m['gemv_gb_s']:.1f}), "
             f"{m['matmul_gflop_s']:.1f} GFLOP/s fp32 matmul; best of {m['measurements']} measurements between "
             f"the timings (the slowest streamed {m['lowest_bandwidth_gb_s']:.1f} GB/s)" for m in machines]
    head = ("| config | threads | step | batch | bound | MB/step | MFLOP/step | experts reached | floor ms/step | "
            "ms/step | achieved / floor |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "\n".join(
        f"| {r['config']} | {r['threads']} | {r['step']} | {r['batch']} | {r['bound']} | {r['mbytes_per_step']:.1f} | "
        f"{r['mflop_per_step']:.1f} | {r['experts_reached']:.1f} | {r['floor_step_ms']:.2f} | {r['step_ms']:.2f} | "
        f"{r['of_floor']:.2f} |" for r in rows)
    speedup = _thread_speedups(rows)
    return "\n".join(lines) + "\n\n" + head + body + "\n" + (("\n" + speedup + "\n") if speedup else "")


def _thread_speedups(rows: list[dict]) -> str:
    """Per (config, step, batch): the step at the most threads against one thread."""
    by_key: dict[tuple, dict[int, float]] = {}
    for r in rows:
        by_key.setdefault((r["config"], r["step"], r["batch"]), {})[r["threads"]] = r["step_ms"]
    parts = []
    for (config, step, batch), ms in by_key.items():
        most = max(ms)
        if 1 in ms and most > 1:
            parts.append(f"{config} {step} batch {batch}: {ms[1] / ms[most]:.2f}x")
    return (f"{max(r['threads'] for r in rows)} threads against one: " + "; ".join(parts)) if parts else ""

