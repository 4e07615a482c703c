"""Prompt logprobs (`SamplingParams(prompt_logprobs=n)`): each prompt token's logprob under the model, as
transformers' own forward over the whole prompt gives it, whatever the chunking, beside other requests, and
never taken from the prefix cache (a hit has no logprobs, so such a request is prefilled whole)."""

import json

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


def oracle_nll(hf, tokens: list[int], window: int, stride: int) -> float:
    """Each token i >= 1 scored once, by transformers, after the tokens of the first window that holds it:
    window k spans [k*stride, k*stride + window), so that is the smallest k with k*stride + window > i."""
    nll = 0.0
    for i in range(1, len(tokens)):
        begin = max(0, -(-(i - window + 1) // stride)) * stride
        with torch.no_grad():
            logits = hf(torch.tensor([tokens[begin:i]])).logits[0, -1]
        nll -= torch.log_softmax(logits.double(), -1)[tokens[i]].item()
    return nll


def test_eval_perplexity_and_bits_per_byte_equal_transformers(checkpoint, hf_model, tmp_path, capsys):
    import math

    from inkling_compiled.cli import main

    text = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # five\n" * 2
    (tmp_path / "t.py").write_text(text)
    tokens = list(text.encode())  # tiny's tokenizer: one token per byte, 3 + the byte
    tokens = [3 + b for b in tokens]
    want = oracle_nll(hf_model("tiny"), tokens, 24, 10)
    assert main(["eval", "--model", str(checkpoint("tiny")), "--text", str(tmp_path / "t.py"), "--window", "24",
                 "--stride", "10", "--compare", "--quiet", "--json", str(tmp_path / "r.json"), "--no-compile"]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    ours = result["engine"]
    assert ours["tokens"] == ours["bytes"] == len(tokens) - 1
    assert math.isclose(ours["nll"], want, rel_tol=1e-5)
    assert math.isclose(ours["perplexity"], math.exp(want / (len(tokens) - 1)), rel_tol=1e-4)
    assert math.isclose(ours["bits_per_byte"], want / math.log(2) / (len(tokens) - 1), rel_tol=1e-5)
    assert result["relative_difference"] < 1e-4
    out = capsys.readouterr().out
    assert f"perplexity {ours['perplexity']:.4f}" in out and "transformers: perplexity" in out


@pytest.mark.parametrize("extra, needle", [
    (["--window", "2048"], "window of 2048 tokens is too long: a prompt may have at most max_model_len - 1 = 2047"),
    (["--window", "8", "--stride", "8"], "stride in 1..window-1, got window 8, stride 8"),
])
def test_eval_refuses_windows_it_cannot_score(extra, needle, checkpoint, tmp_path, capsys):
    from inkling_compiled.cli import main

    (tmp_path / "t.txt").write_text("some text to score")
    assert main(["eval", "--model", str(checkpoint("tiny")), "--text", str(tmp_path / "t.txt"), "--quiet",
                 "--no-compile", *extra]) == 2
    assert needle in capsys.readouterr().err
