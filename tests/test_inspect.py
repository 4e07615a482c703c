"""Inspection and profiling: graph dumps, their diff, NVTX on/off, the profile trace, prep cost."""

import json
import sys
from pathlib import Path

import pytest
import torch

from inkling_compiled import nvtx as nvtx_ranges
from inkling_compiled.cli import main
from inkling_compiled.engine import Engine
from inkling_compiled.dump_graphs import dump_graphs
from inkling_compiled.graphs.dump import diff_dumps
from inkling_compiled.sampling import SamplingParams

from conftest import random_prompt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_prep  # noqa: E402


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("dumps")
    a = dump_graphs(checkpoint("tiny"), root / "a", buckets=(1, 2), backend="eager")
    b = dump_graphs(checkpoint("tiny"), root / "b", buckets=(1, 2), backend="eager")
    c = dump_graphs(checkpoint("tiny"), root / "c", buckets=(1, 4), backend="eager")
    return root, a, b, c


def test_dump_summary_has_the_census(dumps, checkpoint):
    root, summary, _, _ = dumps
    assert set(summary["buckets"]) == {"1", "2"}
    records = summary["buckets"]
    assert (records["1"]["graphs"], records["2"]["graphs"]) == (1, 0)  # the symbolic graph serves both
    assert records["1"]["graph_folder"] == records["2"]["graph_folder"] == "bucket-1"
    assert not (root / "a" / "bucket-2").exists()
    for record in records.values():
        assert record["graph_breaks"] == 0 and record["recompiles"] == 0
        assert record["sconv_calls"] == 4 * 4 and record["ops"]["inkling::sconv_decode"] == 16
        assert record["pool_copies"] == 0 and record["compile_s"] > 0
        assert record["unstable_inputs"] == 0 and record["static_inputs"] > 0
    on_disk = json.loads((root / "a" / "summary.json").read_text())
    assert on_disk["buckets"]["1"]["sconv_calls"] == 16
    folder = root / "a" / "bucket-1"
    for name in ("dynamo_graph.txt", "guards.txt", "census.txt", "static_inputs.md"):
        assert (folder / name).stat().st_size > 0, name
    census = (folder / "census.txt").read_text()
    assert "inkling::sconv_decode  layer=3  stream=mlp" in census
    assert "<id>" in (folder / "guards.txt").read_text() or "0x" not in (folder / "guards.txt").read_text()
    assert (root / "a" / "summary.md").read_text().startswith("# Decode graphs")


def assert_one_clean_verify_graph(folder: Path, step: str, verify_convs: int) -> None:
    """A dump of buckets 1 and 2 of `step`: one symbolic graph for both, no breaks, recompiles or pool
    copies, and `verify_convs` verify convs (no decode conv) in each."""
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["step"] == step
    records = summary["buckets"]
    assert (records["1"]["graphs"], records["2"]["graphs"]) == (1, 0)
    for record in records.values():
        assert record["graph_breaks"] == 0 and record["recompiles"] == 0 and record["pool_copies"] == 0
        assert record["ops"]["inkling::sconv_verify"] == verify_convs and "inkling::sconv_decode" not in record["ops"]


def test_dump_of_the_verify_step(checkpoint, tmp_path, capsys):
    """`--speculative-tokens 2`: the verify step dumped beside decode, one symbolic graph for both buckets,
    every conv a verify conv, no breaks or recompiles; the CLI prints both summaries."""
    assert main(["dump-graphs", "--model", str(checkpoint("tiny")), "--out", str(tmp_path), "--buckets", "1", "2",
                 "--backend", "eager", "--speculative-tokens", "2"]) == 0
    assert_one_clean_verify_graph(tmp_path / "verify", "verify", verify_convs=16)
    assert "inkling::sconv_verify  layer=3  stream=mlp" in (tmp_path / "verify" / "bucket-1" / "census.txt").read_text()
    printed = capsys.readouterr().out
    assert "# Decode graphs of" in printed and "# Verify graphs of" in printed
    assert json.loads((tmp_path / "summary.json").read_text())["buckets"]["1"]["ops"]["inkling::sconv_decode"] == 16


def test_dump_of_the_mtp_draft_step(checkpoint, tmp_path, capsys):
    """`--speculative-tokens 2 --drafter mtp`: the draft step dumped beside decode and verify, one symbolic
    graph for both buckets, no breaks, recompiles or pool copies, and its census one verify conv per depth
    and stream; the CLI prints all three summaries."""
    K = 2
    assert main(["dump-graphs", "--model", str(checkpoint("tiny")), "--out", str(tmp_path), "--drafter", "mtp"]) == 2
    assert "--drafter needs --speculative-tokens" in capsys.readouterr().err
    assert main(["dump-graphs", "--model", str(checkpoint("tiny")), "--out", str(tmp_path), "--buckets", "1", "2",
                 "--backend", "eager", "--speculative-tokens", str(K), "--drafter", "mtp"]) == 0
    assert_one_clean_verify_graph(tmp_path / "draft", "MTP draft", verify_convs=4 * K)
    census = (tmp_path / "draft" / "bucket-1" / "census.txt").read_text()
    convs = sorted(line for line in census.splitlines() if line.startswith("inkling::sconv_verify"))
    assert convs == sorted(f"inkling::sconv_verify  layer={d}  stream={s}" for d in range(K)
                           for s in ("k", "v", "attn", "mlp"))
    printed = capsys.readouterr().out
    assert "# Decode graphs of" in printed and "# Verify graphs of" in printed and "# MTP draft graphs of" in printed


def test_dump_of_an_int8_draft_step(checkpoint, tmp_path, capsys):
    """`--draft-quantization int8`: the draft graph's projections are int8 products and the verify graph's
    stay fp32; asked for without the MTP drafter, one error line."""
    tiny = str(checkpoint("tiny"))
    assert main(["dump-graphs", "--model", tiny, "--out", str(tmp_path), "--speculative-tokens", "2",
                 "--draft-quantization", "int8"]) == 2
    assert "needs --drafter mtp" in capsys.readouterr().err
    assert main(["dump-graphs", "--model", tiny, "--out", str(tmp_path), "--buckets", "1", "--backend", "eager",
                 "--speculative-tokens", "2", "--drafter", "mtp", "--draft-quantization", "int8"]) == 0
    draft = (tmp_path / "draft" / "bucket-1" / "census.txt").read_text()
    verify = (tmp_path / "verify" / "bucket-1" / "census.txt").read_text()
    assert "inkling::linear_int8" in draft and "inkling::linear " not in draft
    assert "inkling::linear " in verify and "inkling::linear_int8" not in verify


def test_dump_diff_against_itself_is_empty_and_names_changes(dumps):
    root, *_ = dumps
    assert diff_dumps(root / "a", root / "b") == []
    changes = diff_dumps(root / "a", root / "c")
    assert f"bucket 2: only in {root / 'a'}" in changes
    assert f"bucket 4: only in {root / 'c'}" in changes


def test_dump_graphs_cli_diff(dumps, capsys):
    root, *_ = dumps
    assert main(["dump-graphs", "--diff", str(root / "a"), str(root / "b")]) == 0
    assert "no differences" in capsys.readouterr().out


def test_inductor_dump_scans_the_generated_code_and_finds_no_pool_copies(checkpoint, tmp_path):
    from inkling_compiled.graphs.dump import pool_copies_in_code

    summary = dump_graphs(checkpoint("tiny"), tmp_path, buckets=(1, 2), backend="inductor")
    record = summary["buckets"]["1"]
    # capturing the code resets Dynamo: bucket 2 must still find bucket 1's symbolic graph, not compile anew
    assert summary["buckets"]["2"]["graphs"] == 0 and summary["buckets"]["2"]["graph_folder"] == "bucket-1"
    code = (tmp_path / "bucket-1" / "output_code.py").read_text()
    assert code.count("torch.ops.inkling.sconv_decode.default(") == 16  # the scanner had real code to read
    assert record["pool_copies"] == 0 and record["graphs"] == 1 and record["graph_breaks"] == 0
    # and it reports a pool-sized buffer when one is there (the tiny k_global stream: 1 x 33 x 3 x 32)
    assert pool_copies_in_code(code + "\ndef call(args):\n    buf9 = empty_strided_cpu((2, 3, 32), (1, 1, 1))",
                               {(2, 3, 32)})


def test_aot_eager_dump_flags_the_pool_copies_it_makes(checkpoint, tmp_path):
    """aot_eager does not reinplace mutations: every mutated pool slice is cloned, and the dump says so."""
    summary = dump_graphs(checkpoint("tiny"), tmp_path, buckets=(1,), backend="aot_eager")
    assert summary["buckets"]["1"]["pool_copies"] >= 16
    assert summary["buckets"]["1"]["ops"].get("aten::mm", 0) > 0


class Tripwire:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        import contextlib

        return contextlib.nullcontext()


def test_nvtx_off_makes_no_call_and_on_gives_the_same_tokens(checkpoint, monkeypatch):
    import nvtx

    trip = Tripwire()
    monkeypatch.setattr(nvtx, "annotate", trip)
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4)
    prompts = [random_prompt(n, seed=n) for n in (3, 11)]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    off = [o.token_ids for o in engine.generate(prompts, params)]
    assert trip.calls == 0
    nvtx_ranges.enable(True)
    try:
        on = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        nvtx_ranges.enable(False)
    assert on == off
    layers = engine.config.num_hidden_layers
    # 5 steps (a prefill, then 4 decodes), each: step, prepare, forward, every layer, every conv stream
    assert trip.calls == 5 * (1 + 2 + layers + 4 * layers)


def test_profile_writes_a_trace_with_layer_ranges(checkpoint, tmp_path, capsys):
    out = tmp_path / "prof"
    assert main(["profile", "--model", str(checkpoint("tiny")), "--out", str(out), "--compile-backend", "eager",
                 "--batch", "2", "--steps", "3", "--buckets", "2"]) == 0
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"layer 0", "layer 3", "profile"} <= names
    assert any(str(n).startswith("inkling::sconv_decode [layer 2 v]") for n in names)  # census-labelled replay op
    assert "sconv mlp @ layer 3" in names  # recorded by the C++ kernel itself
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["per_stream_us"]) == {"k", "v", "attn", "mlp"}
    assert summary["phases_us"]["prepare"] > 0 and summary["phases_us"]["decode compute"] > 0
    assert summary["per_op_us"]["decode"]["inkling::sconv_decode"]["calls"] == 4 * 4  # 4 layers x 4 streams
    assert "decode ops per forward (us, calls):" in capsys.readouterr().out
    assert main(["profile", "--model", "m", "--nsys", "--out", str(tmp_path)]) == 0
    assert "--capture-range=nvtx --nvtx-capture=profile@inkling" in capsys.readouterr().out


def test_profile_splits_each_forward_into_the_ops_it_called_itself():
    """Per step kind, an op's time and calls per forward count only the outermost ops of that kind's
    forwards on their own thread (an op's callee is inside its caller's time; the graph's `##` wrapper,
    another thread's ops and ops outside the forwards are not ops of the forward), grouped without the
    census label; what the forwards spent around their ops is `(outside ops)`."""
    from inkling_compiled.profile import summarize

    def x(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [x("profile", 0, 10_000)]
    for t0, linear_us in ((100, 10), (1_000, 30)):  # two decode replays of 100 us
        events += [x("replay bucket 2 (2 rows)", t0, 100), x("## Call CompiledFxGraph ##", t0 + 1, 98),
                   x("inkling::linear [layer 0]", t0 + 5, linear_us), x("aten::empty", t0 + 6, 2),
                   x("inkling::sconv_decode [layer 0 k]", t0 + 50, 5), x("inkling::linear", t0 + 60, 4),
                   x("inkling::linear", t0 + 20, 50, tid=2)]  # another thread
    events += [x("verify replay bucket 2 (2 rows)", 3_000, 200), x("inkling::linear [layer 1]", 3_010, 80),
               x("inkling::linear", 5_000, 7)]  # after every forward
    ops = summarize(events)["per_op_us"]
    assert ops["decode"] == {"(outside ops)": {"us": 100 - (20 + 5 + 4), "calls": 0.0},
                             "inkling::linear": {"us": 20 + 4, "calls": 2.0},
                             "inkling::sconv_decode": {"us": 5.0, "calls": 1.0}}
    assert ops["verify"] == {"(outside ops)": {"us": 120.0, "calls": 0.0}, "inkling::linear": {"us": 80.0, "calls": 1.0}}


def test_profile_labels_verify_and_draft_replays_from_their_own_census(checkpoint, tmp_path):
    """Under MTP speculation every step verifies and drafts: each verify replay's conv ops are labelled
    by target layer and stream (all 4 streams of every layer, in layer order), each draft replay's by
    depth, and the summary gives both kinds their prep, compute and per-layer (per-depth) times."""
    K = 2
    out = tmp_path / "prof"
    assert main(["profile", "--model", str(checkpoint("tiny")), "--out", str(out), "--compile-backend", "eager",
                 "--batch", "2", "--steps", "3", "--buckets", "2", "--speculative", "mtp",
                 "--num-speculative-tokens", str(K)]) == 0
    layers = Engine.from_pretrained(checkpoint("tiny"), compile=False, progress=False).config.num_hidden_layers
    events = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]

    def conv_labels(prefix):
        replays = [e for e in events if e["name"].startswith(prefix)]
        assert replays, prefix
        for replay in replays:
            yield [e["name"].split("[", 1)[1].rstrip("]").split() for e in sorted(events, key=lambda e: e["ts"])
                   if e["name"].startswith("inkling::sconv_verify [") and e.get("tid") == replay.get("tid")
                   and replay["ts"] <= e["ts"] <= replay["ts"] + replay["dur"]]

    streams = {"k", "v", "attn", "mlp"}
    for labels in conv_labels("verify replay bucket 2"):
        assert [(w, int(n)) for w, n, _ in labels] == sorted((w, int(n)) for w, n, _ in labels)
        assert sorted((w, int(n), s) for w, n, s in labels) == sorted(
            ("layer", n, s) for n in range(layers) for s in streams)
    for labels in conv_labels("draft replay bucket 2"):
        assert sorted((w, int(n), s) for w, n, s in labels) == sorted(
            ("depth", d, s) for d in range(K) for s in streams)
    synthetic = {e["name"] for e in events if e.get("args", {}).get("synthetic")}
    assert {f"depth {d}" for d in range(K)} | {f"layer {n}" for n in range(layers)} == synthetic
    summary = json.loads((out / "summary.json").read_text())
    for kind in ("verify", "draft"):
        assert summary["phases_us"][f"prepare {kind}"] > 0 and summary["phases_us"][f"{kind} compute"] > 0
    assert list(summary["verify_per_layer_us"]) == [f"layer {n}" for n in range(layers)]
    assert list(summary["draft_per_depth_us"]) == [f"depth {d}" for d in range(K)]
    assert all(v > 0 for v in (*summary["verify_per_layer_us"].values(), *summary["draft_per_depth_us"].values()))


def test_the_profile_workload_keeps_every_measured_step_full_under_speculation():
    """A speculative step may emit K+1 tokens a row: each of the measured steps (after the prefill and the
    first decode) still has every request running when it starts, and what is left of them is aborted
    after the range. (Before, requests asked for steps + 3 tokens and a well-drafting engine finished
    them partway through the measured range.)"""
    from inkling_compiled.profile import run_workload

    class Speculating:  # emits K+1 tokens a request each step after the prefill, as if every draft were accepted
        num_speculative_tokens = 2

        def __init__(self):
            self.left, self.running_at_step = [], []

        def add_request(self, prompt, params):
            self.left.append(params.max_new_tokens)
            return len(self.left) - 1

        def abort(self, request_id):
            self.left[request_id] = 0

        def step(self):
            self.running_at_step.append(sum(n > 0 for n in self.left))
            first = len(self.running_at_step) == 1
            self.left = [max(n - (1 if first else self.num_speculative_tokens + 1), 0) for n in self.left]

        def has_unfinished(self):
            return any(self.left)

    engine = Speculating()
    run_workload(engine, batch=3, steps=5)
    assert engine.running_at_step[2:7] == [3] * 5
    assert len(engine.running_at_step) == 7  # then aborted, not run to their end under the profiler


def test_profile_labels_a_replay_whose_calls_inductor_reordered():
    """Inductor runs a layer's k projection and k conv before the v projection (the census, traced with
    the eager backend, has both projections first), and may swap two convs of a layer: each call is still
    labelled with its own layer, a conv with the stream its kernel names, the lm_head left unlabelled, and
    a replay whose calls are not the graph's (one missing) is left alone rather than mislabelled. (Before,
    labels were matched call by call in graph order: an inductor replay lost all but its first label.)"""
    from inkling_compiled.profile import label_trace

    census = [("inkling::linear", 0, None), ("inkling::linear", 0, None), ("inkling::sconv_decode", 0, "k"),
              ("inkling::sconv_decode", 0, "v"), ("inkling::linear", 1, None), ("inkling::sconv_decode", 1, "k"),
              ("inkling::linear", None, None)]
    replayed = ["inkling::linear", "inkling::sconv_decode", "inkling::linear", "inkling::sconv_decode",
                "inkling::linear", "inkling::sconv_decode", "inkling::linear"]
    kernel_streams = {1: "v", 3: "k", 5: "k"}  # layer 0's convs ran v first

    def replay(t0, calls):
        events = [{"ph": "X", "name": "replay bucket 2 (2 rows)", "ts": t0, "dur": 100, "tid": 1}]
        for i, name in enumerate(calls):
            events.append({"ph": "X", "name": name, "ts": t0 + 10 * i + 1, "dur": 8, "tid": 1})
            if i in kernel_streams:
                events.append({"ph": "X", "name": f"sconv {kernel_streams[i]} @ layer {int(i > 3)}",
                               "ts": t0 + 10 * i + 2, "dur": 5, "tid": 1})
        return events

    events = label_trace(replay(0, replayed) + replay(1000, replayed[:-1]), {"decode": census})
    named = [e["name"] for e in events if e["name"].startswith("inkling::")]
    assert named[:7] == ["inkling::linear [layer 0]", "inkling::sconv_decode [layer 0 v]", "inkling::linear [layer 0]",
                         "inkling::sconv_decode [layer 0 k]", "inkling::linear [layer 1]",
                         "inkling::sconv_decode [layer 1 k]", "inkling::linear"]
    assert named[7:] == replayed[:-1]
    spans = [(e["name"], e["ts"], e["dur"]) for e in events if e.get("args", {}).get("synthetic")]
    assert spans == [("layer 0", 1, 38), ("layer 1", 41, 18)]


def test_prep_singleton_allocates_nothing_per_step(checkpoint, capsys):
    assert bench_prep.main(["--config", "tiny", "--batch", "4", "--steps", "20"]) == 0
    out = capsys.readouterr().out
    singleton = next(line for line in out.splitlines() if line.startswith("singleton"))
    naive = next(line for line in out.splitlines() if line.startswith("naive ("))
    assert "   0 tensor allocations/step" in singleton
    assert int(naive.split(",")[1].split()[0]) >= 4 * 4  # at least one per conv read
    # the host-side measure sees numpy temporaries (which the tensor count cannot), and prep's are a few
    # small arrays per step
    import numpy as np

    assert bench_prep.host_peak_bytes(lambda: np.ones(10_000).sum()) >= 80_000
    one_host = int(singleton.split(",")[2].split()[0])
    assert one_host < 16_384
    torch.set_num_threads(1)


def test_host_split_refuses_to_time_steps_after_the_rows_end(checkpoint):
    """tools/host_split.py --steps past max_model_len once printed a 0.005 ms median of empty steps."""
    import host_split

    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_model_len=72, progress=False)
    engine.add_request(random_prompt(64, seed=1), SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert len(host_split.time_steps(engine, 4)) == 4  # the prefill, then decodes
    with pytest.raises(SystemExit, match="--steps 10 outlasts the rows: they end after 4 steps at max_model_len=72"):
        host_split.time_steps(engine, 10)
