"""What a client may send, and reading it within those bounds.

Every bound is checked before the work it bounds: a Content-Length over `max_body_bytes` is refused
before a byte of the body is read, a body that grows past it is refused as soon as it does, and a body
that trickles in slower than `body_timeout` allows is cut off with a 408. Parsing is msgspec's (a few
times faster than the standard library, and it holds the interpreter for as long as it parses, so speed
is what keeps the event loop free); the standard library only speaks when msgspec refuses a body, to
say in its words what is wrong, or to take what msgspec does not (integers past 64 bits, lone surrogates,
which the protocol then refuses by field).
"""

from __future__ import annotations

import asyncio
import json
import threading

import msgspec

from ..checks import is_finite, option_int
from ..errors import OptionError, RequestError


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Bounds on what one client may send; the CLI's options of the same names set them."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_stop_strings: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_header_bytes: int = 64 * 1024  # a request line and headers together
    header_timeout: float = 10.0  # seconds from connecting (or the last response) to a request's whole headers
    body_timeout: float = 30.0  # seconds from the headers to the whole body

    def __post_init__(self):
        for name in ("max_body_bytes", "max_stop_strings", "max_stop_chars", "max_header_bytes"):
            option_int(name, getattr(self, name))
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if not is_finite(value) or value <= 0:
                raise OptionError(f"{name} must be a number of seconds > 0, got {value!r}")


class BodyTooLarge(Exception):
    """The body is larger than `max_body_bytes` (413)."""


class BodyTimeout(Exception):
    """The body did not arrive within `body_timeout` (408)."""


class ServerClosing(Exception):
    """The server stopped waiting for requests in flight while this one was still sending its body (503)."""


class Closing:
    """Set, from any thread, when a shutting-down server stops waiting for the requests in flight: a
    request still reading its body then stops waiting for the rest of it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._set = False
        self._waiters: set[asyncio.Future] = set()

    @property
    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            self._set = True
            waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            waiter.get_loop().call_soon_threadsafe(lambda w=waiter: w.done() or w.set_result(None))

    async def wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._set:
                return
            self._waiters.add(waiter)
        try:
            await waiter
        finally:
            with self._lock:
                self._waiters.discard(waiter)


async def read_body(request, limits: Limits, closing: Closing) -> bytes:
    """The request's body, refused once it is known to be too large or too slow, or once `closing` is set."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise BodyTooLarge(f"the body of {int(declared)} bytes is larger than max_body_bytes={limits.max_body_bytes}")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise BodyTooLarge(f"the body is larger than max_body_bytes={limits.max_body_bytes}")
            chunks.append(chunk)
        return b"".join(chunks)

    reading, stopping = asyncio.ensure_future(read()), asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait((reading, stopping), timeout=limits.body_timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not reading.done():
            reading.cancel()
        # Whatever reading ends with is retrieved, even when this handler is cancelled meanwhile.
        reading.add_done_callback(lambda task: task.cancelled() or task.exception())
    if reading.done():
        return reading.result()  # (raises BodyTooLarge, or what reading raised)
    if closing.is_set:
        raise ServerClosing("the server is shutting down: the rest of the body was not read")
    raise BodyTimeout(f"the body did not arrive within {limits.body_timeout:g} s")


def parse_json(raw: bytes):
    """The body as Python objects, or a RequestError saying why it is not JSON we take."""
    try:
        return msgspec.json.decode(raw)
    except RecursionError:
        raise RequestError("the body is nested too deeply to parse") from None
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError("the body is nested too deeply to parse") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    except ValueError as e:  # valid JSON the standard library will not take: an integer of over 4,300 digits
        raise RequestError(f"the body is not JSON this server takes: {e}") from None
