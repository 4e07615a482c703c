"""The HTTP side of `bench-serve`: C clients in a closed loop over plain HTTP/1.1, each a thread with a
kept-alive connection, reading the server-sent events of streamed completions.

Run as a script in a process of its own (the job as JSON on stdin, its summary as JSON on stdout). It imports
the standard library only, so the process that plays the clients costs what they cost, not torch's import.
"""

from __future__ import annotations

import http.client
import json
import re
import sys
import threading
import time


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(seconds: float, arrivals: list[list[float]], starts: list[float]) -> dict:
    """arrivals[i]: when request i's tokens arrived (one entry per arrival); starts[i]: when it was sent."""
    ttft = [a[0] - s for a, s in zip(arrivals, starts) if a]
    itl = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    tokens = sum(len(a) for a in arrivals)
    return {"requests_s": len(starts) / seconds, "tokens_s": tokens / seconds,
            "ttft_p50_ms": 1e3 * _percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * _percentile(ttft, 0.99),
            "itl_p50_ms": 1e3 * _percentile(itl, 0.5), "itl_p99_ms": 1e3 * _percentile(itl, 0.99)}


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


def stream_completion(conn: http.client.HTTPConnection, prompt: list[int],
                      new_tokens: int) -> tuple[float, list[float]]:
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


def client_main() -> None:
    """The child process of `run_http`: the job as JSON on stdin, its summary as JSON on stdout."""
    job = json.loads(sys.stdin.read())
    print(json.dumps(run_clients(job["port"], job["prompts"], job["concurrency"], job["new_tokens"])))


def run_clients(port: int, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
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
                starts[i], arrivals[i] = stream_completion(conn, prompts[i], new_tokens)
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
    return summary(time.perf_counter() - t0, arrivals, starts)


if __name__ == "__main__":
    client_main()
