"""Prompt logprobs (`SamplingParams(prompt_logprobs=n)`): each prompt token's logprob under the model, as
transformers' own forward over the whole prompt gives it, whatever the chunking, beside other requests, and
never taken from the prefix cache (a hit has no logprobs, so such a request is prefilled whole)."""

import pytest
import torch

from inkling_compiled.engine import Engine
from inkling_compiled.errors import RequestError
from inkling_compiled.sampling import SamplingParams

from conftest import random_prompt

transformers = pytest.importorskip("transformers")


def hf_prompt_scores(hf, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of prompt[1:], the log-softmax rows that predict them) from one forward over the prompt."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)[:-1]
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], logprobs


def check_scores(out, prompt, hf, top_n):
    want, rows = hf_prompt_scores(hf, prompt)
    got = out.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    assert torch.allclose(torch.tensor(got[1:]), want, atol=1e-4), (torch.tensor(got[1:]) - want).abs().max()
    tops = out.prompt_top_logprobs
    if top_n == 0:
        assert tops is None
        return
    assert len(tops) == len(prompt) and tops[0] is None
    for pairs, row in zip(tops[1:], rows):
        ids, vals = zip(*pairs)
        assert torch.allclose(torch.tensor(vals), row.topk(top_n).values, atol=1e-4)
        assert torch.allclose(row[list(ids)], torch.tensor(vals), atol=1e-4)  # each id has its own logprob


@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_prompt_logprobs_equal_transformers_at_any_chunking(chunk, checkpoint, hf_model):
    hf = hf_model("tiny")
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, prefill_chunk_tokens=chunk)
    long, short, plain = random_prompt(45, seed=1), random_prompt(9, seed=2), random_prompt(20, seed=3)
    outs = engine.generate([long, short, plain], [SamplingParams(max_new_tokens=3, prompt_logprobs=2),
                                                  SamplingParams(max_new_tokens=3, prompt_logprobs=0),
                                                  SamplingParams(max_new_tokens=3)])
    check_scores(outs[0], long, hf, 2)
    check_scores(outs[1], short, hf, 0)
    assert outs[2].prompt_logprobs is None and outs[2].prompt_top_logprobs is None
    # scoring the prompt changes nothing about what is generated
    alone = engine.generate([long, short], SamplingParams(max_new_tokens=3))
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in alone]


def test_a_cached_prefix_is_recomputed_for_a_request_that_scores_its_prompt(checkpoint, hf_model):
    hf = hf_model("tiny")
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, prefill_chunk_tokens=16, page_size=8)
    shared = random_prompt(40, seed=4)
    first = engine.generate([shared + [7, 8]], SamplingParams(max_new_tokens=2))[0]
    hit = engine.generate([shared + [9, 10]], SamplingParams(max_new_tokens=2))[0]
    assert first.cached_tokens == 0 and hit.cached_tokens > 0  # the prefix is cached
    scored = engine.generate([shared + [9, 10]], SamplingParams(max_new_tokens=2, prompt_logprobs=1))[0]
    assert scored.cached_tokens == 0
    check_scores(scored, shared + [9, 10], hf, 1)
    assert scored.token_ids == hit.token_ids


def test_a_prompt_token_past_the_logits_scores_minus_infinity(checkpoint):
    """Ids in the padded tail of the vocabulary (tiny: 264..271) are valid input but never predicted."""
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False)
    out = engine.generate([[5, 6, 268, 7]], SamplingParams(max_new_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[2] == float("-inf")
    assert all(v > float("-inf") for v in out.prompt_logprobs[1:2] + out.prompt_logprobs[3:])


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2"])
def test_bad_prompt_logprobs_are_refused_by_name(value):
    with pytest.raises(RequestError, match="prompt_logprobs must be None or an integer in 0..20"):
        SamplingParams(prompt_logprobs=value)
