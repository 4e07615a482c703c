"""`inkling-compiled`: demo, generate, bench."""

from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPTS = ["The short convolution", "Hello, Inkling!", "a", "Continuous batching keeps every slot busy",
                "0123456789", "Pages and slots"]


class ProgressBar:
    """A one-line stderr bar for long generations; drawn only on a terminal."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled and sys.stderr.isatty()
        self.done, self.t0 = 0, time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        frac = self.done / max(self.total, 1)
        rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} tokens {rate:7.1f} tok/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _run_engine(engine, prompts, params, show_progress: bool):
    """Drives add_request/step to completion, feeding the progress bar; outputs in prompt order."""
    rids = [engine.add_request(p, params) for p in prompts]
    bar = ProgressBar(len(prompts) * params.max_new_tokens, "generating", show_progress)
    final, t0 = {}, time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        bar.update(len(outs))
        final.update({o.request_id: o for o in outs if o.finished})
    bar.close()
    return [final[r] for r in rids], time.perf_counter() - t0


def _engine_args(args):
    return dict(device=args.device, dtype=args.dtype, compile=args.compile, max_batch_size=args.max_batch_size)


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .engine import Engine
    from .sampling import SamplingParams
    from .tiny import embedded_checkpoint

    torch.set_num_threads(args.threads)
    path = args.model or embedded_checkpoint()
    engine = Engine.from_pretrained(path, **_engine_args(args))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    outs, seconds = _run_engine(engine, DEMO_PROMPTS, params, show_progress=False)
    print(f"checkpoint: {path} (random weights: the text is noise by design)")
    print(f"{len(DEMO_PROMPTS)} prompts in one continuous batch, compile={args.compile}")
    for prompt, out in zip(DEMO_PROMPTS, outs):
        print(f"  {prompt!r} -> {out.text!r}")
        print(f"      tokens {out.token_ids}")
    total = sum(len(o.token_ids) for o in outs)
    print(f"{total} tokens in {seconds:.2f} s: {total / seconds:.1f} tokens/s (prefill included)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from .engine import Engine
    from .sampling import SamplingParams

    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, **_engine_args(args))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    prompts = [[int(t) for t in p.split(",")] if args.token_ids else p for p in args.prompt]
    outs, seconds = _run_engine(engine, prompts, params, show_progress=not args.quiet)
    for out in outs:
        print(out.text if out.text is not None and not args.token_ids else out.token_ids)
    total = sum(len(o.token_ids) for o in outs)
    print(f"[{total} tokens in {seconds:.2f} s, {total / seconds:.1f} tokens/s]", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import markdown_table, run_bench

    engines = args.engines
    results = run_bench(args.configs, args.batches, args.prompt_len, args.new_tokens, engines, out_json=args.json)
    print(markdown_table(results, engines))
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="run decode steps through the compiled graph")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inkling-compiled", description="A compiled decode engine for Inkling models")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="several prompts in one batch on the embedded tiny checkpoint")
    demo.add_argument("--model", help="checkpoint folder (default: the embedded tiny checkpoint)")
    _add_engine_options(demo)
    demo.set_defaults(run=_demo)

    gen = sub.add_parser("generate", help="generate from prompts with a checkpoint")
    gen.add_argument("--model", required=True, help="checkpoint folder")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--token-ids", action="store_true", help="prompts are comma-separated token ids")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_engine_options(gen)
    gen.set_defaults(run=_generate)

    bench = sub.add_parser("bench", help="decode tokens/s vs transformers' generate (same weights)")
    bench.add_argument("--configs", nargs="+", default=["tiny", "small"])
    bench.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    bench.add_argument("--prompt-len", type=int, default=64)
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--engines", nargs="+", default=["eager", "transformers"])
    bench.add_argument("--json", default="bench-decode.json")
    bench.set_defaults(run=_bench)
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
