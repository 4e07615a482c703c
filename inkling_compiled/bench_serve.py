"""The HTTP server under load, next to the same workload through the Python API.

A closed loop per client: each of C clients sends a request (a random prompt of token ids, greedy,
eos ignored, streamed) and sends the next when the last one ends, until the workload's requests are
done. Over HTTP the clients are threads with a plain HTTP/1.1 connection each, reading server-sent
events; through the API the same C requests are kept in flight with `add_request` and `step`. Both use
one compiled engine. The HTTP clients run in a process of their own (as clients do), so their parsing
does not share the server's interpreter, and each keeps its connection alive. Tokens are counted, not
events: every chunk carries the usage so far (`continuous_usage_stats`), and a chunk's tokens arrive
when it does, as an output of `step` brings its tokens on the API path. Reported: requests/s, output
tokens/s, time to first token and inter-token latency (p50, p99), HTTP over API, and the CPU each side spent
per output token: on a machine with few cores the client's own share decides what HTTP can reach.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .bench import median_run
from .bench_client import summary as _summary
from .engine import Engine
from .sampling import SamplingParams
from .tiny import build_tiny_checkpoint


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n * 1000 + length)
    return torch.randint(3, 259, (n, length), generator=g).tolist()


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended (the HTTP clients, run to their end; aiperf's
    own worker processes are its children and end before it)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds a running process has spent, from /proc (None where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in clock ticks


class CpuMeter:
    """The CPU seconds each side of an HTTP run spends: the client (a child of this process), the server
    (this process: the event loop and the threads that talk to the engine) and the engine's process. With
    no engine process (`engine_pid` None) the engine steps on a thread of this one, inside "server"."""

    def __init__(self, engine_pid: int | None):
        self.engine_pid = engine_pid
        self.spent: dict[str, float | None] = {}

    def _now(self) -> dict[str, float | None]:
        engine = process_cpu_s(self.engine_pid) if self.engine_pid is not None else None
        return {"client": children_cpu_s(), "server": time.process_time(), "engine": engine}

    def __enter__(self) -> "CpuMeter":
        self._start = self._now()
        return self

    def __exit__(self, *exc) -> None:
        end = self._now()
        self.spent = {k: None if end[k] is None else end[k] - self._start[k] for k in end}


def cpu_us_per_token(spent: dict, baseline: dict, tokens: int) -> dict[str, float | None]:
    """Each side's CPU per output token: a run's CPU less that of a smaller run of the same kind (which pays
    the same start-up: aiperf's takes seconds), over the tokens between them."""
    if tokens <= 0:
        return {k: None for k in spent}
    return {k: None if spent[k] is None or baseline.get(k) is None else 1e6 * (spent[k] - baseline[k]) / tokens
            for k in spent}


def run_api(engine: Engine, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    pending = list(range(len(prompts)))
    starts, arrivals = [0.0] * len(prompts), [[] for _ in prompts]
    seen: dict[str, tuple[int, int]] = {}  # request id -> (index, tokens seen)
    t0, cpu0 = time.perf_counter(), time.process_time()

    def send() -> None:
        i = pending.pop(0)
        starts[i] = time.perf_counter()
        seen[engine.add_request(prompts[i], params)] = (i, 0)

    for _ in range(min(concurrency, len(pending))):
        send()
    while seen:
        for out in engine.step():
            i, had = seen[out.request_id]
            now = time.perf_counter()
            arrivals[i] += [now] * (len(out.token_ids) - had)
            seen[out.request_id] = (i, len(out.token_ids))
            if out.finished:
                del seen[out.request_id]
                if pending:
                    send()
    summary = _summary(time.perf_counter() - t0, arrivals, starts)
    tokens = sum(len(a) for a in arrivals)
    summary["cpu_us_per_token"] = {"api": 1e6 * (time.process_time() - cpu0) / tokens if tokens else None}
    return summary


def run_aiperf(port: int, tokenizer: Path, concurrency: int, requests: int, prompt_len: int, new_tokens: int,
               aiperf: str = "aiperf") -> dict:
    """The same workload with aiperf (an OpenAI-compatible benchmark client, the `aiperf` extra) as the
    client: its summary, read from the JSON it exports, in `_summary`'s keys."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([aiperf, "profile", "--model", "inkling", "--url", f"http://127.0.0.1:{port}",
                        "--endpoint-type", "completions", "--streaming", "--extra-inputs", "ignore_eos:true",
                        "--use-server-token-count", "--prompt-input-tokens-mean", str(prompt_len),
                        "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(new_tokens),
                        "--concurrency", str(concurrency), "--request-count", str(requests),
                        "--warmup-request-count", str(concurrency), "--tokenizer", str(tokenizer),
                        "--output-artifact-dir", out, "--ui-type", "none"],
                       capture_output=True, text=True, check=True)
        found = json.loads((Path(out) / "profile_export_aiperf.json").read_text())
    return {"requests_s": found["request_throughput"]["avg"], "tokens_s": found["output_token_throughput"]["avg"],
            "ttft_p50_ms": found["time_to_first_token"]["p50"], "ttft_p99_ms": found["time_to_first_token"]["p99"],
            "itl_p50_ms": found["inter_token_latency"]["p50"], "itl_p99_ms": found["inter_token_latency"]["p99"]}


def run_http(port: int, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    """The HTTP clients (`bench_client`), in a child process that imports nothing of ours; their summary."""
    job = json.dumps({"port": port, "prompts": prompts, "concurrency": concurrency, "new_tokens": new_tokens})
    client = Path(__file__).with_name("bench_client.py")
    # -I: isolated, so the script's folder (this package's, whose profile.py would shadow the standard
    # library's) is not on its path
    run = subprocess.run([sys.executable, "-I", str(client)], input=job, capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_serve_bench(config: str, concurrencies: list[int], requests: int, prompt_len: int, new_tokens: int,
                    engine_process: bool = True, repeats: int = 3, client: str = "threads", aiperf: str = "aiperf",
                    mixed_steps: bool = True, log=print) -> dict:
    """The API on an engine of this process, and the server over an engine of its own process
    (`engine_process`, as `serve` runs) or that same engine stepped on a thread of this one. With an engine
    process the two paths take turns, `repeats` times each, and each reports its median run: a machine
    whose speed drifts moves both alike. `client`: "threads" (ours, one kept-alive connection per client)
    or "aiperf" (the `aiperf` executable). `mixed_steps`: both engines' (see the engine's option)."""
    from .server.engine_process import EngineProcess
    from .server.serve import ApiServer

    torch.set_num_threads(1)
    results = {"config": config, "requests": requests, "prompt_len": prompt_len, "new_tokens": new_tokens,
               "engine_process": engine_process, "repeats": repeats, "client": client, "mixed_steps": mixed_steps,
               "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / config, config)
        options = dict(max_batch_size=max(concurrencies), prefix_cache=False, mixed_steps=mixed_steps,
                       max_model_len=prompt_len + new_tokens + 1, progress=False)
        engine = Engine.from_pretrained(path, **options)
        with engine:
            api: dict[int, list[dict]] = {c: [] for c in concurrencies}
            for c in concurrencies:
                run_api(engine, _prompts(c, prompt_len), c, new_tokens)  # untimed: every bucket on the way
            if engine_process:
                server = ApiServer(EngineProcess(path, options, max_waiting=requests + 64, threads=1), port=0)
            else:  # the API's runs all come first: the server's loop thread must not step beside them
                for c in concurrencies:
                    api[c] = [run_api(engine, _prompts(requests, prompt_len), c, new_tokens) for _ in range(repeats)]
                server = ApiServer(engine, port=0, max_waiting=requests + 64)
            port = server.start()
            engine_pid = server.loop.process.pid if engine_process else None  # else it steps in this process
            try:
                for c in concurrencies:
                    def http_run(count: int) -> dict:
                        with CpuMeter(engine_pid) as meter:
                            if client == "aiperf":
                                run = run_aiperf(port, path, c, count, prompt_len, new_tokens, aiperf)
                            else:
                                run = run_http(port, _prompts(count, prompt_len), c, new_tokens)
                        return {**run, "cpu_s": meter.spent}

                    http_run(c)  # untimed: the first traffic of this concurrency pays its one-time costs
                    base = http_run(c)  # what a run of this client pays to start and end (aiperf: seconds)
                    http_runs = []
                    for _ in range(repeats):
                        if engine_process:
                            api[c].append(run_api(engine, _prompts(requests, prompt_len), c, new_tokens))
                        run = http_run(requests)
                        run["cpu_us_per_token"] = cpu_us_per_token(run["cpu_s"], base["cpu_s"],
                                                                   (requests - c) * new_tokens)
                        http_runs.append(run)
                    http_run, api_run = median_run(http_runs, "tokens_s"), median_run(api[c], "tokens_s")
                    row = {"concurrency": c, "http": http_run, "api": api_run,
                           "http_over_api": http_run["tokens_s"] / api_run["tokens_s"],
                           "tokens_s_all": {"http": [r["tokens_s"] for r in http_runs],
                                            "api": [r["tokens_s"] for r in api[c]]}}
                    client_us = http_run["cpu_us_per_token"]["client"]
                    if client_us is not None:  # the cores the client alone would need to keep up with the engine
                        row["client_cores_at_api_rate"] = client_us * 1e-6 * api_run["tokens_s"]
                    results["runs"].append(row)
                    log(f"concurrency {c:>3}: HTTP {http_run['tokens_s']:8.1f} tok/s, API {api_run['tokens_s']:8.1f} "
                        f"tok/s ({row['http_over_api']:.2f}x); TTFT p50 {http_run['ttft_p50_ms']:.1f} ms vs "
                        f"{api_run['ttft_p50_ms']:.1f} ms; CPU per token {_cpu_text(http_run, api_run, engine_process)}"
                        + (f"; at the API's rate the client alone needs {row['client_cores_at_api_rate']:.1f} of "
                           f"{os.cpu_count()} cores" if client_us is not None else ""))
            finally:
                server.stop()  # and its engine loop or process
    return results


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _cpu_text(http_run: dict, api_run: dict, engine_process: bool) -> str:
    """CPU us per output token: the HTTP run's client / server / engine (server+engine when the engine steps
    on a thread of the server's process), and the API's (engine and clients in one process)."""
    cpu = http_run.get("cpu_us_per_token") or {}
    sides = (f"server {_us(cpu.get('server'))} / engine {_us(cpu.get('engine'))}" if engine_process
             else f"server+engine {_us(cpu.get('server'))}")
    return f"client {_us(cpu.get('client'))} / {sides} us (API {_us(api_run.get('cpu_us_per_token', {}).get('api'))} us)"


def serve_table(results: dict) -> str:
    """The runs as a table; `CPU us/token` on an HTTP row is client / server / engine (the engine "-" and
    inside the server's figure when it stepped on a thread of the server's process)."""
    head = ["concurrency", "path", "requests/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "HTTP / API", "CPU us/token"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["runs"]:
        for path in ("http", "api"):
            r = row[path]
            cpu = r.get("cpu_us_per_token") or {}
            cpu_text = " / ".join(_us(cpu.get(k)) for k in ("client", "server", "engine")) if path == "http" \
                else _us(cpu.get("api"))
            lines.append("| " + " | ".join([
                str(row["concurrency"]), path.upper(), f"{r['requests_s']:.2f}", f"{r['tokens_s']:.1f}",
                f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p99_ms']:.1f}", f"{r['itl_p50_ms']:.2f}", f"{r['itl_p99_ms']:.2f}",
                f"{row['http_over_api']:.2f}x" if path == "http" else "", cpu_text]) + " |")
    return "\n".join(lines)
