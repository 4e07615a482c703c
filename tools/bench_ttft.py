"""Time to first token: the engine's prefill of one prompt against transformers' forward over the same
prompt, same weights, same process, and against the matmul roof (the prompt's FLOPs at the rate of a
large GEMM, as `roofline` measures it).

    OMP_NUM_THREADS=1 python tools/bench_ttft.py [--config small] [--lengths 128 512 1024 2048]
                                                 [--chunks default 256 0]
                                                 [--eager-extend]   (prefill eagerly, to compare)

Each `--chunks` value is one engine: `default` the engine's own prefill budgets (256 tokens a step beside
decoding requests, 2048 with none, so a lone prompt here prefills in chunks of 2048), a number every
step's cap (`prefill_chunk_tokens` set alone: a prompt alone is chunked too), 0 one chunk for the longest
prompt.

TTFT is the median of three `generate(max_new_tokens=1)` calls on fresh prompts (no prefix-cache hit),
after one untimed; transformers' the median of three forwards. Nothing here asserts a speed.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from inkling_compiled.bench import _prompts
from inkling_compiled.engine import Engine
from inkling_compiled.floor import measure_machine, step_cost
from inkling_compiled.sampling import SamplingParams
from inkling_compiled.tiny import build_tiny_checkpoint


def median_seconds(fn, runs: int = 3) -> float:
    fn(0)
    times = []
    for i in range(1, runs + 1):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chunk_choice(text: str) -> str | int:
    return text if text == "default" else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 1024, 2048])
    p.add_argument("--chunks", nargs="+", type=chunk_choice, default=["default", 256, 0],
                   help="each engine's prefill budget: 'default', a prefill_chunk_tokens, or 0 (the longest prompt)")
    p.add_argument("--eager-extend", action="store_true", help="prefill eagerly (compile_extend=False), to compare")
    args = p.parse_args()
    from transformers import InklingForCausalLM

    machine = measure_machine(torch.get_num_threads())
    print(f"{torch.get_num_threads()} thread(s); matmul roof at {machine['matmul_gflop_s']:.1f} GFLOP/s")
    longest = max(args.lengths)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / args.config, args.config)
        hf = InklingForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        engines = {c: Engine.from_pretrained(path, max_batch_size=1, max_model_len=longest + 2, progress=False,
                                             compile_extend=not args.eager_extend,
                                             **({} if c == "default" else {"prefill_chunk_tokens": c or longest}))
                   for c in args.chunks}
        one = SamplingParams(max_new_tokens=1, ignore_eos=True)
        names = {"default": "engine defaults", 0: "engine, one chunk"}
        print("| prompt tokens | transformers ms | " + " | ".join(
            f"{names.get(c, f'engine, chunks of {c}')}: ms | x transformers | of the roof" for c in args.chunks) + " |")
        print("|---|---|" + "---|---|---|" * len(args.chunks))
        for length in args.lengths:
            prompts = _prompts(8, length, seed=length)
            with torch.inference_mode():
                hf_s = median_seconds(lambda i: hf(input_ids=torch.tensor([prompts[i]])))
            cells = [str(length), f"{hf_s * 1e3:.0f}"]
            for c, engine in engines.items():
                s = median_seconds(lambda i: engine.generate([prompts[4 + i]], one))
                roof = step_cost(engine.model, engine.worker.pool, length, 1, length // 2)["flops"] / (
                    machine["matmul_gflop_s"] * 1e9)
                cells += [f"{s * 1e3:.0f}", f"{hf_s / s:.2f}", f"{roof / s:.2f}"]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
