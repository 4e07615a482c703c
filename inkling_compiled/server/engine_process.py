"""The engine in a process of its own, so that HTTP and stepping never take turns on one interpreter.

The server's process keeps the event loop, the tokenizer (prompts in, text out) and a `Frontend`; the
engine process builds the engine from the checkpoint and runs an `EngineCore`. Between them is one pipe
of msgspec messages: commands one way (`Add`, `Abort`, `AbortAll`, `GetState`, `Stop`), and the other
way one `Outputs` per step (each request's new tokens and logprobs, nothing cumulative), admissions, state
replies and a `Failed` if the engine stops. A writer thread sends the commands, so a handler never blocks
on a full pipe; a reader thread turns outputs back into `RequestOutput`s over a request's tokens so far
(the engine's own class) and hands them to the handlers' event loops.

The engine process ignores SIGINT and SIGTERM (the server's process decides when to stop and tells it)
and exits when the pipe closes, so it does not outlive a server that was killed.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
from pathlib import Path

import msgspec

from .. import errors
from ..errors import RequestError
from ..requests import RequestOutput
from ..sampling import SamplingParams
from .loop import EngineCore, Frontend, Metrics, QueueFull

log = logging.getLogger("inkling_compiled")


class Add(msgspec.Struct, tag=True, array_like=True):
    rid: str
    prompt: list[int]
    params: SamplingParams


class Abort(msgspec.Struct, tag=True, array_like=True):
    rid: str
    reason: str


class AbortAll(msgspec.Struct, tag=True, array_like=True):
    pass


class GetState(msgspec.Struct, tag=True, array_like=True):
    ticket: int


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    max_model_len: int
    vocab_size: int


class Admitted(msgspec.Struct, tag=True, array_like=True):
    rid: str
    error: str | None = None  # the message of the refusal
    kind: str | None = None  # "request" (400), "queue_full" (429) or "closed" (503)


class Delta(msgspec.Struct, array_like=True):
    """What one step added to one request."""

    rid: str
    tokens: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    error: str | None
    cached_tokens: int
    # with the request's first tokens, when it asked for prompt logprobs (they are complete by then)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


class Outputs(msgspec.Struct, tag=True, array_like=True):
    deltas: list[Delta]


class State(msgspec.Struct, tag=True, array_like=True):
    ticket: int
    snapshot: dict[str, int]
    stats: dict
    metrics: Metrics


class Failed(msgspec.Struct, tag=True, array_like=True):
    message: str
    kind: str = "RuntimeError"  # an InklingError subclass's name when start-up refused the checkpoint or options


ToEngine = Add | Abort | AbortAll | GetState | Stop
FromEngine = Ready | Admitted | Outputs | State | Failed


# ---- the engine process -------------------------------------------------------------------------------

def _engine_main(conn, path: str, options: dict, max_waiting: int, threads: int | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    from ..engine import Engine

    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(ToEngine).decode
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        engine = Engine.from_pretrained(path, **options)
    except Exception as e:
        conn.send_bytes(encode(Failed(str(e), type(e).__name__)))
        return
    core = EngineCore(engine, max_waiting)
    conn.send_bytes(encode(Ready(engine.max_model_len, engine.config.vocab_size)))
    try:
        with engine:
            _serve_commands(conn, core, encode, decode)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the server's process is gone
        pass


MAX_COMMANDS_PER_STEP = 256  # a flood of commands delays a step by at most this many


def _serve_commands(conn, core: EngineCore, encode, decode) -> None:
    while True:
        wait = 0 if core.busy() else 0.1
        for _ in range(MAX_COMMANDS_PER_STEP):
            if not conn.poll(wait):
                break
            wait = 0
            message = decode(conn.recv_bytes())
            if isinstance(message, Add):
                try:
                    core.add(message.rid, message.prompt, message.params)
                    reply = Admitted(message.rid)
                except RequestError as e:
                    reply = Admitted(message.rid, str(e), "request")
                except QueueFull as e:
                    reply = Admitted(message.rid, str(e), "queue_full")
                except (RuntimeError, errors.InklingError) as e:  # the engine is closed
                    reply = Admitted(message.rid, str(e), "closed")
                conn.send_bytes(encode(reply))
            elif isinstance(message, Abort):
                core.abort(message.rid, message.reason)
            elif isinstance(message, AbortAll):
                core.abort_all()
            elif isinstance(message, GetState):
                conn.send_bytes(encode(State(message.ticket, metrics=core.metrics, **core.state())))
            else:  # Stop
                return
        if not core.busy():
            continue
        try:
            outputs = core.step()
        except Exception as e:  # the engine contains request failures; this one stopped it
            conn.send_bytes(encode(Failed(f"the engine stopped: {type(e).__name__}: {e}")))
            return
        if outputs:
            conn.send_bytes(encode(Outputs([
                Delta(o.request_id, o.new_token_ids, o.new_logprobs, o.new_top_logprobs, o.finish_reason,
                      None if o.error is None else str(o.error), o.cached_tokens,
                      *((o.prompt_logprobs, o.prompt_top_logprobs) if first_delta(o) else ()))
                for o in outputs])))


def first_delta(out: RequestOutput) -> bool:
    """Whether this output brings the request's first tokens (its prompt logprobs travel with them)."""
    return bool(out.new_token_ids) and len(out.new_token_ids) == len(out.token_ids)


# ---- the server's side --------------------------------------------------------------------------------

class _Stream:
    """A request's tokens so far, in the server's process: the fields of an engine `Request` that a
    `RequestOutput` reads, so outputs rebuilt here are the engine's own class, cut at their step."""

    __slots__ = ("request_id", "prompt", "params", "output", "logprobs", "top_logprobs", "prompt_logprobs",
                 "prompt_top_logprobs", "finish_reason", "error", "cached_tokens", "spec_proposed", "spec_accepted")

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.output, self.logprobs, self.top_logprobs = [], [], []
        self.prompt_logprobs = self.prompt_top_logprobs = None
        self.finish_reason = self.error = None
        self.cached_tokens = self.spec_proposed = self.spec_accepted = 0

    def take(self, delta: Delta) -> RequestOutput:
        """The output of the step that brought `delta`."""
        start = len(self.output)
        self.output += delta.tokens
        self.logprobs += delta.logprobs or ()
        self.top_logprobs += delta.top_logprobs or ()
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
        self.finish_reason, self.error, self.cached_tokens = delta.finish_reason, delta.error, delta.cached_tokens
        return RequestOutput(self, start, None, None)


_REFUSALS = {"request": RequestError, "queue_full": QueueFull, "closed": RuntimeError}


class EngineProcess(Frontend):
    """Builds the engine in a new process from `path` and `options` (`Engine.from_pretrained`'s keywords);
    returns once it is ready, or raises what its start-up raised (the same InklingError, by name)."""

    def __init__(self, path: str | Path, options: dict | None = None, *, max_waiting: int = 256,
                 threads: int | None = None, tokenizer=None):
        super().__init__()
        from ..tokenizer import TextTokenizer

        self.tokenizer = tokenizer if tokenizer is not None else TextTokenizer.from_checkpoint(path)
        context = multiprocessing.get_context("spawn")  # no forked torch state; CUDA-safe
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_engine_main, name="inkling-engine",
                                       args=(child, str(path), dict(options or {}), max_waiting, threads))
        self.process.start()
        child.close()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromEngine).decode
        try:
            self._ready(self._receive())
        except BaseException:  # a failed start-up, or Ctrl-C while loading: the child must not stay behind
            self._end_process(0)
            raise
        self._streams: dict[str, _Stream] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tickets: dict[int, tuple[threading.Event, list]] = {}
        self._next_ticket = 0
        self._ticket_lock = threading.Lock()
        self._stopping = False
        self._writer = threading.Thread(target=self._write, name="inkling-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="inkling-engine-reader", daemon=True)

    def _receive(self):
        try:
            return self._decode(self._conn.recv_bytes())
        except (EOFError, OSError):
            self.process.join(5)
            raise RuntimeError(f"the engine process exited (code {self.process.exitcode})") from None

    def _ready(self, message) -> None:
        if isinstance(message, Failed):
            self.process.join(30)
            kind = getattr(errors, message.kind, None)
            raise (kind if isinstance(kind, type) and issubclass(kind, errors.InklingError) else RuntimeError)(
                message.message)
        self.max_model_len, self.vocab_size = message.max_model_len, message.vocab_size

    def start(self) -> "EngineProcess":
        self._writer.start()
        self._reader.start()
        return self

    def state(self, timeout: float = 30.0) -> dict:
        """The engine's snapshot and stats, and the counters, asked of the engine process (blocks: call off
        the event loop)."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        with self._ticket_lock:
            ticket = self._next_ticket
            self._next_ticket += 1
            done, box = self._tickets[ticket] = (threading.Event(), [])
        self._outbox.put(GetState(ticket))
        if not done.wait(timeout):
            self._tickets.pop(ticket, None)
            raise RuntimeError(f"the engine process did not answer within {timeout:g} s")
        if not box:
            raise RuntimeError(self.failure or "the engine process is gone")
        state = box[0]
        return {"snapshot": state.snapshot, "stats": state.stats, "metrics": state.metrics}

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the engine process to stop (it closes the engine) and waits for it; every handler still
        waiting gets an error."""
        self._stopping = True
        self.failure = self.failure or "the server is shutting down"
        self._outbox.put(Stop())
        self._outbox.put(None)
        self._end_process(timeout)
        self._fail_everyone(RuntimeError(self.failure))
        self._wake_tickets()

    def _end_process(self, timeout: float) -> None:
        """Waits `timeout` s for the engine process to end (killing it then), and for the threads that talk
        to it; then closes the pipe."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        for thread in (getattr(self, "_writer", None), getattr(self, "_reader", None)):
            if thread is not None and thread.is_alive():  # the writer ends at None, the reader at EOF
                thread.join(5)
        self._conn.close()

    def _send(self, command, *args) -> None:
        if command == "add":
            rid, prompt, params = args
            self._streams[rid] = _Stream(rid, prompt, params)
            self._outbox.put(Add(rid, prompt, params))
        elif command == "abort":
            self._outbox.put(Abort(*args))
        else:
            self._outbox.put(AbortAll())

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                data = self._encode(message)
            except Exception as e:  # a command that cannot travel (the protocol's checks should stop it first)
                if isinstance(message, Add):
                    self._streams.pop(message.rid, None)
                    self._admitted(message.rid, RequestError(f"the request cannot be sent to the engine: {e}"))
                continue
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):  # the engine process is gone; the reader says so
                return

    def _read(self) -> None:
        try:
            self._read_messages()
        except Exception as e:  # a bug here must not leave every handler waiting in silence
            log.exception("the engine process's reader stopped")
            self._failed(f"the server lost the engine process: {type(e).__name__}: {e}")

    def _read_messages(self) -> None:
        while True:
            try:
                message = self._decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                if not self._stopping:
                    self.process.join(5)
                    self._failed(f"the engine process exited (code {self.process.exitcode})")
                return
            if isinstance(message, Outputs):
                self._deliver([self._output(d) for d in message.deltas])
            elif isinstance(message, Admitted):
                error = None if message.error is None else _REFUSALS[message.kind](message.error)
                if error is not None:
                    self._streams.pop(message.rid, None)
                self._admitted(message.rid, error)
            elif isinstance(message, State):
                done, box = self._tickets.pop(message.ticket, (None, None))
                if done is not None:
                    box.append(message)
                    done.set()
            else:  # Failed
                self._failed(message.message)
                return

    def _output(self, delta: Delta) -> RequestOutput:
        stream = self._streams.pop(delta.rid) if delta.finish_reason is not None else self._streams[delta.rid]
        return stream.take(delta)

    def _failed(self, message: str) -> None:
        self.failure = message
        self._fail_everyone(RuntimeError(message))
        self._wake_tickets()

    def _wake_tickets(self) -> None:
        with self._ticket_lock:
            tickets, self._tickets = list(self._tickets.values()), {}
        for done, _ in tickets:
            done.set()
