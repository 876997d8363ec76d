"""Progress bars leave log records and prints whole lines (fax_bridge.system.progress)."""

import contextlib
import io
import logging
import sys

from fax_bridge.local import chunking
from fax_bridge.system import progress


@contextlib.contextmanager
def terminal():
    """stdout and stderr as one captured stream (as a terminal shows them), and a
    logger whose console handler writes to it. (Set in the test itself: pytest's own
    capture sets sys.stdout again between a fixture's setup and the test.)"""
    stream = io.StringIO()
    log = logging.getLogger("fax_bridge.test_progress")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("fax-bridge: %(message)s"))
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
        try:
            yield stream, log, handler
        finally:
            log.removeHandler(handler)


def shown_lines(text: str) -> list:
    """What a terminal shows of each line: the text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


def check_whole(stream, log, advance) -> None:
    lines = []
    for i in range(4):
        advance(i)
        message = f"record {i} of the round"
        log.info(message)
        print(f"printed {i}")
        lines += [f"fax-bridge: {message}", f"printed {i}"]
    shown = shown_lines(stream.getvalue())
    for line in lines:
        assert line in shown, (line, stream.getvalue())


def test_a_bar_keeps_log_lines_and_prints_whole():
    with terminal() as (stream, log, handler):
        bar = progress.bar(total=4, unit="client", mininterval=0, miniters=1)
        check_whole(stream, log, lambda i: bar.update(1))
        bar.close()
        assert sys.stdout is stream and handler.stream is stream  # put back


def test_a_chunked_trip_keeps_log_lines_whole():
    """The bar `clients_per_step` with `progress=True` shows for each trip."""
    with terminal() as (stream, log, handler):
        bar = chunking.Progress(clients=8, k=2)
        check_whole(stream, log, bar.tick)
        assert sys.stdout is stream and handler.stream is stream


def test_a_disabled_bar_changes_nothing():
    with terminal() as (stream, log, handler):
        bar = progress.bar(total=2, disable=True)
        assert sys.stdout is stream and handler.stream is stream
        bar.close()


def test_nested_bars_put_the_streams_back_once_all_are_closed():
    with terminal() as (stream, log, handler):
        outer = progress.bar(total=2, mininterval=0)
        inner = progress.bar(total=2, mininterval=0)
        inner.close()
        assert sys.stdout is not stream
        print("half a line", end="")
        outer.close()
        assert sys.stdout is stream and handler.stream is stream
        assert stream.getvalue().endswith("half a line")
