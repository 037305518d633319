"""What the command line prints on stderr: our logging, with py-libp2p's folded in.

py-libp2p logs from inside its transport and host at ERROR, several lines at a time
("Failed to open stream to peer …:" followed by six indented lines ending in
"Registry Stats: None"), and again every time a dead peer is redialled. Its import
detaches its loggers from ours (`libp2p/utils/logging.py`: no handler, no
propagation), so Python's last-resort handler printed each record raw. `install`
undoes that at the command line's composition root and sends every record through
one handler:

- quiet (the default): our own records at WARNING and above, and nothing of libp2p's.
  Its failures are the ordinary life of a swarm seen from below — a requester that does
  not serve the dial-back or ping protocol ("protocols not supported"), a peer that left
  and is redialled ("Failed to open TCP stream") — and our own code says what matters of
  them, in its words (a join that fails says why: peer/net/join.py; a session that loses a
  peer fails over and says so). A newcomer read each of them as something gone wrong;
- ``-v``: INFO and above from everyone; each of libp2p's failures (ERROR and above)
  folded into ONE line at WARNING — what failed
  (its first line), why (its ``Error:`` line, or the exception's type and message,
  never a traceback) — and a line repeated within `REPEAT_WINDOW` is not shown
  again: one line per event, however often libp2p retries it, and however many of
  its layers report the same failure (`BURST`, `ECHOES`; a line naming only an address
  is not shown within the window after one naming a peer: it is that peer's redial); a
  failure that only says the other end had gone (`GONE`: a requester that got its answer
  and exited, a peer that left) is not shown at all. libp2p's records below ERROR are its
  internal bookkeeping ("AUTO_CONNECTOR_STATE: num_connections=0 …" at every start): not shown;
- ``-vv`` (or ``$TESSERA_DEBUG``): DEBUG from everyone, libp2p's lines as libp2p wrote them.

    install(verbose=0)                    # in `tessera`'s main, before the command runs
    handler_for(sys.stderr)               # the handler writing there (the TUI swaps it out)
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Callable, TextIO

LIBP2P = "libp2p"
# How long a line of libp2p's that was just shown stays quiet when it comes again. A peer
# that is gone is redialled by the gossip and ping rounds (peer/net/gossip.py: every few
# seconds); ten minutes makes that one line per disconnect, and still says now and then
# (with a count) that it goes on.
REPEAT_WINDOW = 600.0
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
# One failure is reported by several of libp2p's layers within a second or two: when a peer
# dies, the host's "Failed to open stream to peer X" (which names it), then the TCP
# transport's "Failed to open TCP stream … 127.0.0.1:P" as it is redialled (which names only
# its address). Lines within BURST seconds of a shown one, naming no other peer, are that
# same event. (Seen on loopback: 2 s from the first line to the redial's.)
BURST = 5.0
PEER_ID = re.compile(r"\b(?:12D3KooW|Qm)[1-9A-HJ-NP-Za-km-z]{20,}")
# Why a stream could not open when the other end had just closed its connection: a requester
# that finished its answer and exited, a peer that left. Our own code already acts on it (the
# stream fails, the peer is dropped from the view when its record goes); libp2p's line about it
# is a normal exit seen from the other side, shown only with -v.
GONE = re.compile(r"handshake read failed|fail to read from multiselect|connection (?:is |was )?closed|"
                  r"stream (?:is )?(?:reset|closed)|\bEOF\b", re.IGNORECASE)
# Loggers whose failures libp2p reports again one layer up, with the peer named: the
# protocol negotiation's "MultiselectClient handshake: read failed" precedes the host's
# "Failed to open stream to peer X: handshake read failed".
ECHOES = ("libp2p.protocol_muxer",)


def fold(record: logging.LogRecord) -> str:
    """A libp2p record as one line: its first line (what) and its `Error:` line or exception (why)."""
    lines = [line.strip() for line in record.getMessage().splitlines() if line.strip()]
    what = lines[0].rstrip(":") if lines else "(empty message)"
    why = next((line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("error:")), "")
    if record.exc_info and record.exc_info[1] is not None:
        error = record.exc_info[1]
        why = why or f"{type(error).__name__}: {error}".splitlines()[0]
    return f"{what}: {why}" if why else what


class OneLinePerEvent(logging.Filter):
    """Folds libp2p's records into one line at WARNING and drops repeats (see module docstring)."""

    def __init__(self, *, window: float = REPEAT_WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window = window
        self.clock = clock
        self.shown: dict[tuple[str, str], tuple[float, int]] = {}  # (logger, line) -> (when shown, repeats since)
        self.burst: tuple[float, str | None] | None = None  # the last line shown: when, and the peer it names
        self.peer_failure_at: float | None = None  # when a line naming a peer was last shown

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.name == LIBP2P or record.name.startswith(LIBP2P + ".")):
            return True
        verdict = getattr(record, "tessera_shown", None)
        if verdict is not None:  # a second handler (the TUI's and a log file's) shares this filter
            return verdict
        record.tessera_shown = self._fold_once(record)
        return record.tessera_shown

    def _fold_once(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return False  # bookkeeping, not a failure (some of libp2p's loggers set their own level)
        if record.name.startswith(ECHOES):
            return False
        line = fold(record)
        if GONE.search(line):
            return False  # the other end went away as we spoke to it: a departure, not a failure
        key, now = (record.name, line), self.clock()
        last = self.shown.get(key)
        if last is not None and now - last[0] < self.window:
            self.shown[key] = (last[0], last[1] + 1)
            return False
        if last is not None and last[1]:
            line += f" (and {last[1]} times more in the last {self.window / 60:g} min)"
        self.shown[key] = (now, 0)  # also when the line is part of a burst: its repeats stay quiet too
        if len(self.shown) > 1024:  # addresses come and go; forget the oldest
            for old in sorted(self.shown, key=lambda k: self.shown[k][0])[:512]:
                del self.shown[old]
        peer = PEER_ID.search(line)
        peer_id = peer.group() if peer else None
        if self.burst is not None and now - self.burst[0] < BURST and peer_id in (None, self.burst[1]):
            return False  # the same failure, seen again by another layer (or the redial after it)
        if peer_id is None and self.peer_failure_at is not None and now - self.peer_failure_at < self.window:
            # A line naming only an address, after the host reported a peer's failure: the gossip
            # and ping rounds redialling that peer (seen on a quiet loopback 43 s after the host's
            # line, well past BURST). Its address cannot be tied to the peer here, and the peer's
            # failure was already said, so it is not said again.
            return False
        self.burst = (now, peer_id)
        if peer_id is not None:
            self.peer_failure_at = now
        # libp2p's ERRORs are not ours: the peer goes on serving, our own messages say what matters
        record.msg, record.args, record.exc_info, record.exc_text = line, (), None, None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def install(verbose: int = 0, *, stream: TextIO | None = None, import_libp2p: bool = True) -> logging.Handler:
    """Route all logging (libp2p's included) to one handler on `stream` (stderr); returns it.

    `import_libp2p` imports libp2p first, since its import would undo what is set here;
    a command that never touches the network passes False and does not pay for it.
    """
    if import_libp2p:
        import tessera.peer.net.libp2p  # noqa: F401 - imports py-libp2p, which resets the "libp2p" logger: do it before configuring

    level = logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "tessera", False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.tessera = True  # type: ignore[attr-defined] - marks ours, so install() is idempotent
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    if verbose == 0:
        handler.addFilter(not_libp2p)
    elif verbose == 1:
        handler.addFilter(OneLinePerEvent())
    root.addHandler(handler)
    root.setLevel(level)
    lib = logging.getLogger(LIBP2P)
    lib.handlers.clear()
    lib.propagate = True
    lib.setLevel(logging.ERROR if verbose <= 1 else level)
    return handler


def not_libp2p(record: logging.LogRecord) -> bool:
    """Quiet: every record but libp2p's (a filter on the handler, as some of its loggers set their own level)."""
    return not (record.name == LIBP2P or record.name.startswith(LIBP2P + "."))


def handler_for(stream: TextIO) -> logging.Handler | None:
    """The handler `install` set up on `stream`, if any."""
    for handler in logging.getLogger().handlers:
        if getattr(handler, "tessera", False) and getattr(handler, "stream", None) is stream:
            return handler
    return None
