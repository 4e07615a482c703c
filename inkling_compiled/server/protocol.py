"""OpenAI request bodies in, engine requests out; engine outputs in, OpenAI response objects out.

Bodies are checked here, field by field, with the engine's own checks behind them (`SamplingParams`,
the prompt checks of `add_request`): every problem is a RequestError whose text the server returns with
a 400. Fields the API has and this engine does not do (several choices, penalties, logit bias, suffix;
echo in chat) are refused by name rather than ignored; fields that change nothing here (user, metadata) pass.
Extensions that vLLM also takes: `top_k`, `ignore_eos`, `stop_token_ids`, and token ids inside `stop`.
"""

from __future__ import annotations

import dataclasses
import json
import time

from ..checks import is_finite, is_int
from ..errors import RequestError
from ..requests import RequestOutput
from ..sampling import MAX_COUNT, MAX_TOP_LOGPROBS, SamplingParams
from .body import Limits
from .text import TextStream


@dataclasses.dataclass
class Job:
    """One checked request: what to add to the engine, and how to answer."""

    chat: bool
    prompt: str | list[int]
    params: SamplingParams
    stops: list[str]
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs in the answer; else how many alternatives per token
    max_tokens_field: str | None = None  # the field that set the length, if the body gave one
    continuous_usage: bool = False  # every chunk carries the usage so far (vLLM's continuous_usage_stats)
    echo: bool = False  # completions: the answer starts with the prompt (and its logprobs, with `logprobs`)
    generates: bool = True  # False for echo with max_tokens=0: one token is generated, none answered


@dataclasses.dataclass(frozen=True)
class Rules:
    """What bodies are checked against: the engine's sizes and the server's limits."""

    max_model_len: int
    vocab_size: int
    limits: Limits = Limits()
    default_max_tokens: int = 16  # a completion's length when the body gives none (the API's default)


def checked_text(value: str, field: str) -> str:
    """`value`, unless it holds a lone surrogate (JSON's "\\ud800" escape): no tokenizer takes that."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{field} holds a lone surrogate ({value[e.start]!r} at character {e.start}), "
                           "which is not Unicode text") from None
    return value


_UNSUPPORTED = {  # field -> the values that are fine (the API's defaults)
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
}


def _refuse_unsupported(body: dict, handled: tuple[str, ...] = ()) -> None:
    for name, fine in _UNSUPPORTED.items():  # by type too: true is not 1
        if name in handled:
            continue
        if name in body and not any(type(body[name]) is type(v) and body[name] == v for v in fine):
            raise RequestError(f"{name}={body[name]!r} is not supported by this server (only {fine[1]!r})")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise RequestError(f"response_format={fmt!r} is not supported (only plain text)")


def _number(body: dict, name: str, default, *, integer: bool = False, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    ok = is_int(value) if integer else is_finite(value)
    if not ok or (low is not None and value < low) or (high is not None and value > high):
        kind = "an integer" if integer else "a number"
        bounds = f" in {low}..{high}" if high is not None else (f" >= {low}" if low is not None else "")
        raise RequestError(f"{name} must be {kind}{bounds}, got {value!r}")
    return value


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}")
    return value


def _stops(body: dict, rules: Rules) -> tuple[list[str], list[int]]:
    """`stop` (a string, or a list of strings and token ids) and `stop_token_ids`, counted before they are
    read."""
    limits = rules.limits
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list):
        raise RequestError(f"stop must be a string or a list of strings and token ids, got {type(stop).__name__}")
    ids = body.get("stop_token_ids")
    ids = [] if ids is None else ids
    if not isinstance(ids, list):
        raise RequestError(f"stop_token_ids must be a list of token ids, got {type(ids).__name__}")
    if len(stop) + len(ids) > limits.max_stop_strings:
        raise RequestError(f"{len(stop) + len(ids)} stops (stop and stop_token_ids) are more than "
                           f"max_stop_strings={limits.max_stop_strings}")
    for i, s in enumerate(stop):
        if isinstance(s, str):
            if len(s) > limits.max_stop_chars:
                raise RequestError(f"stop[{i}] has {len(s)} characters, more than max_stop_chars={limits.max_stop_chars}")
            checked_text(s, f"stop[{i}]")
        elif not is_int(s):
            raise RequestError(f"stop must be a string or a list of strings and token ids, got {s!r} at {i}")
    if not all(is_int(t) for t in ids):
        raise RequestError(f"stop_token_ids must be a list of token ids, got {ids!r}")
    stop_ids = [int(t) for t in stop if not isinstance(t, str)] + [int(t) for t in ids]
    bad = next((t for t in stop_ids if not 0 <= t < rules.vocab_size), None)
    if bad is not None:
        raise RequestError(f"stop token id {bad} is out of range [0, {rules.vocab_size})")
    return [s for s in stop if isinstance(s, str)], stop_ids


MAX_CHARS_PER_TOKEN = 64  # a text prompt longer than this times max_model_len is refused before tokenizing


def _prompt(body: dict, max_model_len: int, vocab_size: int) -> str | list[int]:
    """The prompt, its length checked before its content: a million ids cost one comparison to refuse."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if len(prompt) > MAX_CHARS_PER_TOKEN * max_model_len:  # no tokenizer packs more into max_model_len tokens
            raise RequestError(f"prompt of {len(prompt)} characters is too long for max_model_len={max_model_len} "
                               "tokens")
        return checked_text(prompt, "prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt[:2]):
        raise RequestError(f"one prompt per request: got {len(prompt)}")
    if isinstance(prompt, list):
        if len(prompt) >= max_model_len:
            raise RequestError(f"prompt of {len(prompt)} tokens is too long: max_model_len={max_model_len} leaves "
                               "no room to generate")
        if all(is_int(t) for t in prompt):
            bad = next(((i, t) for i, t in enumerate(prompt) if not 0 <= t < vocab_size), None)
            if bad is not None:  # here, not only in the engine: an id past 64 bits cannot even travel to it
                raise RequestError(f"token id {bad[1]} at position {bad[0]} is out of range [0, {vocab_size})")
            return prompt
    raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None, low: int = 1
                ) -> tuple[int | None, str | None]:
    """(the length the body asks for, or `default`; the field that asked, if one did). Every one of
    `names` the body gives is checked, the first one given decides."""
    given = [(name, _number(body, name, None, integer=True, low=low, high=MAX_COUNT)) for name in names]
    return next(((value, name) for name, value in given if value is not None), (default, None))


def _sampling(body: dict, max_tokens: int, stop_ids: list[int], top_logprobs: int | None,
              prompt_logprobs: int | None = None) -> SamplingParams:
    top_k = _number(body, "top_k", 0, integer=True, low=-1, high=MAX_COUNT)
    return SamplingParams(
        max_new_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, low=0),
        top_p=_number(body, "top_p", 1.0), top_k=max(top_k, 0), seed=_number(body, "seed", None, integer=True),
        stop_token_ids=tuple(stop_ids), ignore_eos=_flag(body, "ignore_eos"),
        logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0, detokenize=False,  # text: TextStream
        prompt_logprobs=prompt_logprobs)


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of `stream_options`."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream or not isinstance(options, dict):
        raise RequestError("stream_options needs stream=true and must be an object")
    return _flag(options, "include_usage"), _flag(options, "continuous_usage_stats")


def completion_job(body, rules: Rules) -> Job:
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    _refuse_unsupported(body, handled=("echo",))
    prompt = _prompt(body, rules.max_model_len, rules.vocab_size)
    top = _number(body, "logprobs", None, integer=True, low=0, high=MAX_TOP_LOGPROBS)
    echo = _flag(body, "echo")
    stops, stop_ids = _stops(body, rules)
    # echo with max_tokens=0 scores a prompt (lm-evaluation-harness's loglikelihood): the engine still takes
    # one token, which the answer leaves out
    max_tokens, field = _max_tokens(body, ("max_tokens",), rules.default_max_tokens, low=0 if echo else 1)
    stream = _flag(body, "stream")
    include_usage, continuous = _stream_options(body, stream)
    params = _sampling(body, max(max_tokens, 1), stop_ids, top, prompt_logprobs=top if echo else None)
    return Job(False, prompt, params, stops, stream, include_usage, top, field if max_tokens else None, continuous,
               echo=echo, generates=max_tokens > 0)


def chat_job(body, render, rules: Rules) -> Job:
    """`render(messages)` -> the prompt text (the checkpoint's chat template). Without a length in the body,
    the reply may take all the room the prompt leaves."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    _refuse_unsupported(body)
    prompt = checked_text(render(body.get("messages")), "messages")
    if len(prompt) > MAX_CHARS_PER_TOKEN * rules.max_model_len:
        raise RequestError(f"messages of {len(prompt)} characters are too long for max_model_len="
                           f"{rules.max_model_len} tokens")
    top = None
    if _flag(body, "logprobs"):
        top = _number(body, "top_logprobs", 0, integer=True, low=0, high=MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise RequestError("top_logprobs needs logprobs=true")
    stops, stop_ids = _stops(body, rules)
    max_tokens, field = _max_tokens(body, ("max_completion_tokens", "max_tokens"), rules.max_model_len)
    stream = _flag(body, "stream")
    include_usage, continuous = _stream_options(body, stream)
    return Job(True, prompt, _sampling(body, max_tokens, stop_ids, top), stops, stream, include_usage, top,
               field, continuous)


def check_room(job: Job, prompt_tokens: int, max_model_len: int) -> None:
    """A length the body asked for must fit beside the prompt (OpenAI's and vLLM's 400); a default length
    is cut to the room left."""
    if job.max_tokens_field is not None and prompt_tokens + job.params.max_new_tokens > max_model_len:
        raise RequestError(f"the prompt's {prompt_tokens} tokens plus {job.max_tokens_field}="
                           f"{job.params.max_new_tokens} are more than max_model_len={max_model_len}")


# ---- answers -----------------------------------------------------------------------------------------

def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def ascii_json(content) -> bytes:
    """Compact JSON, ASCII-escaped: an error quoting the client's text (a lone surrogate) cannot fail to
    encode."""
    return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def usage(out: RequestOutput, completion_tokens: int) -> dict:
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def token_text(tokenizer, token: int) -> str:
    """A token as the API names it: its own text (a word-start space included), or, when its bytes are
    not whole characters (one byte of a character), "bytes:\\xc3" as OpenAI spells those."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


# What a logprob of -inf (a prompt token past the logits' vocabulary: the model never predicts it) is
# answered as: JSON has no infinity, and null already means "no logprob" (the first token). vLLM's value.
NEVER_PREDICTED = -9999.0


def prompt_echo(tokenizer, out: RequestOutput, with_logprobs: bool) -> tuple[str, dict | None]:
    """An echoed prompt: its text, and with `logprobs` the legacy logprobs object of its tokens (the first
    has none, as OpenAI gives it; so has every token a request stopped before scoring, aborted mid-prefill)."""
    text = TextStream(tokenizer)
    text.update(out.prompt_token_ids, final=True)
    if not with_logprobs:
        return text.text, None
    n = len(out.prompt_token_ids)
    scores = list(out.prompt_logprobs or [])[:n]
    tops = list(out.prompt_top_logprobs or [None] + [[]] * (len(scores) - 1))[:len(scores)]
    scores += [None] * (n - len(scores))
    tops += [None] * (n - len(tops))

    def finite(lp):
        return None if lp is None else max(lp, NEVER_PREDICTED)

    return text.text, {
        "tokens": [token_text(tokenizer, t) for t in out.prompt_token_ids],
        "token_logprobs": [finite(lp) for lp in scores],
        "top_logprobs": [None if top is None else {token_text(tokenizer, t): lp for t, lp in top} for top in tops],
        "text_offset": list(text.offsets)}


def joined_logprobs(first: dict | None, then: dict | None) -> dict | None:
    """Two legacy logprobs objects as one (an echoed prompt's, then its completion's)."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def completion_logprobs(tokenizer, out: RequestOutput, offsets: list[int], start: int, end: int) -> dict:
    """OpenAI's legacy logprobs object for generated tokens [start, end); `offsets` where each one's text
    starts (`TextStream.offsets`)."""
    tops = (out.top_logprobs or [[]] * len(out.token_ids))[start:end]
    return {"tokens": [token_text(tokenizer, t) for t in out.token_ids[start:end]],
            "token_logprobs": out.logprobs[start:end],
            "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in top} for top in tops],
            "text_offset": offsets[start:end]}


def chat_logprobs(tokenizer, out: RequestOutput, offsets: list[int], start: int, end: int) -> dict:
    """The chat API's logprobs object for generated tokens [start, end)."""
    tops = (out.top_logprobs or [[]] * len(out.token_ids))[start:end]

    def entry(token: int, logprob: float) -> dict:
        return {"token": token_text(tokenizer, token), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
                        for t, lp, top in zip(out.token_ids[start:end], out.logprobs[start:end], tops)]}


def finish_reason(out: RequestOutput, stopped_by_text: bool, generates: bool = True) -> str | None:
    if stopped_by_text:
        return "stop"
    if not generates and out.finish_reason in ("stop", "length"):
        return "length"  # max_tokens=0: the one token the engine took is not part of the answer
    return out.finish_reason if out.finish_reason in ("stop", "length", "abort") else None


def envelope(job: Job, rid: str, model: str, choice: dict, chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
    return {"id": ("chatcmpl-" if job.chat else "cmpl-") + rid, "object": kind, "created": int(time.time()),
            "model": model, "choices": [{"index": 0, **choice}]}
