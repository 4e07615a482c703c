"""The engine's side of serving (`EngineCore`) and the handlers' side (`Frontend`), joined by commands.

A handler never waits for the engine. `submit` and `abort` hand a command to whoever owns the engine
and return (`submit` then awaits its admission, which comes at the next step boundary); the owner runs
every command before each step, in the order they came, and each step's outputs reach the event loops
of the handlers that wait for them, one wake-up per event loop per step. So a hundred clients leaving at
once cost the event loop a hundred appends, and a step in progress delays nobody's `/health`.

Two owners share this: `EngineLoop` (here) steps an engine of this process on a thread of its own, which
tests and in-process tools use; `engine_process.EngineProcess` steps it in a process of its own, so that
the event loop and the engine never take turns on one interpreter (what `serve` runs).

A request that waits for a slot counts against `max_waiting`: past it, admission fails with `QueueFull`
(the server's 429). Counters for /metrics are kept by the core, where every step and output passes.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time

import msgspec

from ..errors import InklingError, RequestError
from ..requests import RequestOutput

log = logging.getLogger("inkling_compiled")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds


class QueueFull(Exception):
    """More requests wait for a slot than the server takes (`max_waiting`)."""


class Metrics(msgspec.Struct):
    """Totals since start, and a histogram of step times (a Struct: it crosses to the HTTP process)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    step_buckets: list[int] = msgspec.field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    finished: dict[str, int] = msgspec.field(default_factory=dict)
    rejected: int = 0  # 429s

    def step(self, seconds: float) -> None:
        self.steps += 1
        self.step_seconds += seconds
        for i, bound in enumerate(STEP_BUCKETS):
            if seconds <= bound:
                self.step_buckets[i] += 1


class EngineCore:
    """Admits, aborts and steps one engine, counting for /metrics. Used by one thread only."""

    def __init__(self, engine, max_waiting: int):
        self.engine, self.max_waiting = engine, max_waiting
        self.metrics = Metrics()
        self._sent: dict[str, int] = {}  # request id -> tokens already counted in generation_tokens
        self._reasons: dict[str, str] = {}  # request id -> why the server ended it

    def add(self, rid: str, prompt: list[int], params) -> None:
        """Raises the engine's RequestError, QueueFull past `max_waiting`, RuntimeError once it is closed."""
        waiting = self.engine.snapshot()["waiting"]
        if waiting >= self.max_waiting:
            self.metrics.rejected += 1
            raise QueueFull(f"{waiting} requests are waiting for a slot (max_waiting={self.max_waiting}); "
                            "retry shortly")
        self.engine.add_request(prompt, params, request_id=rid)
        self._sent[rid] = 0  # its prompt tokens are counted when its first output says how many

    def abort(self, rid: str, reason: str = "abort") -> None:
        """Ends a request (`reason="stop"`: its stop string came, and /metrics counts it as stopped)."""
        if rid not in self._sent:  # finished meanwhile
            return
        self._reasons[rid] = reason
        try:
            self.engine.abort(rid)
        except RequestError:  # it finished in the step that just ran
            pass

    def abort_all(self) -> None:
        for rid in list(self._sent):
            self.abort(rid)

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of this server's requests, counted."""
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self.metrics.step(time.perf_counter() - t0)
        return [out for out in outputs if self._account(out)]

    def state(self) -> dict:
        return {"snapshot": self.engine.snapshot(), "stats": self.engine.stats()}

    def _account(self, out: RequestOutput) -> bool:
        rid = out.request_id
        sent = self._sent.get(rid)
        if sent is None:  # not a request of this server's (added to the engine directly)
            return False
        m, new = self.metrics, len(out.new_token_ids)
        if sent == 0 and new:
            m.prompt_tokens += len(out.prompt_token_ids)
        m.generation_tokens += new
        self._sent[rid] = sent + new
        if out.finished:
            reason = self._reasons.pop(rid, out.finish_reason)
            m.finished[reason] = m.finished.get(reason, 0) + 1
            del self._sent[rid]
        return True


class Subscription:
    """One request as a handler sees it: its admission (a future that gets the request id, or the reason it
    was refused) and the queue its outputs arrive in, both on the handler's event loop."""

    def __init__(self, request_id: str, prompt: list[int], loop: asyncio.AbstractEventLoop):
        self.request_id, self.prompt, self.loop = request_id, prompt, loop
        self.admitted: asyncio.Future = loop.create_future()
        self.queue: asyncio.Queue = asyncio.Queue()


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():  # else its handler was cancelled meanwhile
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)


def _put_all(items: list) -> None:
    for sub, item in items:
        sub.queue.put_nowait(item)


class Frontend:
    """The handlers' side: request ids, subscriptions, and delivery to event loops. Subclasses carry the
    commands ("add", "abort", "abort_all") to the engine's owner (`_send`) and report back through
    `_admitted`, `_deliver` and `_fail_everyone`."""

    tokenizer = None
    max_model_len: int
    vocab_size: int

    def __init__(self):
        self._subs: dict[str, Subscription] = {}
        self._ids = itertools.count()
        self.failure: str | None = None  # set when the engine can serve no more
        self.started = time.time()

    async def submit(self, prompt: list[int], params) -> Subscription:
        """Admits a request (token ids, checked by the protocol) at the next step boundary; raises the
        engine's RequestError, QueueFull past `max_waiting`, or RuntimeError once the engine cannot serve."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        sub = Subscription(str(next(self._ids)), prompt, asyncio.get_running_loop())
        self._subs[sub.request_id] = sub
        if self.failure is not None:  # it failed meanwhile, before or after everyone was told: not this one
            self._subs.pop(sub.request_id, None)
            raise RuntimeError(self.failure)
        self._send("add", sub.request_id, prompt, params)
        try:
            await sub.admitted
        except asyncio.CancelledError:  # the client left before admission: the request must not outlive it
            self.abort(sub)
            raise
        except BaseException:
            self._subs.pop(sub.request_id, None)
            raise
        return sub

    def abort(self, sub: Subscription, reason: str = "abort") -> None:
        """Ends a request whose client went away (or, `reason="stop"`, whose stop string came): its slot and
        pages are freed before the next step; nothing more is delivered for it."""
        if self._subs.pop(sub.request_id, None) is not None:
            self._send("abort", sub.request_id, reason)

    def abort_all(self) -> None:
        """Ends every request (shutdown past its timeout): each handler gets a final "abort" output."""
        self._send("abort_all")

    def _send(self, *command) -> None:
        raise NotImplementedError

    def _admitted(self, rid: str, error: BaseException | None) -> None:
        sub = self._subs.get(rid)
        if sub is not None:
            _call_soon(sub.loop, _resolve, sub.admitted, error)

    def _deliver(self, outputs) -> None:
        """Each output to its request's queue, one wake-up per event loop."""
        pushes: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            sub = self._subs.pop(out.request_id, None) if out.finished else self._subs.get(out.request_id)
            if sub is not None:
                pushes.setdefault(sub.loop, []).append((sub, out))
        for loop, items in pushes.items():
            _call_soon(loop, _put_all, items)

    def _fail_everyone(self, error: BaseException) -> None:
        """Every handler waiting for admission or for outputs gets `error` (the engine is gone)."""
        subs, self._subs = list(self._subs.values()), {}
        pushes: dict[asyncio.AbstractEventLoop, list] = {}
        for sub in subs:
            pushes.setdefault(sub.loop, []).append((sub, error))
        for loop, items in pushes.items():
            _call_soon(loop, _resolve_or_put, items)


def _call_soon(loop: asyncio.AbstractEventLoop, *call) -> None:
    try:
        loop.call_soon_threadsafe(*call)
    except RuntimeError:  # that event loop is closed already: nobody waits there any more
        pass


def _resolve_or_put(items: list) -> None:
    for sub, error in items:
        if not sub.admitted.done():
            sub.admitted.set_exception(error)
        else:
            sub.queue.put_nowait(error)


class EngineLoop(Frontend):
    """An engine of this process, stepped on a thread of its own; commands go through an inbox."""

    def __init__(self, engine, max_waiting: int = 256):
        super().__init__()
        self.engine = engine
        self.tokenizer, self.max_model_len, self.vocab_size = engine.tokenizer, engine.max_model_len, \
            engine.config.vocab_size
        self.core = EngineCore(engine, max_waiting)
        self._inbox: collections.deque = collections.deque()  # deque appends are atomic
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="inkling-engine-loop", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def state(self) -> dict:
        """The engine's snapshot and stats, and the counters (waits for a step in progress: call off the loop)."""
        return {**self.core.state(), "metrics": self.core.metrics}

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the engine thread; every handler still waiting gets an error."""
        self._stopping = True
        self.failure = self.failure or "the server is shutting down"
        self._wake.set()
        self._thread.join(timeout)
        self._fail_everyone(RuntimeError(self.failure))

    def _send(self, *command) -> None:
        self._inbox.append(command)
        self._wake.set()

    def _run(self) -> None:
        core = self.core
        while not self._stopping:
            while self._inbox:
                command, *args = self._inbox.popleft()
                if command == "add":
                    try:
                        core.add(*args)
                        self._admitted(args[0], None)
                    except (InklingError, QueueFull, RuntimeError) as e:  # the engine's refusal, or it is closed
                        self._admitted(args[0], e)
                elif command == "abort":
                    core.abort(*args)
                else:
                    core.abort_all()
            if not core.busy():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                outputs = core.step()
            except Exception as e:  # the engine contains request failures; this one stopped it
                log.exception("the engine stopped")
                self.failure = f"the engine stopped: {type(e).__name__}: {e}"
                self._fail_everyone(RuntimeError(self.failure))
                return
            self._deliver(outputs)
