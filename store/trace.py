"""The trace: one row per event a peer (or requester) saw, written off the hot path.

    tracer = TraceWriter(DATA_DIR / "tessera.db", peer=my_peer_id)
    t0 = time.perf_counter()
    out = stage.forward(...)
    tracer.emit("forward", session=sid, step=7, span_start=0, span_end=10,
                duration=time.perf_counter() - t0)
    tracer.emit("push", session=sid, step=7, remote=next_peer, bytes=len(frame))
    ...
    tracer.close()   # or `with TraceWriter(...) as tracer:`

`emit()` validates the fields (a wrong kind or type raises here, in the caller, as a
typed error), stamps the time and appends one tuple to the writer's queue: it never waits
for the disk. The store's writer thread commits a batch every ``flush_interval`` seconds
(store/writer.py); a kill -9 loses at most that interval.

Fields (columns of the ``trace`` table; all optional but the kind):

- ``mono_ns`` / ``wall`` — when the event happened: the writing process's monotonic clock
  (ns) and unix time (s). Taken at `emit()` unless given (a simulation passes its own
  clock). **An event with a duration is emitted when it ends**: it covers
  ``[wall - duration, wall]``. Export orders and aligns events by ``wall``.
- ``peer`` — who saw it; defaults to the tracer's peer (a simulation may override it).
- ``session`` (bytes or hex str), ``step`` (int), ``span_start``/``span_end`` (ints,
  half-open), ``bytes`` (int), ``duration`` (seconds), ``remote`` (the other peer of a
  push, receive, connect or disconnect), ``detail`` (a dict, stored as JSON).
- ``span=(start, end)`` is accepted as a shorthand for the two span fields.

Kinds are `EVENT_KINDS`. A ``push`` (activations sent to ``remote``) and the matching
``receive`` (got from ``remote``) carry the same session and step: export pairs them to
align clocks and draw arrows. When several messages share a (session, step) on one link,
put the same ``detail["msg"]`` on both ends; otherwise the k-th push pairs with the k-th
receive. A ``connect`` carries ``detail={"kind": "direct" | "punched" | "relayed"}``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tessera.store.db import PeerStore
from tessera.store.errors import BadTraceField, NotJSON, StoreClosed, UnknownEventKind
from tessera.store.writer import TRACE_COLUMNS

EVENT_KINDS = (
    "join",  # the peer joined the swarm (detail: addrs, model)
    "advertise",  # it published an advertisement (detail: span, throughput, load ...)
    "claim",  # it claimed a span (span_*; detail: shard)
    "release",  # it released a span
    "connect",  # a connection to `remote` came up (detail: {"kind": direct|punched|relayed})
    "disconnect",  # a connection to `remote` went down
    "session_open",  # a session opened here
    "session_close",  # a session closed here (detail: steps, tokens, reason)
    "session_revoked",  # the requester revoked this peer from a session; its KV and keys are dropped
    "forward",  # one forward step computed; duration = compute time
    "push",  # activations sent to `remote`; duration = send time
    "receive",  # activations received from `remote`
    "result",  # the last stage returned logits/hidden states to the requester
    "rollback",  # KV position moved back (detail: from, to)
    "failover",  # a span moved to a replacement peer mid-session (detail: dead, new)
    "ban",  # a peer was banned (remote; detail: reason, until)
    "leave",  # the peer left the swarm
    "error",  # something failed (detail: type, message)
    "request",  # requester side: a generation started or ended (detail: phase, prompt_tokens ...)
    "token",  # requester side: a token was produced (detail: token id, position)
    "misbehaviour",  # a misbehaviour report was sent or received (remote = accused)
    "move",  # placement moved this peer to another span (detail: from, to)
    "audit",  # a tensor-shard step: what one node held and every collective it joined (peer/plan/audit.py)
    "drain",  # the operator drained the peer: no new sessions, running ones finish (span_*)
    "pause",  # the operator paused compute: steps held, no new sessions (span_*; detail: sessions held)
    "resume",  # the operator resumed: sessions accepted again (span_*)
)
CONNECT_KINDS = ("direct", "punched", "relayed")

_KINDS = frozenset(EVENT_KINDS)
_INT_FIELDS = ("step", "span_start", "span_end", "bytes")
_FIELDS = frozenset(TRACE_COLUMNS) - {"kind"} | {"span"}
_HEX = "0123456789abcdef"


def _bad(kind: str, name: str, value: Any, want: str) -> BadTraceField:
    return BadTraceField(f"{kind} event: {name} must be {want}, got {value!r}")


def make_row(kind: str, peer: str, fields: dict[str, Any]) -> tuple:
    """Validate one event and return its row in `TRACE_COLUMNS` order (detail as JSON text)."""
    if kind not in _KINDS:
        raise UnknownEventKind(f"event kind {kind!r} is not one of {EVENT_KINDS!r}")
    for name in fields:
        if name not in _FIELDS:
            raise BadTraceField(f"{kind} event: unknown field {name!r}; fields are {sorted(_FIELDS)!r}")
    get = fields.get
    span = get("span")
    if span is not None:
        if not (isinstance(span, (tuple, list)) and len(span) == 2):
            raise _bad(kind, "span", span, "a (start, end) pair")
        fields = {**fields, "span_start": span[0], "span_end": span[1]}
        get = fields.get
    mono_ns = get("mono_ns")
    if mono_ns is None:
        mono_ns = time.monotonic_ns()
    elif isinstance(mono_ns, bool) or not isinstance(mono_ns, int):
        raise _bad(kind, "mono_ns", mono_ns, "an int")
    wall = get("wall")
    if wall is None:
        wall = time.time()
    elif isinstance(wall, bool) or not isinstance(wall, (int, float)) or not math.isfinite(wall):
        raise _bad(kind, "wall", wall, "a finite number of unix seconds")
    who = get("peer", peer)
    if not isinstance(who, str) or not who:
        raise _bad(kind, "peer", who, "a non-empty str")
    session = get("session")
    if session is not None:
        if isinstance(session, (bytes, bytearray)):
            session = bytes(session).hex()
        elif not (isinstance(session, str) and session and not session.lower().strip(_HEX)):
            raise _bad(kind, "session", session, "bytes or a hex str")
        else:
            session = session.lower()
    ints = []
    for name in _INT_FIELDS:
        value = get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise _bad(kind, name, value, "an int >= 0")
        ints.append(value)
    duration = get("duration")
    if duration is not None:
        if (
            isinstance(duration, bool)
            or not isinstance(duration, (int, float))
            or not duration >= 0
            or not math.isfinite(duration)
        ):
            raise _bad(kind, "duration", duration, "a finite number of seconds >= 0")
        duration = float(duration)
    remote = get("remote")
    if remote is not None and (not isinstance(remote, str) or not remote):
        raise _bad(kind, "remote", remote, "a non-empty str (a peer id)")
    detail = get("detail")
    if detail is not None:
        if not isinstance(detail, dict):
            raise _bad(kind, "detail", detail, "a dict")
        if kind == "connect" and detail.get("kind") not in CONNECT_KINDS:
            raise _bad(kind, "detail['kind']", detail.get("kind"), f"one of {CONNECT_KINDS!r}")
        try:
            detail = json.dumps(detail, separators=(",", ":"), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise NotJSON(f"{kind} event: detail {detail!r} is not JSON ({error})") from None
    elif kind == "connect":
        raise _bad(kind, "detail", None, f"a dict with 'kind' one of {CONNECT_KINDS!r}")
    return (mono_ns, float(wall), who, kind, session, *ints, duration, remote, detail)


@runtime_checkable
class Tracer(Protocol):
    """What peer code emits events to: a `TraceWriter`, a `NullTracer` or a `MemoryTracer`."""

    def emit(self, kind: str, **fields: Any) -> None:
        """Record one event; never blocks on I/O. Raises on an unknown kind or a bad field."""
        ...

    def flush(self) -> None:
        """Block until every event emitted so far is stored."""
        ...

    def close(self) -> None:
        """Flush and stop; idempotent."""
        ...

    def __enter__(self) -> "Tracer": ...

    def __exit__(self, *exc: object) -> None: ...


class _Closing:
    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]


class TraceWriter(_Closing):
    """Writes events to a peer database through its background writer thread.

    `store_or_path` is an open `PeerStore` (shared: `close()` then only flushes) or a path
    (the tracer opens the store and closes it on `close()`). `flush_interval` applies to a
    store the tracer opens; given with a shared store, the store's writer takes the shorter
    of its own interval and this one.
    """

    def __init__(
        self, store_or_path: PeerStore | Path | str, *, peer: str, flush_interval: float | None = None
    ) -> None:
        if not isinstance(peer, str) or not peer:
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

    def emit(self, kind: str, **fields: Any) -> None:
        if self._closed:
            raise StoreClosed(f"tracer for {self.peer!r} is closed; cannot emit {kind!r}")
        self._writer.submit(("trace", make_row(kind, self.peer, fields)))

    @property
    def dropped(self) -> int:
        """Events refused because the disk was stuck and the queue full (see store/writer.py)."""
        return self._writer.dropped

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

    def emit(self, kind: str, **fields: Any) -> None:
        make_row(kind, self.peer, fields)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class MemoryTracer(_Closing):
    """Keeps events in `events` as dicts (columns of the trace table, detail decoded): for tests."""

    def __init__(self, *, peer: str = "memory") -> None:
        self.peer = peer
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        row = dict(zip(TRACE_COLUMNS, make_row(kind, self.peer, fields)))
        row["detail"] = json.loads(row["detail"]) if row["detail"] else {}
        self.events.append(row)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
