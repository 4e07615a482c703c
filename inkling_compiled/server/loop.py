"""One thread steps the engine; HTTP handlers add and abort requests and await their outputs.

The engine's API is thread-safe, so handlers call `add_request` and `abort` directly; the loop thread
only steps and hands each output to the asyncio queue of the request it belongs to. A request that waits
for a slot counts against `max_waiting`: past it, `submit` raises `QueueFull` (the server's 429).
Counters for /metrics are kept here, where every step and output passes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ..errors import RequestError
from ..requests import RequestOutput

log = logging.getLogger("inkling_compiled")

MAX_CHARS_PER_TOKEN = 64  # a text prompt longer than this times max_model_len is refused before tokenizing
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds


class QueueFull(Exception):
    """More requests wait for a slot than the server takes (`max_waiting`)."""


class Subscription:
    """Where a request's outputs arrive: an asyncio queue on the event loop of the handler that made it."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id, self.loop = request_id, loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def push(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Metrics:
    """Totals since start, and a histogram of step times."""

    def __init__(self):
        self.prompt_tokens = self.generation_tokens = self.steps = 0
        self.step_seconds = 0.0
        self.step_buckets = [0] * len(STEP_BUCKETS)
        self.finished: dict[str, int] = {}
        self.rejected = 0  # 429s

    def step(self, seconds: float) -> None:
        self.steps += 1
        self.step_seconds += seconds
        for i, bound in enumerate(STEP_BUCKETS):
            if seconds <= bound:
                self.step_buckets[i] += 1


class EngineLoop:
    def __init__(self, engine, max_waiting: int = 256):
        self.engine, self.max_waiting = engine, max_waiting
        self.metrics = Metrics()
        self._subs: dict[str, Subscription] = {}
        self._sent: dict[str, int] = {}  # request id -> tokens already counted in generation_tokens
        self._reasons: dict[str, str] = {}  # request id -> why the server ended it (counted for /metrics)
        self._lock = threading.Lock()  # _subs, _sent and the metrics
        self._wake = threading.Event()
        # Handlers adding a request right now. The loop lets them in before its next step: the engine's lock
        # is not fair, and a loop that takes it again at once would keep a new request out for steps.
        self._adding = 0
        self._added = threading.Condition()
        self._stopping = False
        self.failure: str | None = None  # set when the engine can serve no more (a tensor-parallel rank died)
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, name="inkling-engine-loop", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, prompt, params, loop: asyncio.AbstractEventLoop) -> Subscription:
        """Adds a request (a RequestError for bad input, QueueFull past `max_waiting`). A text prompt is
        tokenized here, before any lock: a long one delays only its own request."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        if isinstance(prompt, str):
            limit = MAX_CHARS_PER_TOKEN * self.engine.max_model_len
            if len(prompt) > limit:  # no tokenizer packs more than that into max_model_len tokens
                raise RequestError(f"prompt of {len(prompt)} characters is too long for max_model_len="
                                   f"{self.engine.max_model_len} tokens")
            prompt = self.engine.tokenizer.encode(prompt)
        with self._added:
            self._adding += 1
        try:
            with self._lock:
                waiting = self.engine.snapshot()["waiting"]
                if waiting >= self.max_waiting:
                    self.metrics.rejected += 1
                    raise QueueFull(f"{waiting} requests are waiting for a slot (max_waiting="
                                    f"{self.max_waiting}); retry shortly")
                rid = self.engine.add_request(prompt, params)
                sub = self._subs[rid] = Subscription(rid, loop)
                self._sent[rid] = 0  # its prompt tokens are counted when its first output says how many
        finally:
            with self._added:
                self._adding -= 1
                self._added.notify_all()
        self._wake.set()
        return sub

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Ends a request whose client went away (or, `reason="stop"`, whose stop string came: /metrics counts
        it as stopped): its slot and pages are freed now; nothing more is delivered for it."""
        with self._lock:
            self._subs.pop(request_id, None)
            if request_id in self._sent:
                self._reasons[request_id] = reason
        try:
            self.engine.abort(request_id)
        except RequestError:  # it finished meanwhile
            pass

    def abort_all(self) -> None:
        """Ends every request the engine has (shutdown past its timeout): each one's handler gets a final
        output with finish_reason "abort" and answers with it."""
        with self._lock:
            rids = list(self._sent)
        for rid in rids:
            try:
                self.engine.abort(rid)
            except RequestError:  # finished meanwhile
                pass
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts what is left and joins the thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            sub.push(RuntimeError("the server is shutting down"))

    def running(self) -> int:
        now = self.engine.snapshot()
        return now["running"] + now["prefilling"]

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            with self._added:  # requests being added go in first (bounded: a handler never waits long)
                self._added.wait_for(lambda: self._adding == 0, timeout=0.05)
            if not engine.has_unfinished():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as e:  # the engine contains request failures; this one stopped it
                log.exception("the engine stopped")
                self.failure = f"the engine stopped: {type(e).__name__}: {e}"
                with self._lock:
                    subs, self._subs = list(self._subs.values()), {}
                for sub in subs:
                    sub.push(RuntimeError(self.failure))
                return
            seconds = time.perf_counter() - t0
            with self._lock:
                self.metrics.step(seconds)
                for out in outputs:
                    self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        rid = out.request_id
        sent = self._sent.get(rid)
        if sent is None:  # not a request of this server's (added to the engine directly)
            return
        if sent == 0 and out.token_ids:
            self.metrics.prompt_tokens += len(out.prompt_token_ids)
        self.metrics.generation_tokens += len(out.token_ids) - sent
        self._sent[rid] = len(out.token_ids)
        if out.finished:
            reason = self._reasons.pop(rid, out.finish_reason)
            self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1
            del self._sent[rid]
        sub = self._subs.pop(rid, None) if out.finished else self._subs.get(rid)
        if sub is not None:
            sub.push(out)
