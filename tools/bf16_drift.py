"""bf16 vs fp32 drift on a tiny checkpoint: max |logit diff| and greedy agreement. Reported, not asserted.

    python tools/bf16_drift.py [--config tiny] [--length 40] [--new-tokens 32]
"""

import argparse
import tempfile

import torch

from inkling_compiled import load_model
from inkling_compiled.generation import greedy_full_recompute
from inkling_compiled.tiny import build_tiny_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--length", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_checkpoint(d, args.config)
        fp32, _ = load_model(path, dtype=torch.float32)
        bf16, _ = load_model(path, dtype=torch.bfloat16)
    prompt = torch.randint(3, 259, (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    a = fp32.forward_sequences([prompt])[0]
    b = bf16.forward_sequences([prompt])[0].float()
    ga = greedy_full_recompute(fp32, prompt, args.new_tokens)
    gb = greedy_full_recompute(bf16, prompt, args.new_tokens)
    first = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), None)
    print(f"config={args.config} prompt={args.length} tokens")
    print(f"max |logit(bf16) - logit(fp32)| = {(a - b).abs().max().item():.3f} (max |logit| {a.abs().max().item():.2f})")
    print(f"greedy tokens equal: {sum(x == y for x, y in zip(ga, gb))}/{len(ga)}"
          + (f", first divergence at token {first}" if first is not None else ""))


if __name__ == "__main__":
    main()
