"""The HTTP server under load, next to the same workload through the Python API.

A closed loop per client: each of C clients sends a request (a random prompt of token ids, greedy,
eos ignored, streamed) and sends the next when the last one ends, until the workload's requests are
done. Over HTTP the clients are threads with a plain HTTP/1.1 connection each, reading server-sent
events; through the API the same C requests are kept in flight with `add_request` and `step`. Both use
one compiled engine. The HTTP clients run in a process of their own (as clients do), so their parsing
does not share the server's interpreter, and each keeps its connection alive. Tokens are counted, not
events: every chunk carries the usage so far (`continuous_usage_stats`), and a chunk's tokens arrive
when it does, as an output of `step` brings its tokens on the API path. Reported: requests/s, output
tokens/s, time to first token and inter-token latency (p50, p99), and HTTP over API.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from .bench import median_run
from .engine import Engine
from .sampling import SamplingParams
from .tiny import build_tiny_checkpoint


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n * 1000 + length)
    return torch.randint(3, 259, (n, length), generator=g).tolist()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(seconds: float, arrivals: list[list[float]], starts: list[float]) -> dict:
    """arrivals[i]: when request i's tokens arrived (one entry per arrival); starts[i]: when it was sent."""
    ttft = [a[0] - s for a, s in zip(arrivals, starts) if a]
    itl = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    tokens = sum(len(a) for a in arrivals)
    return {"requests_s": len(starts) / seconds, "tokens_s": tokens / seconds,
            "ttft_p50_ms": 1e3 * _percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * _percentile(ttft, 0.99),
            "itl_p50_ms": 1e3 * _percentile(itl, 0.5), "itl_p99_ms": 1e3 * _percentile(itl, 0.99)}


def run_api(engine: Engine, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    pending = list(range(len(prompts)))
    starts, arrivals = [0.0] * len(prompts), [[] for _ in prompts]
    seen: dict[str, tuple[int, int]] = {}  # request id -> (index, tokens seen)
    t0 = time.perf_counter()

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
    return _summary(time.perf_counter() - t0, arrivals, starts)


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


def _stream(conn: http.client.HTTPConnection, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """(sent at, arrival time of each token) of one streamed completion on a kept-alive connection. Every
    chunk carries the usage so far (`continuous_usage_stats`), so a chunk's tokens are what its
    completion_tokens adds, whatever its text; the last usage must say `new_tokens`."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    arrivals, counted, pending, done = [], 0, b"", False
    while not done:
        block = response.read1(65536)  # whatever has arrived: events that came together arrive together
        if not block:
            break
        now = time.perf_counter()
        events = pending + block
        cut = events.rfind(b"\n\n") + 2  # parse whole events only; keep the rest for the next block
        for found in _COMPLETION_TOKENS.finditer(events, 0, cut):
            total = int(found.group(1))
            arrivals += [now] * (total - counted)
            counted = total
        done = b"data: [DONE]" in events[:cut]
        pending = events[cut:] if cut > 1 else events
    response.read()
    if counted != new_tokens:
        raise RuntimeError(f"the stream's usage says {counted} completion tokens, not {new_tokens}")
    return sent, arrivals


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
    """The HTTP clients, in a child process; their summary."""
    job = json.dumps({"port": port, "prompts": prompts, "concurrency": concurrency, "new_tokens": new_tokens})
    run = subprocess.run([sys.executable, "-c", "from inkling_compiled.bench_serve import client_main; client_main()"],
                         input=job, capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def client_main() -> None:
    """The child process of `run_http`: the job as JSON on stdin, its summary as JSON on stdout."""
    job = json.loads(sys.stdin.read())
    print(json.dumps(_clients(job["port"], job["prompts"], job["concurrency"], job["new_tokens"])))


def _clients(port: int, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    pending = list(range(len(prompts)))
    starts, arrivals = [0.0] * len(prompts), [[] for _ in prompts]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)  # kept alive, as clients do
        try:
            while True:
                with lock:
                    if not pending:
                        return
                    i = pending.pop(0)
                starts[i], arrivals[i] = _stream(conn, prompts[i], new_tokens)
        except BaseException as e:
            errors.append(e)
        finally:
            conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return _summary(time.perf_counter() - t0, arrivals, starts)


def run_serve_bench(config: str, concurrencies: list[int], requests: int, prompt_len: int, new_tokens: int,
                    engine_process: bool = True, repeats: int = 3, client: str = "threads", aiperf: str = "aiperf",
                    log=print) -> dict:
    """The API on an engine of this process, and the server over an engine of its own process
    (`engine_process`, as `serve` runs) or that same engine stepped on a thread of this one. With an engine
    process the two paths take turns, `repeats` times each, and each reports its median run: a machine
    whose speed drifts moves both alike. `client`: "threads" (ours, one kept-alive connection per client)
    or "aiperf" (the `aiperf` executable)."""
    from .server.engine_process import EngineProcess
    from .server.serve import ApiServer

    torch.set_num_threads(1)
    results = {"config": config, "requests": requests, "prompt_len": prompt_len, "new_tokens": new_tokens,
               "engine_process": engine_process, "repeats": repeats, "client": client, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / config, config)
        options = dict(max_batch_size=max(concurrencies), prefix_cache=False,
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
            try:
                for c in concurrencies:
                    def http_run() -> dict:
                        if client == "aiperf":
                            return run_aiperf(port, path, c, requests, prompt_len, new_tokens, aiperf)
                        return run_http(port, _prompts(requests, prompt_len), c, new_tokens)

                    run_http(port, _prompts(c, prompt_len), c, new_tokens)
                    http_runs = []
                    for _ in range(repeats):
                        if engine_process:
                            api[c].append(run_api(engine, _prompts(requests, prompt_len), c, new_tokens))
                        http_runs.append(http_run())
                    http_run, api_run = median_run(http_runs, "tokens_s"), median_run(api[c], "tokens_s")
                    row = {"concurrency": c, "http": http_run, "api": api_run,
                           "http_over_api": http_run["tokens_s"] / api_run["tokens_s"],
                           "tokens_s_all": {"http": [r["tokens_s"] for r in http_runs],
                                            "api": [r["tokens_s"] for r in api[c]]}}
                    results["runs"].append(row)
                    log(f"concurrency {c:>3}: HTTP {http_run['tokens_s']:8.1f} tok/s, API {api_run['tokens_s']:8.1f} "
                        f"tok/s ({row['http_over_api']:.2f}x); TTFT p50 {http_run['ttft_p50_ms']:.1f} ms vs "
                        f"{api_run['ttft_p50_ms']:.1f} ms")
            finally:
                server.stop()  # and its engine loop or process
    return results


def serve_table(results: dict) -> str:
    head = ["concurrency", "path", "requests/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "HTTP / API"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["runs"]:
        for path in ("http", "api"):
            r = row[path]
            lines.append("| " + " | ".join([
                str(row["concurrency"]), path.upper(), f"{r['requests_s']:.2f}", f"{r['tokens_s']:.1f}",
                f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p99_ms']:.1f}", f"{r['itl_p50_ms']:.2f}", f"{r['itl_p99_ms']:.2f}",
                f"{row['http_over_api']:.2f}x" if path == "http" else ""]) + " |")
    return "\n".join(lines)
