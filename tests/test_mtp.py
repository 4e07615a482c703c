"""The MTP head: its forward against a plain-torch recipe built on transformers' own decoder layer, the
drafter's lagged state against that recipe from scratch, and MTP speculative decoding against plain
decoding and transformers."""

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from inkling_compiled import load_model
from inkling_compiled.engine import Engine
from inkling_compiled.sampling import SamplingParams

from conftest import count_guard_checks, random_prompt

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(max_new_tokens=12, logprobs=True, ignore_eos=True)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def hf_mtp_logits(hf, folder, tokens: list[int], depths: int) -> list[torch.Tensor]:
    """inkling-mtp.md §3 step by step, with transformers' modules: depth m over positions 0..n-1-m takes
    prev (h for m=1, else depth m-1's output) and the trunk-normed embedding of x_{q+m}, fuses
    input_proj(cat[hidden_norm(prev), embed_norm(e)]), runs one decoder layer (dense MLP; sliding where
    mtp_local_layer_ids says), chain_norm if the flag is set; logits = lm_head(out / mup)."""
    from transformers.models.inkling.modeling_inkling import InklingRMSNorm, InklingTextModel

    config = hf.config
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.mtp.")}

    def norm(name):
        n = InklingRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        n.weight.data.copy_(weights[name])
        return n

    ids = torch.tensor([tokens])
    with torch.no_grad():
        prev = hf.model(ids).last_hidden_state[0]
        outs = []
        for i in range(depths):
            m, n = i + 1, len(tokens) - i - 1
            p = f"model.mtp.layers.{i}."
            block_config = copy.deepcopy(config)
            block_config.num_hidden_layers = 1
            block_config.layer_types = [config.mtp_layer_types[i]]
            block_config.mlp_layer_types = ["dense"]
            block = InklingTextModel(block_config).eval()
            block.layers[0].load_state_dict({k[len(p + "block."):]: v for k, v in weights.items()
                                             if k.startswith(p + "block.")})
            captured = []
            block.layers[0].register_forward_hook(lambda mod, args, out: captured.append(out))
            embedded = hf.model.embed_tokens(ids[:, m:m + n])[0]
            fused = F.linear(torch.cat([norm(p + "hidden_norm.weight")(prev[:n]), norm(p + "embed_norm.weight")(embedded)],
                                       -1), weights[p + "input_proj.weight"])
            block(inputs_embeds=fused[None], use_cache=False)
            out = captured[0][0]
            if config.chain_hidden_post_norm:
                out = norm("model.mtp.chain_norm.weight")(out)
            logits = F.linear(out / config.logits_mup_width_multiplier, hf.lm_head.weight)
            outs.append(logits[:, :config.unpadded_vocab_size or config.vocab_size])
            prev = out
    return outs


@pytest.mark.parametrize("name, depths", [("tiny", 4), ("tiny-k3", 2)])
def test_mtp_forward_matches_the_recipe_on_transformers_layers(name, depths, checkpoint, hf_model):
    tokens = random_prompt(21, seed=5)
    model, _ = load_model(checkpoint(name), mtp_depths=depths)
    ours = model.model.mtp.forward_sequence(model, _trunk_hidden(model, tokens), torch.tensor(tokens))
    want = hf_mtp_logits(hf_model(name), checkpoint(name), tokens, depths)
    assert len(ours) == depths
    for m, (a, b) in enumerate(zip(ours, want), start=1):
        assert a.shape == b.shape == (len(tokens) - m, b.shape[1])
        assert torch.allclose(a, b, atol=1e-4), (m, (a - b).abs().max().item())


def _full(model, n):
    from inkling_compiled.contexts import FullSequenceContext

    return FullSequenceContext([n], model.config, "cpu")


def _trunk_hidden(model, tokens):
    with torch.no_grad():
        return model.hidden_states(torch.tensor(tokens), _full(model, len(tokens)))


def _compile_drafter(engine, backend, buckets):
    """The drafter's step compiled on its own (the engine's target stays eager: quick to build)."""
    return engine.drafter.compile(dict(device="cpu", buckets=buckets, compile_backend=backend))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_drafts_equal_the_recipe_from_scratch(compiled, checkpoint, fresh_dynamo):
    """The drafter's per-depth state (taken in only over known tokens, drafts run on top of it) gives the
    drafts the head computes over the whole sequence from scratch: after the prefill and after several
    verify steps, for every depth, with the draft step run eagerly and as inductor's graph."""
    K = 4
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=2, max_model_len=96,
                                    speculative="mtp", num_speculative_tokens=K, progress=False)
    if compiled:
        _compile_drafter(engine, "inductor", (1, 2))
    engine.drafter.extend_chunk = 5  # a prompt taken in over several calls per depth
    prompts = [random_prompt(9, seed=70), random_prompt(14, seed=71)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True))
    model, head = engine.model, engine.model.model.mtp
    for step in range(6):
        engine.step()
        for req in engine.scheduler.running:
            drafts = engine.drafter.propose([req])[0]
            known = req.prompt + req.output
            sequence = known + drafts[:-1]  # depth m at the anchor reads x_{P-1+m}: drafts d_1..d_{m-1}
            logits = head.forward_sequence(model, _trunk_hidden(model, sequence), torch.tensor(sequence))
            anchor = len(known) - 2
            assert drafts == [logits[m][anchor].argmax().item() for m in range(K)], (step, req.request_id)


def _dequantized(w: torch.Tensor) -> torch.Tensor:
    """The int8 rule from its formula (not our quantizer): per output row, scale = max |w| / 127, values
    rounded half to even and clamped to +-127, then times the scale again."""
    scale = w.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(w / scale).clamp(-127, 127) * scale


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_int8_drafts_are_the_recipe_on_dequantized_weights(compiled, checkpoint, tmp_path, fresh_dynamo):
    """draft_quantization='int8': the drafts are those of transformers' layers (`hf_mtp_logits`) on a copy of
    the checkpoint whose head projections and lm_head hold the values the int8 rule gives, step after step,
    eager and as inductor's graph, and the head's logits match that recipe's; the target keeps its own
    weights, so the output is plain decoding's. Every row of those weights has an outlier, so that rounding
    to int8 moves the drafts (checked: the fp32 head drafts otherwise somewhere) and a draft read from
    weights other than the rule's (the trunk's fp32 lm_head, say) shows."""
    import shutil

    from safetensors.torch import load_file, save_file

    K = 2
    coarse, folder = tmp_path / "coarse", tmp_path / "dequantized"
    shutil.copytree(checkpoint("tiny"), coarse)
    weights = load_file(str(coarse / "model.safetensors"))
    changed = [n for n in weights if n == "lm_head.weight" or (n.startswith("model.mtp.") and n.endswith("_proj.weight"))]
    assert len(changed) > 2 * K
    for n in changed:  # (lm_head's outlier the same in every row: it shifts all logits alike, argmax unmoved)
        w = weights[n].float().clone()
        w[:, 0] = 30 * (w.abs().max() if n == "lm_head.weight" else w.abs().amax(-1))
        weights[n] = w
    save_file(weights, str(coarse / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(coarse, folder)
    save_file(weights | {n: _dequantized(weights[n]) for n in changed}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    hf = transformers.InklingForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_coarse = transformers.InklingForCausalLM.from_pretrained(coarse, dtype=torch.float32).eval()

    engine = Engine.from_pretrained(coarse, compile=False, max_batch_size=2, max_model_len=96, speculative="mtp",
                                    num_speculative_tokens=K, draft_quantization="int8", progress=False)
    head, model = engine.drafter.head, engine.model
    assert {p.dtype for n, p in head.named_parameters() if n.endswith("_proj.weight")} == {torch.int8}
    assert head.draft_lm_head.weight.dtype == torch.int8 and model.lm_head.weight.dtype == torch.float32
    if compiled:
        _compile_drafter(engine, "inductor", (1, 2))
    prompts = [random_prompt(9, seed=74), random_prompt(14, seed=75)]
    want = Engine.from_pretrained(coarse, compile=False, max_batch_size=2, progress=False).generate(prompts, GREEDY)
    for p in prompts:
        engine.add_request(p, GREEDY)
    compared = moved = 0
    for step in range(5):
        engine.step()
        for req in engine.scheduler.running:
            drafts = engine.drafter.propose([req])[0]
            known = req.prompt + req.output
            sequence = known + drafts[:-1]
            logits = hf_mtp_logits(hf, folder, sequence, K)
            anchor = len(known) - 2
            assert drafts == [logits[m][anchor].argmax().item() for m in range(K)], (step, req.request_id)
            unrounded = hf_mtp_logits(hf_coarse, coarse, sequence, K)
            moved += drafts != [unrounded[m][anchor].argmax().item() for m in range(K)]
            compared += 1
    sequence = random_prompt(20, seed=76)  # the head's logits over a whole sequence against the recipe's
    ours = head.forward_sequence(model, _trunk_hidden(model, sequence), torch.tensor(sequence))
    for a, b in zip(ours, hf_mtp_logits(hf, folder, sequence, K)):  # (the outliers make logits of 1e4 and more: the bound is relative to them)
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), ((a - b).abs().max().item(), b.abs().max().item())
    while engine.has_unfinished():
        engine.step()
    assert compared >= 6 and moved >= 1
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [w.token_ids for w in want]


def test_draft_quantization_is_refused_where_nothing_drafts_from_weights(checkpoint, monkeypatch):
    """Bad values, and int8 drafts without the MTP drafter, are refused before any weight is read; 'none'
    goes with any drafter."""
    import inkling_compiled.engine as engine_module
    from inkling_compiled.errors import OptionError

    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    for bad in ("int4", "INT8", 8, ["int8"]):
        with pytest.raises(OptionError, match=r"draft_quantization=.*: choose one of none, int8"):
            Engine.from_pretrained(checkpoint("tiny"), compile=False, speculative="mtp", draft_quantization=bad)
    with pytest.raises(OptionError, match="only the MTP head drafts.*speculative='ngram'"):
        Engine.from_pretrained(checkpoint("tiny"), compile=False, speculative="ngram", draft_quantization="int8")
    with pytest.raises(OptionError, match="only the MTP head drafts.*speculative=None"):
        Engine.from_pretrained(checkpoint("tiny"), compile=False, draft_quantization="int8",
                               tensor_parallel_size=2)
    with pytest.raises(OptionError, match="unknown speculative='MTP'"):
        Engine.from_pretrained(checkpoint("tiny"), compile=False, speculative="MTP", draft_quantization="int8")
    monkeypatch.undo()
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, speculative="ngram", draft_quantization="none",
                                    progress=False)
    assert engine.stats()["draft_quantization"] == "none"


def test_int8_drafts_leave_a_shared_model_as_it_was(checkpoint):
    """Engines may share one loaded model: an engine drafting from int8 weights (and one whose construction
    failed after its drafter was made) leaves the model's head and lm_head as they were, so an engine
    drafting from them beside it drafts as a fresh one does."""
    model, _ = load_model(checkpoint("tiny"), mtp_depths=2)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    kw = dict(compile=False, max_batch_size=2, max_model_len=64, progress=False, speculative="mtp",
              num_speculative_tokens=2)
    fp32 = Engine(model, **kw)
    with pytest.raises(Exception, match="max_batch_size"):
        Engine(model, **{**kw, "max_batch_size": 0}, draft_quantization="int8")
    int8 = Engine(model, **kw, draft_quantization="int8")
    assert int8.drafter.head is not model.model.mtp and fp32.drafter.head is model.model.mtp
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(after[n].dtype == t.dtype and torch.equal(after[n], t) for n, t in before.items())
    fresh = Engine(load_model(checkpoint("tiny"), mtp_depths=2)[0], **kw)
    prompts = [random_prompt(9, seed=77), random_prompt(12, seed=78)]
    for engine in (fp32, int8, fresh):
        for p in prompts:
            engine.add_request(p, GREEDY)
    for _ in range(4):
        for engine in (fp32, int8, fresh):
            engine.step()
        running = [list(e.scheduler.running) for e in (fp32, fresh)]
        assert fp32.drafter.propose(running[0]) == fresh.drafter.propose(running[1])
    assert fp32.stats()["draft_quantization"] == "none" and int8.stats()["draft_quantization"] == "int8"


def test_one_symbolic_draft_graph_no_breaks_and_a_full_census(checkpoint, fresh_dynamo):
    """K=2: one draft graph with a symbolic batch serves buckets 2 and 4: each depth's convs as sconv_verify
    (none decodes or extends), one kv_write per depth, zero graph breaks; replays of 3 rows and of 1 (padded)
    never recompile, and MTP decoding stays plain decoding's tokens."""
    from inkling_compiled.graphs import GraphRecorder, census
    from inkling_compiled.streams import STREAM_NAMES

    from conftest import has_symbolic_batch

    K = 2
    prompts = [random_prompt(6 + 3 * i, seed=60 + i) for i in range(3)]
    want = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4, progress=False).generate(
        prompts, GREEDY)
    torch._dynamo.utils.counters.clear()
    recorder = GraphRecorder("eager")
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4, progress=False,
                                    speculative="mtp", num_speculative_tokens=K)
    drafting = _compile_drafter(engine, recorder, (2, 4))
    engine.drafter.warm_up()
    assert drafting.graphs() == [(2, 4)] and len(recorder.graphs) == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    gm = recorder.graphs[0]
    assert has_symbolic_batch(gm)
    c = census(gm)
    calls = sorted((x["layer"], x["stream"]) for x in c["custom_calls"] if x["op"] == "inkling::sconv_verify")
    assert calls == sorted((depth, s) for depth in range(K) for s in STREAM_NAMES)
    assert c["sconv_calls"] == 4 * K and c["ops"]["inkling::kv_write"] == K
    assert "inkling::sconv_decode" not in c["ops"] and "inkling::sconv_extend" not in c["ops"]
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    outs = engine.generate(prompts, GREEDY)
    engine.generate([prompts[0]], GREEDY)  # one row, in bucket 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    assert engine.stats()["spec_proposed"] > 0


def test_an_mtp_engine_compiles_no_extend_graph_it_would_never_run(checkpoint):
    """The MTP drafter reads every prompt token's hidden state, which only the eager prefill hands back:
    the engine compiles decode, verify and draft steps, and no extend step (a cold start's worth of
    inductor time that would never replay); a drafter that needs no hidden states keeps its extend graph."""
    mtp = Engine.from_pretrained(checkpoint("tiny"), compile=True, compile_backend="eager", warmup=False,
                                 max_batch_size=2, progress=False, speculative="mtp", num_speculative_tokens=2)
    assert mtp.worker.extender is None and mtp.worker.decoder is not None and mtp.worker.verifier is not None
    ngram = Engine.from_pretrained(checkpoint("tiny"), compile=True, compile_backend="eager", warmup=False,
                                   max_batch_size=2, progress=False, speculative="ngram", num_speculative_tokens=2)
    assert ngram.worker.extender is not None


def test_the_draft_step_is_saved_whole_and_a_later_engine_loads_it(checkpoint, tmp_path, fresh_dynamo, monkeypatch):
    """With a package key (the engine passes its decode step's), the draft step is saved whole: a later
    drafter, of another `max_batch_size` (the key holds no pool size), loads it and traces nothing, and its
    drafts, step after step, are the eager draft step's. A
    bucket's draft steps run its guards once (then inductor's code on the bound inputs, see
    `package.PackagedForward`)."""
    K = 2
    options = dict(device="cpu", buckets=(1, 2), compile_backend="inductor",
                   package_key=("a draft step saved whole", str(tmp_path)))

    def drafter_engine(compiled: bool, max_batch_size: int) -> Engine:
        engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=max_batch_size, max_model_len=96,
                                        speculative="mtp", num_speculative_tokens=K, progress=False)
        if compiled:
            engine.drafter.compile(options)
            engine.drafter.warm_up()
        return engine

    first = drafter_engine(True, 2).drafter.compiled
    assert first.packaged and not first.loaded and first.package_path.is_file()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    later, eager = drafter_engine(True, 5), drafter_engine(False, 5)
    assert later.drafter.compiled.loaded and later.drafter.compiled.package_path == first.package_path
    prompts = [random_prompt(9, seed=90), random_prompt(14, seed=91)]
    for engine in (later, eager):
        for p in prompts:
            engine.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
    checks = count_guard_checks(monkeypatch)
    compared = 0
    for _ in range(8):
        later.step(), eager.step()
        got = later.drafter.propose(list(later.scheduler.running))
        want = eager.drafter.propose(list(eager.scheduler.running))
        assert got == want
        compared += sum(d is not None for d in got)
    assert compared >= 8 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert len(checks) <= len(options["buckets"])


@pytest.mark.parametrize("K", [1, 2, 4])
def test_mtp_greedy_equals_plain_decoding_and_transformers(K, checkpoint, hf_greedy):
    prompts = [random_prompt(5 + 4 * i, seed=80 + i) for i in range(3)] + [[7, 8, 9] * 5]
    plain = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4, progress=False)
    spec = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4, progress=False,
                                  speculative="mtp", num_speculative_tokens=K)
    want = plain.generate(prompts, GREEDY)
    outs = spec.generate(prompts, GREEDY)
    for prompt, out, w in zip(prompts, outs, want):
        assert out.token_ids == w.token_ids == hf_greedy("tiny", prompt, GREEDY.max_new_tokens)[0]
        assert max(abs(a - b) for a, b in zip(out.logprobs, w.logprobs)) < 1e-4
        assert out.spec_proposed > 0
    assert spec.stats()["verify_steps"] > 0 and spec.stats()["decode_steps"] == 0


def test_the_head_takes_a_prompt_in_during_its_prefill(checkpoint, monkeypatch):
    """The step that ends a prompt also runs the head's extend forwards over it (the draft head's prefill is
    prefill work): each depth then stands one position short of where a draft step continues it, and the
    decode steps after run the draft step alone, with no extend forward of the head."""
    K = 2
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=2, max_model_len=64,
                                    speculative="mtp", num_speculative_tokens=K, progress=False)
    prompts = [random_prompt(9, seed=72), random_prompt(13, seed=73)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True))
    engine.step()
    tracks = {len(req.prompt): track for req, track in engine.drafter.tracks.items()}
    assert {n: t.done for n, t in tracks.items()} == {len(p): [len(p) - 1 - i for i in range(K)] for p in prompts}
    extends = []
    take_in = engine.drafter._take_in
    monkeypatch.setattr(engine.drafter, "_take_in", lambda behind: (extends.append(behind), take_in(behind)))
    while engine.has_unfinished():
        engine.step()
    assert extends == []


def test_mtp_with_continuous_batching_chunked_prefill_and_prefix_hits(checkpoint):
    """Staggered arrivals, prompts prefilled over several steps, a shared prefix served from the cache (the
    head's history then starts past it) and an abort: outputs stay those of plain decoding."""
    shared = random_prompt(20, seed=90)
    prompts = [shared + random_prompt(3 + i, seed=91 + i) for i in range(5)]
    kw = dict(compile=False, max_batch_size=3, max_model_len=96, prefill_chunk_tokens=8, progress=False)
    want = Engine.from_pretrained(checkpoint("tiny"), **kw).generate(prompts, GREEDY)
    engine = Engine.from_pretrained(checkpoint("tiny"), speculative="mtp", num_speculative_tokens=2, **kw)
    final, rids = {}, {}
    for step in range(300):
        if step < 5:
            rids[engine.add_request(prompts[step], GREEDY)] = step
        if step == 6:
            engine.abort(next(r for r, i in rids.items() if i == 1))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if len(final) == 5 and not engine.has_unfinished():
            break
    assert sum(o.cached_tokens for o in final.values()) > 0
    for rid, i in rids.items():
        if i != 1:
            assert final[rid].token_ids == want[i].token_ids
    assert final[next(r for r, i in rids.items() if i == 1)].finish_reason == "abort"
    assert not engine.drafter.tracks  # every request's drafter state is gone with it


def test_mtp_needs_a_head(checkpoint, tmp_path):
    from inkling_compiled.errors import OptionError
    from inkling_compiled.tiny import build_tiny_checkpoint

    headless = build_tiny_checkpoint(tmp_path / "headless", "tiny", overrides={"num_mtp_layers": None, "mtp_local_layer_ids": None})
    with pytest.raises(OptionError, match="MTP depth"):
        Engine.from_pretrained(headless, compile=False, speculative="mtp", num_speculative_tokens=1)
    with pytest.raises(OptionError, match="MTP depth"):
        Engine.from_pretrained(checkpoint("tiny-k3"), compile=False, speculative="mtp", num_speculative_tokens=3)
