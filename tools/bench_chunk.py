"""What `prefill_chunk_tokens` trades: a long prompt's time to first token against the inter-token
latency of the requests decoding beside it while it prefills.

    OMP_NUM_THREADS=1 python tools/bench_chunk.py [--config small] [--prompt 2048] [--decoding 8]
                                                  [--chunks 128 256 512 1024 2048]

Per chunk size, one compiled engine: `--decoding` requests with short prompts decode; once they all
are, a prompt of `--prompt` tokens arrives. Each engine step gives every decoder one token, so a step's
wall time is their inter-token latency; the table gives it alone (decode steps before the prompt came)
and during the prompt's prefill (median and worst), with the prompt's TTFT (its arrival to its first
token). Medians over `--rounds` arrivals, each a fresh prompt (no prefix-cache hit). Nothing here
asserts a speed.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from inkling_compiled.bench import _prompts
from inkling_compiled.engine import Engine
from inkling_compiled.sampling import SamplingParams
from inkling_compiled.tiny import build_tiny_checkpoint


def step_seconds(engine: Engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def one_arrival(engine: Engine, prompt: list[int]) -> tuple[float, list[float], list[float]]:
    """(the prompt's TTFT, decode-only step times before it, step times while it prefilled)."""
    alone = [step_seconds(engine) for _ in range(8)]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    during = []
    while engine.scheduler.get(rid) is not None:
        during.append(step_seconds(engine))
    return time.perf_counter() - t0, alone, during


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--prompt", type=int, default=2048, help="tokens of the arriving prompt")
    p.add_argument("--decoding", type=int, default=8, help="requests decoding beside it")
    p.add_argument("--chunks", nargs="+", type=int, default=[128, 256, 512, 1024, 2048])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    print(f"{args.decoding} requests decoding; a {args.prompt}-token prompt arrives; {args.config}, compiled")
    print("| prefill_chunk_tokens | prompt TTFT ms | decode step alone ms | during prefill: median ms | worst ms |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / args.config, args.config)
        prompts = _prompts(args.rounds + 1, args.prompt, seed=7)
        for chunk in args.chunks:
            engine = Engine.from_pretrained(path, max_batch_size=args.decoding + 1, progress=False,
                                            max_model_len=args.prompt + 64, prefill_chunk_tokens=chunk)
            engine.generate([prompts[0]], SamplingParams(max_new_tokens=2, ignore_eos=True))  # untimed
            for i, short in enumerate(_prompts(args.decoding, 16, seed=11)):
                engine.add_request(short, SamplingParams(max_new_tokens=args.prompt, ignore_eos=True), request_id=f"d{i}")
            while engine.scheduler.waiting or engine.scheduler.prefilling:  # until every decoder decodes
                engine.step()
            ttfts, alone, during = [], [], []
            for prompt in prompts[1:]:
                ttft, a, d = one_arrival(engine, prompt)
                ttfts.append(ttft)
                alone += a
                during += d
            for i in range(args.decoding):
                engine.abort(f"d{i}")
            engine.close()
            print(f"| {chunk} | {ms(statistics.median(ttfts))} | {ms(statistics.median(alone))} | "
                  f"{ms(statistics.median(during))} | {ms(max(during))} |", flush=True)


if __name__ == "__main__":
    main()
