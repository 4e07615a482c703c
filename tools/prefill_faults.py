"""Minor page faults and seconds of a many-prompt prefill: the engine's prefill of a batch of fresh
prompts (no prefix-cache hit), after two untimed. What glibc's freed-memory settings change
(inkling_compiled/host_memory.py): run it as it is and with INKLING_KEEP_FREED_MEMORY=0.

    OMP_NUM_THREADS=1 python tools/prefill_faults.py [--config small] [--batch 32] [--prompt-len 64] [--waves 3]

Nothing here asserts a speed.
"""

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch

from inkling_compiled.engine import Engine
from inkling_compiled.host_memory import thresholds_set
from inkling_compiled.sampling import SamplingParams
from inkling_compiled.tiny import build_tiny_checkpoint


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--waves", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / args.config, args.config)
        engine = Engine.from_pretrained(path, max_batch_size=args.batch, progress=False)
    vocab = engine.config.vocab_size
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)

    def wave() -> tuple[float, int]:
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
        faults, t0 = minor_faults(), time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - t0, minor_faults() - faults

    wave(), wave()
    kept = "kept (INKLING_KEEP_FREED_MEMORY=0 to compare)" if thresholds_set() else "left to glibc's defaults"
    print(f"{args.config}, {args.batch} prompts of {args.prompt_len} tokens, one token each; freed memory {kept}")
    for i in range(args.waves):
        seconds, faults = wave()
        print(f"wave {i + 1}: {1e3 * seconds:.0f} ms, {faults} minor page faults")
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() >> 20
    print(f"resident {resident} MB")


if __name__ == "__main__":
    main()
