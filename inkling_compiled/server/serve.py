"""Running the app: uvicorn in the foreground (the CLI) or on a thread (tests, bench-serve).

Shutdown is graceful: on SIGINT or SIGTERM uvicorn stops accepting connections and waits up to
`shutdown_timeout` seconds for the requests in flight, which the engine loop keeps serving; whatever is
left then is cancelled, and each cancelled stream aborts its request. The process then exits with 0.
"""

from __future__ import annotations

import signal
import socket
import threading

import uvicorn

from .app import build_app
from .chat import ChatTemplate
from .loop import EngineLoop


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling us when a signal asked it to shut down."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)


class ApiServer:
    def __init__(self, engine, *, host: str = "127.0.0.1", port: int = 8000, model_name: str = "inkling",
                 max_waiting: int = 256, chat_template: ChatTemplate | None = None, shutdown_timeout: float = 10.0,
                 default_max_tokens: int = 16):
        self.host, self.port, self.shutdown_timeout = host, port, shutdown_timeout
        self.loop = EngineLoop(engine, max_waiting)
        self.app = build_app(self.loop, model_name, chat_template, default_max_tokens)
        # uvicorn's own deadline comes later than ours: by then every request has answered with "abort".
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=shutdown_timeout + 5)
        self.uvicorn = _Uvicorn(config, self._shutting_down)
        self._deadline: threading.Timer | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    def _shutting_down(self) -> None:
        """A signal came: requests in flight get `shutdown_timeout` seconds, then are aborted."""
        if self._deadline is None:
            self._deadline = threading.Timer(self.shutdown_timeout, self.loop.abort_all)
            self._deadline.daemon = True
            self._deadline.start()

    def bind(self) -> int:
        """Listens on (host, port) now, a free port when port is 0; returns the port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(2048)  # connections queue from now on, before uvicorn takes the socket over
        self.port = sock.getsockname()[1]
        self._socket = sock
        return self.port

    def run(self) -> None:
        """Serves until SIGINT/SIGTERM (in the main thread) or `stop()`; then stops the engine loop."""
        if self._socket is None:
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
