"""The OpenAI-compatible server on loopback, driven by the official `openai` client (and plain HTTP where
the client hides what is tested: status codes, headers, disconnects).

Oracle: `Engine.generate` on a second engine over the same checkpoint, each request run alone. Every wait
is bounded in count and time.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from inkling_compiled import Engine, SamplingParams  # noqa: E402
from inkling_compiled.step_plan import StepKind  # noqa: E402
from http_helpers import http, metric, metric_or_zero, start, wait_for  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ["Hello there", "The short convolution", "a", "Continuous batching keeps every slot busy"]


@pytest.fixture(scope="module")
def chat_checkpoint(checkpoint, tmp_path_factory):
    """tiny, with a chat template in its tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("tiny-chat") / "tiny-chat"
    shutil.copytree(checkpoint("tiny"), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<eos>"}))
    return folder


@pytest.fixture(scope="module")
def oracle(chat_checkpoint):
    engine = Engine.from_pretrained(chat_checkpoint, compile=False, max_batch_size=4, progress=False)

    def solo(prompt, **params):
        return engine.generate([prompt], SamplingParams(**params))[0]

    return solo


@pytest.fixture(scope="module")
def server(chat_checkpoint):
    server = start(chat_checkpoint, max_waiting=64)
    yield server
    server.stop()
    server.loop.engine.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=60)


# ---- completions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, top_k=50, seed=7)])
@pytest.mark.parametrize("prompt", [PROMPTS[0], [5, 9, 11, 200]])
def test_completions_equal_engine_generate(client, oracle, sampling, prompt):
    want = oracle(prompt, max_new_tokens=12, logprobs=True, top_logprobs=2, **sampling)
    extra = {"top_k": sampling.pop("top_k")} if "top_k" in sampling else {}
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, logprobs=2, extra_body=extra,
                                      **sampling)
    choice = whole.choices[0]
    assert choice.text == want.text and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert [len(t) for t in choice.logprobs.top_logprobs] == [2] * 12
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, logprobs=2, stream=True,
                                            extra_body=extra, **sampling))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(want.logprobs, abs=1e-4)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_echo_scores_the_prompt_as_lm_evaluation_harness_reads_it(client, oracle):
    """echo=true with logprobs: the prompt's tokens and logprobs first (the first token has none), then the
    generated ones; max_tokens=0 answers only the prompt."""
    prompt = [3 + b for b in b"def f(x):"]  # tiny: byte b is token 3 + b
    want = oracle(prompt, max_new_tokens=1, logprobs=True, prompt_logprobs=1)
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0).choices[0]
    lp = scored.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-4)
    assert [v for t in lp.top_logprobs[1:] for v in t.values()] == pytest.approx(
        [v for top in want.prompt_top_logprobs[1:] for _, v in top], abs=1e-4)
    assert len(lp.tokens) == len(lp.text_offset) == len(prompt) and lp.text_offset == sorted(lp.text_offset)
    assert scored.text == "".join(lp.tokens) and scored.finish_reason == "length"
    # max_tokens=1, as lm-evaluation-harness asks: the continuation's logprobs are [ctxlen:-1]
    text = "Hello there, short convolution"
    want = oracle(text, max_new_tokens=1, logprobs=True, prompt_logprobs=1)
    whole = client.completions.create(model="tiny", prompt=text, max_tokens=1, echo=True, logprobs=1, temperature=0)
    choice = whole.choices[0]
    n = len(want.prompt_token_ids)
    assert choice.text == text + want.text and whole.usage.completion_tokens == 1
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:] + want.logprobs, abs=1e-4)
    assert choice.logprobs.text_offset[n] == len(text)
    # streamed: the prompt's chunk first; without logprobs, text only
    chunks = list(client.completions.create(model="tiny", prompt=text, max_tokens=4, echo=True, stream=True,
                                            temperature=0))
    assert chunks[0].choices[0].text == text and chunks[0].choices[0].logprobs is None
    assert "".join(c.choices[0].text for c in chunks) == text + oracle(text, max_new_tokens=4).text
    status, _, answer = http(client_server(client), "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert status == 400 and "echo=True is not supported" in answer["error"]["message"]


def test_echo_edges_never_predicted_tokens_streamed_offsets_and_an_unfinished_prompt(server, client, oracle):
    # a prompt id past the logits (tiny: 264..271) scores -inf, answered as vLLM does (JSON has no infinity)
    prompt = [3 + b for b in b"ab"] + [268] + [3 + b for b in b"cd"]
    status, _, answer = http(server, "POST", "/v1/completions",
                             {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert status == 200, answer
    assert answer["choices"][0]["logprobs"]["token_logprobs"][2] == -9999.0
    # max_tokens=0 answers "length" even when the token the engine took is a stop token
    first = oracle([5, 6, 7], max_new_tokens=1).token_ids[0]
    status, _, answer = http(server, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 0, "echo": True,
                                                                 "stop_token_ids": [first]})
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 0
    # streamed with logprobs: the completion's text offsets follow the echoed prompt, as in the whole answer
    text = "offsets follow"
    whole = client.completions.create(model="tiny", prompt=text, max_tokens=5, echo=True, logprobs=1, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=text, max_tokens=5, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    streamed = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == whole.choices[0].logprobs.text_offset and streamed[len(text)] == len(text)


def test_an_echo_of_a_prompt_never_scored_has_no_logprobs():
    """A request aborted before its prompt was scored (a shutdown mid-prefill) echoes its tokens with null
    logprobs, not an error."""
    from inkling_compiled.requests import Request, RequestOutput
    from inkling_compiled.server.protocol import prompt_echo
    from inkling_compiled.tokenizer import TextTokenizer
    from inkling_compiled.tiny import embedded_checkpoint

    tokenizer = TextTokenizer.from_checkpoint(embedded_checkpoint())
    req = Request("r", [3 + b for b in b"hello"], SamplingParams(prompt_logprobs=1), seed=0, stop_ids=frozenset(),
                  budget=16)
    req.finish_reason = "abort"
    text, logprobs = prompt_echo(tokenizer, RequestOutput(req, 0, None, tokenizer), True)
    assert text == "hello" and logprobs["token_logprobs"] == [None] * 5 and logprobs["top_logprobs"] == [None] * 5
    req.prompt_logprobs, req.prompt_top_logprobs = None, None  # as the engine process's stream holds it
    assert prompt_echo(tokenizer, RequestOutput(req, 0, None, tokenizer), True)[1]["token_logprobs"] == [None] * 5


def test_stop_strings_and_stop_token_ids(client, oracle):
    want = oracle(PROMPTS[1], max_new_tokens=16)
    printable = [i for i in range(2, len(want.text) - 1) if want.text[i:i + 2].isprintable() and
                 "\ufffd" not in want.text[i:i + 2]]
    cut = printable[0]
    stop = want.text[cut:cut + 2]
    cut = want.text.index(stop)
    stopped = metric_or_zero(client_server(client), 'requests_finished_total{reason="stop"}')
    counts = []
    for stream in (False, True):
        answer = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                           stop=[stop, "never appears"], stream=stream, logprobs=1,
                                           stream_options={"include_usage": True} if stream else None)
        chunks = list(answer) if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text[:cut]
        assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "stop"
        # logprobs cover exactly the tokens whose text is in the answer, streamed or not, as usage says
        logprobs = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        counts.append((len(logprobs), chunks[-1].usage.completion_tokens))
    assert counts[0] == counts[1] and counts[0][0] == counts[0][1] <= len(want.token_ids)
    wait_for(lambda: metric_or_zero(client_server(client), 'requests_finished_total{reason="stop"}') == stopped + 2)
    # a stop token id (inside `stop`, as vLLM takes them): the answer ends before its text
    token = want.token_ids[5]
    first = want.token_ids.index(token)
    answer = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                       extra_body={"stop": [token]})
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == oracle(PROMPTS[1], max_new_tokens=first).text
    assert answer.usage.completion_tokens == first + 1
    wait_for(lambda: metric_running(client) == 0)


def client_server(client):
    """A stand-in with the `port` of the server `client` talks to (for `metric`)."""
    return type("S", (), {"port": int(str(client.base_url).split(":")[2].split("/")[0])})


def metric_running(client) -> float:
    port = int(str(client.base_url).split(":")[2].split("/")[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("inkling_requests_running "):
                return float(line.split()[1])
    raise KeyError("inkling_requests_running")


def test_chat_completions_render_the_template(client, oracle):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = "<|system|>Be brief.\n<|user|>Hi!\n<|assistant|>"  # the template, by hand
    want = oracle(prompt, max_new_tokens=10, logprobs=True)
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True)
    assert answer.choices[0].message.content == want.text and answer.choices[0].message.role == "assistant"
    assert [c.logprob for c in answer.choices[0].logprobs.content] == pytest.approx(want.logprobs, abs=1e-4)
    assert answer.usage.prompt_tokens == len(want.prompt_token_ids)
    # each token's bytes, joined, are the answer's text (the tiny tokenizer's token t is byte t - 3)
    joined = b"".join(bytes(c.bytes) for c in answer.choices[0].logprobs.content)
    assert joined == bytes(t - 3 for t in want.token_ids if t >= 3) and joined.decode(errors="replace") == want.text
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert http(server, "GET", "/health")[:3:2] == (200, {"status": "ok"})
    _, headers, text = http(server, "GET", "/metrics")
    assert "text/plain" in headers["Content-Type"]
    for name in ("requests_running", "requests_waiting", "generation_tokens_total", "step_seconds_count",
                 "prefix_cache_hit_tokens_total", "spec_accepted_tokens_total"):
        assert f"\ninkling_{name}" in text, name
    before = metric(server, "generation_tokens_total")
    client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0)
    assert metric(server, "generation_tokens_total") == before + 3


# ---- errors -----------------------------------------------------------------------------------------

BAD_BODIES = [
    (None, b"{not json", "not valid JSON"),
    ({"prompt": "hi", "max_tokens": 0}, None, "max_tokens must be an integer in 1.."),
    ({"prompt": 7}, None, "prompt must be a string or a list of token ids"),
    ({"prompt": ["a", "b"]}, None, "one prompt per request"),
    ({"prompt": []}, None, "empty prompt"),
    ({"prompt": [5, 999]}, None, "token id 999 at position 1 is out of range"),
    ({"prompt": [5] * 3000}, None, "prompt of 3000 tokens is too long"),
    ({"prompt": "hi", "temperature": -1}, None, "temperature must be a number >= 0"),
    ({"prompt": "hi", "top_p": 0}, None, "top_p must be in (0, 1]"),
    ({"prompt": "hi", "seed": -3}, None, "seed must be None or an integer in 0..2**64-1"),
    ({"prompt": "hi", "logprobs": 50}, None, "logprobs must be an integer in 0..20"),
    ({"prompt": "hi", "n": 2}, None, "n=2 is not supported"),
    ({"prompt": "hi", "n": True}, None, "n=True is not supported"),
    ({"prompt": "hi", "stop_token_ids": 0}, None, "stop_token_ids must be a list"),
    ({"prompt": "x" * (64 * 2048 + 1)}, None, "prompt of 131073 characters is too long"),
    ({"prompt": "hi", "echo": "yes"}, None, "echo must be true or false"),
    ({"prompt": "hi", "max_tokens": 0}, None, "max_tokens must be an integer in 1.."),
    ({"prompt": "hi", "stop": {"x": 1}}, None, "stop must be a string or a list"),
    ({"prompt": "hi", "stream": "yes"}, None, "stream must be true or false"),
]


@pytest.mark.parametrize("body, raw, message", BAD_BODIES, ids=[m for *_, m in BAD_BODIES])
def test_bad_bodies_get_400_with_the_engine_message(server, body, raw, message):
    status, _, answer = http(server, "POST", "/v1/completions", body, raw)
    assert status == 400 and message in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_unknown_model_and_chat_without_a_template(server, checkpoint, client, tmp_path):
    status, _, answer = http(server, "POST", "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert status == 404 and "gpt-9" in answer["error"]["message"]
    status, _, answer = http(server, "GET", "/v1/nothing")
    assert status == 404 and answer["error"]["type"] == "not_found_error"
    status, _, answer = http(server, "POST", "/v1/chat/completions", {"messages": [{"role": "wizard"}]})
    assert status == 400 and "messages[0] needs a role" in answer["error"]["message"]
    bare = tmp_path / "tiny-no-template"
    shutil.copytree(checkpoint("tiny"), bare)
    (bare / "tokenizer_config.json").unlink()
    plain = start(bare)  # no chat template
    try:
        status, _, answer = http(plain, "POST", "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "no chat template" in answer["error"]["message"]
    finally:
        plain.stop()
        plain.loop.engine.close()
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].finish_reason == "length"


def test_a_full_queue_gets_429_and_the_server_goes_on(checkpoint):
    busy = start(checkpoint("tiny"), max_batch_size=1, max_waiting=1)
    results = {}

    def send(name, max_tokens):
        results[name] = http(busy, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": max_tokens,
                                                                "ignore_eos": True})

    try:
        first = threading.Thread(target=send, args=("first", 400))
        first.start()
        wait_for(lambda: metric(busy, "requests_running") == 1)
        second = threading.Thread(target=send, args=("second", 2))
        second.start()
        wait_for(lambda: metric(busy, "requests_waiting") == 1)
        status, headers, answer = http(busy, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 429 and headers["Retry-After"] == "1" and "max_waiting=1" in answer["error"]["message"]
        first.join(60)
        second.join(60)
        assert results["first"][0] == results["second"][0] == 200
        assert http(busy, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
        assert metric(busy, "requests_rejected_total") == 1
    finally:
        busy.stop()
        busy.loop.engine.close()
    assert not busy._thread.is_alive() and not busy.loop._thread.is_alive()  # no thread outlives the server


def test_a_failed_step_fails_only_its_requests(server, client, monkeypatch):
    """The second decode step of a request raises (the only request in flight): a 500 for the whole
    answer, an error event then [DONE] for a stream; then the server answers as before."""
    engine = server.loop.engine
    real = engine.worker.runner.run
    calls = {"n": 0}

    def failing_second(plan):
        if plan.kind is StepKind.DECODE:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected fault")
        return real(plan)

    monkeypatch.setattr(engine.worker.runner, "run", failing_second)
    status, _, answer = http(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 5})
    assert status == 500 and "injected fault" in answer["error"]["message"]
    calls["n"] = 0
    with urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{server.port}/v1/completions", method="POST",
            data=json.dumps({"prompt": "hi", "max_tokens": 5, "stream": True}).encode(),
            headers={"Content-Type": "application/json"}), timeout=60) as r:
        chunks = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert "injected fault" in chunks[-2] and chunks[-1] == "data: [DONE]"
    monkeypatch.setattr(engine.worker.runner, "run", real)
    assert http(server, "GET", "/health")[0] == 200
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=4).usage.completion_tokens == 4


# ---- concurrency ------------------------------------------------------------------------------------

def test_32_concurrent_streams_equal_their_solo_runs(server, client, oracle):
    prompts = [f"{PROMPTS[i % 4]} #{i}" for i in range(32)]
    texts, errors = {}, []

    def stream(i):
        try:
            chunks = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0,
                                               stream=True)
            texts[i] = "".join(c.choices[0].text for c in chunks)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(texts) == 32
    for i, prompt in enumerate(prompts):
        assert texts[i] == oracle(prompt, max_new_tokens=8).text, i
    wait_for(lambda: metric(server, "requests_running") == 0)


def test_a_client_that_disconnects_frees_its_slot(server):
    import http.client

    aborted = metric_or_zero(server, 'requests_finished_total{reason="abort"}')
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1500, "ignore_eos": True,
                                                        "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(3):
        assert response.readline().startswith(b"data: ")
        response.readline()
    assert metric(server, "requests_running") == 1
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: metric(server, "requests_running") == 0 and metric(server, "slots_free") == 8)
    assert metric_or_zero(server, 'requests_finished_total{reason="abort"}') == aborted + 1
    # and a client that leaves before its whole (not streamed) answer is ready
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1500, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    wait_for(lambda: metric(server, "requests_running") == 1)
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: metric_or_zero(server, 'requests_finished_total{reason="abort"}') == aborted + 2, seconds=10)
    assert metric(server, "requests_running") == 0 and metric(server, "slots_free") == 8


# ---- the CLI: serve, SIGTERM ------------------------------------------------------------------------

def test_sigterm_during_traffic_exits_cleanly(chat_checkpoint):
    """A request in flight when SIGTERM comes finishes; one that would outlast --shutdown-timeout ends with
    finish_reason "abort" and [DONE]; one still sending its body then gets a JSON 503 (it once waited for
    uvicorn's own deadline 5 s later and got a plain-text 500); the process exits 0. A completion without max_tokens takes
    --max-new-tokens. (The long request's 1,900 tokens once took over 2 s on the eager tiny engine; with
    less host work a step they fit in 2 s on a quiet machine, hence a timeout well inside either.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "inkling_compiled.cli", "serve", "--model", str(chat_checkpoint),
                             "--port", "0", "--no-compile", "--max-batch-size", "4", "--shutdown-timeout", "0.5",
                             "--max-new-tokens", "5"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "serving" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, line
            line = proc.stderr.readline()
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny-chat", prompt="hi").usage.completion_tokens == 5
        short = client.completions.create(model="tiny-chat", prompt="hi", max_tokens=40, stream=True,
                                          extra_body={"ignore_eos": True})
        long = client.completions.create(model="tiny-chat", prompt="ho", max_tokens=1900, stream=True,
                                         extra_body={"ignore_eos": True})
        firsts = [next(iter(short)), next(iter(long))]
        halfway = socket.create_connection(("127.0.0.1", port), timeout=30)  # still sending its body
        halfway.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n{\"prompt\": \"hi\"")
        time.sleep(0.3)  # its headers taken in before the signal
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        ends = [([firsts[0]] + list(short))[-1], ([firsts[1]] + list(long))[-1]]
        assert [e.choices[0].finish_reason for e in ends] == ["length", "abort"]
        reply = b"".join(iter(lambda: halfway.recv(4096), b""))
        assert reply.startswith(b"HTTP/1.1 503") and b"application/json" in reply, reply
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"].startswith("the server is shutting down")
        assert proc.wait(30) == 0 and time.monotonic() - started < 15
        assert "server stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ---- text as it arrives -----------------------------------------------------------------------------

def test_text_stream_never_splits_a_character_and_holds_back_stop_strings(checkpoint):
    """Byte tokens of "naïve café ✓ done" arrive one at a time: every delta is whole characters, and
    together they are the text up to the stop string (oracle: Python's own UTF-8 decoding)."""
    from inkling_compiled.server.text import TextStream
    from inkling_compiled.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_checkpoint(checkpoint("tiny"))
    text = "naïve café ✓ done"
    tokens = [3 + b for b in text.encode()]  # the tiny tokenizer: one token per byte, from id 3
    stream = TextStream(tokenizer, ["✓ d"])
    deltas = [stream.update(tokens[:i + 1], final=i + 1 == len(tokens)) for i in range(len(tokens))]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text[:text.index("✓ d")] and stream.stopped
    assert stream.tokens_within() == len(text[:text.index("✓ d")].encode())
    # each token's offset is where its character starts (the bytes of "ï" share one)
    want = [i for i, ch in enumerate(text) for _ in ch.encode()]
    assert stream.offsets == want[:len(stream.offsets)]
    # without stops, everything arrives, and a character's last byte releases it at once
    plain = TextStream(tokenizer)
    deltas = [plain.update(tokens[:i + 1]) for i in range(len(tokens))]
    assert "".join(deltas) == text and deltas[len("naï".encode()) - 1] == "ï"
