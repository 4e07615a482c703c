"""The server over an engine in a process of its own (`EngineProcess`, what `serve` runs): the same
answers as the engine gives in-process, slots freed when clients leave, a full queue, a start-up that
fails by name, and an engine process that dies. Oracle: `Engine.generate` on an engine of this process.
"""

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from inkling_compiled import Engine, SamplingParams  # noqa: E402
from inkling_compiled.errors import ConfigError, OptionError  # noqa: E402
from inkling_compiled.server.engine_process import EngineProcess  # noqa: E402
from inkling_compiled.server.serve import ApiServer  # noqa: E402
from http_helpers import http, metric, wait_for  # noqa: E402

OPTIONS = dict(compile=False, max_batch_size=4, progress=False)


def serve(path, **options) -> ApiServer:
    max_waiting = options.pop("max_waiting", 64)
    server = ApiServer(EngineProcess(path, {**OPTIONS, **options}, max_waiting=max_waiting, threads=1), port=0,
                       model_name="tiny")
    server.start()
    return server


@pytest.fixture(scope="module")
def server(checkpoint):
    server = serve(checkpoint("tiny"))
    yield server
    server.stop()
    assert server.loop.process.exitcode == 0  # it closed its engine and ended
    assert not server.loop._reader.is_alive() and not server.loop._writer.is_alive()


@pytest.fixture(scope="module")
def oracle(checkpoint):
    engine = Engine.from_pretrained(checkpoint("tiny"), **OPTIONS)
    yield lambda prompt, **p: engine.generate([prompt], SamplingParams(**p))[0]
    engine.close()


def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=60)


def test_answers_over_the_engine_process_equal_the_engine_in_process(server, oracle):
    prompts = [f"prompt number {i}" for i in range(8)]
    results, errors = {}, []

    def one(i):
        try:
            sampling = dict(temperature=0.0) if i % 2 else dict(temperature=0.9, top_p=0.8, seed=i)
            if i < 4:
                chunks = list(client(server).completions.create(
                    model="tiny", prompt=prompts[i], max_tokens=10, logprobs=2, stream=True,
                    stream_options={"include_usage": True}, **sampling))
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                lps = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
                results[i] = (text, lps, chunks[-1].usage.completion_tokens, sampling)
            else:
                whole = client(server).completions.create(model="tiny", prompt=prompts[i], max_tokens=10, logprobs=2,
                                                          **sampling)
                results[i] = (whole.choices[0].text, whole.choices[0].logprobs.token_logprobs,
                              whole.usage.completion_tokens, sampling)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 8
    for i, (text, lps, n, sampling) in results.items():
        want = oracle(prompts[i], max_new_tokens=10, logprobs=True, top_logprobs=2, **sampling)
        assert text == want.text and n == 10, i
        assert lps == pytest.approx(want.logprobs, abs=1e-4), i
    wait_for(lambda: metric(server, "requests_running") == 0)
    assert metric(server, "generation_tokens_total") >= 80


def test_echoed_prompt_logprobs_cross_the_engine_process(server, oracle):
    text = "score this prompt"
    want = oracle(text, max_new_tokens=1, logprobs=True, prompt_logprobs=2)
    choice = client(server).completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=2,
                                               temperature=0).choices[0]
    assert choice.text == text and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-4)
    assert [len(t) for t in choice.logprobs.top_logprobs[1:]] == [2] * (len(want.prompt_token_ids) - 1)


def test_bad_requests_and_leaving_clients_over_the_engine_process(server):
    status, _, answer = http(server, "POST", "/v1/completions", {"prompt": [5, 999]})
    assert status == 400 and "token id 999 at position 1 is out of range" in answer["error"]["message"]
    # an id past 64 bits cannot even be encoded for the pipe: a 400, and the pipe goes on working
    status, _, answer = http(server, "POST", "/v1/completions", {"prompt": [5, 2**64]})
    assert status == 400 and f"token id {2**64} at position 1 is out of range" in answer["error"]["message"]
    assert http(server, "POST", "/v1/completions", {"prompt": [5], "max_tokens": 2})[0] == 200
    from http.client import HTTPConnection

    conn = HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1500, "ignore_eos": True,
                                                        "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    assert metric(server, "requests_running") == 1
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: metric(server, "requests_running") == 0 and metric(server, "slots_free") == 4)


def test_a_full_queue_is_a_429_over_the_engine_process(checkpoint):
    busy = serve(checkpoint("tiny"), max_batch_size=1, max_waiting=1)
    try:
        long = threading.Thread(target=http, args=(busy, "POST", "/v1/completions",
                                                   {"prompt": "hi", "max_tokens": 300, "ignore_eos": True}))
        long.start()
        wait_for(lambda: metric(busy, "requests_running") == 1)
        waiting = threading.Thread(target=http, args=(busy, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
        waiting.start()
        wait_for(lambda: metric(busy, "requests_waiting") == 1)
        status, headers, answer = http(busy, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 429 and "max_waiting=1" in answer["error"]["message"]
        long.join(60)
        waiting.join(60)
        assert metric(busy, "requests_rejected_total") == 1
    finally:
        busy.stop()


def test_start_up_failures_are_raised_by_name(checkpoint, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text(open(checkpoint("tiny") / "tokenizer.json").read())
    with pytest.raises(ConfigError, match="unsupported model_type None"):  # the engine's own error, by name
        EngineProcess(tmp_path, OPTIONS)
    with pytest.raises(OptionError, match="max_batch_size"):
        EngineProcess(checkpoint("tiny"), {**OPTIONS, "max_batch_size": 0})


def test_an_engine_process_that_dies_fails_its_streams_and_health(checkpoint):
    doomed = serve(checkpoint("tiny"))
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{doomed.port}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": "hi", "max_tokens": 1900, "ignore_eos": True, "stream": True}).encode())
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.readline().startswith(b"data: ")
            os.kill(doomed.loop.process.pid, signal.SIGKILL)
            lines = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
        assert "the engine process exited" in lines[-2] and lines[-1] == "data: [DONE]"
        status, _, answer = http(doomed, "GET", "/health")
        assert status == 503 and "the engine process exited" in answer["error"]["message"]
        assert http(doomed, "GET", "/metrics")[0] == 503
        t0 = time.perf_counter()
        status, _, answer = http(doomed, "POST", "/v1/completions", {"prompt": "hi"})
        assert status == 503 and time.perf_counter() - t0 < 5
    finally:
        doomed.stop()


def test_a_failing_reader_fails_the_server_instead_of_hanging_it(checkpoint, monkeypatch):
    """A fault in the server's side of the pipe (here: rebuilding an output) is the server's 503 and an
    error event, not streams that wait forever."""
    from inkling_compiled.server import engine_process

    broken = serve(checkpoint("tiny"))
    try:
        def fault(*args):
            raise KeyError("injected")

        monkeypatch.setattr(engine_process._Stream, "take", fault)
        request = urllib.request.Request(
            f"http://127.0.0.1:{broken.port}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": "hi", "max_tokens": 5, "stream": True}).encode())
        with urllib.request.urlopen(request, timeout=30) as r:
            lines = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
        assert "the server lost the engine process: KeyError" in lines[-2] and lines[-1] == "data: [DONE]"
        assert http(broken, "GET", "/health")[0] == 503
    finally:
        monkeypatch.undo()
        broken.stop()


def test_an_interrupted_start_up_leaves_no_engine_process(checkpoint, monkeypatch):
    """Ctrl-C while the engine loads: the child is ended with the start-up, not left loading."""
    started = []
    real = EngineProcess._receive

    def interrupted(self):
        started.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(EngineProcess, "_receive", interrupted)
    with pytest.raises(KeyboardInterrupt):
        EngineProcess(checkpoint("tiny"), OPTIONS)
    assert started and not started[0].process.is_alive()
    monkeypatch.setattr(EngineProcess, "_receive", real)
