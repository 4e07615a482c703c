"""Tensor and expert parallelism on CPU (gloo): shards, loading, multi-rank decoding against transformers,
per-rank graph census, failures.

Multi-rank tests start real worker processes (`Engine.from_pretrained(..., tensor_parallel_size=N)`), so
each one costs a few seconds of interpreter start-up; they share checkpoints and the transformers oracle.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import inkling_compiled.checkpoint as checkpoint_module
from inkling_compiled import ConfigError, Engine, OptionError, SamplingParams, load_model
from inkling_compiled.config import InklingConfig
from inkling_compiled.graphs.census import GraphRecorder
from inkling_compiled.parallel.runtime import ParallelError
from inkling_compiled.tiny import build_tiny_checkpoint

from conftest import checkpoint_named, random_prompt

PROMPTS = [random_prompt(n, seed=n) for n in (1, 5, 13, 21)]
SHARED = random_prompt(19, seed=99)  # a prompt prefix two requests share (a prefix-cache hit)
NEW = 10
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, logprobs=True)


@pytest.fixture(scope="module")
def five_experts(tmp_path_factory):
    """tiny with 5 routed experts: 3 + 2 on two ranks."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-e5"), "tiny", overrides={"n_routed_experts": 5})


@pytest.fixture(scope="module")
def oracle(five_experts, hf_greedy):
    """oracle(name, prompt) -> transformers' batch-1 greedy (tokens, logprobs) for "tiny" or "tiny-e5"."""
    transformers = pytest.importorskip("transformers")
    e5 = transformers.InklingForCausalLM.from_pretrained(five_experts, dtype=torch.float32).eval()
    cache = {}

    def get(name, prompt):
        if name == "tiny":
            return hf_greedy("tiny", prompt, NEW)
        key = tuple(prompt)
        if key not in cache:
            out = e5.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt):]
            logprobs = torch.log_softmax(torch.stack(out.logits, 1)[0].float(), -1).gather(-1, tokens[:, None])[:, 0]
            cache[key] = (tokens.tolist(), logprobs)
        return cache[key]

    return get


def serve_schedule(engine: Engine) -> dict[str, object]:
    """Continuous batching: requests arrive over several steps, one is aborted mid-decode, and the last
    two share a 19-token prefix (the second resumes from the prefix cache). Final outputs by prompt."""
    prompts = {f"p{i}": p for i, p in enumerate(PROMPTS)}
    prompts["shared-a"], prompts["shared-b"] = SHARED + [7, 8], SHARED + [9]
    final = {}

    def step():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out

    engine.add_request(prompts["p0"], GREEDY, request_id="p0")
    engine.add_request(prompts["p1"], GREEDY, request_id="p1")
    engine.add_request(random_prompt(9, seed=5), GREEDY, request_id="aborted")
    step()
    step()
    engine.add_request(prompts["p2"], GREEDY, request_id="p2")
    engine.add_request(prompts["shared-a"], GREEDY, request_id="shared-a")
    step()
    engine.abort("aborted")
    engine.add_request(prompts["p3"], GREEDY, request_id="p3")
    for _ in range(3 * NEW):
        step()
        if "shared-a" in final and "shared-b" not in prompts.get("_queued", ""):
            prompts["_queued"] = "shared-b"
            engine.add_request(prompts["shared-b"], GREEDY, request_id="shared-b")
        if not engine.has_unfinished():
            break
    assert final["aborted"].finish_reason == "abort"
    assert final["shared-b"].cached_tokens >= 16  # a full page of the shared prefix came from the cache
    return {rid: (prompts[rid], out) for rid, out in final.items() if rid != "aborted"}


def assert_matches_oracle(outputs: dict, oracle, name: str) -> None:
    for rid, (prompt, out) in outputs.items():
        tokens, logprobs = oracle(name, prompt)
        assert out.token_ids == tokens, rid
        torch.testing.assert_close(torch.tensor(out.logprobs), logprobs, rtol=0, atol=1e-4)


def assert_no_ranks_left(engine: Engine) -> None:
    for proc in engine.ranks.procs:
        assert proc.poll() is not None, f"rank process {proc.pid} still running"
    assert not dist.is_initialized()


# ---- shards and loading (in this process: no collectives needed) --------------------------------------

def _kv_rows(config: InklingConfig, layer: int, rank: int, world: int) -> list[int]:
    """Rows of k_proj a rank must hold: the KV heads its query heads read (head h reads h // group)."""
    g = config.geometry(layer)
    per_rank, group = g.num_heads // world, g.num_heads // g.num_kv_heads
    heads = sorted({h // group for h in range(rank * per_rank, (rank + 1) * per_rank)})
    return [head * g.head_dim + d for head in heads for d in range(g.head_dim)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", ["tiny", "tiny-e5"])
def test_shards_are_the_checkpoint_cut_by_heads_experts_and_vocabulary(checkpoint, five_experts, world, variant):
    path = checkpoint("tiny") if variant == "tiny" else five_experts
    full, _ = load_model(path)
    full_params = checkpoint_named(full)
    shards = [checkpoint_named(load_model(path, tensor_parallel=(r, world, None))[0]) for r in range(world)]
    config = full.config
    cut_dims = {"q_proj": 0, "r_proj": 0, "o_proj": 1, "gate_proj.weight": 0, "up_proj.weight": 0,
                "down_proj.weight": 1, "shared_experts.gate_proj": 1, "shared_experts.up_proj": 1,
                "shared_experts.down_proj": 2, ".experts.gate_up_proj": 0, ".experts.down_proj": 0}
    for name, whole in full_params.items():
        parts = [s[name] for s in shards]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            joined = torch.cat(parts)
            assert torch.equal(joined[:whole.shape[0]], whole) and not joined[whole.shape[0]:].any(), name
            assert len({p.shape for p in parts}) == 1  # equal shares: they gather into one tensor
        elif any(k in name for k in ("k_proj", "v_proj", "k_sconv", "v_sconv")):
            layer = int(name.split(".")[2])
            for rank, part in enumerate(parts):
                assert torch.equal(part, whole[_kv_rows(config, layer, rank, world)]), (name, rank)
        elif (dim := next((d for key, d in cut_dims.items() if key in name), None)) is not None:
            assert torch.equal(torch.cat(parts, dim=dim), whole), name
            if ".experts.gate_up_proj" in name:
                E = config.n_routed_experts
                assert [p.shape[0] for p in parts] == [E // world + (r < E % world) for r in range(world)]
        else:  # norms, router, the output convs, the relative-bias table: every rank holds all of it
            assert all(torch.equal(p, whole) for p in parts), name
    full_bytes = sum(p.numel() for p in full_params.values())
    assert all(sum(p.numel() for p in s.values()) < full_bytes * (0.75 if world == 2 else 0.5) for s in shards)


def test_loading_reads_only_the_ranks_slices(checkpoint, monkeypatch):
    """Every tensor a rank cuts is read through a slice of the file, never whole, and the bytes read are
    the rank's share (the mmap is touched only there)."""
    read: dict[str, int] = {}
    real = checkpoint_module.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            t = self.handle.get_tensor(name)
            read[name] = read.get(name, 0) + t.numel()
            return t

        def get_slice(self, name):
            sliced = self.handle.get_slice(name)

            class Slice:
                def get_shape(self):
                    return sliced.get_shape()

                def __getitem__(self, index):
                    t = sliced[index]
                    read[name] = read.get(name, 0) + t.numel()
                    return t

            return Slice()

    monkeypatch.setattr(checkpoint_module, "safe_open", Recording)
    full, _ = load_model(checkpoint("tiny"))
    read.clear()
    shard, _ = load_model(checkpoint("tiny"), tensor_parallel=(1, 2, None))
    held = checkpoint_named(shard)
    for name, whole in checkpoint_named(full).items():
        if held[name].shape == whole.shape:  # replicated: read once, whole
            assert read[name] == whole.numel(), name
        else:  # cut: only the share was read (the vocabulary's last share is padded with zeros after reading)
            assert read[name] <= held[name].numel() < whole.numel(), name
    assert sum(read.values()) < 0.7 * sum(p.numel() for p in full.parameters())


def test_what_cannot_be_sharded_is_refused_before_any_rank_starts(checkpoint):
    with pytest.raises(ConfigError, match=r"swa_num_attention_heads=3 is not divisible by tensor_parallel_size=2"):
        Engine.from_pretrained(checkpoint("tiny-k3"), tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2 neither divides"):
        Engine.from_pretrained(checkpoint("tiny-k3"), tensor_parallel_size=3)
    for options, message in ((dict(speculative="mtp"), "speculative='mtp'"), (dict(host_cache_bytes=1 << 20), "host tier"),
                             (dict(cpp_wrapper=True), "cpp_wrapper"), (dict(tensor_parallel_size=0), "tensor_parallel_size"),
                             (dict(tensor_parallel_timeout=0), "tensor_parallel_timeout")):
        with pytest.raises(OptionError, match=message):
            Engine.from_pretrained(checkpoint("tiny"), **{"tensor_parallel_size": 2, **options})
    assert not dist.is_initialized()


# ---- several ranks -------------------------------------------------------------------------------

def test_two_ranks_eager_serve_like_one_uneven_experts(five_experts, oracle):
    """5 experts on 2 ranks (3 + 2): continuous batching, an abort and a prefix-cache hit, tokens equal to
    transformers batch-1 and logprobs within 1e-4."""
    with Engine.from_pretrained(five_experts, compile=False, max_batch_size=4, tensor_parallel_size=2,
                                tensor_parallel_timeout=60, progress=False) as engine:
        assert_matches_oracle(serve_schedule(engine), oracle, "tiny-e5")
        # prompt logprobs: every rank scores the same positions (lm_head gathers across them)
        prompt = random_prompt(30, seed=8)
        scored = engine.generate([prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=1))[0]
        hf = pytest.importorskip("transformers").InklingForCausalLM.from_pretrained(five_experts, dtype=torch.float32)
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), -1)
        want = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(scored.prompt_logprobs[1:]), want, rtol=0, atol=1e-4)
        reports = engine.parallel_report()
        assert [r["rank"] for r in reports] == [0, 1]
        assert [r["shapes"]["model.layers.1.mlp.experts.gate_up_proj"][0] for r in reports] == [3, 2]
    assert_no_ranks_left(engine)


def test_four_ranks_compiled_one_graph_each_with_its_collectives(checkpoint, oracle):
    """Each rank compiles one graph for every bucket with zero breaks: 4 x layers sconv ops, an all-reduce
    after attention and after the MLP of every layer plus one for the embedding, one vocabulary gather."""
    layers = 4
    with Engine.from_pretrained(checkpoint("tiny"), compile=True, compile_backend=GraphRecorder("aot_eager"),
                                max_batch_size=4, tensor_parallel_size=4, tensor_parallel_timeout=120,
                                progress=False) as engine:
        assert_matches_oracle(serve_schedule(engine), oracle, "tiny")
        reports = engine.parallel_report()
        assert [len(r["graphs"]) for r in reports] == [1, 1, 1, 1] and engine.worker.decoder.graphs() == [(1, 2, 4)]
        for report in reports:
            (census,) = report["graphs"]
            ops = census["ops"]
            assert census["sconv_calls"] == 4 * layers
            assert ops.get("_c10d_functional::all_reduce") == 2 * layers + 1, ops
            assert sum(n for op, n in ops.items() if op.startswith("_c10d_functional::all_gather")) == 1, ops
            assert ops.get("_c10d_functional::wait_tensor") == 2 * layers + 2, ops
            # one head of 4: q's 16 rows, k's and v's of the KV head it reads, r's d_rel
            config = InklingConfig.from_file(checkpoint("tiny"))
            kv = len(_kv_rows(config, 1, 0, 4))
            assert report["shapes"]["model.layers.1.self_attn.qkvr_proj.weight"][0] == 16 + 2 * kv + config.d_rel
    assert_no_ranks_left(engine)


def test_two_ranks_inductor_with_speculative_verify(checkpoint, oracle):
    """Inductor graphs on both ranks, and n-gram speculation: verify steps run on every rank and each rank
    commits the windows of what its own (identical) acceptance chose."""
    repeat = [11, 12, 13, 14] * 4
    with Engine.from_pretrained(checkpoint("tiny"), compile=True, max_batch_size=4, buckets=(4,),
                                tensor_parallel_size=2, tensor_parallel_timeout=120, speculative="ngram",
                                progress=False) as engine:
        outs = engine.generate([repeat, PROMPTS[2]], GREEDY)
        assert engine.stats()["verify_steps"] > 0
    for prompt, out in zip([repeat, PROMPTS[2]], outs):
        tokens, logprobs = oracle("tiny", prompt)
        assert out.token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.logprobs), logprobs, rtol=0, atol=1e-4)
    assert_no_ranks_left(engine)


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_failed_rank_stops_every_rank_with_a_clear_error(checkpoint, how):
    timeout = 4.0
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4, tensor_parallel_size=2,
                                    tensor_parallel_timeout=timeout, progress=False)
    engine.add_request(PROMPTS[3], SamplingParams(max_new_tokens=50))
    engine.step()
    worker = engine.ranks.procs[0]
    os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    if how == "killed":
        worker.wait(10)
    started = time.monotonic()
    expected = r"rank 1 \(pid \d+\) was killed by signal 9" if how == "killed" else "tensor_parallel_timeout=4 s"
    with pytest.raises(ParallelError, match=expected):
        for _ in range(50):
            engine.step()
    assert time.monotonic() - started < timeout + 10
    assert_no_ranks_left(engine)
    with pytest.raises(ParallelError, match="every rank was stopped"):  # and it stays stopped
        engine.step()


def test_torchrun_ranks_join_the_group_it_started(checkpoint, tmp_path, oracle):
    """Under torchrun every rank runs the script: rank 0 gets the engine, the others serve it inside
    from_pretrained and exit when rank 0 closes it."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from inkling_compiled import Engine, SamplingParams
        engine = Engine.from_pretrained({str(checkpoint("tiny"))!r}, compile=False, max_batch_size=2,
                                        tensor_parallel_size=2, progress=False)
        out = engine.generate([{PROMPTS[2]!r}], SamplingParams(max_new_tokens={NEW}))
        print("TOKENS", out[0].token_ids)
        engine.close()
    """))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("TOKENS")]
    assert line == f"TOKENS {oracle('tiny', PROMPTS[2])[0]}"


def test_cli_generate_on_two_ranks_prints_what_one_rank_prints(checkpoint, capsys):
    from inkling_compiled.cli import main

    args = ["generate", "--model", str(checkpoint("tiny")), "--prompt", "5,6,7", "--prompt", "9", "--token-ids",
            "--max-new-tokens", "6", "--ignore-eos", "--quiet", "--no-compile"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main(args + ["--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == one and not dist.is_initialized()


def test_profile_of_a_tensor_parallel_engine_finishes(checkpoint, tmp_path):
    """`profile` on two ranks times rank 0's compiled replays; it traces no census probe there, whose step
    would run collectives that no other rank joins (before, it waited for them until the timeout)."""
    from inkling_compiled.profile import profile

    engine = Engine.from_pretrained(checkpoint("tiny"), compile=True, compile_backend="eager", max_batch_size=2,
                                    buckets=(2,), progress=False, tensor_parallel_size=2, tensor_parallel_timeout=30)
    try:
        summary = profile(engine, tmp_path, batch=2, steps=2)
    finally:
        engine.close()
    assert summary["labelled"] == [] and summary["phases_us"]["decode compute"] > 0
    assert summary["phases_us"]["prepare"] > 0


def test_a_rank_that_cannot_start_is_reported_at_once(checkpoint, monkeypatch):
    import inkling_compiled.parallel.runtime as runtime

    monkeypatch.setattr(runtime, "_WORKER_ENTRY", "import sys; sys.exit(7)")
    started = time.monotonic()
    with pytest.raises(ParallelError, match=r"rank 1 \(pid \d+\) exited with code 7"):
        Engine.from_pretrained(checkpoint("tiny"), compile=False, tensor_parallel_size=2, progress=False)
    assert time.monotonic() - started < 30 and not dist.is_initialized()  # not the 300 s group timeout


class FlakyDrafter:
    """Prompt lookup that raises for one request id: a host-side failure before anything is sent."""

    def __new__(cls, bad: str):
        from inkling_compiled.spec import NgramDrafter

        class Flaky(NgramDrafter):
            def propose(self, reqs):
                if any(r.request_id == bad for r in reqs):
                    raise ValueError(f"drafter bug for {bad}")
                return super().propose(reqs)

        return Flaky(2)


def test_what_fails_on_rank_0_alone_stays_contained(checkpoint):
    """A drafter that raises before the step is sent fails only its batch, as on one rank; an interrupt
    inside a sent step stops the ranks and propagates as itself; bad options are the same errors as on
    one rank."""
    with pytest.raises(TypeError, match="max_bach_size"):
        Engine.from_pretrained(checkpoint("tiny"), tensor_parallel_size=2, max_bach_size=3)
    with pytest.raises(OptionError, match="page_size"):
        Engine.from_pretrained(checkpoint("tiny"), compile=False, tensor_parallel_size=2, page_size=0)
    assert not dist.is_initialized()
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4, tensor_parallel_size=2,
                                    speculative=FlakyDrafter("bad"), progress=False)
    engine.add_request(PROMPTS[1], GREEDY, request_id="bad")
    failed = {o.request_id: o for o in engine.generate([PROMPTS[2]], GREEDY) + engine.step()}
    assert failed["bad"].finish_reason == "error" and "drafter bug" in failed["bad"].error
    assert engine.ranks.dead() is None
    (again,) = engine.generate([PROMPTS[2]], GREEDY)  # still serving, and right
    assert again.finish_reason == "length" and len(again.token_ids) == NEW

    real = engine.worker.runner.run
    engine.worker.runner.run = lambda plan: (_ for _ in ()).throw(KeyboardInterrupt)  # after the plan went out
    engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.worker.runner.run = real
    assert_no_ranks_left(engine)
    with pytest.raises(ParallelError, match="every rank was stopped"):
        engine.step()


def test_an_interrupted_warm_up_stops_the_ranks_at_once(checkpoint):
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=True, compile_backend="eager", warmup=False,
                                    max_batch_size=4, tensor_parallel_size=2, progress=False)
    engine.worker.decoder.warmup = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.warm_up([4])
    assert_no_ranks_left(engine)
    started = time.monotonic()
    with pytest.raises(ParallelError):
        engine.generate([PROMPTS[0]], GREEDY)
    assert time.monotonic() - started < 5


def test_a_report_from_a_hung_rank_times_out(checkpoint):
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4, tensor_parallel_size=2,
                                    tensor_parallel_timeout=4, progress=False)
    engine.generate([PROMPTS[0]], GREEDY)
    os.kill(engine.ranks.procs[0].pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(ParallelError, match="tensor_parallel_timeout=4 s"):
        engine.parallel_report()
    assert time.monotonic() - started < 15
    assert_no_ranks_left(engine)
