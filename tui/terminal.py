"""Where the TUI draws, and where logging goes while it draws.

Textual's Linux driver writes the screen to ``sys.__stderr__``, so
``tessera peer --tui 2>peer.log`` drew the whole UI into the file and left the
terminal blank. `ui_terminal` picks the stream to draw on instead: stderr when it
is a terminal (what Textual would do anyway), else stdout when that is one, else
the controlling terminal (``/dev/tty``); `driver_for` makes a driver that draws
there and measures that terminal's size.

While the UI has the terminal, a log record written to it would draw over the
screen (and Textual swallows ``print``s to stderr, so they vanished). `logs_to`
sends every record to the peer's lines instead (the Events panel shows them, and
they are printed when the UI closes), and keeps a handler of ours that writes to a
file (``2>file``) writing there.

    with ui_terminal() as terminal:
        app = TesseraApp(handle, driver_class=driver_for(terminal))
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Callable, Iterator, TextIO

DATE_FORMAT = "%H:%M:%S"  # the clock on each line, as the console's (peer/cli/log_setup.py)

TTY = "/dev/tty"
LINE_FORMAT = "%(levelname)s %(name)s: %(message)s"  # the Events panel puts the time in front


def _is_terminal(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (ValueError, OSError):  # closed, or not a real file
        return False


@contextlib.contextmanager
def ui_terminal(*, stdout: TextIO | None = None, stderr: TextIO | None = None, tty: str = TTY) -> Iterator[TextIO | None]:
    """The stream the UI should draw on (see module docstring); None when Textual's default will do.

    `stdout` and `stderr` default to the process's own (``sys.__stdout__``/``__stderr__``).
    A terminal opened here (``/dev/tty``) is closed when the block ends.
    """
    stdout = stdout if stdout is not None else sys.__stdout__
    stderr = stderr if stderr is not None else sys.__stderr__
    if _is_terminal(stderr):
        yield None  # Textual draws on stderr: nothing to change
    elif _is_terminal(stdout):
        yield stdout
    else:
        try:
            opened = open(tty, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError:
            yield None  # no terminal at all (a service): Textual does what it does
            return
        try:
            yield opened
        finally:
            opened.close()


def driver_for(terminal: TextIO | None) -> type | None:
    """A Textual driver class that draws on `terminal`; None (Textual's choice) if `terminal` is None or not on POSIX."""
    if terminal is None or os.name != "posix":
        return None
    from textual.drivers.linux_driver import LinuxDriver

    class TerminalDriver(LinuxDriver):
        """Textual's Linux driver, drawing on `terminal` rather than on stderr."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._file = terminal

        def _get_terminal_size(self) -> tuple[int, int]:
            try:
                return tuple(os.get_terminal_size(terminal.fileno()))  # type: ignore[return-value]
            except (OSError, ValueError):
                return super()._get_terminal_size()

    return TerminalDriver


class LinesHandler(logging.Handler):
    """Hands each record, as one string, to `out` (a `PeerHandle`'s lines: the Events panel)."""

    def __init__(self, out: Callable[[str], None]) -> None:
        super().__init__()
        self.out = out
        self.setFormatter(logging.Formatter(LINE_FORMAT, DATE_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.out(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never take the caller down
            self.handleError(record)


@contextlib.contextmanager
def logs_to(out: Callable[[str], None]) -> Iterator[LinesHandler]:
    """While the block runs: records go to `out`, and handlers of ours writing to a terminal pause.

    A handler of ours (`tessera.peer.cli.log_setup.install`) that writes to a file (stderr
    redirected) keeps writing: the file is the log the operator asked for. Its filters
    (one line per libp2p event) apply to `out` too.
    """
    root = logging.getLogger()
    already = [h for h in root.handlers if isinstance(h, LinesHandler) and h.out == out]
    if already:  # run_with_tui routes from before the app starts; the app's own call is then a no-op
        yield already[0]
        return
    ours = [h for h in root.handlers if getattr(h, "tessera", False)]
    paused = [h for h in ours if _is_terminal(getattr(h, "stream", None))]
    handler = LinesHandler(out)
    for h in ours:
        for f in h.filters:
            handler.addFilter(f)
    for h in paused:
        root.removeHandler(h)
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        for h in paused:
            root.addHandler(h)
