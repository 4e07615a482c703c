"""`inkling-compiled` command line."""

from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPTS = ["The short convolution", "Hello, Inkling!", "a", "Continuous batching keeps every slot busy"]


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .generation import greedy_full_recompute
    from .loading import load_model
    from .tiny import embedded_checkpoint
    from .tokenizer import TextTokenizer

    torch.set_num_threads(args.threads)
    path = args.model or embedded_checkpoint()
    model, _ = load_model(path)
    tok = TextTokenizer.from_checkpoint(path)
    print(f"checkpoint: {path}")
    print("path: full-sequence recomputation, one prompt at a time (no KV or conv cache yet)")
    total, t0 = 0, time.perf_counter()
    for prompt in DEMO_PROMPTS:
        ids = tok.encode(prompt)
        new = greedy_full_recompute(model, ids, args.max_new_tokens)
        total += len(new)
        print(f"{prompt!r} -> {tok.decode(new)!r}  tokens={new}")
    dt = time.perf_counter() - t0
    print(f"{total} tokens in {dt:.2f} s ({total / dt:.1f} tokens/s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inkling-compiled", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate from a few prompts on the embedded tiny checkpoint")
    demo.add_argument("--model", help="checkpoint folder (default: the embedded tiny checkpoint)")
    demo.add_argument("--max-new-tokens", type=int, default=16)
    demo.add_argument("--threads", type=int, default=1)
    demo.set_defaults(run=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import InklingError

    try:
        return args.run(args)
    except InklingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
