"""Progress bars that leave printed lines whole: every tqdm bar fax_bridge shows.

A tqdm bar redraws its line in place (a carriage return, then the bar). A log record or a
`print` written to the terminal while it shows lands after the bar's text on the bar's
line, and the next redraw writes over it: a torn line. `bar(...)` is tqdm's `tqdm.auto`
bar, and while any such bar is open (not disabled) the console log handlers (a
`logging.StreamHandler` on stdout or stderr, of any logger) and `sys.stdout` write
line by line, as tqdm's `write` and `logging_redirect_tqdm` do: the open bars are cleared,
the line written, the bars drawn again below it (on whichever stream each bar is: stdout
and stderr share a terminal), each handler kept itself (its level, filters, formatter).
The last bar to close puts the streams back.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

_LOCK = threading.RLock()
_OPEN: list = []     # the bars open and shown
_SWAPPED: list = []  # (handler or None for sys.stdout, the stream it had)
_CLASS: list = []    # the bar class, made on first use (tqdm imported then)


class LineWriter:
    """A text stream that writes each whole line to `stream` with the open bars cleared
    before it and drawn again after it; a line without its newline waits for it (or for
    the last bar to close)."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.pending = ""

    def write(self, text: str) -> int:
        head, newline, self.pending = (self.pending + text).rpartition("\n")
        if newline:
            with _CLASS[0].get_lock():
                shown = list(_OPEN)
                for b in shown:
                    b.clear(nolock=True)
                self.stream.write(head + "\n")
                self.flush()
                for b in shown:
                    b.refresh(nolock=True)
        return len(text)

    def flush(self) -> None:
        getattr(self.stream, "flush", lambda: None)()

    def drain(self) -> None:
        """Writes what waits for a newline straight to the stream."""
        if self.pending:
            self.stream.write(self.pending)
            self.pending = ""

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno...
        return getattr(self.stream, name)


def _console_handlers() -> list:
    loggers = [logging.getLogger()] + [
        x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger)]
    consoles = (sys.stdout, sys.stderr)
    return [h for x in loggers for h in x.handlers
            if isinstance(h, logging.StreamHandler) and any(h.stream is s for s in consoles)]


def _opened(shown: Any) -> None:
    with _LOCK:
        _OPEN.append(shown)
        if len(_OPEN) > 1:
            return
        for handler in _console_handlers():
            _SWAPPED.append((handler, handler.stream))
            handler.setStream(LineWriter(handler.stream))
        _SWAPPED.append((None, sys.stdout))
        sys.stdout = LineWriter(sys.stdout)


def _closed(shown: Any) -> None:
    with _LOCK:
        _OPEN.remove(shown)
        if _OPEN:
            return
        while _SWAPPED:
            handler, stream = _SWAPPED.pop()
            current = sys.stdout if handler is None else handler.stream
            if isinstance(current, LineWriter) and current.stream is stream:
                current.drain()
                if handler is None:
                    sys.stdout = stream
                else:
                    handler.setStream(stream)


def bar(**kwargs: Any):
    """A `tqdm.auto.tqdm(**kwargs)` bar under which log records and prints stay whole
    lines (the module docstring); closing it (or the last open one) ends that."""
    if not _CLASS:
        from tqdm.auto import tqdm

        class Bar(tqdm):
            def __init__(self, *args: Any, **kw: Any):
                super().__init__(*args, **kw)
                self.redirecting = not self.disable
                if self.redirecting:
                    _opened(self)

            def close(self) -> None:
                try:
                    super().close()
                finally:
                    if getattr(self, "redirecting", False):
                        self.redirecting = False
                        _closed(self)

        _CLASS.append(Bar)
    return _CLASS[0](**kwargs)
