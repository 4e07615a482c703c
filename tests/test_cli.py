"""The command line, run in-process."""

import importlib.util
import json
import math
import re

import pytest
import torch

from inkling_compiled.cli import DEMO_PROMPTS, main


def test_demo_prints_every_prompt_and_a_rate(checkpoint, capsys):
    assert main(["demo", "--model", str(checkpoint("tiny")), "--max-new-tokens", "3", "--compile-backend", "eager"]) == 0
    out = capsys.readouterr().out
    assert all(repr(p) in out for p in DEMO_PROMPTS)
    assert "tokens/s" in out


def test_generate_token_ids_and_bad_prompt(checkpoint, capsys):
    path = str(checkpoint("tiny"))
    assert main(["generate", "--model", path, "--prompt", "5,6,7", "--token-ids", "--max-new-tokens", "4",
                 "--ignore-eos", "--quiet", "--no-compile"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(json.loads(printed)) == 4
    assert main(["generate", "--model", path, "--prompt", "5,999", "--token-ids", "--quiet", "--no-compile"]) == 2
    assert "token id 999 at position 1 is out of range" in capsys.readouterr().err


def test_bench_writes_json_with_ratios(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--configs", "tiny", "--batches", "1", "2", "--prompt-len", "8", "--new-tokens", "4",
                 "--engines", "eager", "transformers", "--json", str(out), "--png", str(png)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["batch"] for r in runs] == [1, 2]
    assert all(r["eager"]["tok_s"] > 0 and r["transformers"]["tok_s"] > 0 for r in runs)
    assert all(0 < r["eager"]["of_floor"] < 1.5 for r in runs)  # a fraction of the floor measured in the run
    printed = capsys.readouterr().out
    assert "eager / transformers" in printed and "eager / floor" in printed and "1 thread(s); floor at" in printed
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.is_file() and png.stat().st_size > 0
    else:
        assert not png.exists() and "no PNG: matplotlib is not installed" in printed


def test_a_steps_floor_counts_its_tokens_weights_and_rows(checkpoint):
    """step_cost against a count by hand: FLOPs scale with tokens (a verify row carries 1 + K), routed
    experts are read as far as the tokens reach them, and state is read once per row."""
    from inkling_compiled.engine import Engine
    from inkling_compiled.floor import step_cost

    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, progress=False)
    model, pool, config = engine.model, engine.worker.pool, engine.config
    one, three = step_cost(model, pool, 1, 1, 40), step_cost(model, pool, 3, 1, 40)
    assert three["flops"] == pytest.approx(3 * one["flops"])
    E, k = config.n_routed_experts, config.num_experts_per_tok
    assert one["experts_reached"] == pytest.approx(k)
    assert three["experts_reached"] == pytest.approx(E * (1 - (1 - k / E) ** 3))
    bank = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    embed_row = config.hidden_size * 4
    assert three["bytes"] - one["bytes"] == pytest.approx(bank / E * (three["experts_reached"] - k) + 2 * embed_row)
    two_rows = step_cost(model, pool, 3, 2, 40)  # the same tokens over two rows: one more row's state
    assert two_rows["flops"] == three["flops"] and two_rows["bytes"] > three["bytes"]


@pytest.mark.parametrize("workload", [["--model", "MODEL"], ["--configs", "tiny"]], ids=["model", "copy"])
def test_the_speculative_bench_runs_at_the_threads_asked(workload, monkeypatch):
    """`bench --speculative --threads 2`: the engines are built, and the machine's rates (the roofline
    column's) measured, at two threads (before, the speculative bench ran at one whatever was asked)."""
    from inkling_compiled import bench
    from inkling_compiled.tiny import trained_checkpoint

    class Built(Exception):
        pass

    seen = {}

    def rates(threads):
        seen["rates at"] = threads
        return {"bandwidth_gb_s": 10.0, "matmul_gflop_s": 100.0}

    def from_pretrained(*args, **kwargs):
        seen["engine threads"] = torch.get_num_threads()
        raise Built

    monkeypatch.setattr(bench, "measure_machine", rates)
    monkeypatch.setattr(bench.Engine, "from_pretrained", from_pretrained)
    argv = [str(trained_checkpoint()) if a == "MODEL" else a for a in workload]
    try:
        with pytest.raises(Built):
            main(["bench", "--speculative", "mtp", *argv, "--batches", "1", "--num-speculative-tokens", "1",
                  "--threads", "2"])
    finally:
        torch.set_num_threads(1)
    assert seen == {"rates at": 2, "engine threads": 2}


def test_the_speculative_bench_takes_rounds_in_turns_and_keeps_the_median_round(monkeypatch):
    """Three rounds: plain, mtp, plain, mtp, plain, mtp; each round's speed-up is its mtp run over the plain
    run just before it, and the row keeps the round of median speed-up (not the ratio of two medians)."""
    from inkling_compiled import bench

    plain_rates, mtp_rates = iter([100.0, 50.0, 80.0]), iter([150.0, 90.0, 96.0])  # rounds: 1.5x, 1.8x, 1.2x
    order = []

    def bench_engine(engine, prompts, new_tokens):
        order.append(engine)
        return {"tok_s": next(plain_rates if engine == "plain" else mtp_rates), "ttft_ms": 1.0}

    class Mtp(str):  # a speculative engine as `_spec_row` reads it
        def stats(self):
            return {"spec_proposed": 0, "spec_accepted": 0, "depth_accepted": [], "depth_proposed": [],
                    "decode_tokens": 0, "row_steps": 0}

    monkeypatch.setattr(bench, "bench_engine", bench_engine)
    monkeypatch.setattr(bench, "roofline_speedup", lambda *args: 1.4)

    row = bench._spec_rows("m", 1, [[1, 2]], "plain", {"mtp": Mtp("mtp")}, 8, 2, {}, lambda *_: None, rounds=3)
    assert order == ["plain", "mtp"] * 3
    assert row["mtp"]["round_speedups"] == pytest.approx([1.5, 1.8, 1.2])
    assert row["mtp"]["speedup"] == pytest.approx(1.5) and row["mtp"]["tok_s"] == 150.0
    assert row["plain"]["tok_s"] == 80.0 and row["mtp"]["roofline_speedup"] == 1.4


def test_the_replay_drafter_knows_what_the_benchmark_sends_and_a_failed_request_fails_the_benchmark(checkpoint):
    """`bench_engine` sends each run its own variant of every prompt (`run_prompt`); `replay_outputs` replays
    each of those variants, so every draft is accepted. A drafter that fails its requests fails the benchmark rather than
    having their tokens counted as made. (Before, the replay drafter was keyed by the unvaried prompts: every
    request failed on a KeyError: `bench --speculative replay` reported 13x from runs that made nothing, and
    `roofline --steps verify` timed failed requests.)"""
    from conftest import random_prompt
    from inkling_compiled import bench
    from inkling_compiled.engine import Engine
    from inkling_compiled.sampling import SamplingParams

    new_tokens = 6
    prompts = [random_prompt(12, seed=5), random_prompt(9, seed=6)]
    options = dict(compile=False, max_batch_size=2, progress=False)
    greedy = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    # what `bench --speculative replay` and `roofline --steps verify` hand their replay drafter
    replayed = bench.replay_outputs(Engine.from_pretrained(checkpoint("tiny"), **options), [prompts], greedy)
    engine = Engine.from_pretrained(checkpoint("tiny"), speculative=bench.ReplayDrafter(replayed),
                                    num_speculative_tokens=2, **options)
    bench.bench_engine(engine, prompts, new_tokens)
    stats = engine.stats()
    assert stats["spec_accepted"] == stats["spec_proposed"] > 0
    unknown = Engine.from_pretrained(checkpoint("tiny"), speculative=bench.ReplayDrafter({}), num_speculative_tokens=2,
                                     **options)
    with pytest.raises(RuntimeError, match="a benchmarked request failed"):
        bench.bench_engine(unknown, prompts, new_tokens)


def test_a_draft_steps_cost_and_the_roofline_speedup(checkpoint):
    """draft_cost against the checkpoint file's own tensors: each depth's read once and multiplied over
    every token, the lm_head read once a depth and multiplied over one token a row. The roofline speed-up is
    tokens per step times a plain step's floor over a verify step's plus the draft step's (none for prompt
    lookup); rates set so that bytes bound one step kind and FLOPs another."""
    from safetensors import safe_open

    from inkling_compiled.bench import roofline_speedup
    from inkling_compiled.engine import Engine
    from inkling_compiled.floor import draft_cost, step_cost

    folder = checkpoint("tiny")
    shapes = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    rates = {"bandwidth_gb_s": 10.0, "matmul_gflop_s": 12.0}  # 1.2 FLOPs a byte: between decode's and verify's
    floor = lambda c: max(c["bytes"] / 10e9, c["flops"] / 12e9)
    for depths in (1, 2):
        engine = Engine.from_pretrained(folder, compile=False, speculative="mtp", num_speculative_tokens=depths,
                                        max_model_len=64, progress=False)
        rows, width = shapes["lm_head.weight"]
        lm_head = width * min(rows, engine.config.logits_vocab_size)  # the rows past the logits' vocab are not kept
        own = [shape for n, shape in shapes.items() if any(n.startswith(f"model.mtp.layers.{i}.") for i in range(depths))]
        matrices = sum(math.prod(shape) for shape in own if len(shape) >= 2)
        T = engine.drafter.tokens_per_row
        cost = draft_cost(engine.model, engine.drafter.head, depths, 3, T)
        assert cost["bytes"] == 4 * (sum(math.prod(shape) for shape in own) + depths * lm_head)  # fp32 in the engine
        assert cost["flops"] == 2 * 3 * (T * matrices + depths * lm_head)
        # int8 drafts: a byte a projection weight and 4 a row for its scale, the lm_head's copy likewise
        int8 = Engine.from_pretrained(folder, compile=False, speculative="mtp", num_speculative_tokens=depths,
                                      draft_quantization="int8", max_model_len=64, progress=False)
        projections = [shape for n, shape in shapes.items() if n.endswith("_proj.weight")
                       and any(n.startswith(f"model.mtp.layers.{i}.") for i in range(depths))]
        assert int8.drafter.head is not int8.model.model.mtp and projections
        lm_rows = min(rows, engine.config.logits_vocab_size)
        assert draft_cost(int8.model, int8.drafter.head, depths, 3, T)["bytes"] == (
            4 * sum(math.prod(shape) for shape in own) - sum(3 * math.prod(s) - 4 * s[0] for s in projections)
            + depths * (lm_head + 4 * lm_rows))
        model, pool = engine.model, engine.worker.pool
        plain, verify = step_cost(model, pool, 2, 2, 40), step_cost(model, pool, 2 * (depths + 1), 2, 40)
        assert floor(plain) == plain["bytes"] / 10e9 and floor(verify) == verify["flops"] / 12e9
        assert roofline_speedup(engine, rates, 2, depths, 1.5, 40) == pytest.approx(
            1.5 * floor(plain) / (floor(verify) + floor(draft_cost(model, engine.drafter.head, depths, 2, T))))
    lookup = Engine.from_pretrained(folder, compile=False, speculative="ngram", num_speculative_tokens=2,
                                    max_model_len=64, progress=False)
    model, pool = lookup.model, lookup.worker.pool
    assert roofline_speedup(lookup, rates, 1, 2, 2.0, 40) == pytest.approx(
        2.0 * floor(step_cost(model, pool, 1, 1, 40)) / floor(step_cost(model, pool, 3, 1, 40)))


def one_error_line(err: str, needle: str) -> None:
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err


@pytest.mark.parametrize("extra, needle", [
    (["--dtype", "garbage"], "--dtype: invalid choice: 'garbage'"),
    (["--threads", "0"], "--threads: '0' must be at least 1"),
    (["--max-batch-size", "0"], "--max-batch-size: '0' must be at least 1"),
    (["--max-new-tokens", "x"], "--max-new-tokens: 'x' is not an integer"),
])
def test_bad_options_are_one_error_line_and_exit_2(extra, needle, checkpoint, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(checkpoint("tiny")), "--prompt", "hi", *extra])
    assert e.value.code == 2
    one_error_line(capsys.readouterr().err, needle)


@pytest.mark.parametrize("extra, needle", [
    (["--prompt", "1,,2", "--token-ids"], "bad part: ''"),
    (["--prompt", "hi", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["--prompt", "hi", "--seed", "-1"], "seed must be None or an integer in 0..2**64-1"),
] + ([(["--prompt", "hi", "--device", "cuda"], "sees no CUDA device")] if not torch.cuda.is_available() else []))
def test_bad_requests_and_devices_are_one_error_line_and_exit_2(extra, needle, checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint("tiny")), "--no-compile", "--quiet", *extra]) == 2
    one_error_line(capsys.readouterr().err, needle)


def test_generated_text_reaches_the_terminal_escaped():
    from inkling_compiled.cli import printable

    assert printable("ok\x1b[31m red\x07\nnext\tcol") == "ok\\x1b[31m red\\x07\nnext\tcol"


def test_no_compile_extend_prefills_eagerly(checkpoint, monkeypatch):
    """--no-compile-extend reaches the engine: its compiled steps are decode's alone."""
    from inkling_compiled.engine import Engine

    built, real = [], Engine.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        built.append(real(cls, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(spy))
    for flag in ("--compile-extend", "--no-compile-extend"):
        assert main(["generate", "--model", str(checkpoint("tiny")), "--prompt", "5,6,7", "--token-ids",
                     "--max-new-tokens", "2", "--compile-backend", "eager", flag]) == 0
    assert [e.worker.extender is not None for e in built] == [True, False]


def test_no_parallel_compile_reaches_the_engine(checkpoint, monkeypatch):
    """--no-parallel-compile reaches from_pretrained (the default asks for the second process)."""
    from inkling_compiled.engine import Engine

    asked, real = [], Engine.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        asked.append(kwargs["parallel_compile"])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(spy))
    for flags in ([], ["--no-parallel-compile"]):
        assert main(["generate", "--model", str(checkpoint("tiny")), "--prompt", "5,6,7", "--token-ids",
                     "--max-new-tokens", "2", "--compile-backend", "eager", *flags]) == 0
    assert asked == [True, False]


def test_bench_compile_times_takes_the_parallel_compile_flag(monkeypatch, tmp_path, capsys):
    """bench --compile-times hands --no-parallel-compile to its start-up phases (default: the second
    process), and says which phases compiled the decode step beside the others."""
    import inkling_compiled.bench as bench

    asked = []

    def phases(config, max_batch_size, draft_tokens, parallel_compile):
        asked.append(parallel_compile)
        one = {"buckets": {"1": 1.0}, "verify_graphs": None, "total_s": 2.0, "first_token_s": 2.5,
               "compiled_beside": parallel_compile}
        return {"cold": one, "warm": {**one, "compiled_beside": False}}

    monkeypatch.setattr(bench, "compile_times", phases)
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: {"runs": []})
    monkeypatch.setattr(bench, "markdown_table", lambda *a, **k: "")
    for flags in ([], ["--no-parallel-compile"]):
        assert main(["bench", "--configs", "tiny", "--engines", "compiled", "--compile-times", "tiny",
                     "--json", str(tmp_path / "b.json"), "--png", str(tmp_path / "b.png"), *flags]) == 0
    assert asked == [True, False]
    out = capsys.readouterr().out
    assert out.count("the decode step compiled in a second process") == 1


def test_every_option_has_help_and_shows_its_default(capsys):
    from inkling_compiled.cli import build_parser

    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    for name, sub in subcommands.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.option_strings} has no help"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: 16)" in help_text and "(default: inductor)" in help_text


def test_dump_graphs_keeps_dynamo_logs_in_its_files(checkpoint, tmp_path, capfd):
    assert main(["dump-graphs", "--model", str(checkpoint("tiny")), "--out", str(tmp_path), "--buckets", "1",
                 "--backend", "eager"]) == 0
    out, err = capfd.readouterr()
    assert "GUARDS" not in err and len(err.splitlines()) < 5, err[:500]
    assert "| bucket |" in out
    assert "GUARDS" in (tmp_path / "bucket-1" / "guards.txt").read_text()


def test_demo_compiles_one_graph_of_its_batch_size(checkpoint, capsys):
    assert main(["demo", "--model", str(checkpoint("tiny")), "--max-new-tokens", "2", "--compile-backend", "eager",
                 "--max-batch-size", "4"]) == 0
    assert "compiled decode graphs (eager): bucket 4:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["bench", "--configs", "nope"], "--configs: invalid choice: 'nope'"),
])
def test_bad_bench_config_is_one_error_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    one_error_line(capsys.readouterr().err, needle)


def test_an_unwritable_output_folder_is_one_error_line(checkpoint, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["profile", "--model", str(checkpoint("tiny")), "--out", str(blocker / "sub"), "--no-compile",
                 "--steps", "1", "--batch", "1"]) == 2
    one_error_line(capsys.readouterr().err, "error: [Errno")


def test_generate_compiles_only_the_bucket_it_starts_in_and_says_so(checkpoint, capsys):
    """Two prompts: bucket 2's graph, no other; each start-up stage is a line on stderr off a terminal,
    the state pool's memory first."""
    assert main(["generate", "--model", str(checkpoint("tiny")), "--prompt", "5,6,7", "--prompt", "8,9",
                 "--token-ids", "--max-new-tokens", "3", "--ignore-eos", "--compile-backend", "eager"]) == 0
    err = capsys.readouterr().err
    stages = [line for line in err.splitlines() if line.startswith("inkling-compiled: ")]
    assert stages[0].startswith("inkling-compiled: memory: weights ") and "KV pages of 16 tokens" in stages[0]
    assert stages[1] == "inkling-compiled: compiling the decode step: bucket 2"
    assert "decode step ready: 1 graph(s) for buckets 2 in" in stages[2]
    assert not any("bucket 1" in line or "bucket 4" in line for line in stages)


def test_stage_log_draws_in_place_on_a_terminal_and_writes_lines_elsewhere():
    import io

    from inkling_compiled.progress import StageLog

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    pipe, tty = io.StringIO(), Terminal()
    for stream in (pipe, tty):
        log = StageLog(stream=stream)
        log("compiling", 1, 3)
        log.finish("ready")
    assert pipe.getvalue() == "inkling-compiled: compiling\ninkling-compiled: ready\n"
    assert tty.getvalue() == "\r\033[Kcompiling [#..]\r\033[Kready\n"
    quiet = io.StringIO()
    StageLog(False, stream=quiet)("compiling")
    assert quiet.getvalue() == ""


def test_roofline_prints_the_machine_and_each_step_kind_against_its_floor(capsys):
    # verify steps are timed as decode steps are (a speculative engine's), left out here for its compile time
    assert main(["roofline", "--configs", "tiny", "--batches", "1", "2", "--context", "72", "--threads", "1",
                 "--steps", "decode", "extend", "--extend-tokens", "64"]) == 0
    out = capsys.readouterr().out
    machine = out.splitlines()[0]
    assert machine.startswith("machine at 1 thread(s): ") and "GB/s weight streaming" in machine
    rates = [float(v) for v in re.findall(r"(?:copy|sum|GEMV) ([0-9.]+)", machine)]
    best = float(re.search(r": ([0-9.]+) GB/s", machine).group(1))
    assert len(rates) == 3 and best == pytest.approx(max(rates), abs=0.051)  # the floor's rate is the best of three
    # measured before each of the three timings and after the last; the floor takes the best of those
    slowest = float(re.search(r"slowest streamed ([0-9.]+) GB/s", machine).group(1))
    assert "best of 4 measurements between the timings" in machine and slowest <= best
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| tiny |")]
    assert [(r[2].strip(), int(r[3])) for r in rows] == [("decode", 1), ("decode", 2), ("extend", 1)]
    mbytes = {(r[2].strip(), int(r[3])): float(r[5]) for r in rows}
    mflop = {(r[2].strip(), int(r[3])): float(r[6]) for r in rows}
    assert mbytes["decode", 2] > mbytes["decode", 1]  # a second row reaches more experts
    assert mflop["extend", 1] == pytest.approx(64 * mflop["decode", 1], rel=0.2)  # 64 tokens (printed rounded)
    for r in rows:
        mbytes, floor_ms, ms, ratio = float(r[5]), float(r[8]), float(r[9]), float(r[10])
        assert mbytes > 0 and floor_ms > 0 and ms > 0
        # all three printed to 0.01: the bound follows the rounding (a floor of 0.015 ms prints as 0.02)
        assert abs(ratio - floor_ms / ms) <= 0.005 + 0.005 / ms + 0.005 * floor_ms / ms ** 2 + 1e-9


def test_the_floor_of_a_run_takes_each_rate_at_its_best():
    from inkling_compiled.floor import best_rates

    def measured(copy, gemv, matmul):
        return {"threads": 2, "copy_gb_s": copy, "reduce_gb_s": 1.0, "gemv_gb_s": gemv,
                "bandwidth_gb_s": max(copy, 1.0, gemv), "matmul_gflop_s": matmul}

    best = best_rates([measured(9.0, 12.0, 150.0), measured(11.0, 10.0, 160.0), measured(8.0, 7.0, 90.0)])
    assert best == {"threads": 2, "measurements": 3, "lowest_bandwidth_gb_s": 8.0, "copy_gb_s": 11.0,
                    "reduce_gb_s": 1.0, "gemv_gb_s": 12.0, "bandwidth_gb_s": 12.0, "matmul_gflop_s": 160.0}


def test_the_speculative_bench_builds_an_mtp_engine_per_draft_quantization():
    from inkling_compiled.bench import drafter_variants

    assert drafter_variants(["ngram", "mtp", "replay"], ["none", "int8"]) == {
        "ngram": {"speculative": "ngram"}, "mtp": {"speculative": "mtp", "draft_quantization": "none"},
        "mtp int8": {"speculative": "mtp", "draft_quantization": "int8"}, "replay": {"speculative": "replay"}}
    assert list(drafter_variants(["mtp"])) == ["mtp"]


def test_draft_quantization_reaches_the_engine_and_is_refused_without_mtp(checkpoint, capsys):
    tiny = str(checkpoint("tiny"))
    assert main(["generate", "--model", tiny, "--prompt", "5,6,7", "--token-ids", "--no-compile", "--max-new-tokens",
                 "4", "--speculative", "mtp", "--draft-quantization", "int8"]) == 0
    assert "speculative mtp (K=2, int8 drafts)" in capsys.readouterr().err
    assert main(["generate", "--model", tiny, "--prompt", "hi", "--no-compile", "--quiet",
                 "--draft-quantization", "int8"]) == 2
    one_error_line(capsys.readouterr().err, "only the MTP head drafts from weights of its own")
    assert main(["bench", "--configs", "tiny", "--speculative", "ngram", "--draft-quantization", "int8"]) == 2
    one_error_line(capsys.readouterr().err, "--draft-quantization builds MTP engines")
