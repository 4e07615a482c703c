"""`inkling-compiled`: demo, generate, eval, bench, roofline, dump-graphs, profile, serve, bench-serve."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

# Openings of Python code: the shipped checkpoint was trained on the standard library's source. None ends
# in a newline: its tokenizer spells a newline and the next line's indent as one token.
DEMO_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self):",
                "    for i in range(len(items)):", "if __name__ == '__main__':", "    except KeyError:"]


def printable(text: str) -> str:
    """Generated text with control characters escaped (newlines and tabs kept): what a terminal may show."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text)


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


def _quantize(args) -> int:
    from .checkpoint import write_quantized

    sizes = write_quantized(args.input, args.output)
    print(f"wrote {args.output}: tensors {sizes['bytes_before'] / 2**20:.1f} MiB -> {sizes['bytes_after'] / 2**20:.1f} MiB")
    return 0


def _engine_args(args):
    buckets = tuple(args.buckets) if args.buckets else (args.max_batch_size,) if getattr(args, "one_bucket", False) \
        else None
    return dict(device=args.device, dtype=args.dtype, compile=args.compile, compile_extend=args.compile_extend,
                parallel_compile=args.parallel_compile, max_batch_size=args.max_batch_size,
                buckets=buckets, compile_backend=args.compile_backend,
                prefill_chunk_tokens=args.prefill_chunk_tokens, idle_prefill_tokens=args.idle_prefill_tokens,
                prefix_cache=args.prefix_cache, mixed_steps=args.mixed_steps,
                speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                draft_quantization=args.draft_quantization,
                tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization)


def _speculation_line(engine) -> str | None:
    s = engine.stats()
    if s["speculative"] is None:
        return None
    rate = "n/a" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.2f}"
    per_step = "n/a" if s["mean_tokens_per_step"] is None else f"{s['mean_tokens_per_step']:.2f}"
    depths = ", ".join(f"depth {d + 1} {'n/a' if a is None else f'{a:.2f}'}" for d, a in enumerate(s["acceptance_by_depth"]))
    drafts = ", int8 drafts" if s["draft_quantization"] == "int8" else ""
    return (f"speculative {s['speculative']} (K={s['num_speculative_tokens']}{drafts}): {s['spec_accepted']}/"
            f"{s['spec_proposed']} drafts accepted ({rate}; {depths}), {per_step} tokens per request per step")


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .engine import Engine
    from .sampling import SamplingParams
    from .tiny import trained_checkpoint

    torch.set_num_threads(engine_threads(args))
    path = args.model or trained_checkpoint()
    engine = Engine.from_pretrained(path, **_engine_args(args))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    with engine:
        outs, seconds = _run_engine(engine, DEMO_PROMPTS, params, show_progress=False)
    about = "the shipped checkpoint, trained on Python's standard library; its README.md is the model card" \
        if args.model is None else "your checkpoint"
    print(f"checkpoint: {path} ({about})")
    if engine.worker.decoder is not None:
        warm = ", ".join(f"bucket {b}: {t:.1f} s" for b, t in engine.worker.decoder.compile_seconds.items())
        beside = " (compiled in a second process; the seconds are this one's load and first replay)" \
            if engine.worker.decoder_compiled_beside else ""
        print(f"compiled decode graphs ({args.compile_backend}): {warm}{beside}")
    ranks = f", {args.tensor_parallel_size} tensor-parallel ranks" if args.tensor_parallel_size > 1 else ""
    print(f"{len(DEMO_PROMPTS)} prompts in one continuous batch, compile={args.compile}{ranks}")
    for prompt, out in zip(DEMO_PROMPTS, outs):
        print(f"--- {prompt!r} ->")
        print(printable(prompt + out.text))
    total = sum(len(o.token_ids) for o in outs)
    print(f"{total} tokens in {seconds:.2f} s: {total / seconds:.1f} tokens/s (prefill included)")
    if line := _speculation_line(engine):
        print(line)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from .engine import Engine
    from .sampling import SamplingParams

    prompts = args.prompt
    if args.token_ids:
        try:
            prompts = [token_ids(p) for p in args.prompt]
        except argparse.ArgumentTypeError as e:
            print(f"error: --prompt: {e}", file=sys.stderr)
            return 2
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)  # checked before loading
    torch.set_num_threads(engine_threads(args))
    # Compile only the graph this batch starts in; a smaller bucket (requests finishing early) compiles
    # on first use.
    engine = Engine.from_pretrained(args.model, warmup=False, progress=not args.quiet, **_engine_args(args))
    with engine:
        if engine.worker.decoder is not None:
            engine.warm_up([engine.worker.decoder.bucket_for(min(len(prompts), engine.worker.decoder.largest))])
        outs, seconds = _run_engine(engine, prompts, params, show_progress=not args.quiet)
    for out in outs:
        print(printable(out.text) if out.text is not None and not args.token_ids else out.token_ids)
    total = sum(len(o.token_ids) for o in outs)
    print(f"[{total} tokens in {seconds:.2f} s, {total / seconds:.1f} tokens/s]", file=sys.stderr)
    if line := _speculation_line(engine):
        print(f"[{line}]", file=sys.stderr)
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json

    import torch

    from .engine import Engine
    from .evaluate import check_windows, engine_score, transformers_score
    from .progress import StageLog
    from .tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_checkpoint(args.model)
    if tokenizer is None:
        print(f"error: {args.model} has no tokenizer.json: eval reads text", file=sys.stderr)
        return 2
    text = Path(args.text).read_text(encoding="utf-8")
    tokens = tokenizer.encode(text)
    if args.max_tokens:
        tokens = tokens[:args.max_tokens]
    window = args.window or args.max_model_len - 1
    stride = args.stride or max(1, window // 2)
    check_windows(len(tokens), window, stride, args.max_model_len)  # before the model loads
    torch.set_num_threads(engine_threads(args))
    log = StageLog(enabled=not args.quiet)
    # Each window is one request that ends at its prefill, so no decode step runs: nothing to compile.
    engine = Engine.from_pretrained(args.model, warmup=False, progress=not args.quiet, max_model_len=args.max_model_len,
                                    **_engine_args(args))
    t0 = time.perf_counter()
    with engine:
        ours = engine_score(engine, tokens, window, stride, progress=log)
    seconds = time.perf_counter() - t0
    log.close()
    result = {"model": str(args.model), "text": str(args.text), "window": window, "stride": stride,
              "engine": ours.summary(), "seconds": seconds}
    print(f"{args.text}: {ours.tokens:,} tokens scored ({ours.bytes:,} bytes), windows of {window} every {stride}")
    print(f"engine:       perplexity {ours.perplexity:.4f}, {ours.bits_per_byte:.4f} bits per byte "
          f"({ours.tokens / seconds:,.0f} tokens/s)")
    if args.compare:
        theirs = transformers_score(args.model, tokens, window, stride, tokenizer, progress=log)
        log.close()
        rel = abs(ours.perplexity - theirs.perplexity) / theirs.perplexity
        result["transformers"], result["relative_difference"] = theirs.summary(), rel
        print(f"transformers: perplexity {theirs.perplexity:.4f}, {theirs.bits_per_byte:.4f} bits per byte "
              f"(relative difference {rel:.1e})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .bench import compile_times, engine_names, markdown_table, plot, quantization_table, run_bench

    if args.quantization and (args.speculative or args.tensor_parallel_size):
        print("error: --quantization runs with the decode benchmark, not with --speculative or "
              "--tensor-parallel-size", file=sys.stderr)
        return 2
    if args.draft_quantization != ["none"] and "mtp" not in (args.speculative or []):
        print("error: --draft-quantization builds MTP engines: add mtp to --speculative", file=sys.stderr)
        return 2
    if args.speculative:
        return _bench_speculative(args)
    if args.tensor_parallel_size:
        return _bench_parallel(args)
    engines = args.engines
    results = run_bench(args.configs, args.batches, args.prompt_len, args.new_tokens, engines, threads=args.threads,
                        quantizations=args.quantization)
    print(markdown_table(results, engine_names(engines, args.quantization)))
    if args.quantization and set(args.quantization) == {"none", "int8"}:
        print()
        print(quantization_table(results, engines))
    if args.compile_times:
        results["compile_times"] = {c: compile_times(c, max(args.batches), args.compile_times_verify,
                                                     parallel_compile=args.parallel_compile)
                                    for c in args.compile_times}
        for c, t in results["compile_times"].items():
            verify = f" and a verify step for K={args.compile_times_verify}" if args.compile_times_verify else ""
            print(f"{c}: buckets {sorted(map(int, t['cold']['buckets']))}{verify} ready in (new process each; "
                  "first token in brackets):")
            for phase, r in t.items():
                graphs = f", verify graphs {r['verify_graphs']}" if r["verify_graphs"] else ""
                graphs += ", the decode step compiled in a second process" if r["compiled_beside"] else ""
                print(f"  {phase:<13} {r['total_s']:6.1f} s  ({r['first_token_s']:.1f} s){graphs}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {args.png}" if plot(results, engine_names(engines, args.quantization), args.png)
              else "no PNG: matplotlib is not installed")
    return 0


def _report(results: dict, table: str, path: str | None) -> int:
    """Prints a benchmark's table and writes its results as JSON (when a path is given)."""
    import json

    print(table)
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


def _bench_speculative(args: argparse.Namespace) -> int:
    from .bench import run_model_spec_bench, run_spec_bench, spec_table

    if args.model and "replay" in args.speculative:
        print("error: --speculative replay runs on the copy workload (--configs), not on --model", file=sys.stderr)
        return 2
    by_k = {}
    for K in args.num_speculative_tokens:
        if args.model:
            by_k[K] = run_model_spec_bench(args.model, args.batches, args.new_tokens, args.speculative, K,
                                           threads=args.threads, rounds=args.rounds,
                                           draft_quantization=args.draft_quantization)
        else:
            by_k[K] = run_spec_bench(args.configs, args.batches, args.copy_overlap, args.new_tokens, args.speculative, K,
                                     threads=args.threads, rounds=args.rounds,
                                     draft_quantization=args.draft_quantization)
    tables = "\n\n".join(spec_table(r) for r in by_k.values())
    return _report({"by_num_speculative_tokens": by_k}, tables, args.json)


def _bench_parallel(args: argparse.Namespace) -> int:
    from .bench_parallel import parallel_table, run_parallel_bench

    results = run_parallel_bench(args.configs, args.batches, args.tensor_parallel_size, args.prompt_len, args.new_tokens)
    return _report(results, parallel_table(results), args.json)


def _serve(args: argparse.Namespace) -> int:
    """Everything the options can get wrong is found before the model loads: the limits, the tokenizer,
    the chat template, and the address (the socket is bound first, so a port in use fails at once)."""
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        print("error: serve needs FastAPI and uvicorn: pip install 'inkling-compiled[serve]'", file=sys.stderr)
        return 2
    import torch

    from .engine import Engine
    from .server.body import Limits
    from .server.chat import ChatTemplate
    from .server.engine_process import EngineProcess
    from .server.serve import ApiServer, listen

    try:
        limits = Limits(max_body_bytes=args.max_body_bytes, max_stop_strings=args.max_stop_strings,
                        max_stop_chars=args.max_stop_chars, max_header_bytes=args.max_header_bytes,
                        header_timeout=args.header_timeout, body_timeout=args.body_timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (Path(args.model) / "tokenizer.json").is_file():
        print(f"error: {args.model} has no tokenizer.json: the server answers in text", file=sys.stderr)
        return 2
    chat_template = ChatTemplate.from_checkpoint(args.model)
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    name = args.served_model_name or Path(args.model).resolve().name
    options = dict(max_model_len=args.max_model_len, **_engine_args(args))
    with sock:
        if args.engine_process:  # the engine steps in a process of its own; HTTP keeps this one
            try:
                engine = EngineProcess(args.model, options, max_waiting=args.max_waiting, threads=engine_threads(args))
            except RuntimeError as e:  # it died while starting (its own traceback is above)
                print(f"error: {e}", file=sys.stderr)
                return 2
        else:
            torch.set_num_threads(engine_threads(args))
            engine = Engine.from_pretrained(args.model, **options)
        try:
            server = ApiServer(engine, sock=sock, model_name=name, max_waiting=args.max_waiting,
                               chat_template=chat_template, shutdown_timeout=args.shutdown_timeout,
                               default_max_tokens=args.max_new_tokens, limits=limits)
            print(f"inkling-compiled: serving {name!r} at http://{args.host}:{server.port}/v1 (chat "
                  f"{'on' if chat_template else 'off: no chat template'}); SIGINT or SIGTERM stops it",
                  file=sys.stderr, flush=True)
            server.run_until_signal()  # stops the engine loop or process on its way out
        finally:
            if args.engine_process:
                engine.stop()
            else:
                engine.close()
    print("inkling-compiled: server stopped", file=sys.stderr)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from .bench_serve import run_serve_bench, serve_table

    results = run_serve_bench(args.config, args.concurrency, args.requests, args.prompt_len, args.new_tokens,
                              engine_process=args.engine_process, repeats=args.repeats, client=args.client,
                              aiperf=args.aiperf, mixed_steps=args.mixed_steps)
    return _report(results, serve_table(results), args.json)


def _dump_graphs(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from .dump_graphs import dump_graphs
    from .graphs.dump import diff_dumps

    if args.diff:
        missing = [d for d in args.diff if not (Path(d) / "summary.json").is_file()]
        if missing:
            print(f"error: dump-graphs --diff: {missing[0]} is not a graph dump (no summary.json)", file=sys.stderr)
            return 2
        changes = diff_dumps(*args.diff)
        print("\n".join(changes) if changes else f"no differences between {args.diff[0]} and {args.diff[1]}")
        return 0
    if not args.model or not args.out:
        print("error: dump-graphs needs --model and --out (or --diff A B)", file=sys.stderr)
        return 2
    if args.draft_quantization == "int8" and args.drafter != "mtp":
        print("error: dump-graphs --draft-quantization int8 needs --drafter mtp (only its head drafts from weights)",
              file=sys.stderr)
        return 2
    if args.drafter != "ngram" and not args.speculative_tokens:
        print("error: dump-graphs --drafter needs --speculative-tokens K (the verify step's drafts)", file=sys.stderr)
        return 2
    torch.set_num_threads(engine_threads(args))
    summary = dump_graphs(args.model, args.out, buckets=tuple(args.buckets) if args.buckets else None,
                          backend=args.backend, device=args.device, draft_tokens=args.speculative_tokens,
                          drafter=args.drafter, draft_quantization=args.draft_quantization)
    print((Path(args.out) / "summary.md").read_text(), end="")
    for step in ("verify", "draft"):
        if step in summary:
            print("\n" + (Path(args.out) / step / "summary.md").read_text(), end="")
    print(f"wrote {args.out}/ ({len(summary['buckets'])} buckets)")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from .engine import Engine
    from .profile import PER_LAYER, UNIT, profile, run_nsys

    out = Path(args.out)
    if args.nsys:
        return run_nsys(sys.argv[1:] if args.argv is None else args.argv, out)
    torch.set_num_threads(engine_threads(args))
    out.mkdir(parents=True, exist_ok=True)  # an unwritable folder fails now, not after building the engine
    engine = Engine.from_pretrained(args.model, **_engine_args(args))
    summary = profile(engine, out, batch=args.batch, steps=args.steps)
    print(f"wrote {out}/trace.json (open in https://ui.perfetto.dev or chrome://tracing)")
    print("per layer (us):", {k: round(v) for k, v in summary["per_layer_us"].items()})
    for kind in ("verify", "draft"):
        if PER_LAYER[kind] in summary:
            print(f"{kind} per {UNIT[kind]} (us):", {k: round(v) for k, v in summary[PER_LAYER[kind]].items()})
    print("per conv stream (us):", {k: round(v) for k, v in summary["per_stream_us"].items()})
    print("prep vs compute (us):", {k: round(v) for k, v in summary["phases_us"].items()})
    for kind, ops in summary["per_op_us"].items():
        top = list(ops.items())[:8]
        print(f"{kind} ops per forward (us, calls):", {k: (round(v["us"], 1), round(v["calls"], 1)) for k, v in top})
    print(f"wrote {out}/summary.png" if summary["png"] else "no summary.png: matplotlib is not installed")
    return 0


def _roofline(args: argparse.Namespace) -> int:
    from .roofline import roofline, roofline_table

    machines, rows = [], []
    for config in args.configs:
        m, r = roofline(config, args.batches, context=args.context, threads=args.threads, kinds=tuple(args.steps),
                        extend_tokens=args.extend_tokens, quantization=args.quantization)
        machines, rows = machines + m, rows + r
    print(roofline_table(machines, rows), end="")
    return 0


def engine_threads(args: argparse.Namespace) -> int:
    """--threads, else torch's default (every core; OMP_NUM_THREADS if set) shared among the ranks of a
    tensor-parallel run on this machine. The engine pins the count it is built under."""
    import torch

    if getattr(args, "threads", None):
        return args.threads
    return max(1, torch.get_num_threads() // max(1, getattr(args, "tensor_parallel_size", 1) or 1))


class Parser(argparse.ArgumentParser):
    """argparse with every default in the help and one `error:` line (exit 2) for a bad command line."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0..65535; 0 takes a free one)")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds >= 0 (nan, inf and negatives are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds >= 0")
    return value


def token_ids(text: str) -> list[int]:
    """'5,6,7' -> [5, 6, 7]; anything else is an argparse error naming the bad part."""
    ids = []
    for part in text.split(","):
        try:
            ids.append(int(part, 10))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated token ids (bad part: {part!r})") \
                from None
    return ids


def _add_engine_options(p: argparse.ArgumentParser, max_batch_size: int = 32, buckets=None) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "fp32", "bf16"],
                   help="weights and caches (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--quantization", default=None, choices=["none", "int8"],
                   help="int8: every projection, expert and the lm_head stored as int8 with one scale per output "
                        "row (default: as the checkpoint is; an int8 checkpoint loads as int8)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="decode through the compiled decode graph (--no-compile: the eager path)")
    p.add_argument("--compile-extend", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill through the one compiled extend graph too (--no-compile-extend: prefill eagerly)")
    p.add_argument("--parallel-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="a second process compiles the decode step while this one compiles the others, where the "
                        "machine has a second core (--no-parallel-compile: one after another, here)")
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "eager", "aot_eager", "tensorrt"],
                   help="torch.compile backend of the decode graphs")
    p.add_argument("--max-batch-size", type=positive_int, default=max_batch_size,
                   help="requests decoded together (slots in the state pool)")
    p.add_argument("--buckets", type=positive_int, nargs="+", default=buckets,
                   help="batch sizes to compile a graph for (default: powers of two up to --max-batch-size)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="tokens to generate per prompt")
    p.add_argument("--prefill-chunk-tokens", type=positive_int, default=None,
                   help="prompt tokens prefilled per step while requests decode, all requests together (longer "
                        "prompts take several; default 256; set alone, it also caps --idle-prefill-tokens)")
    p.add_argument("--idle-prefill-tokens", type=positive_int, default=None,
                   help="prompt tokens a step may prefill while no request decodes (default 2048, or "
                        "--prefill-chunk-tokens when that is given)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the cached state of prompt prefixes other requests had (--no-prefix-cache: off)")
    p.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="a step that prefills also decodes the running requests, in one forward (--no-mixed-steps: "
                        "a decode forward of its own first; speculative decoding never mixes)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads per rank (default: torch's, every core, shared among the ranks)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="ranks the model is sharded over: worker processes on this machine, or the ranks of a "
                        "torchrun launch")
    _add_speculative_options(p)


def _add_speculative_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=["ngram", "mtp"], default=None,
                   help="speculative decoding: prompt-lookup drafts, or the checkpoint's MTP head (default: off)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=2,
                   help="draft tokens checked per request and step (with --speculative)")
    p.add_argument("--draft-quantization", choices=["none", "int8"], default=None,
                   help="the weights the MTP head drafts from (int8, with --speculative mtp: a copy of its "
                        "projections and of the lm_head in int8, a quarter of the bytes; the output is the same, "
                        "only acceptance may move; default: as loaded)")


def build_parser() -> argparse.ArgumentParser:
    from .tiny import TINY_CONFIGS

    p = Parser(prog="inkling-compiled", description="A compiled decode engine for Inkling models")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="Python prompts completed in one batch by the shipped trained checkpoint")
    demo.add_argument("--model", help="checkpoint folder (default: the shipped checkpoint, inkling-pystd)")
    _add_engine_options(demo, max_batch_size=8)
    demo.set_defaults(max_new_tokens=48)
    demo.set_defaults(one_bucket=True)  # one graph, of --max-batch-size: quick to compile the first time
    demo.set_defaults(run=_demo)

    gen = sub.add_parser("generate", help="generate from prompts with a checkpoint")
    gen.add_argument("--model", required=True, help="checkpoint folder")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--token-ids", action="store_true", help="prompts are comma-separated token ids")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set reaching this mass (1 = off)")
    gen.add_argument("--seed", type=int, default=None, help="0..2**64-1 (default: the engine draws one)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the eos token")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_engine_options(gen)
    gen.set_defaults(run=_generate)

    ev = sub.add_parser("eval", help="perplexity and bits per byte of a text file (prompt logprobs over windows)")
    ev.add_argument("--model", required=True, help="checkpoint folder (with its tokenizer.json)")
    ev.add_argument("--text", required=True, help="a UTF-8 text file")
    ev.add_argument("--max-model-len", type=positive_int, default=2048, help="prompt + generated tokens per request")
    ev.add_argument("--window", type=positive_int, default=None,
                    help="tokens per scored window (default: --max-model-len - 1)")
    ev.add_argument("--stride", type=positive_int, default=None,
                    help="tokens between window starts; each scored token has at least window - stride before it "
                         "(default: half the window)")
    ev.add_argument("--max-tokens", type=positive_int, default=None, help="score only the text's first N tokens")
    ev.add_argument("--compare", action="store_true", help="also score it with transformers (needs transformers)")
    ev.add_argument("--json", default=None, help="also write the results here")
    ev.add_argument("--quiet", action="store_true", help="no progress lines")
    _add_engine_options(ev)
    ev.set_defaults(run=_eval)

    bench = sub.add_parser("bench", help="decode tokens/s vs transformers' generate (same weights)")
    bench.add_argument("--configs", nargs="+", default=["tiny", "small"], choices=sorted(TINY_CONFIGS),
                       help="tiny checkpoint configs to run")
    bench.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8, 32], help="batch sizes")
    bench.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens per request")
    bench.add_argument("--new-tokens", type=positive_int, default=64, help="tokens generated per request")
    bench.add_argument("--engines", nargs="+", default=["compiled", "eager", "transformers"],
                       choices=["compiled", "eager", "transformers"], help="what to measure")
    bench.add_argument("--threads", type=positive_int, default=1,
                       help="intra-op threads for every engine and transformers alike")
    bench.add_argument("--quantization", nargs="+", choices=["none", "int8"], default=None,
                       help="run each engine with these weights (none int8: also a table of int8 against fp32)")
    bench.add_argument("--json", default="bench-decode.json", help="results file")
    bench.add_argument("--png", default="bench-decode.png", help="plot (needs matplotlib: the [bench] extra)")
    bench.add_argument("--compile-times", nargs="*", default=[], metavar="CONFIG",
                       help="also time cold and warm warm-up of all default buckets for these configs, packaged and traced")
    bench.add_argument("--parallel-compile", action=argparse.BooleanOptionalAction, default=True,
                       help="--compile-times: the engine's parallel_compile (--no-parallel-compile: every step "
                            "compiled in the one process)")
    bench.add_argument("--compile-times-verify", type=positive_int, default=0, metavar="K",
                       help="--compile-times: the engine also compiles a verify step for K drafts (n-gram drafter)")
    bench.add_argument("--speculative", nargs="+", choices=["ngram", "mtp", "replay"], default=None,
                       help="instead: compiled speculative decoding with these drafters against compiled plain "
                            "decoding on a copy workload, every layer made sliding (replay: the plain run's own "
                            "tokens as drafts, the ceiling)")
    bench.add_argument("--num-speculative-tokens", type=positive_int, nargs="+", default=[2],
                       help="K for --speculative (several: a run for each)")
    bench.add_argument("--draft-quantization", nargs="+", choices=["none", "int8"], default=["none"],
                       help="--speculative mtp: an MTP engine for each of these draft weights ('mtp', 'mtp int8')")
    bench.add_argument("--rounds", type=positive_int, default=3,
                       help="--speculative: rounds of a plain run then each drafter's, in turns (each row keeps "
                            "the median round's speed-up, and every round's in the JSON)")
    bench.add_argument("--model", default=None,
                       help="--speculative on this checkpoint's held-out prompts (held_out.json, as "
                            "tools/train_tiny.py writes it) instead of the copy workload on --configs")
    bench.add_argument("--tensor-parallel-size", nargs="+", type=positive_int, default=None, metavar="N",
                       help="instead: compiled decode at each of these tensor-parallel sizes (one thread per rank), "
                            "with rank 0's step split into collectives, step message and compute")
    bench.add_argument("--copy-overlap", type=positive_int, default=600,
                       help="--speculative: tokens of the copied span already in the prompt (covering the "
                            "sliding layers' receptive field makes the continuation a copy)")
    bench.set_defaults(run=_bench)
    roof = sub.add_parser("roofline", help="this machine's bandwidth and matmul rate per thread count, each step "
                                           "kind's floor, and how close the compiled engine gets")
    roof.add_argument("--configs", nargs="+", default=["small"], choices=sorted(TINY_CONFIGS),
                      help="tiny checkpoint configs to run")
    roof.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8, 32], help="batch sizes")
    roof.add_argument("--context", type=positive_int, default=128,
                      help="tokens in each sequence's cache (prompt = context - 64, then 64 new tokens)")
    roof.add_argument("--threads", type=positive_int, nargs="+", default=None,
                      help="intra-op thread counts to measure at (default: 1 and torch's default, all cores)")
    roof.add_argument("--steps", nargs="+", default=["decode", "verify", "extend"],
                      choices=["decode", "verify", "extend"], help="step kinds to time against their floor")
    roof.add_argument("--extend-tokens", type=positive_int, default=256, help="tokens of the timed prefill chunk")
    roof.add_argument("--quantization", default="none", choices=["none", "int8"],
                      help="the engine's weights (int8: its floor counts the int8 bytes)")
    roof.set_defaults(run=_roofline)
    dump = sub.add_parser("dump-graphs", help="write each bucket's graphs, code, guards and op census as text")
    dump.add_argument("--model", help="checkpoint folder")
    dump.add_argument("--out", help="output folder")
    dump.add_argument("--buckets", type=positive_int, nargs="+", default=None,
                      help="batch sizes to dump (default: powers of two up to 32)")
    dump.add_argument("--backend", default="inductor", choices=["inductor", "eager", "aot_eager"],
                      help="compile backend to record")
    dump.add_argument("--device", default="cpu", help="cpu or cuda")
    dump.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's, every core)")
    dump.add_argument("--speculative-tokens", type=positive_int, default=0, metavar="K",
                      help="also dump the verify step for K drafts, under OUT/verify")
    dump.add_argument("--drafter", choices=["ngram", "mtp"], default="ngram",
                      help="the verify step's drafter with --speculative-tokens (mtp: the checkpoint's MTP head, "
                           "whose draft step is dumped too, under OUT/draft)")
    dump.add_argument("--draft-quantization", choices=["none", "int8"], default=None,
                      help="--drafter mtp: the weights the draft step reads (int8: see --draft-quantization of "
                           "generate)")
    dump.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two dump folders instead")
    dump.set_defaults(run=_dump_graphs)

    prof = sub.add_parser("profile", help="profile a fixed decode workload (torch.profiler trace, or nsys)")
    prof.add_argument("--model", required=True, help="checkpoint folder")
    prof.add_argument("--out", default="profile-out", help="output folder")
    prof.add_argument("--batch", type=positive_int, default=4, help="requests in the workload")
    prof.add_argument("--steps", type=positive_int, default=8, help="measured decode steps")
    prof.add_argument("--nsys", action="store_true", help="print (and run, where nsys exists) the nsys command")
    _add_engine_options(prof, max_batch_size=8)
    prof.set_defaults(run=_profile, argv=None)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the [serve] extra)")
    srv.add_argument("--model", required=True, help="checkpoint folder (with its tokenizer.json)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=port_number, default=8000, help="port to listen on (0: a free one, printed)")
    srv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the folder's)")
    srv.add_argument("--max-waiting", type=positive_int, default=256,
                     help="requests that may wait for a slot; more get 429 with Retry-After")
    srv.add_argument("--shutdown-timeout", type=seconds, default=10.0,
                     help="seconds SIGINT/SIGTERM waits for requests in flight before aborting them")
    from .server.body import Limits  # msgspec only: no web framework to import for --help

    limits = Limits()
    srv.add_argument("--max-body-bytes", type=positive_int, default=limits.max_body_bytes,
                     help="largest request body; larger ones get 413 before they are read")
    srv.add_argument("--max-stop-strings", type=positive_int, default=limits.max_stop_strings,
                     help="stop strings and stop token ids per request")
    srv.add_argument("--max-stop-chars", type=positive_int, default=limits.max_stop_chars,
                     help="characters per stop string")
    srv.add_argument("--max-header-bytes", type=positive_int, default=limits.max_header_bytes,
                     help="largest request line and headers together (then 431 and closed)")
    srv.add_argument("--header-timeout", type=seconds, default=limits.header_timeout,
                     help="seconds a connection may take to send a request's headers (then 408 and closed)")
    srv.add_argument("--body-timeout", type=seconds, default=limits.body_timeout,
                     help="seconds a request may take to send its body after its headers (then 408)")
    srv.add_argument("--max-model-len", type=positive_int, default=2048, help="prompt + generated tokens per request")
    srv.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                     help="step the engine in a process of its own, so HTTP never waits for the interpreter "
                          "(--no-engine-process: on a thread of the server's process)")
    _add_engine_options(srv)
    srv.set_defaults(run=_serve)

    qz = sub.add_parser("quantize", help="write an int8 copy of a checkpoint (one scale per output row)")
    qz.add_argument("input", help="checkpoint folder (transformers names)")
    qz.add_argument("output", help="folder for the int8 checkpoint (config, tokenizer and other files copied)")
    qz.set_defaults(run=_quantize)

    bs = sub.add_parser("bench-serve", help="load a local server at several concurrencies, against the Python API")
    bs.add_argument("--config", default="small", choices=sorted(TINY_CONFIGS), help="tiny config to serve")
    bs.add_argument("--concurrency", nargs="+", type=positive_int, default=[1, 8, 32], help="clients at once")
    bs.add_argument("--requests", type=positive_int, default=64, help="requests per concurrency")
    bs.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens per request")
    bs.add_argument("--new-tokens", type=positive_int, default=64, help="tokens generated per request")
    bs.add_argument("--client", default="threads", choices=["threads", "aiperf"],
                    help="HTTP client: ours (a thread and a kept-alive connection per client) or aiperf")
    bs.add_argument("--aiperf", default="aiperf", help="the aiperf executable (--client aiperf)")
    bs.add_argument("--repeats", type=positive_int, default=3, help="runs per path and concurrency (median kept)")
    bs.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                    help="the server's engine in a process of its own, as serve runs it (--no-engine-process: on a "
                         "thread of the server's process)")
    bs.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=True,
                    help="both engines decode inside the prefill's forward when prompts arrive (--no-mixed-steps: "
                         "a decode forward of its own first)")
    bs.add_argument("--json", default="bench-serve.json", help="results file")
    bs.set_defaults(run=_bench_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import InklingError

    try:
        return args.run(args)
    except (InklingError, OSError) as e:  # OSError: an output folder that cannot be written, say
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
