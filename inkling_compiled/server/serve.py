"""Running the app: uvicorn in the foreground (the CLI) or on a thread (tests, bench-serve).

uvicorn has no deadline for a request's headers, so a client that trickles them (or connects and says
nothing) would hold its connection forever; `_with_header_limits` gives uvicorn's protocol one: from
the connection (or the end of the last response) to a request's whole headers, `limits.header_timeout`
seconds, then the connection closes (with a 408 if part of a request had come); it also bounds the
headers' bytes and answers what does not parse with JSON. The body's deadline is the app's
(`body.read_body`).

Shutdown is graceful: on SIGINT or SIGTERM uvicorn stops accepting connections and waits up to
`shutdown_timeout` seconds for the requests in flight, which the engine loop keeps serving; then the
engine's requests are aborted (each answers "abort") and a request still sending its body gets a 503
(`body.Closing`). The process then exits with 0.
"""

from __future__ import annotations

import signal
import socket
import threading

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .app import build_app
from .body import Closing, Limits
from .chat import ChatTemplate
from .loop import EngineLoop, Frontend
from .protocol import ascii_json, error_body

_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def closing_json_error(status: str, message: str) -> bytes:
    """A whole HTTP response carrying the API's JSON error object, for the protocol to write before it
    closes the connection (no request reached the app: its headers were too long or did not parse)."""
    body = ascii_json(error_body(message))
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def _with_header_limits(protocol: type, header_timeout: float, max_header_bytes: int) -> type:
    """uvicorn's HTTP protocol (httptools or h11; both make `self.cycle` when a request's headers are
    complete), closing a connection whose next request's headers take longer than `header_timeout`, and
    answering a request it cannot parse with a JSON 400. With httptools, a request whose headers pass
    `max_header_bytes` is a JSON 431 (the parser appends a header it has not seen the end of to what it
    holds, so an endless one costs it time that grows with its square): the bytes that arrive while a
    request's headers are unfinished are counted, from the read after the one that began it (the bytes
    of one read before them may be the last request's body), so the bound holds within one read. (h11
    has its own bound, which uvicorn's config sets to the same number: a 400.)"""

    class HeaderLimits(protocol):
        _deadline = None
        _started = False  # bytes of the next request have come (a 408 then says why it closes)
        _in_headers = False  # a request has begun and its headers are not complete (httptools' callbacks)
        _header_bytes = 0  # bytes read since then, less the read that began it

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers, self._header_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            self._started = True
            counted = self._in_headers  # a read that begins a request is not counted
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()
            if counted and self._in_headers:
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes and not self.transport.is_closing():
                    self._too_long()

        def _too_long(self) -> None:
            """The 431, unless a response on this connection is still being written (a pipelined request
            behind it): then the connection just closes, which aborts that response's request too."""
            in_flight = self.cycle is not None and not self.cycle.response_complete
            self._refuse(None if in_flight else "431 Request Header Fields Too Large",
                         f"the request line and headers are larger than max_header_bytes={max_header_bytes}")

        def send_400_response(self, msg: str) -> None:
            self._refuse("400 Bad Request", f"the request is not valid HTTP/1.1: {msg}")

        def _refuse(self, status: str | None, message: str) -> None:
            """Closes the connection, after a JSON error of `status` where one may be written."""
            self._disarm()
            if status is not None:
                self.transport.write(closing_json_error(status, message))
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request on this connection gets its own deadline

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._started = False
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                if self._started:  # an idle connection just closes, as a kept-alive one would
                    self.transport.write(_TIMEOUT_408)
                self.transport.close()

    return HeaderLimits


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling us when a signal asked it to shut down."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on (host, port), a free port when port is 0: connections queue from now on, before
    uvicorn takes it over. An OSError says why it cannot (a port in use, an address not of this machine)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


class ApiServer:
    def __init__(self, engine, *, host: str = "127.0.0.1", port: int = 8000, sock: socket.socket | None = None,
                 model_name: str = "inkling", max_waiting: int = 256, chat_template: ChatTemplate | None = None,
                 shutdown_timeout: float = 10.0, default_max_tokens: int = 16, limits: Limits = Limits()):
        """`engine`: an Engine of this process (stepped on a thread; `max_waiting` applies) or an
        `EngineProcess` (which has its own). Listens on `sock` when given (bound by `listen`), else on
        (host, port) once started."""
        self.host, self.port, self.shutdown_timeout = host, port, shutdown_timeout
        self.loop = engine if isinstance(engine, Frontend) else EngineLoop(engine, max_waiting)
        self.closing = Closing()
        self.app = build_app(self.loop, model_name, chat_template, default_max_tokens, limits, self.closing)
        # uvicorn's own deadline comes later than ours: by then every request has answered with "abort".
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                http=_with_header_limits(AutoHTTPProtocol, limits.header_timeout,
                                                           limits.max_header_bytes),
                                h11_max_incomplete_event_size=limits.max_header_bytes,
                                timeout_graceful_shutdown=shutdown_timeout + 5)
        self.uvicorn = _Uvicorn(config, self._shutting_down)
        self._deadline: threading.Timer | None = None
        self._thread: threading.Thread | None = None
        self._socket = sock
        if sock is not None:
            self.port = sock.getsockname()[1]

    def _shutting_down(self) -> None:
        """A signal came: requests in flight get `shutdown_timeout` seconds, then are aborted."""
        if self._deadline is None:
            self._deadline = threading.Timer(self.shutdown_timeout, self._stop_waiting)
            self._deadline.daemon = True
            self._deadline.start()

    def _stop_waiting(self) -> None:
        """The shutdown's deadline: requests still sending their bodies get a 503, and those in the engine
        are aborted (each answers "abort"). `closing` is set first: a request that reaches the engine
        after `abort_all` finds it set and aborts itself (`app.admit`)."""
        self.closing.set()
        self.loop.abort_all()

    def bind(self) -> int:
        """Listens on (host, port) now, a free port when port is 0; returns the port."""
        if self._socket is None:
            self._socket = listen(self.host, self.port)
            self.port = self._socket.getsockname()[1]
        return self.port

    def run(self) -> None:
        """Serves until SIGINT/SIGTERM (in the main thread) or `stop()`; then stops the engine loop."""
        self.bind()
        self.loop.start()
        try:
            self.uvicorn.run(sockets=[self._socket])
        finally:
            if self._deadline is not None:
                self._deadline.cancel()
            self.loop.stop()

    def run_until_signal(self) -> None:
        """The CLI's foreground run. uvicorn raises the signal it caught again once it has shut down; these
        handlers take it, so the process ends normally (exit 0) rather than by the signal."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        self.run()

    def start(self) -> int:
        """Serves on a thread, on a free port of `host` when port is 0; returns the port once it listens."""
        self.bind()
        self._thread = threading.Thread(target=self.run, name="inkling-http", daemon=True)
        self._thread.start()
        while not self.uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            self._thread.join(0.01)
        return self.port

    def stop(self, timeout: float = 30.0) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
