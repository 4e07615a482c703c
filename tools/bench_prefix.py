"""Shared-prefix workload: time to first token and total time, prefix cache off, on, and on the host tier.

    OMP_NUM_THREADS=1 python tools/bench_prefix.py [--config small] [--requests 64] [--prefix 1024]
        [--suffix 32] [--new-tokens 32] [--chunk 2048] [--no-compile]

Every request is the same `--prefix` tokens (a system prompt) and `--suffix` tokens of its own. Each
engine first serves one request of the workload's shape, untimed (it builds and warms what it needs:
with the cache on, that also caches the shared prefix, as the previous user of a system prompt would
have), then all requests arrive at once and run to completion. TTFT is measured from their arrival
to the step that returns each one's first token. A single request alone is timed the same way after
the batch. "host" is the cache with every entry evicted to the host tier before the batch (and before
the single request), so each first hit loads the prefix back; the overlap its per-layer waits gain is
the lone request's TTFT again with every wait made to wait for the whole load (the last layer) first.
Ratios are against "off"; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from inkling_compiled.engine import Engine
from inkling_compiled.sampling import SamplingParams
from inkling_compiled.tiny import build_tiny_checkpoint


def workload(requests: int, prefix: int, suffix: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 259, (prefix,), generator=g).tolist()
    return [shared + torch.randint(3, 259, (suffix,), generator=g).tolist() for _ in range(requests)]


def serve(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], float, int]:
    """(TTFT of each request, total seconds, prompt tokens served from the cache)."""
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            if out.finished:
                cached += out.cached_tokens
    return [first[r] for r in rids], time.perf_counter() - t0, cached


def evict_to_host(engine: Engine) -> None:
    """Every cached entry leaves the device for the host tier (as memory pressure would make it)."""
    while leaves := engine.cache.prefix.evictable():
        for entry in leaves:
            engine.cache.prefix.evict(entry)


def lone_ttft(engine: Engine, prefix: list[int], suffix: int, params: SamplingParams, *, from_host: bool,
              whole_load_first: bool = False, reps: int = 5) -> float:
    """Median TTFT of one request alone that shares `prefix` (a new suffix each time); `from_host`:
    the cache is evicted to the host tier first; `whole_load_first`: its load is waited for completely
    before the forward reads anything (no overlap)."""
    from inkling_compiled.cache.host_tier import HostLoad

    per_layer = HostLoad.wait_until
    if whole_load_first:
        HostLoad.wait_until = lambda self, layer_id: per_layer(self, len(self.done) - 1)
    try:
        times = []
        for r in range(reps):
            if from_host:
                evict_to_host(engine)
            times.append(serve(engine, [prefix + [100 + r + 10 * whole_load_first] * suffix], params)[0][0])
        return statistics.median(times)
    finally:
        HostLoad.wait_until = per_layer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--suffix", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=2048, help="prefill_chunk_tokens")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    prompts = workload(args.requests, args.prefix, args.suffix, seed=0)
    warm = workload(1, args.prefix, args.suffix, seed=0)[0][:args.prefix] + [7] * args.suffix
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(tmp, args.config)
        for mode in ("off", "on", "host"):
            engine = Engine.from_pretrained(path, compile=args.compile, max_batch_size=args.requests,
                                            max_model_len=args.prefix + args.suffix + args.new_tokens + 1,
                                            prefill_chunk_tokens=args.chunk, prefix_cache=mode != "off",
                                            prefix_checkpoints=4 * args.requests, progress=False,
                                            host_cache_bytes=2**31 if mode == "host" else 0)
            serve(engine, [warm], params)
            if mode == "host":
                evict_to_host(engine)
            ttft, total, cached = serve(engine, prompts, params)
            shared = prompts[0][:args.prefix]
            alone = lone_ttft(engine, shared, args.suffix, params, from_host=mode == "host")
            results[mode] = dict(ttft=statistics.mean(ttft), p50=statistics.median(ttft), total=total,
                                 cached=cached, alone=alone)
            print(f"cache {mode:4}: mean TTFT {results[mode]['ttft']:7.2f} s (median {results[mode]['p50']:.2f}), "
                  f"total {total:7.2f} s, single request TTFT {alone * 1e3:8.1f} ms, "
                  f"{cached} prompt tokens from the cache", flush=True)
            if mode == "host":
                results["serial"] = lone_ttft(engine, shared, args.suffix, params, from_host=True,
                                              whole_load_first=True)
    off, on, host = results["off"], results["on"], results["host"]
    print(f"\n{args.config}, {args.requests} requests, {args.prefix}-token shared prefix, {args.suffix}-token "
          f"suffixes, {args.new_tokens} new tokens, chunk {args.chunk}, compile={args.compile}")
    print("| measure | cache off | cache on | host tier | off / on | off / host |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for label, key, scale, unit in (("mean TTFT, all at once", "ttft", 1, "s"), ("median TTFT", "p50", 1, "s"),
                                    ("total time", "total", 1, "s"),
                                    ("TTFT of a request alone (median of 5)", "alone", 1e3, "ms")):
        print(f"| {label} | {off[key] * scale:.2f} {unit} | {on[key] * scale:.2f} {unit} | "
              f"{host[key] * scale:.2f} {unit} | {off[key] / on[key]:.1f}x | {off[key] / host[key]:.1f}x |")
    print(f"\nlone request from the host tier: {host['alone'] * 1e3:.1f} ms with per-layer waits, "
          f"{results['serial'] * 1e3:.1f} ms waiting for the whole load first (overlap gained "
          f"{(results['serial'] - host['alone']) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
