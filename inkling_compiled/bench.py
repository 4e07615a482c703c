"""Decode throughput: our engine against transformers' own `generate`, same weights, same process.

Decode tokens/s counts the tokens produced once every prompt is prefilled (the first comes out of
prefill), over the time those steps took. Each measurement runs once untimed first, then REPEATS times; the median
is reported (this machine class is noisy). Results are ratios, printed and written as JSON; nothing
here asserts a speed.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .engine import Engine
from .errors import OptionError
from .floor import draft_cost, measure_machine, step_cost
from .sampling import SamplingParams
from .spec import Drafter
from .spec.mtp import MtpDrafter
from .tiny import TINY_CONFIGS, build_tiny_checkpoint

REPEATS = 3


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (batch, length), generator=g).tolist()


def run_prompt(prompt: list[int], run: int) -> list[int]:
    """`prompt` as `bench_engine`'s run number `run` (1 is its warm-up) sends it: with a first token of that
    run's own, so no run's prefill is a prefix-cache hit on another's and the time to first token is a
    prefill's."""
    return [3 + run % 200, *prompt[1:]]


def bench_engine(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Decode tokens/s, ms a step and the time to first token of `prompts` (the median of REPEATS timed
    runs after a warm-up). A request that fails (its drafter raised, say) fails the benchmark: its tokens
    would otherwise be counted as made."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)

    run_index = itertools.count(1)

    def made(outputs) -> dict[int, int]:  # tokens each request has so far
        for o in outputs:
            if o.finish_reason == "error":
                raise RuntimeError(f"a benchmarked request failed: {o.error}")
        return {o.request_id: len(o.token_ids) for o in outputs}

    def run() -> tuple[float, int, int, float]:
        number = next(run_index)
        t_first = time.perf_counter()
        for p in prompts:
            engine.add_request(run_prompt(p, number), params)
        produced = made(engine.step())  # prefill + first tokens, apart
        while (now := engine.snapshot())["waiting"] or now["prefilling"]:  # a prefill over several steps too
            produced.update(made(engine.step()))
        ttft = time.perf_counter() - t_first  # the batch's prefill: every request's first token
        tokens = len(prompts) * new_tokens - sum(produced.values())  # the timed steps' tokens
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished():
            made(engine.step())
            steps += 1
        return time.perf_counter() - t0, steps, tokens, ttft

    run()
    runs = [run() for _ in range(REPEATS)]
    seconds, steps, tokens, _ = sorted(runs)[REPEATS // 2]
    return {"tok_s": tokens / seconds, "step_ms": 1e3 * seconds / max(steps, 1),
            "ttft_ms": 1e3 * sorted(r[3] for r in runs)[REPEATS // 2]}


def bench_transformers(hf_model, prompts: list[list[int]], new_tokens: int) -> dict:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0

    with torch.inference_mode():
        timed(new_tokens)
        decode_s = sorted(timed(new_tokens) - timed(1) for _ in range(REPEATS))[REPEATS // 2]
    tokens = len(prompts) * (new_tokens - 1)
    return {"tok_s": tokens / decode_s, "step_ms": 1e3 * decode_s / (new_tokens - 1)}


def engine_names(engines: list[str], quantizations: list[str] | None) -> list[str]:
    """The result keys of our engines: 'compiled', 'eager', and with int8 'compiled int8', 'eager int8'."""
    names = []
    for kind in engines:
        if kind == "transformers":
            names.append(kind)
            continue
        names += [kind if q == "none" else f"{kind} {q}" for q in (quantizations or ["none"])]
    return names


def run_bench(configs: list[str], batches: list[int], prompt_len: int, new_tokens: int,
              engines: list[str], log=print, threads: int = 1, quantizations: list[str] | None = None) -> dict:
    """Every engine (and transformers) at `threads` intra-op threads; each engine's step also as a
    fraction of the floor (roofline.py) measured in this run at the same count, the floor of its own
    weights' bytes (int8 ones with `quantizations`)."""
    machine = measure_machine(threads)
    torch.set_num_threads(threads)
    results = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "prompt_len": prompt_len, "new_tokens": new_tokens,
               "rates": machine, "runs": []}
    rate, matmul = machine["bandwidth_gb_s"] * 1e9, machine["matmul_gflop_s"] * 1e9
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            path = build_tiny_checkpoint(Path(tmp) / name, name)
            ours = {}
            for key in engine_names(engines, quantizations):
                if key == "transformers":
                    continue
                kind, _, quantization = key.partition(" ")
                ours[key] = Engine.from_pretrained(path, compile=(kind == "compiled"), max_batch_size=max(batches),
                                                   max_model_len=prompt_len + new_tokens + 1,
                                                   prefill_chunk_tokens=max(batches) * prompt_len, progress=False,
                                                   quantization=quantization or "none")
                if kind == "compiled":
                    results.setdefault("compile_s", {})[f"{name} {quantization}" if quantization else name] = \
                        ours[key].worker.decoder.compile_seconds
            hf = None
            if "transformers" in engines:
                from transformers import InklingForCausalLM

                hf = InklingForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for batch in batches:
                prompts = _prompts(batch, prompt_len, seed=batch)
                row = {"config": name, "batch": batch}
                for kind, engine in ours.items():
                    row[kind] = bench_engine(engine, prompts, new_tokens)
                    cost = step_cost(engine.model, engine.worker.pool, batch, batch, prompt_len + new_tokens // 2)
                    floor_ms = 1e3 * max(cost["bytes"] / rate, cost["flops"] / matmul)
                    row[kind]["of_floor"] = floor_ms / row[kind]["step_ms"]
                if hf is not None:
                    row["transformers"] = bench_transformers(hf, prompts, new_tokens)
                results["runs"].append(row)
                log(format_row(row, engine_names(engines, quantizations)))
    return results


def format_row(row: dict, engines: list[str]) -> str:
    cells = [f"{row['config']:>8} bs={row['batch']:<3}"]
    for kind in engines:
        if kind in row:
            floor = f", {row[kind]['of_floor']:.2f} of floor" if "of_floor" in row[kind] else ""
            cells.append(f"{kind} {row[kind]['tok_s']:8.1f} tok/s ({row[kind]['step_ms']:6.2f} ms/step{floor})")
    if "transformers" in row:
        base = row["transformers"]["tok_s"]
        cells += [f"{kind}/transformers {row[kind]['tok_s'] / base:5.2f}x" for kind in engines
                  if kind in row and kind != "transformers"]
    return " | ".join(cells)


def markdown_table(results: dict, engines: list[str]) -> str:
    ours = [e for e in engines if e != "transformers"]
    head = ["config", "batch"] + [f"{e} tok/s" for e in engines] + [f"{e} / floor" for e in ours]
    if "transformers" in engines:
        head += [f"{e} / transformers" for e in ours]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["runs"]:
        cells = [row["config"], str(row["batch"])] + [f"{row[e]['tok_s']:.1f}" for e in engines]
        cells += [f"{row[e]['of_floor']:.2f}" for e in ours]
        if "transformers" in engines:
            cells += [f"{row[e]['tok_s'] / row['transformers']['tok_s']:.2f}x" for e in ours]
        lines.append("| " + " | ".join(cells) + " |")
    rates = results.get("rates")
    machine = (f"{results['threads']} thread(s); floor at {rates['bandwidth_gb_s']:.1f} GB/s and "
               f"{rates['matmul_gflop_s']:.1f} GFLOP/s, measured in this run\n\n") if rates else ""
    return machine + "\n".join(lines)


def quantization_table(results: dict, engines: list[str]) -> str:
    """int8 against fp32 per engine kind: decode tokens/s, time to first token of the batch, each
    engine's fraction of its own floor."""
    kinds = [e for e in engines if e != "transformers"]
    head = ["config", "batch"]
    for kind in kinds:
        head += [f"{kind} tok/s", f"{kind} int8 tok/s", "int8 / fp32", f"{kind} TTFT ms", "int8 TTFT ms",
                 "int8 / floor"]
    if "transformers" in engines:
        head.append("int8 / transformers")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["runs"]:
        cells = [row["config"], str(row["batch"])]
        for kind in kinds:
            fp32, int8 = row[kind], row[f"{kind} int8"]
            cells += [f"{fp32['tok_s']:.1f}", f"{int8['tok_s']:.1f}", f"{int8['tok_s'] / fp32['tok_s']:.2f}x",
                      f"{fp32['ttft_ms']:.0f}", f"{int8['ttft_ms']:.0f}", f"{int8['of_floor']:.2f}"]
        if "transformers" in engines:
            cells.append(f"{row[f'{kinds[0]} int8']['tok_s'] / row['transformers']['tok_s']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- speculative decoding ----------------------------------------------------------------------------

def replay_outputs(plain: Engine, prompt_lists, params: SamplingParams) -> dict[tuple[int, ...], list[int]]:
    """`plain`'s greedy output of every prompt that `bench_engine` sends for the prompts of `prompt_lists`
    (each run's variant, `run_prompt`, the warm-up's included): what a `ReplayDrafter` proposes."""
    sent = [run_prompt(p, run) for prompts in prompt_lists for p in prompts for run in range(1, REPEATS + 2)]
    return {tuple(p): o.token_ids for p, o in zip(sent, plain.generate(sent, params))}


class ReplayDrafter(Drafter):
    """Proposes what a plain greedy run of the same prompt produced: every draft is accepted, so a run with
    it measures what verification costs and gains at full acceptance (the ceiling of any drafter)."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]]):
        self.outputs = outputs

    def propose(self, reqs: list) -> list[list[int] | None]:
        return [self.outputs[tuple(r.prompt)][len(r.output):len(r.output) + self.num_tokens] or None for r in reqs]


def sliding_only(config: str) -> dict:
    """Overrides that make every layer of a tiny config a sliding-window layer."""
    return {"layer_types": ["hybrid_sliding"] * TINY_CONFIGS[config]["num_hidden_layers"], "local_layer_ids": None}


def copy_prompts(engine: Engine, starts: list[list[int]], overlap: int, new_tokens: int) -> list[list[int]]:
    """Prompts whose continuation copies a long span of themselves, as when a model edits code: each is
    s + G + s + G[:overlap], G the engine's greedy continuation of s. On a model whose layers all use a
    sliding window (and so see only the last few hundred tokens), once `overlap` covers that receptive
    field the continuation is G[overlap:], which prompt lookup finds in the prompt. A model with global
    layers would see the whole prompt and need not copy, whatever its weights."""
    generated = engine.generate(starts, SamplingParams(max_new_tokens=overlap + new_tokens, ignore_eos=True))
    return [s + g.token_ids + s + g.token_ids[:overlap] for s, g in zip(starts, generated)]


def drafter_variants(drafters: list[str], draft_quantization: Sequence[str] = ("none",)) -> dict[str, dict]:
    """Each speculative engine a benchmark builds, by its label: its drafter options, the MTP drafter once
    per draft quantization ('mtp', 'mtp int8'), the others once."""
    variants = {}
    for kind in drafters:
        for q in (draft_quantization if kind == "mtp" else ("none",)):
            label = kind if q == "none" else f"{kind} {q}"
            variants[label] = dict(speculative=kind) | ({"draft_quantization": q} if kind == "mtp" else {})
    return variants


def run_spec_bench(configs: list[str], batches: list[int], overlap: int, new_tokens: int, drafters: list[str],
                   K: int, threads: int = 1, rounds: int = 1, log=print,
                   draft_quantization: Sequence[str] = ("none",)) -> dict:
    """Compiled speculative decoding with each drafter against compiled plain decoding on the copy workload
    (`copy_prompts`, every layer made sliding): decode tokens/s, the acceptance rate and tokens per
    request-step of the timed runs, and the speed-up, at `threads` intra-op threads."""
    torch.set_num_threads(threads)
    results = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": threads,
               "workload": "copy", "overlap": overlap, "new_tokens": new_tokens, "num_speculative_tokens": K,
               "rounds": rounds, "runs": []}
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start_len = 16
    rates = results["rates"] = measure_machine(threads)
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            path = build_tiny_checkpoint(Path(tmp) / name, name, overrides=sliding_only(name))
            prompt_len = 2 * (start_len + overlap) + new_tokens
            common = dict(compile=True, max_batch_size=max(batches), buckets=tuple(sorted(set(batches))),
                          max_model_len=prompt_len + new_tokens + K + 1, prefill_chunk_tokens=2048, prefix_cache=False,
                          progress=False)
            plain = Engine.from_pretrained(path, **common)
            workloads = {batch: copy_prompts(plain, _prompts(batch, start_len, seed=batch), overlap, new_tokens)
                         for batch in batches}
            replayed = replay_outputs(plain, workloads.values(), params)
            engines = {label: Engine.from_pretrained(
                path, **(dict(speculative=ReplayDrafter(replayed)) if label == "replay" else options),
                num_speculative_tokens=K, **common)
                for label, options in drafter_variants(drafters, draft_quantization).items()}
            for batch, prompts in workloads.items():
                results["runs"].append(_spec_rows(name, batch, prompts, plain, engines, new_tokens, K, rates, log,
                                                  rounds))
    return results


def _spec_rows(name: str, batch: int, prompts: list[list[int]], plain: Engine, engines: dict[str, Engine],
               new_tokens: int, K: int, rates: dict, log, rounds: int = 1) -> dict:
    """One batch's row: `rounds` rounds, each the plain engine's run and then each speculative engine's
    (`_spec_row`) against it, so that a speed-up compares runs minutes apart at most however the machine
    drifts. The row keeps the plain run of median tok/s, and for each drafter its run of median speed-up
    (each round's speed-ups in `round_speedups`), with its roofline speed-up at the machine's `rates`
    (`floor.measure_machine`)."""
    plain_runs, spec_runs = [], {kind: [] for kind in engines}
    for _ in range(rounds):
        plain_runs.append(bench_engine(plain, prompts, new_tokens))
        for kind, engine in engines.items():
            spec_runs[kind].append(_spec_row(engine, prompts, new_tokens, plain_runs[-1]["tok_s"]))
    row = {"config": name, "batch": batch, "prompt_len": sum(map(len, prompts)) / len(prompts),
           "plain": median_run(plain_runs, "tok_s")}
    for kind, runs in spec_runs.items():
        row[kind] = {**median_run(runs, "speedup"), "round_speedups": [r["speedup"] for r in runs]}
        row[kind]["roofline_speedup"] = roofline_speedup(engines[kind], rates, batch, K, row[kind]["tokens_per_step"],
                                                         int(row["prompt_len"]) + new_tokens // 2)
    log(f"{name:>8} K={K} bs={batch:<3} plain {row['plain']['tok_s']:8.1f} tok/s | " + " | ".join(
        f"{kind} {row[kind]['tok_s']:8.1f} tok/s {row[kind]['speedup']:.2f}x (rounds: "
        + " ".join(f"{x:.2f}x" for x in row[kind]["round_speedups"]) + ")" for kind in engines))
    return row


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median of `runs` (the upper middle one of an even count): all its numbers
    from that one run."""
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


def _spec_row(engine: Engine, prompts: list[list[int]], new_tokens: int, plain_tok_s: float) -> dict:
    """One speculative engine's run over `prompts` (`bench_engine`), with what its timed runs accepted: the
    overall rate, the rate at each draft depth, tokens per request-step, and the speed-up over plain."""
    before = engine.stats()
    row = bench_engine(engine, prompts, new_tokens)
    after = engine.stats()
    proposed = after["spec_proposed"] - before["spec_proposed"]
    by_depth = [(a1 - a0) / (p1 - p0) if p1 > p0 else None for a0, a1, p0, p1 in zip(
        before["depth_accepted"], after["depth_accepted"], before["depth_proposed"], after["depth_proposed"])]
    row.update(acceptance=(after["spec_accepted"] - before["spec_accepted"]) / proposed if proposed else None,
               acceptance_by_depth=by_depth,
               tokens_per_step=(after["decode_tokens"] - before["decode_tokens"])
               / max(after["row_steps"] - before["row_steps"], 1),
               speedup=row["tok_s"] / plain_tok_s, paired_plain_tok_s=plain_tok_s)
    return row


def roofline_speedup(engine: Engine, rates: dict, batch: int, K: int, tokens_per_step: float, context: int) -> float:
    """The speed-up over plain decoding that a speculative engine would reach if each of its steps and each
    plain step ran at its floor (`floor.step_cost` and, for MTP, `floor.draft_cost` against the machine's
    `rates`): a verify step over K+1 tokens a row (the experts those reach) plus the draft step, against
    `tokens_per_step` plain steps. Host work, which costs a step the same whatever its tokens, is left out:
    plain decoding pays it once a token and speculation once a step, so a measured speed-up can pass it."""
    def floor(cost: dict) -> float:
        return max(cost["bytes"] / (rates["bandwidth_gb_s"] * 1e9), cost["flops"] / (rates["matmul_gflop_s"] * 1e9))

    model, pool, drafter = engine.model, engine.worker.pool, engine.drafter
    plain = floor(step_cost(model, pool, batch, batch, context))
    verify = floor(step_cost(model, pool, batch * (K + 1), batch, context))
    drafted = floor(draft_cost(model, drafter.head, K, batch, drafter.tokens_per_row)) \
        if isinstance(drafter, MtpDrafter) else 0.0
    return tokens_per_step * plain / (verify + drafted)


def held_out_prompts(path: str | Path) -> list[list[int]]:
    """A checkpoint's sample prompts (held_out.json, as tools/train_tiny.py writes it)."""
    file = Path(path) / "held_out.json"
    if not file.is_file():
        raise OptionError(f"{path} has no held_out.json: the model workload needs a checkpoint made by "
                          "tools/train_tiny.py (the copy workload runs on the tiny configs)")
    return json.loads(file.read_text())["prompts"]


def run_model_spec_bench(path: str | Path, batches: list[int], new_tokens: int, drafters: list[str], K: int,
                         threads: int = 1, rounds: int = 1, log=print,
                         draft_quantization: Sequence[str] = ("none",)) -> dict:
    """Compiled speculative decoding with each drafter against compiled plain decoding on a checkpoint's own
    held-out prompts (batch b takes the first b, cycled), greedy: what its drafters accept on real text, at
    `threads` intra-op threads."""
    torch.set_num_threads(threads)
    prompts = held_out_prompts(path)
    results = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": threads,
               "workload": f"held-out prompts of {path}", "new_tokens": new_tokens, "num_speculative_tokens": K,
               "rounds": rounds,
               "runs": []}
    rates = results["rates"] = measure_machine(threads)
    common = dict(compile=True, max_batch_size=max(batches), buckets=tuple(sorted(set(batches))), prefix_cache=False,
                  max_model_len=max(map(len, prompts)) + new_tokens + K + 1, progress=False)
    plain = Engine.from_pretrained(path, **common)
    depths = plain.config.num_mtp_layers or 0
    if "mtp" in drafters and K > depths:
        log(f"K={K}: mtp left out (the head has {depths} depth(s), one draft token each)")
    engines = {label: Engine.from_pretrained(path, **options, num_speculative_tokens=K, **common)
               for label, options in drafter_variants(drafters, draft_quantization).items()
               if options["speculative"] != "mtp" or K <= depths}
    for batch in batches:
        work = [prompts[i % len(prompts)] for i in range(batch)]
        results["runs"].append(_spec_rows(Path(path).name, batch, work, plain, engines, new_tokens, K, rates, log,
                                          rounds))
    for engine in (plain, *engines.values()):
        engine.close()
    return results


def spec_table(results: dict) -> str:
    kinds = [k for k in results["runs"][0] if k not in ("config", "batch", "prompt_len", "plain")]
    head = ["config", "batch", "K", "plain tok/s", "plain TTFT ms"] + [
        f"{k} {c}" for k in kinds for c in ("tok/s", "TTFT ms", "accepted by depth", "tokens/step", "speed-up",
                                            "roofline speed-up")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def rate(a):
        return "n/a" if a is None else f"{a:.2f}"

    for row in results["runs"]:
        cells = [row["config"], str(row["batch"]), str(results["num_speculative_tokens"]), f"{row['plain']['tok_s']:.1f}",
                 f"{row['plain']['ttft_ms']:.1f}"]
        for k in kinds:
            r = row[k]
            cells += [f"{r['tok_s']:.1f}", f"{r['ttft_ms']:.1f}", " / ".join(rate(a) for a in r["acceptance_by_depth"]),
                      f"{r['tokens_per_step']:.2f}", f"{r['speedup']:.2f}x", f"{r['roofline_speedup']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


STARTUP_PHASES = (  # (name, inductor cache folder, compile_package): each phase a new process, in this order
    ("cold", "packaged", True), ("warm", "packaged", True), ("cold, traced", "traced", False),
    ("warm, traced", "traced", False))


def compile_times(config: str, max_batch_size: int = 32, draft_tokens: int = 0,
                  parallel_compile: bool = True) -> dict:
    """Warm-up of every default bucket in a new process: cold (empty compile cache) and warm (the same
    cache again), with the step saved and loaded whole (the default) and traced by Dynamo each time
    (`compile_package=False`, a cache of its own). Per phase: seconds per bucket, to a ready engine
    (`total_s`, from the start of the process's imports) and to its first generated token
    (`first_token_s`). With `draft_tokens`, the engine also compiles a verify step for that many drafts
    (n-gram drafter), and its buckets' seconds and graphs are reported too. `parallel_compile` is the
    engine's option: with it, a cold phase may compile the decode step in a second process
    (`compiled_beside`), whose buckets' seconds are then this process's load and first replay."""
    spec = f"speculative='ngram', num_speculative_tokens={draft_tokens}, " if draft_tokens else ""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_tiny_checkpoint(Path(tmp) / config, config)
        out = {}
        for phase, cache, packaged in STARTUP_PHASES:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / cache), "OMP_NUM_THREADS": "1"}
            script = ("import json, sys, time, torch; torch.set_num_threads(1); t = time.perf_counter(); "
                      "from inkling_compiled.engine import Engine; "
                      f"e = Engine.from_pretrained(sys.argv[1], max_batch_size={max_batch_size}, progress=False, "
                      f"{spec}compile_package={packaged}, parallel_compile={parallel_compile}); "
                      "ready = time.perf_counter() - t; e.generate([3, 4, 5]); v = e.worker.verifier; "
                      "print(json.dumps({'buckets': e.worker.decoder.compile_seconds, 'graphs': e.worker.decoder.graphs(), "
                      "'verify_buckets': v and v.compile_seconds, 'verify_graphs': v and v.graphs(), "
                      "'packaged': e.worker.decoder.packaged, 'compiled_beside': e.worker.decoder_compiled_beside, "
                      "'total_s': ready, "
                      "'first_token_s': time.perf_counter() - t}))")
            run = subprocess.run([sys.executable, "-c", script, str(ckpt)], env=env, capture_output=True, text=True,
                                 check=True)
            out[phase] = json.loads(run.stdout.strip().splitlines()[-1])
        return out


def plot(results: dict, engines: list[str], path: str | Path) -> bool:
    """tokens/s vs batch per engine and config, as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    configs = sorted({r["config"] for r in results["runs"]})
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4), squeeze=False)
    for ax, config in zip(axes[0], configs):
        rows = [r for r in results["runs"] if r["config"] == config]
        for kind in engines:
            ax.plot([r["batch"] for r in rows], [r[kind]["tok_s"] for r in rows], marker="o", label=kind)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{config} (prompt {results['prompt_len']}, {results['new_tokens']} new, "
                     f"{results['threads']} thread(s))")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
