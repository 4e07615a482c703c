"""Start-up progress as a user sees it: one line per stage on stderr, redrawn in place on a terminal."""

from __future__ import annotations

import sys


class StageLog:
    """`log(message)` reports a stage; `log(message, done, total)` draws a bar on a terminal.

    Off a terminal (a pipe, a log file, CI) every stage is its own line, so a long compile is never
    silent; on a terminal the stages share one line that `finish()` replaces and `close()` clears."""

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = False

    def __call__(self, message: str, done: int | None = None, total: int | None = None) -> None:
        if not self.enabled:
            return
        if self.tty:
            bar = f" [{'#' * done}{'.' * (total - done)}]" if total else ""
            self.stream.write(f"\r\033[K{message}{bar}")
            self._drawn = True
        else:
            self.stream.write(f"inkling-compiled: {message}\n")
        self.stream.flush()

    def finish(self, message: str) -> None:
        """The last stage: a line that stays, on a terminal too."""
        if self.enabled:
            self.stream.write(f"\r\033[K{message}\n" if self.tty else f"inkling-compiled: {message}\n")
            self.stream.flush()
            self._drawn = False

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False
