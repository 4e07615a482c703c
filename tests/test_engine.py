"""Serving engine (eager path) against transformers batch-1 runs: tokens identical, logprobs within 1e-4."""


import pytest
import torch

from inkling_compiled.engine import Engine
from inkling_compiled.errors import RequestError
from inkling_compiled.sampling import SamplingParams

from conftest import PARITY_CONFIGS, PARITY_LENGTHS, random_prompt

NEW = 12
GREEDY = SamplingParams(max_new_tokens=NEW, logprobs=True, ignore_eos=True)


def engine_for(checkpoint, name, **kw):
    return Engine.from_pretrained(checkpoint(name), compile=False, **kw)


def assert_matches_hf(hf_greedy, name, prompt, out, n=NEW):
    want_tokens, want_logprobs = hf_greedy(name, prompt, n)
    assert out.token_ids == want_tokens[:len(out.token_ids)]
    diff = (torch.tensor(out.logprobs) - want_logprobs[:len(out.logprobs)]).abs().max().item()
    assert diff < 1e-4, f"logprob diff {diff:.3g}"
    return diff


@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_one_batch_of_prompts_matches_transformers(name, checkpoint, hf_greedy):
    engine = engine_for(checkpoint, name)
    prompts = [random_prompt(n, seed=1000 + n) for n in PARITY_LENGTHS]
    outs = engine.generate(prompts, GREEDY)
    worst = max(assert_matches_hf(hf_greedy, name, p, o) for p, o in zip(prompts, outs))
    assert all(o.finish_reason == "length" and len(o.token_ids) == NEW for o in outs)
    print(f"\n{name}: {len(prompts)} prompts in one batch, max logprob diff {worst:.2e}")


@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_staggered_arrivals_early_finish_and_abort(name, checkpoint, hf_greedy):
    """16 requests arrive over several steps; some finish early; one is aborted mid-flight."""
    engine = engine_for(checkpoint, name, max_batch_size=8)  # fewer slots than requests: some queue
    prompts = [random_prompt(3 + 5 * i, seed=2000 + i) for i in range(16)]
    budgets = [NEW if i % 3 else 4 + i % 5 for i in range(16)]
    final, rids, victim = {}, {}, None
    for step in range(200):
        if step < 16:  # one new request per step
            rid = engine.add_request(prompts[step], SamplingParams(max_new_tokens=budgets[step], logprobs=True,
                                                                   ignore_eos=True))
            rids[rid] = step
            if step == 5:
                victim = rid
        if step == 8:
            engine.abort(victim)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if len(final) == 16 and not engine.has_unfinished():
            break
    assert len(final) == 16
    assert final[victim].finish_reason == "abort"
    for rid, i in rids.items():
        if rid == victim:
            continue
        out = final[rid]
        assert out.finish_reason == "length" and len(out.token_ids) == budgets[i]
        assert_matches_hf(hf_greedy, name, prompts[i], out, n=NEW)
    assert engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity
    engine.clear_prefix_cache()  # cached prompt pages are held on purpose; the rest must be free
    assert engine.worker.pool.pages.num_free == engine.worker.pool.pages.capacity


def test_public_api_names(checkpoint):
    """The names DESIGN.md promises: `from inkling_compiled import Engine, SamplingParams`."""
    import inkling_compiled

    engine = inkling_compiled.Engine.from_pretrained(checkpoint("tiny"), compile=False)
    (out,) = engine.generate([[5, 6]], inkling_compiled.SamplingParams(max_new_tokens=2, logprobs=True))
    assert isinstance(out, inkling_compiled.RequestOutput)
    assert (len(out.token_ids), len(out.logprobs), out.finish_reason) == (2, 2, "length")
    assert out.request_id and out.text is not None


def test_streaming_outputs_are_cumulative(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    rid = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        (out,) = engine.step()
        assert out.request_id == rid
        seen.append(list(out.token_ids))
    assert [len(s) for s in seen] == [1, 2, 3, 4]
    assert all(seen[i] == seen[-1][: i + 1] for i in range(4))


def test_stop_tokens_finish_with_stop(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    prompt = random_prompt(9, seed=5)
    free_run = engine.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0].token_ids
    stop_at = free_run[3]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run[: free_run.index(stop_at) + 1]


def test_eos_finishes_with_stop_unless_ignored(checkpoint, tmp_path):
    """A checkpoint whose eos is a token the greedy run really produces: generation stops there."""
    from inkling_compiled.tiny import build_tiny_checkpoint

    prompt = random_prompt(9, seed=5)
    free_run = engine_for(checkpoint, "tiny").generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    eos = free_run.token_ids[4]
    path = build_tiny_checkpoint(tmp_path / "eos", "tiny", overrides={"eos_token_id": eos})
    engine = Engine.from_pretrained(path, compile=False)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=10))[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run.token_ids[: free_run.token_ids.index(eos) + 1]
    ignored = engine.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == free_run.token_ids


def byte_level_text(ids):
    """The tiny tokenizer's decode, written independently: ids 3..258 are bytes, the rest are skipped;
    runs of undecodable bytes become one U+FFFD each side, so compare with runs collapsed."""
    import re

    text = bytes(t - 3 for t in ids if 3 <= t < 259).decode("utf-8", errors="replace")
    return re.sub("\ufffd+", "\ufffd", text)


def test_text_in_text_out(checkpoint):
    import re

    engine = engine_for(checkpoint, "tiny")
    out = engine.generate("hello", SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert out.prompt_token_ids == [b + 3 for b in b"hello"]
    assert re.sub("\ufffd+", "\ufffd", out.text) == byte_level_text(out.token_ids)
    assert engine.tokenizer.decode([3 + b for b in "héllo, ✓".encode()]) == "héllo, ✓"


def test_top_logprobs(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    out = engine.generate([[4, 5, 6]], SamplingParams(max_new_tokens=3, logprobs=True, top_logprobs=4))[0]
    assert len(out.top_logprobs) == 3
    for chosen, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 4 and top[0] == (chosen, pytest.approx(lp))  # greedy: the chosen token is the top one
        assert [v for _, v in top] == sorted([v for _, v in top], reverse=True)


# ---- sampling -------------------------------------------------------------------------------------

def test_same_seed_same_tokens_whatever_the_batch(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    target = random_prompt(7, seed=9)
    alone = engine.generate([target], sampled)[0].token_ids
    others = [random_prompt(n, seed=n) for n in (3, 11, 20)]
    mixed = engine.generate(others[:2] + [target] + others[2:],
                            [GREEDY, SamplingParams(max_new_tokens=6, temperature=1.3, seed=5), sampled, GREEDY])
    assert mixed[2].token_ids == alone
    other_seed = engine.generate([target], SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.95,
                                                          seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_one_and_tiny_top_p_are_greedy(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    prompt = random_prompt(12, seed=3)
    greedy = engine.generate([prompt], GREEDY)[0].token_ids
    assert engine.generate([prompt], SamplingParams(max_new_tokens=NEW, temperature=2.0, top_k=1, seed=7,
                                                    ignore_eos=True))[0].token_ids == greedy
    assert engine.generate([prompt], SamplingParams(max_new_tokens=NEW, temperature=0.7, top_p=1e-6, seed=7,
                                                    ignore_eos=True))[0].token_ids == greedy


def test_sampler_follows_the_distribution():
    from inkling_compiled.sampling import sample

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    ones = torch.ones(4000)
    tokens, _ = sample(logits, ones, torch.zeros(4000, dtype=torch.long), ones, torch.arange(4000),
                       torch.zeros(4000, dtype=torch.long))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)
    tokens, _ = sample(logits, ones, torch.full((4000,), 2), ones, torch.arange(4000), torch.zeros(4000, dtype=torch.long))
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = sample(logits, ones, torch.zeros(4000, dtype=torch.long), torch.full((4000,), 0.8), torch.arange(4000),
                       torch.zeros(4000, dtype=torch.long))
    assert set(tokens.tolist()) == {0, 1}  # p(0)+p(1) = 0.84 >= 0.8 > p(0) = 0.64


# ---- bad input --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_logprobs=99), "top_logprobs"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(seed="x"), "seed"),
])
def test_invalid_sampling_params(kwargs, needle):
    with pytest.raises(RequestError, match=needle):
        SamplingParams(**kwargs)


def test_bad_requests_fail_alone(checkpoint, hf_greedy):
    engine = engine_for(checkpoint, "tiny", max_model_len=64, max_batch_size=2)
    good = [random_prompt(10, seed=11), random_prompt(20, seed=12), random_prompt(5, seed=13)]
    rids = [engine.add_request(p, GREEDY) for p in good]  # 3 requests, 2 slots: one queues
    engine.step()
    with pytest.raises(RequestError, match="empty prompt"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match=r"token id 300 at position 1 is out of range \[0, 272\)"):
        engine.add_request([5, 300], GREEDY)
    with pytest.raises(RequestError, match="prompt of 64 tokens is too long: max_model_len=64"):
        engine.add_request([5] * 64, GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([5], GREEDY, request_id=rids[0])
    with pytest.raises(RequestError, match="no tokenizer|SamplingParams"):
        engine.add_request([5], {"max_new_tokens": 3})
    with pytest.raises(RequestError, match="no unfinished request"):
        engine.abort("nope")
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(final) == set(rids)
    for rid, prompt in zip(rids, good):
        assert_matches_hf(hf_greedy, "tiny", prompt, final[rid])


def test_max_model_len_caps_generation(checkpoint):
    engine = engine_for(checkpoint, "tiny", max_model_len=16)
    out = engine.generate([random_prompt(10, seed=1)], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_generate_rejects_a_bad_prompt_without_leaking(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    with pytest.raises(RequestError, match="empty prompt"):
        engine.generate([[5, 6], []], GREEDY)
    assert not engine.has_unfinished()
    assert engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))[0].finish_reason is not None


@pytest.mark.parametrize("prompt, needle", [
    ([1.5, 2.7], "token 0 is float 1.5"),
    ([True, 5], "token 0 is bool True"),
    (["1", "2"], "token 0 is str '1'"),
    (b"\x05\x06", "got bytes"),
    ({"ids": [5]}, "got dict"),
    ([float("nan")], "token 0 is float nan"),
    ([5, None], "token 1 is NoneType None"),
    (None, "got NoneType"),
    ([[5, 6], 7], "token 0 is list"),
    (torch.tensor([[5, 6]]), r"1-D of integer token ids, got shape \(1, 2\)"),
    (torch.tensor([5.0, 6.0]), "of torch.float32"),
    ("\ud800", "cannot be tokenized"),
])
def test_prompts_are_exactly_text_or_integer_ids(prompt, needle, checkpoint):
    engine = engine_for(checkpoint, "tiny")
    with pytest.raises(RequestError, match=needle):
        engine.add_request(prompt, GREEDY)
    assert not engine.has_unfinished()


def test_integer_arrays_and_tensors_are_prompts(checkpoint):
    import numpy as np

    engine = engine_for(checkpoint, "tiny")
    want = engine.generate([[5, 6, 7]], GREEDY)[0].token_ids
    for prompt in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), (5, 6, 7), [np.int64(5), 6, 7]):
        (out,) = engine.generate(prompt, GREEDY)  # one prompt, not three
        assert out.prompt_token_ids == [5, 6, 7] and out.token_ids == want


def test_request_ids_never_collide(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    params = SamplingParams(max_new_tokens=2)
    assert engine.add_request([5], params, request_id="1") == "1"
    automatic = [engine.add_request([5], params) for _ in range(3)]
    assert len(set(automatic + ["1"])) == 4
    assert engine.add_request([5], params, request_id=12345) == "12345"
    engine.abort(12345)  # the int a caller used works for abort too
    with pytest.raises(RequestError, match="already in use"):  # its abort has not been delivered yet
        engine.add_request([5], params, request_id="12345")
    outs = engine.step()
    assert len([o for o in outs if o.request_id == "12345"]) == 1
    assert engine.add_request([5], params, request_id="12345") == "12345"  # free once delivered
    with pytest.raises(RequestError, match="a request id must be a str or an int"):
        engine.add_request([5], params, request_id=1.5)
    with pytest.raises(RequestError, match="a request id must be a str or an int, got NoneType"):
        engine.abort(None)


def test_a_generate_finished_id_stays_taken_until_its_output_is_returned(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.add_request([5, 6], params, request_id="x")
    engine.generate([[7, 8]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # steps "x" to its end
    with pytest.raises(RequestError, match="'x' is already in use"):
        engine.add_request([5], params, request_id="x")
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason, len(out.token_ids)) == ("x", "length", 2)
    assert engine.add_request([5], params, request_id="x") == "x"


def test_every_bit_of_the_seed_counts(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    prompt = random_prompt(6, seed=8)

    def tokens(seed):
        return engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.5, seed=seed,
                                                        ignore_eos=True))[0].token_ids

    runs = [tokens(s) for s in (0, 2**32, 2**63, 2**64 - 1, 1)]
    assert len({tuple(r) for r in runs}) == len(runs)
    assert tokens(2**64 - 1) == runs[3]  # and the same seed is the same tokens


def test_kv_page_budget_is_refused_with_its_name(checkpoint):
    engine = engine_for(checkpoint, "tiny", max_model_len=64, page_size=4, num_pages=5, prefill_chunk_tokens=3)
    with pytest.raises(RequestError, match="needs 5 KV pages but the pool has 4"):
        engine.add_request([5] * 8, SamplingParams(max_new_tokens=9))  # 17 tokens: 5 pages
    rid = engine.add_request([5] * 8, SamplingParams(max_new_tokens=8, ignore_eos=True))  # 16 tokens: 4 pages
    outs = []
    while engine.has_unfinished():
        outs += engine.step()  # the 8-token prompt is prefilled 3 + 3 + 2: two steps without a token
    out = outs[-1]
    assert out.request_id == rid and len(out.token_ids) == 8 and out.finish_reason == "length"


class CountingTokenizer:
    """The checkpoint's tokenizer, counting the token ids each step's outputs decode."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.inner.decode(ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_long_outputs_cost_the_same_per_step(checkpoint):
    """2,000 tokens: what a step's output decodes stays a short window (the text incremental, once per
    request), the deltas add up to the whole text, and an output kept from early on still reads as it was."""
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=1, max_model_len=2100,
                                    progress=False)
    counting = engine.tokenizer = CountingTokenizer(engine.tokenizer)
    rid = engine.add_request([40, 41, 42], SamplingParams(max_new_tokens=2000, ignore_eos=True, logprobs=True))
    per_step, pieces, kept = [], [], {}
    while engine.has_unfinished():
        before = counting.decoded
        (out,) = engine.step()
        per_step.append(counting.decoded - before)
        pieces.append(out.new_text)
        assert len(out.new_token_ids) == 1 and len(out.new_logprobs) == 1
        if len(per_step) in (1, 10, 1000):
            kept[len(per_step)] = out
    assert out.request_id == rid and len(out.token_ids) == 2000 and out.finished
    assert max(per_step[1000:]) <= 64 and sum(per_step) < 20 * 2000, max(per_step)
    assert "".join(pieces) == engine.tokenizer.inner.decode(out.token_ids)[:len("".join(pieces))]
    assert out.text == engine.tokenizer.inner.decode(out.token_ids)
    for n, early in kept.items():
        assert early.token_ids == out.token_ids[:n] and early.logprobs == out.logprobs[:n] and not early.finished


def test_detokenize_false_decodes_nothing_and_text_still_reads(checkpoint):
    """A server decodes text itself: with detokenize=False a step decodes no token (new_text is None), and
    the whole text can still be asked for."""
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=2, progress=False)
    counting = engine.tokenizer = CountingTokenizer(engine.tokenizer)
    engine.add_request([40, 41, 42], SamplingParams(max_new_tokens=12, ignore_eos=True, detokenize=False))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert counting.decoded == 0 and all(o.new_text is None for o in outs)
    assert outs[-1].text == counting.inner.decode(outs[-1].token_ids) and len(outs[-1].token_ids) == 12
    with pytest.raises(RequestError, match="detokenize must be True or False"):
        SamplingParams(detokenize=1)
