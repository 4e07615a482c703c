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
    assert engine.pool.slots.num_free == engine.pool.slots.capacity
    assert engine.pool.pages.num_free == engine.pool.pages.capacity


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


def test_stop_tokens_and_eos_finish_with_stop(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    prompt = random_prompt(9, seed=5)
    free_run = engine.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0].token_ids
    stop_at = free_run[3]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run[: free_run.index(stop_at) + 1]


def test_text_in_text_out(checkpoint):
    engine = engine_for(checkpoint, "tiny")
    out = engine.generate("hello", SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert out.prompt_token_ids == [b + 3 for b in b"hello"]
    assert out.text == engine.tokenizer.decode(out.token_ids)


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
