"""Driving a server under test: start one on a free port, plain HTTP requests, its metrics, bounded waits."""

import json
import time
import urllib.error
import urllib.request

from inkling_compiled import Engine
from inkling_compiled.server.chat import ChatTemplate
from inkling_compiled.server.serve import ApiServer


def start(path, **options) -> ApiServer:
    engine_options = {k: options.pop(k) for k in ("max_batch_size", "num_pages") if k in options}
    engine = Engine.from_pretrained(path, compile=False, progress=False, **{"max_batch_size": 8, **engine_options})
    server = ApiServer(engine, port=0, model_name="tiny", chat_template=ChatTemplate.from_checkpoint(path), **options)
    server.start()
    return server


def http(server, method: str, path: str, body=None, raw: bytes | None = None):
    """(status, headers, parsed JSON or text) of one plain request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, headers, text = r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        status, headers, text = e.code, e.headers, e.read().decode()
    try:
        return status, headers, json.loads(text)
    except json.JSONDecodeError:
        return status, headers, text


def metric(server, name: str) -> float:
    _, _, text = http(server, "GET", "/metrics")
    for line in text.splitlines():
        if line.startswith(f"inkling_{name} ") or line.startswith(f"inkling_{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def metric_or_zero(server, name: str) -> float:
    _, _, text = http(server, "GET", "/metrics")
    line = next((line for line in text.splitlines() if line.startswith(f"inkling_{name} ")), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0
