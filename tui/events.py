"""Reading the peer's trace and ledger for the UI: blocking sqlite reads, run in worker threads.

The UI opens the peer's database a second time, read-only (`StoreReader`): it never
queues work on the peer's writer or waits for its commits, and it outlives the
peer's own connection (which the peer closes when it stops), so the events and the
ledger stay readable after the peer has left.

The events panel tails the trace. Its filter is what the operator types:

- nothing: every kind but the routine ones (store/events.py `ROUTINE_KINDS`: one per token per
  hop, one RTT per neighbour per ping round, ...), and the lines the peer printed and logged
  (and the UI's own notes);
- words naming event kinds (``claim session_open ban``): only those kinds — add ``peer`` for
  the printed lines too;
- ``all``: every kind, per-step ones included, and the printed lines;
- any other word: only lines containing it (case-insensitive), e.g. a peer id's tail.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from tessera.store.db import PeerStore
from tessera.store.errors import StoreClosed
from tessera.store.events import BY_KIND, EVENT_TYPES, NOTABLE_KINDS, Stamped, TraceEvent
PRINTED = "peer"  # the filter word for the lines the peer printed (shown as "(peer)" in the log)
BACKLOG = 200  # events shown from before the UI opened (or the filter changed)
PAGE = 500  # trace rows per read; a busy peer catches up in a few ticks


@dataclass(frozen=True)
class EventFilter:
    """A parsed filter: which event classes to read from sqlite, and words every line must contain."""

    kinds: tuple[type[TraceEvent], ...]
    words: tuple[str, ...] = ()
    printed: bool = True  # the peer's printed and logged lines: not when only some kinds were asked for

    @staticmethod
    def parse(text: str) -> "EventFilter":
        tokens = text.lower().split()
        kinds = [BY_KIND[t] for t in tokens if t in BY_KIND]
        words = tuple(t for t in tokens if t not in BY_KIND and t not in ("all", PRINTED))
        if "all" in tokens:
            return EventFilter(EVENT_TYPES, words)
        return EventFilter(tuple(dict.fromkeys(kinds)) or NOTABLE_KINDS, words, printed=not kinds or PRINTED in tokens)

    def keeps(self, line: str) -> bool:
        lowered = line.lower()
        return all(w in lowered for w in self.words)


class StoreReader:
    """A read-only `PeerStore` on the peer's database, opened on first use (in a worker thread)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._store: PeerStore | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def store(self) -> PeerStore:
        with self._lock:
            if self._closed:
                raise StoreClosed(f"the UI's reader of {str(self.path)!r} is closed")
            if self._store is None:
                self._store = PeerStore(self.path, readonly=True)
            return self._store

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._store is not None:
                self._store.close()
                self._store = None


def last_id(store: PeerStore, kinds: tuple[type[TraceEvent], ...]) -> int:
    """The id of the newest trace row of `kinds` (0 if none).

    `PeerStore.events` reads forward from an id; a peer's trace keeps every run it
    ever had, so the tail is found by searching: "is there a row after x" is
    monotone in x, and each probe is one indexed read. About 2 log2(rows) probes.
    """
    def after(x: int) -> bool:
        return bool(store.events(after_id=x, kinds=kinds, limit=1))

    if not after(0):
        return 0
    high = 1
    while after(high):
        high *= 2
    low = high // 2  # after(low) is true (or low is 0, checked above); after(high) is false
    while high - low > 1:
        middle = (low + high) // 2
        if after(middle):
            low = middle
        else:
            high = middle
    return high


def read_backlog(store: PeerStore, flt: EventFilter, keep: int = BACKLOG) -> tuple[list[Stamped], int]:
    """The last `keep` rows of the filter's kinds, oldest first, and the id to tail from."""
    newest = last_id(store, flt.kinds)
    reach = keep
    while True:
        rows = store.events(after_id=max(0, newest - reach), kinds=flt.kinds)
        if len(rows) >= keep or reach >= newest:
            return rows[-keep:], max(newest, rows[-1].id if rows else 0)
        reach *= 4


def read_new(store: PeerStore, flt: EventFilter, after_id: int) -> list[Stamped]:
    """Rows of the filter's kinds after `after_id`, oldest first, at most PAGE of them."""
    return store.events(after_id=after_id, kinds=flt.kinds, limit=PAGE)
