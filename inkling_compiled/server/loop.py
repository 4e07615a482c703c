"""One thread owns the engine: it adds, aborts and steps; HTTP handlers only send it commands.

A handler never waits for the engine. `submit` and `abort` put a command in the loop's inbox and return
(`submit` then awaits its admission, which comes at the next step boundary); the engine thread runs
every command in the inbox before each step, in the order they came, and hands each step's outputs to
the event loops of the handlers that wait for them, one wake-up per event loop per step. So a hundred
clients leaving at once cost the event loop a hundred appends, and a step in progress delays nobody's
`/health`. A request that waits for a slot counts against `max_waiting`: past it, admission fails with
`QueueFull` (the server's 429). Counters for /metrics are kept here, where every step and output passes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

from ..errors import RequestError
from ..requests import RequestOutput

log = logging.getLogger("inkling_compiled")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds


class QueueFull(Exception):
    """More requests wait for a slot than the server takes (`max_waiting`)."""


class Subscription:
    """One request as a handler sees it: its admission (a future that gets the request id, or the reason it
    was refused) and the queue its outputs arrive in, both on the handler's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.request_id: str | None = None  # set by the engine thread once admitted
        self.admitted: asyncio.Future = loop.create_future()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()


def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # its handler was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _put_all(items: list[tuple[Subscription, RequestOutput | BaseException]]) -> None:
    for sub, item in items:
        sub.queue.put_nowait(item)


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
        self._inbox: collections.deque = collections.deque()  # (command, ...) tuples; deque appends are atomic
        self._wake = threading.Event()
        # Everything below is touched by the engine thread only.
        self._subs: dict[str, Subscription] = {}
        self._sent: dict[str, int] = {}  # request id -> tokens already counted in generation_tokens
        self._reasons: dict[str, str] = {}  # request id -> why the server ended it (counted for /metrics)
        self._stopping = False
        self.failure: str | None = None  # set when the engine can serve no more (its step raised, a rank died)
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, name="inkling-engine-loop", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    # ---- called by handlers (any thread, never blocking) ------------------------------------------------

    async def submit(self, prompt: list[int], params) -> Subscription:
        """Admits a request (token ids, checked by the protocol) at the next step boundary; raises the
        engine's RequestError, QueueFull past `max_waiting`, or RuntimeError once the engine cannot serve."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        sub = Subscription(asyncio.get_running_loop())
        self._send("add", sub, prompt, params)
        try:
            await sub.admitted
        except asyncio.CancelledError:  # the client left before admission: the request must not outlive it
            self.abort(sub)
            raise
        return sub

    def abort(self, sub: Subscription, reason: str = "abort") -> None:
        """Ends a request whose client went away (or, `reason="stop"`, whose stop string came: /metrics counts
        it as stopped): its slot and pages are freed before the next step; nothing more is delivered."""
        self._send("abort", sub, reason)

    def abort_all(self) -> None:
        """Ends every request the engine has (shutdown past its timeout): each one's handler gets a final
        output with finish_reason "abort" and answers with it."""
        self._send("abort_all")

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the engine thread; every handler still waiting gets an error."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._fail_everyone(RuntimeError("the server is shutting down"))

    def _send(self, *command) -> None:
        self._inbox.append(command)
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._run_commands()
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
                self._fail_everyone(RuntimeError(self.failure))
                return
            self.metrics.step(time.perf_counter() - t0)
            pushes: dict[asyncio.AbstractEventLoop, list] = {}
            for out in outputs:
                sub = self._account(out)
                if sub is not None:
                    pushes.setdefault(sub.loop, []).append((sub, out))
            for loop, items in pushes.items():
                loop.call_soon_threadsafe(_put_all, items)

    def _run_commands(self) -> None:
        while self._inbox:
            command, *args = self._inbox.popleft()
            if command == "add":
                self._add(*args)
            elif command == "abort":
                self._abort(*args)
            elif command == "abort_all":
                for rid in list(self._sent):
                    self._end(rid)

    def _add(self, sub: Subscription, prompt, params) -> None:
        try:
            waiting = self.engine.snapshot()["waiting"]
            if waiting >= self.max_waiting:
                self.metrics.rejected += 1
                raise QueueFull(f"{waiting} requests are waiting for a slot (max_waiting={self.max_waiting}); "
                                "retry shortly")
            rid = self.engine.add_request(prompt, params)
        except (RequestError, QueueFull, RuntimeError) as e:  # RuntimeError: the engine is closed
            sub.loop.call_soon_threadsafe(_resolve, sub.admitted, None, e)
            return
        sub.request_id = rid
        self._subs[rid] = sub
        self._sent[rid] = 0  # its prompt tokens are counted when its first output says how many
        sub.loop.call_soon_threadsafe(_resolve, sub.admitted, rid)

    def _abort(self, sub: Subscription, reason: str) -> None:
        rid = sub.request_id
        if rid is None or self._subs.pop(rid, None) is None:  # refused, or finished meanwhile
            return
        self._reasons[rid] = reason
        self._end(rid)

    def _end(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except RequestError:  # it finished in the step that just ran
            pass

    def _account(self, out: RequestOutput) -> Subscription | None:
        """Counts an output for /metrics; returns the subscription it goes to, if any still listens."""
        rid = out.request_id
        sent = self._sent.get(rid)
        if sent is None:  # not a request of this server's (added to the engine directly)
            return None
        m = self.metrics
        if sent == 0 and out.new_token_ids:
            m.prompt_tokens += len(out.prompt_token_ids)
        m.generation_tokens += len(out.new_token_ids)
        self._sent[rid] = sent + len(out.new_token_ids)
        if not out.finished:
            return self._subs.get(rid)
        reason = self._reasons.pop(rid, out.finish_reason)
        m.finished[reason] = m.finished.get(reason, 0) + 1
        del self._sent[rid]
        return self._subs.pop(rid, None)

    def _fail_everyone(self, error: BaseException) -> None:
        """Every handler waiting for admission or for outputs gets `error` (the engine thread is done)."""
        pushes: dict[asyncio.AbstractEventLoop, list] = {}
        for sub in self._subs.values():
            pushes.setdefault(sub.loop, []).append((sub, error))
        self._subs = {}
        while self._inbox:
            command, *args = self._inbox.popleft()
            if command == "add":
                args[0].loop.call_soon_threadsafe(_resolve, args[0].admitted, None, error)
        for loop, items in pushes.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed already
                pass
