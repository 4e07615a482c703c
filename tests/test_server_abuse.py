"""The server under clients that misbehave: mass disconnects, huge and malformed bodies, slow senders,
limits, and the CLI's refusals before anything loads. Oracles: the event loop's own responsiveness
(`/health` answered while the abuse goes on, bounded generously), status codes and messages, the
engine's metrics (slots and pages back), and `Engine.generate` for what a stream must carry.
"""

import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from inkling_compiled import Engine, SamplingParams  # noqa: E402
from inkling_compiled.server.body import Limits  # noqa: E402
from http_helpers import http, metric, metric_or_zero, start, wait_for  # noqa: E402

STALL_BOUND = 0.5  # seconds: /health must answer within this while others abuse the server


@pytest.fixture(scope="module")
def server(checkpoint):
    server = start(checkpoint("tiny"), max_waiting=256, limits=Limits(max_body_bytes=64 * 2**20))
    yield server
    server.stop()
    server.loop.engine.close()


class HealthProbe:
    """Asks /health every 20 ms on a thread; `worst` is the longest answer it waited for."""

    def __init__(self, server):
        self.server, self.worst, self.answers = server, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t0 = time.perf_counter()
            assert http(self.server, "GET", "/health")[0] == 200
            self.worst = max(self.worst, time.perf_counter() - t0)
            self.answers += 1
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)


def open_stream(port: int, body: dict) -> socket.socket:
    """A raw streaming request whose first event has been read (so its request runs or waits)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a reset, where it closed with bytes of ours
    unread, is a close too); a socket timeout if it does not."""
    data = b""
    try:
        while more := sock.recv(65536):
            data += more
    except ConnectionResetError:
        pass
    return data


def slow_steps(engine, monkeypatch, seconds: float):
    """Each forward takes `seconds` longer (a sleep, which lets the interpreter go as a kernel does): the
    engine of a model much larger than tiny."""
    real = engine.worker.runner.run

    def slow(plan):
        time.sleep(seconds)
        return real(plan)

    monkeypatch.setattr(engine.worker.runner, "run", slow)


def test_a_hundred_clients_leaving_at_once_stall_nobody(server, monkeypatch):
    """100 streams (8 running, the rest waiting) vanish together while steps are slow: /health and a
    surviving stream go on, and every slot comes back. Aborting used to wait for the engine's lock on the
    event loop, once per client."""
    slow_steps(server.loop.engine, monkeypatch, 0.05)
    survivor = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=60)
    gaps, stream_done = [], threading.Event()

    def survive():
        last = time.perf_counter()
        for _ in survivor.completions.create(model="tiny", prompt="hi", max_tokens=60, stream=True,
                                             extra_body={"ignore_eos": True}):
            now = time.perf_counter()
            gaps.append((now, now - last))
            last = now
        stream_done.set()

    keeper = threading.Thread(target=survive)
    keeper.start()
    wait_for(lambda: metric(server, "requests_running") == 1)
    socks = [open_stream(server.port, {"prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True})
             for _ in range(100)]
    wait_for(lambda: metric(server, "requests_running") + metric(server, "requests_waiting") == 101)
    with HealthProbe(server) as probe:
        time.sleep(0.1)
        leaving = time.perf_counter()
        for s in socks:
            s.shutdown(socket.SHUT_RDWR)
            s.close()
        wait_for(lambda: metric(server, "requests_waiting") == 0 and metric(server, "requests_running") <= 1)
        time.sleep(0.3)
    keeper.join(120)
    assert probe.answers > 3 and probe.worst < STALL_BOUND, probe.worst
    # (the survivor's events from the disconnects on: what the aborts could hold up)
    after = [gap for at, gap in gaps if at > leaving]
    assert stream_done.is_set() and len(after) > 10 and max(after) < 1.0, after
    monkeypatch.undo()
    wait_for(lambda: metric(server, "requests_running") == 0 and metric(server, "slots_free") == 8)


def test_a_four_million_id_prompt_is_refused_by_its_length_without_a_stall(server):
    """A 4M-id prompt (28 MB, within this server's 64 MiB limit) is a 400 naming its length, and /health
    answers meanwhile: the length is checked before any id is."""
    body = json.dumps({"prompt": [5] * 4_000_000, "max_tokens": 4}).encode()
    with HealthProbe(server) as probe:
        time.sleep(0.1)
        t0 = time.perf_counter()
        status, _, answer = http(server, "POST", "/v1/completions", raw=body)
        took = time.perf_counter() - t0
        time.sleep(0.1)
    assert status == 400 and "prompt of 4000000 tokens is too long" in answer["error"]["message"]
    assert took < 5 and probe.worst < STALL_BOUND, (took, probe.worst)


@pytest.mark.parametrize("raw, field", [
    (b'{"prompt": "\\ud800"}', "prompt holds a lone surrogate"),
    (b'{"prompt": "ok \\udfff"}', "prompt holds a lone surrogate ('\\udfff' at character 3)"),
    (b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop[0] holds a lone surrogate"),
], ids=["high", "low", "stop"])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, raw, field):
    status, headers, answer = http(server, "POST", "/v1/completions", raw=raw)
    assert status == 400 and field in answer["error"]["message"], answer
    assert "application/json" in headers["Content-Type"]


def test_a_lone_surrogate_in_chat_content_or_the_model_name_is_a_json_4xx(server):
    status, _, answer = http(server, "POST", "/v1/chat/completions",
                             raw=b'{"messages": [{"role": "user", "content": "a\\ud83d"}]}')
    assert status == 400 and "messages[0].content holds a lone surrogate" in answer["error"]["message"]
    status, _, answer = http(server, "POST", "/v1/completions", raw=b'{"model": "\\ud800", "prompt": "hi"}')
    assert status == 404 and "does not exist" in answer["error"]["message"]
    # a valid pair is text like any other
    status, _, answer = http(server, "POST", "/v1/completions",
                             raw=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert status == 200 and answer["usage"]["prompt_tokens"] == 4  # the emoji's 4 UTF-8 bytes


def test_an_integer_longer_than_python_parses_is_a_json_400(server):
    """msgspec refuses an integer of 5,000 digits and Python's own parser will not convert one: a 400
    naming why, not a plain-text 500."""
    for raw in (b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", b'{"prompt": [1' + b"0" * 5000 + b"]}"):
        status, headers, answer = http(server, "POST", "/v1/completions", raw=raw)
        assert status == 400 and "application/json" in headers["Content-Type"], answer
        assert "the body is not JSON this server takes" in answer["error"]["message"]


def test_a_chat_of_half_a_million_messages_is_checked_without_a_stall(server):
    """A 17 MB chat body of 500,000 messages (within this server's 64 MiB limit) is refused as too long, and
    /health answers meanwhile: a large body is parsed, checked and rendered off the event loop (its
    messages' checks and template once held the loop for seconds)."""
    body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 500_000}).encode()
    with HealthProbe(server) as probe:
        time.sleep(0.1)
        status, _, answer = http(server, "POST", "/v1/chat/completions", raw=body)
        time.sleep(0.1)
    assert status == 400 and "too long" in answer["error"]["message"], answer
    assert probe.worst < STALL_BOUND, probe.worst


def test_a_long_answer_is_built_off_the_event_loop(server, monkeypatch):
    """An answer of more than ANSWER_IN_THREAD_TOKENS tokens is built and encoded on a thread: here one
    whose building takes 1 s of Python (as 32 answers of 2,000 tokens with 20 logprobs each did, finishing
    in one step) leaves /health answering. (Built on the loop, it held it for that second.)"""
    from inkling_compiled.server import app as app_module

    real = app_module.Answer.whole

    def slow(self):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:  # Python work, not a sleep: it holds the interpreter
            pass
        return real(self)

    monkeypatch.setattr(app_module.Answer, "whole", slow)
    tokens = app_module.ANSWER_IN_THREAD_TOKENS + 1
    with HealthProbe(server) as probe:
        status, _, answer = http(server, "POST", "/v1/completions",
                                 {"prompt": "hi", "max_tokens": tokens, "ignore_eos": True, "logprobs": 2})
        time.sleep(0.1)
    assert status == 200 and answer["usage"]["completion_tokens"] == tokens
    assert len(answer["choices"][0]["logprobs"]["tokens"]) == tokens
    assert probe.worst < STALL_BOUND, probe.worst


def test_an_endless_header_is_a_431_and_a_malformed_request_a_json_400(server):
    """A header that never ends is cut off at max_header_bytes with a JSON 431 (the parser's cost grows
    with the square of what it holds: 69 MB of one header once stalled every client for seconds before
    its 408); a request that is not HTTP gets a JSON 400, not uvicorn's plain text."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ")
    with HealthProbe(server) as probe:
        try:
            for _ in range(64):  # 4 MB at most; the server closes after 64 KB
                sock.sendall(b"a" * 65536)
        except OSError:  # the server closed the connection
            pass
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 431") and b"application/json" in reply, reply[:200]
    assert b"larger than max_header_bytes=65536" in reply
    assert probe.worst < STALL_BOUND, probe.worst
    # behind a request in flight on the same connection, an endless header closes the connection
    # (which aborts that request) instead of growing while the request runs
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    body = json.dumps({"prompt": "hi", "max_tokens": 2000, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(0.2)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ")
    try:
        for _ in range(16):  # 1 MB, then nothing more
            sock.sendall(b"a" * 65536)
    except OSError:
        pass
    sock.settimeout(5)
    assert read_until_closed(sock).count(b"HTTP/1.1 ") <= 1  # closed, not after the 2,000 tokens
    wait_for(lambda: metric(server, "requests_running") == 0)
    # a body the app answers without reading (an unknown route) is still body, not the next headers:
    # one response, and the connection serves the next request
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 300000\r\n\r\n" + b"x" * 300_000)
    time.sleep(0.3)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    replies = b""
    while replies.count(b"HTTP/1.1 ") < 2 or not replies.endswith(b"}"):
        more = sock.recv(65536)
        if not more:  # closed
            break
        replies += more
    assert replies.startswith(b"HTTP/1.1 404") and b"HTTP/1.1 200" in replies and b"431" not in replies, replies
    for request in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                    b"NOT HTTP AT ALL\r\n\r\n"):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(request)
        reply = read_until_closed(sock)
        assert reply.startswith(b"HTTP/1.1 400") and b"application/json" in reply, reply
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"].startswith("the request is not valid HTTP")


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000,
                                 b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"], ids=["array", "field"])
def test_deeply_nested_json_is_a_400_not_a_503(server, raw):
    status, _, answer = http(server, "POST", "/v1/completions", raw=raw)
    assert status == 400 and "nested too deeply" in answer["error"]["message"], answer
    assert http(server, "GET", "/health")[0] == 200


def test_prompt_plus_max_tokens_over_max_model_len_is_a_400_naming_both(server):
    status, _, answer = http(server, "POST", "/v1/completions", {"prompt": [5] * 2000, "max_tokens": 100})
    assert status == 400, answer
    assert "prompt's 2000 tokens plus max_tokens=100 are more than max_model_len=2048" in answer["error"]["message"]
    status, _, answer = http(server, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "x" * 2000}], "max_completion_tokens": 100})
    assert status == 400 and "max_completion_tokens=100" in answer["error"]["message"]
    # without a length, the default fits or is cut to the room left
    status, _, answer = http(server, "POST", "/v1/completions", {"prompt": [5] * 2040, "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 8


def test_every_step_that_brought_tokens_sends_an_event_with_its_logprobs(server, checkpoint):
    """Greedy bytes of the random tiny model include unfinished UTF-8 characters, whose text is empty until
    the character ends: every token still gets its event, carrying its logprob, and the usage so far."""
    oracle = Engine.from_pretrained(checkpoint("tiny"), compile=False, progress=False)
    prompt = next(p for p in ([5, 9, 11, 200], [7, 7, 7], [100, 40, 3], [250, 1, 80])
                  if any(t >= 3 + 0x80 for t in oracle.generate([p], SamplingParams(max_new_tokens=12,
                                                                                    temperature=0))[0].token_ids))
    want = oracle.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0, logprobs=True))[0]
    oracle.close()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=60)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    events = [c for c in chunks if c.choices]
    assert len(events) == 12  # one per step: no speculation, one token each
    assert any(e.choices[0].text == "" for e in events)  # an unfinished character's event is still sent
    assert [len(e.choices[0].logprobs.tokens) for e in events] == [1] * 12
    assert [e.choices[0].logprobs.token_logprobs[0] for e in events] == pytest.approx(want.logprobs, abs=1e-4)
    assert [e.usage.completion_tokens for e in events] == list(range(1, 13))
    assert "".join(e.choices[0].text for e in events) == want.text and chunks[-1].usage.completion_tokens == 12


class BodyWrites:
    """ASGI middleware: how many body messages (socket writes) each response sent, and the event loop."""

    def __init__(self, app):
        self.app, self.writes, self.loop = app, [], None

    async def __call__(self, scope, receive, send):
        self.loop = asyncio.get_running_loop()
        count = [0]

        async def counted(message):
            count[0] += message["type"] == "http.response.body"
            await send(message)

        await self.app(scope, receive, counted)
        self.writes.append(count[0])


def test_events_that_arrived_together_leave_in_one_write_each_still_its_own_event(checkpoint, monkeypatch):
    """A handler that wakes behind the engine (its event loop was busy while the request's last 11 steps
    ran) sends what piled up in one write, not one per step, with its usage and [DONE]; the client still
    reads one event per step, each with its usage so far."""
    from inkling_compiled.server.serve import ApiServer

    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, progress=False, max_batch_size=8)
    real, steps, go = engine.worker.runner.run, [], threading.Event()

    def gated(plan):  # every step after the first waits until the event loop is busy
        steps.append(plan)
        if len(steps) > 1:
            go.wait(60)
        return real(plan)

    monkeypatch.setattr(engine.worker.runner, "run", gated)
    server = ApiServer(engine, port=0, model_name="tiny")
    counter = server.uvicorn.config.app = BodyWrites(server.uvicorn.config.app)
    server.start()
    try:
        sock = open_stream(server.port, {"prompt": [5, 9, 11], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        data = b""
        while b"data: " not in data:  # the first event: the handler now waits for the next
            data += sock.recv(65536)
        blocked = threading.Event()
        counter.loop.call_soon_threadsafe(lambda: (blocked.set(), time.sleep(2.0)))  # busy while 11 steps run
        assert blocked.wait(60)
        go.set()
        while b"data: [DONE]" not in data:
            data += sock.recv(65536)
        sock.close()
        wait_for(lambda: counter.writes)
        events = [json.loads(line[6:]) for line in data.decode("utf-8", "replace").splitlines()
                  if line.startswith("data: {")]
        tokens = [e for e in events if e["choices"]]
        assert [e["usage"]["completion_tokens"] for e in tokens] == list(range(1, 13))
        assert events[-1]["usage"]["completion_tokens"] == 12 and not events[-1]["choices"]
        # the first event, everything after the pause, and the end of the chunked body
        assert counter.writes == [3]
    finally:
        server.stop()
        engine.close()


def test_bench_serve_counts_tokens_as_usage_does(server):
    """The bench client's token arrivals are what the server's usage says, one per generated token."""
    import http.client

    from inkling_compiled.bench_client import stream_completion

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        for new_tokens in (1, 9):  # and on one kept-alive connection
            sent, arrivals = stream_completion(conn, [5, 6, 7], new_tokens)
            assert len(arrivals) == new_tokens and all(a >= sent for a in arrivals)
    finally:
        conn.close()


def test_bench_serve_reads_each_sides_cpu_as_the_process_counts_its_own():
    """bench-serve's CPU columns: a running process's CPU from /proc and an ended child's from the kernel's
    accounting, each against what the process measured of itself."""
    import subprocess
    import sys

    from inkling_compiled.bench_serve import children_cpu_s, cpu_us_per_token, process_cpu_s

    burn = ("import sys, time\n"
            "while time.process_time() < 0.4: pass\n"
            "print(time.process_time(), flush=True)\n"
            "sys.stdin.read()\n"
            "print(time.process_time(), flush=True)\n")
    before = children_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    own = float(child.stdout.readline())
    seen = process_cpu_s(child.pid)  # running, past its busy loop
    end, _ = child.communicate("")
    ended = children_cpu_s() - before
    assert own >= 0.4 and seen == pytest.approx(own, abs=0.05)
    assert float(end) >= 0.4 and ended >= float(end) - 0.02
    assert process_cpu_s(child.pid) is None  # gone, and reaped
    per_token = cpu_us_per_token({"client": 3.0, "server": 1.5, "engine": None}, {"client": 1.0, "server": 0.5}, 1000)
    assert per_token == {"client": 2000.0, "server": 1000.0, "engine": None}


@pytest.mark.parametrize("body, message", [
    ({"prompt": "hi", "stop": [str(i) for i in range(17)]}, "17 stops (stop and stop_token_ids) are more than "
                                                           "max_stop_strings=16"),
    ({"prompt": "hi", "stop": ["x"] * 10, "stop_token_ids": [5] * 7}, "17 stops"),
    ({"prompt": "hi", "stop": ["y" * 257]}, "stop[0] has 257 characters, more than max_stop_chars=256"),
    ({"prompt": "hi", "stop_token_ids": [999]}, "stop token id 999 is out of range [0, "),
    ({"prompt": "hi", "stop": [5, -1]}, "stop token id -1 is out of range"),
    ({"prompt": "hi", "max_tokens": 2**40}, "max_tokens must be an integer in 1..2147483647"),
    ({"prompt": "hi", "top_k": 2**40}, "top_k must be an integer in -1..2147483647"),
], ids=["count", "count-with-ids", "length", "oov-id", "negative-id", "max_tokens", "top_k"])
def test_stop_limits_and_field_names(server, body, message):
    status, _, answer = http(server, "POST", "/v1/completions", body)
    assert status == 400 and message in answer["error"]["message"], answer
    assert "max_new_tokens" not in answer["error"]["message"]


def test_bodies_over_the_limit_are_413_before_they_are_read(checkpoint):
    small = start(checkpoint("tiny"), limits=Limits(max_body_bytes=1000, header_timeout=0.5, body_timeout=0.5))
    try:
        # a declared length over the limit: answered at once, without sending the body
        sock = socket.create_connection(("127.0.0.1", small.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n")
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()
        sock.close()
        # chunked, with no length: refused once it grows past the limit
        status, _, answer = http(small, "POST", "/v1/completions", {"prompt": "x" * 2000})
        assert status == 413 and "larger than max_body_bytes=1000" in answer["error"]["message"]
        # a body shorter than its Content-Length: 408 after body_timeout, not held forever
        sock = socket.create_connection(("127.0.0.1", small.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"prompt\"")
        t0 = time.perf_counter()
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in reply
        assert time.perf_counter() - t0 < 5
        sock.close()
        # headers that trickle: a 408 and the connection closed after header_timeout; one that never
        # says anything is closed
        socks = [socket.create_connection(("127.0.0.1", small.port), timeout=10) for _ in range(50)]
        for s in socks[:25]:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
        t0 = time.perf_counter()
        for i, s in enumerate(socks):
            if i < 25:
                assert s.recv(4096).startswith(b"HTTP/1.1 408")
            assert s.recv(4096) == b""
            s.close()
        assert time.perf_counter() - t0 < 5
        # a kept-alive connection gets a new deadline after each response, and normal requests go on
        sock = socket.create_connection(("127.0.0.1", small.port), timeout=10)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /hea")
        assert sock.recv(4096).startswith(b"HTTP/1.1 408") and sock.recv(4096) == b""
        sock.close()
        assert http(small, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
    finally:
        small.stop()
        small.loop.engine.close()


def test_every_length_field_is_checked_and_the_old_function_fields_refused(server):
    """A chat body giving both length fields has both checked (a bad max_tokens beside a good
    max_completion_tokens was once ignored); `functions` and `function_call`, the API's older tool
    fields, are refused by name as `tools` is."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    status, _, answer = http(server, "POST", "/v1/chat/completions", {**chat, "max_completion_tokens": 4, "max_tokens": "a"})
    assert status == 400 and "max_tokens must be an integer" in answer["error"]["message"], answer
    for field, value in (("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto")):
        status, _, answer = http(server, "POST", "/v1/chat/completions", {**chat, field: value})
        assert status == 400 and f"{field}={value!r} is not supported" in answer["error"]["message"], answer


def test_head_health_and_the_pages_cached_gauge(server):
    status, _, _ = http(server, "HEAD", "/health")
    assert status == 200
    assert http(server, "HEAD", "/metrics")[0] == 200
    server.loop.engine.clear_prefix_cache()
    wait_for(lambda: metric(server, "pages_cached") == 0)
    http(server, "POST", "/v1/completions", {"prompt": [9] * 40, "max_tokens": 2})
    wait_for(lambda: metric(server, "requests_running") == 0)
    assert metric(server, "pages_cached") == 40 // 16  # the prompt's full pages stay cached


def test_limits_refuse_nonsense():
    for bad in (dict(max_body_bytes=0), dict(max_stop_strings=-1), dict(max_header_bytes=0), dict(header_timeout=float("nan")),
                dict(body_timeout=0), dict(header_timeout=float("inf"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Limits(**bad)


# ---- the CLI refuses before it loads anything --------------------------------------------------------

@pytest.fixture
def no_loading(monkeypatch):
    """Engine.from_pretrained fails the test if reached: every refusal below comes before the model loads."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    from inkling_compiled.server.engine_process import EngineProcess

    monkeypatch.setattr(Engine, "from_pretrained", load)
    monkeypatch.setattr(EngineProcess, "__init__", load)


@pytest.mark.parametrize("options, message", [
    (["--port", "99999"], "'99999' is not a port number (0..65535"),
    (["--port", "-5"], "'-5' is not a port number"),
    (["--shutdown-timeout", "nan"], "'nan' must be a finite number of seconds >= 0"),
    (["--shutdown-timeout", "-1"], "'-1' must be a finite number of seconds >= 0"),
    (["--header-timeout", "inf"], "'inf' must be a finite number of seconds"),
    (["--max-body-bytes", "0"], "'0' must be at least 1"),
], ids=["port-high", "port-negative", "timeout-nan", "timeout-negative", "header-inf", "body-zero"])
def test_serve_refuses_bad_options_before_loading(checkpoint, no_loading, capsys, options, message):
    from inkling_compiled.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(checkpoint("tiny"))] + options)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    # a zero timeout is a number argparse takes; the limits refuse it
    assert main(["serve", "--model", str(checkpoint("tiny")), "--body-timeout", "0"]) == 2
    assert "body_timeout must be a number of seconds > 0" in capsys.readouterr().err


def test_serve_refuses_a_busy_port_a_bad_host_and_no_tokenizer_before_loading(checkpoint, no_loading, capsys,
                                                                              tmp_path):
    import shutil

    from inkling_compiled.cli import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(checkpoint("tiny")), "--port", str(port)]) == 2
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    finally:
        busy.close()
    assert main(["serve", "--model", str(checkpoint("tiny")), "--host", "256.1.1.1"]) == 2
    assert "cannot listen on 256.1.1.1:8000" in capsys.readouterr().err
    assert main(["serve", "--model", str(checkpoint("tiny")), "--host", "192.0.2.1"]) == 2  # not this machine's
    assert "cannot listen on 192.0.2.1:8000" in capsys.readouterr().err
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(checkpoint("tiny"), bare)
    (bare / "tokenizer.json").unlink()
    assert main(["serve", "--model", str(bare)]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


def test_the_engines_own_refusals_name_the_api_field(checkpoint):
    """A pool too small for the length asked: the engine's message says max_new_tokens, the answer names
    the field the client sent."""
    small = start(checkpoint("tiny"), max_batch_size=1, num_pages=10)
    try:
        status, _, answer = http(small, "POST", "/v1/completions", {"prompt": [5] * 10, "max_tokens": 500})
        assert status == 400 and "lower max_tokens" in answer["error"]["message"], answer
        status, _, answer = http(small, "POST", "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500})
        assert status == 400 and "lower max_completion_tokens" in answer["error"]["message"], answer
        assert "max_new_tokens" not in answer["error"]["message"]
    finally:
        small.stop()
        small.loop.engine.close()


def test_a_client_that_leaves_while_sending_its_body_logs_no_error(server, caplog):
    """A client that hangs up halfway through its body is a disconnect like any other: no traceback of
    an unhandled exception in the server's log, and the server serves on."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    time.sleep(0.2)
    sock.close()
    time.sleep(0.3)
    assert http(server, "GET", "/health")[0] == 200
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]


def test_a_request_reaching_the_engine_after_the_shutdown_deadline_is_aborted(checkpoint):
    """Once the shutdown's deadline has passed (`closing` set, then every request in the engine aborted),
    a request whose body was still being checked reaches the engine afterwards: it is aborted at once,
    as the others were, rather than left running until uvicorn cancels it."""
    server = start(checkpoint("tiny"))
    try:
        server.closing.set()
        status, _, answer = http(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 200, "ignore_eos": True})
        assert status == 200 and answer["choices"][0]["finish_reason"] == "abort", answer
        assert answer["usage"]["completion_tokens"] < 200
        wait_for(lambda: metric(server, "requests_running") == 0)
    finally:
        server.stop()
        server.loop.engine.close()


def test_a_stream_whose_client_leaves_before_its_first_event_is_aborted(server, monkeypatch):
    """The client hangs up while its request waits for admission (steps are slow): the stream's generator
    never starts, and the request is still aborted rather than decoded to max_tokens for nobody."""
    slow_steps(server.loop.engine, monkeypatch, 0.05)
    aborted = metric_or_zero(server, 'requests_finished_total{reason="abort"}')
    busy = open_stream(server.port, {"prompt": [5], "max_tokens": 1500, "ignore_eos": True})  # keeps steps going
    wait_for(lambda: metric(server, "requests_running") == 1)
    for _ in range(5):
        sock = open_stream(server.port, {"prompt": [6], "max_tokens": 1500, "ignore_eos": True})
        sock.close()
    wait_for(lambda: metric_or_zero(server, 'requests_finished_total{reason="abort"}') == aborted + 5, seconds=10)
    busy.close()
    monkeypatch.undo()
    wait_for(lambda: metric(server, "requests_running") == 0 and metric(server, "slots_free") == 8)


def test_a_stopped_loop_refuses_new_requests_instead_of_hanging(checkpoint):
    import asyncio

    from inkling_compiled.server.loop import EngineLoop

    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, progress=False)
    loop = EngineLoop(engine).start()
    loop.stop()

    async def submit():
        return await asyncio.wait_for(loop.submit([5, 6], SamplingParams(max_new_tokens=2)), timeout=5)

    with pytest.raises(RuntimeError, match="the server is shutting down"):
        asyncio.run(submit())
    engine.close()
