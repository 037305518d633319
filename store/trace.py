"""The trace: one row per event a peer (or requester) saw, written off the hot path.

    tracer = TraceWriter(DATA_DIR / "tessera.db", peer=my_peer_id)
    tracer = TraceWriter("requester.db")   # the peer id bound later: `Swarm.join(..., tracer=tracer)` binds its own
    t0 = time.perf_counter()
    out = stage.forward(...)
    tracer.emit(Forward(session=sid, step=7, span=(0, 10), duration=time.perf_counter() - t0))
    tracer.emit(Push(session=sid, step=7, remote=next_peer, bytes=len(frame)))
    ...
    tracer.close()   # or `with TraceWriter(...) as tracer:`

Events are the frozen dataclasses of store/events.py, one per kind, with typed fields.
`emit()` checks the event's values (a wrong type raises here, in the caller, as a typed
error), stamps the time and appends one tuple to the writer's queue: it never waits for
the disk. The store's writer thread commits a batch every ``flush_interval`` seconds
(store/writer.py); a kill -9 loses at most that interval.

Besides the event, a row holds its envelope:

- ``mono_ns`` / ``wall`` — when the event happened: the writing process's monotonic clock
  (ns) and unix time (s). Taken at `emit()` unless given (a simulation passes its own
  clock). **An event with a duration is emitted when it ends**: it covers
  ``[wall - duration, wall]``. Export orders and aligns events by ``wall``. A **push is
  stamped when its send starts** (`now()` before the send, passed to `emit()` after it):
  the receiver may log the frame before the sender's send returns, and a push stamped
  after its receive would make the clock alignment of store/timeline.py contradict itself.
- ``peer`` — who saw it; defaults to the tracer's peer (a simulation, or a rank's audit
  log, may name another). A tracer made before its owner has a peer id (a requester's id
  exists only once `Swarm.join` has made its key) is given it by `bind(peer)`; emitting
  before that is a `BadTraceField`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from tessera.store.db import PeerStore
from tessera.store.errors import BadTraceField, StoreClosed
from tessera.store.events import Stamped, TraceEvent, Unknown, encode, stamped
from tessera.store.writer import TRACE_COLUMNS


def now() -> tuple[float, int]:
    """(wall, mono_ns) as `emit()` would stamp them now: for an event emitted after it happened."""
    return time.time(), time.monotonic_ns()


def make_row(event: TraceEvent, peer: str, *, wall: float | None = None, mono_ns: int | None = None) -> tuple:
    """Check one event and return its row in `TRACE_COLUMNS` order (detail as JSON text)."""
    kind, columns, detail = encode(event)
    if mono_ns is None:
        mono_ns = time.monotonic_ns()
    elif isinstance(mono_ns, bool) or not isinstance(mono_ns, int):
        raise BadTraceField(f"{kind} event: mono_ns must be an int, got {mono_ns!r}")
    if wall is None:
        wall = time.time()
    elif isinstance(wall, bool) or not isinstance(wall, (int, float)) or not math.isfinite(wall):
        raise BadTraceField(f"{kind} event: wall must be a finite number of unix seconds, got {wall!r}")
    if not isinstance(peer, str) or not peer:
        raise BadTraceField(f"{kind} event: peer must be a non-empty str, got {peer!r}")
    return (mono_ns, float(wall), peer, kind, *columns, detail)


@runtime_checkable
class Tracer(Protocol):
    """What peer code emits events to: a `TraceWriter`, a `NullTracer` or a `MemoryTracer`."""

    def emit(
        self, event: TraceEvent, *, peer: str | None = None, wall: float | None = None, mono_ns: int | None = None
    ) -> None:
        """Record one event (seen by `peer`, default the tracer's); never blocks on I/O. Raises on a bad field."""
        ...

    def flush(self) -> None:
        """Block until every event emitted so far is stored."""
        ...

    def close(self) -> None:
        """Flush and stop; idempotent."""
        ...

    def bind(self, peer: str) -> None:
        """Take `peer` as the default peer of every event, unless one was given when the tracer
        was made (a requester binds its id as it joins; a test's named tracer keeps its name)."""
        ...

    def __enter__(self) -> "Tracer": ...

    def __exit__(self, *exc: object) -> None: ...


class _Closing:
    """The context manager, and the late `bind` of the peer id, of every tracer."""

    peer: str | None

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]

    def bind(self, peer: str) -> None:
        if not isinstance(peer, str) or not peer:
            raise BadTraceField(f"peer must be a non-empty str, got {peer!r}")
        if self.peer is None:
            self.peer = peer


class TraceWriter(_Closing):
    """Writes events to a peer database through its background writer thread.

    `store_or_path` is an open `PeerStore` (shared: `close()` then only flushes) or a path
    (the tracer opens the store and closes it on `close()`). `peer`: whose events these are;
    None until `bind` gives it (see the module docstring). `flush_interval` applies to a
    store the tracer opens; given with a shared store, the store's writer takes the shorter
    of its own interval and this one.
    """

    def __init__(
        self, store_or_path: PeerStore | Path | str, *, peer: str | None = None, flush_interval: float | None = None
    ) -> None:
        if peer is not None and (not isinstance(peer, str) or not peer):
            raise BadTraceField(f"peer must be a non-empty str, got {peer!r}")
        self.peer = peer
        if isinstance(store_or_path, PeerStore):
            self.store, self._owns = store_or_path, False
            if flush_interval is not None:
                writer = self.store.writer
                writer.flush_interval = min(writer.flush_interval, float(flush_interval))
        else:
            kwargs = {} if flush_interval is None else {"flush_interval": flush_interval}
            self.store, self._owns = PeerStore(store_or_path, **kwargs), True
        self._writer = self.store.writer
        self._closed = False

    def emit(
        self, event: TraceEvent, *, peer: str | None = None, wall: float | None = None, mono_ns: int | None = None
    ) -> None:
        if self._closed:
            raise StoreClosed(f"tracer for {self.peer!r} is closed; cannot emit {event.kind!r}")
        peer = peer or self.peer
        if peer is None:
            raise BadTraceField(f"{event.kind} event: this tracer has no peer id yet: make it with peer=..., "
                                "or hand it to Swarm.join, which binds the requester's")
        self._writer.submit(("trace", make_row(event, peer, wall=wall, mono_ns=mono_ns)))

    def flush(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        if timeout is None:
            self._writer.flush()
        else:
            self._writer.flush(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns:
            self.store.close()
        else:
            self._writer.flush()


class NullTracer(_Closing):
    """Checks events like a `TraceWriter` (so bad calls fail in tests too) and keeps nothing."""

    def __init__(self, *, peer: str = "null") -> None:
        self.peer = peer

    def emit(
        self, event: TraceEvent, *, peer: str | None = None, wall: float | None = None, mono_ns: int | None = None
    ) -> None:
        make_row(event, peer or self.peer, wall=wall, mono_ns=mono_ns)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class MemoryTracer(_Closing):
    """Keeps events in `events` as a store reader would get them back (`Stamped`; id: 1, 2, ...): for tests."""

    def __init__(self, *, peer: str = "memory") -> None:
        self.peer = peer
        self.events: list[Stamped] = []

    def emit(
        self, event: TraceEvent, *, peer: str | None = None, wall: float | None = None, mono_ns: int | None = None
    ) -> None:
        row = dict(zip(TRACE_COLUMNS, make_row(event, peer or self.peer, wall=wall, mono_ns=mono_ns)))
        back = stamped({"id": len(self.events) + 1, **row})  # as a reader of the store would see it
        if isinstance(back.event, Unknown):
            raise BadTraceField(f"{event!r} does not read back: {back.event.problem}")
        self.events.append(back)

    def of_kind(self, kind: type[TraceEvent]) -> list[Stamped]:
        return [e for e in self.events if isinstance(e.event, kind)]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
