"""Every trace event: one frozen dataclass per kind, shared by the emitters and every reader.

    tracer.emit(Forward(session=sid, step=7, span=(0, 10), duration=dt, start_pos=0, n_tokens=5, batch=1))
    for row in store.events(kinds=(Forward,)):      # Stamped(id, mono_ns, wall, peer, event)
        row.event.duration

An emitter constructs the class of its kind (a field the class lacks is a TypeError where
it is written); a reader picks rows by class (``isinstance(row.event, Claim)``) and reads
typed attributes, so a kind or a field cannot be written under one name and read under
another. `EVENT_TYPES` lists them all; tests/store/test_store_events.py checks that every class
is emitted somewhere and that no emitter or reader names a kind by string.

Storage (the ``trace`` table of store/schema.py, unchanged from before these classes): a
field named like a column — ``session`` (bytes, or hex; read back as hex), ``step``,
``span`` (``span_start``/``span_end``, half-open), ``bytes``, ``duration`` (seconds),
``remote`` (the other peer) — goes to that column; every other field is a key of the JSON
``detail`` (its name, or ``metadata["key"]`` where the name would shadow a keyword or the
kind: `Move.moved_from` is ``detail["from"]``, `Connect.link` is ``detail["kind"]``). A
detail field left None is not written. Fields a class does not have read back as None on
every event (``event.duration`` is None for a `Join`), so generic readers (export, the
TUI's event line) need no per-kind code.

Reading an old or foreign trace (`decode`): a row whose kind no class has, or whose values
do not fit its class (a required field missing, a value of the wrong type, a detail key
the class does not define), becomes an `Unknown` event holding the raw kind, columns,
detail and the problem: it is kept — export shows every row — and readers that look for
a class pass over it. Only a row without a usable time or peer (the envelope) is refused,
with `BadTraceRow`, because nothing can place it on a timeline. One legacy shape is
accepted: a ``detail["span"]`` pair on a row whose span columns are empty (a group's
``session_open`` and ``misbehaviour`` wrote their span there before these classes).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from tessera.store.errors import BadTraceField, BadTraceRow, NotJSON, UnknownEventKind

COLUMN_FIELDS = ("session", "step", "span", "bytes", "duration", "remote")
# The stored columns an event fills, in the trace table's order (store/writer.py TRACE_COLUMNS).
ROW_COLUMNS = ("session", "step", "span_start", "span_end", "bytes", "duration", "remote")
CONNECT_KINDS = ("direct", "punched", "relayed")  # peer/net/transport.py LinkKind; a test keeps them equal
_HEX = "0123456789abcdef"

Span = tuple[int, int]  # half-open layer interval [start, end)
SessionId = bytes | str  # written as bytes or hex, read back as lowercase hex
JSONList = list  # any JSON array (routes, addresses, audit records)


class TraceEvent:
    """Base of every event class. Column fields a subclass lacks read as None (see the docstring)."""

    kind: ClassVar[str]
    # Declared for type checkers only: a value here would become the dataclass default.
    session: str | None
    step: int | None
    span: Span | None
    bytes: int | None
    duration: float | None
    remote: str | None

    def __getattr__(self, name: str) -> Any:  # only called for attributes the instance lacks
        if name in COLUMN_FIELDS:
            return None
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")


def _key(name: str) -> dict[str, str]:
    return {"key": name}


@dataclass(frozen=True)
class Join(TraceEvent):
    """The peer joined the swarm (a requester too: when it has pulled its first view)."""

    kind: ClassVar[str] = "join"
    addrs: JSONList
    model: str


@dataclass(frozen=True)
class Advertise(TraceEvent):
    """The peer published its advertisement: its state and load, or a new reachability verdict."""

    kind: ClassVar[str] = "advertise"
    span: Span | None = None
    state: str | None = None  # peer/plan/view.py PeerState
    load: float | None = None
    reachability: str | None = None  # peer/plan/view.py Reachability, when the verdict changed
    addrs: JSONList | None = None  # the addresses the verdict reached


@dataclass(frozen=True)
class Claim(TraceEvent):
    """The peer claimed a span: what placement (and a replay) needs to know of it."""

    kind: ClassVar[str] = "claim"
    span: Span
    throughput: float  # tokens per second per layer
    capacity: int  # layers its memory holds


@dataclass(frozen=True)
class Move(TraceEvent):
    """Placement moved the peer to another span."""

    kind: ClassVar[str] = "move"
    span: Span
    reason: str
    moved_from: JSONList | None = field(default=None, metadata=_key("from"))


@dataclass(frozen=True)
class Connect(TraceEvent):
    """A connection to `remote` came up."""

    kind: ClassVar[str] = "connect"
    remote: str
    link: str = field(metadata=_key("kind"))  # one of CONNECT_KINDS


@dataclass(frozen=True)
class Disconnect(TraceEvent):
    """A connection to `remote` went down."""

    kind: ClassVar[str] = "disconnect"
    remote: str


@dataclass(frozen=True)
class Rtt(TraceEvent):
    """A round trip to `remote` measured by a ping (`duration`, seconds): what routing prices the
    link with (the pinger's moving average of these), and what a replay gives the link."""

    kind: ClassVar[str] = "rtt"
    remote: str
    duration: float


@dataclass(frozen=True)
class SessionOpen(TraceEvent):
    """A session opened: on a serving peer (span, requester as `remote`, `next` hop or group
    rank) or on the requester (its `route`, or the shard `group` and its `members`)."""

    kind: ClassVar[str] = "session_open"
    session: SessionId
    span: Span | None = None
    remote: str | None = None
    capacity: int | None = None  # positions the serving peer reserved
    next: str | None = None  # the serving peer's next hop
    group: str | None = None  # a tensor-shard group: served by a rank of it, or opened by the requester
    rank: int | None = None
    members: JSONList | None = None
    route: JSONList | None = None  # the requester's route: [[peer, start, end], ...]
    segments: int | None = None
    max_length: int | None = None
    via: str | None = None  # what carries the session stream here: "dedicated", "libp2p" (peer/net/transport.py)
    # the requester: how long before this open its answer began (a route wait, peers pinged for
    # their load first): a replay's request arrives then, not at the session's first event
    began_before: float | None = None
    next_via: str | None = None  # and the serving peer's link to its next hop


@dataclass(frozen=True)
class SessionClose(TraceEvent):
    """A session closed (on the serving peer, with what it computed; or on the requester)."""

    kind: ClassVar[str] = "session_close"
    session: SessionId
    reason: str
    span: Span | None = None
    steps: int | None = None
    tokens: int | None = None


@dataclass(frozen=True)
class SessionRevoked(TraceEvent):
    """The requester revoked a peer from a session; the peer dropped its KV cache and keys."""

    kind: ClassVar[str] = "session_revoked"
    session: SessionId
    remote: str
    span: Span
    steps: int | None = None  # on the revoked peer: what it had computed
    tokens: int | None = None


@dataclass(frozen=True)
class Forward(TraceEvent):
    """One forward step computed; `duration` is the compute time."""

    kind: ClassVar[str] = "forward"
    session: SessionId
    step: int
    span: Span
    duration: float
    start_pos: int | None = None
    n_tokens: int | None = None
    batch: int | None = None  # steps computed together in one batch
    bytes: int | None = None


@dataclass(frozen=True)
class Push(TraceEvent):
    """Activations sent to `remote`. The k-th push of a (session, step) on a link pairs with the
    k-th `Receive` of it at the other end (store/timeline.py aligns clocks on those pairs)."""

    kind: ClassVar[str] = "push"
    session: SessionId
    step: int
    remote: str
    bytes: int
    span: Span | None = None
    start_pos: int | None = None
    n_tokens: int | None = None


@dataclass(frozen=True)
class Receive(TraceEvent):
    """Activations received from `remote`."""

    kind: ClassVar[str] = "receive"
    session: SessionId
    step: int
    remote: str
    bytes: int
    span: Span | None = None


@dataclass(frozen=True)
class Result(TraceEvent):
    """The requester got a step's output back; `duration` from sending it."""

    kind: ClassVar[str] = "result"
    session: SessionId
    step: int
    duration: float
    start_pos: int
    n_tokens: int
    group: str | None = None  # the step went through a tensor-shard group


@dataclass(frozen=True)
class Failover(TraceEvent):
    """A span moved to replacement peers mid-session after `remote` failed."""

    kind: ClassVar[str] = "failover"
    session: SessionId
    remote: str
    duration: float
    reason: str
    position: int
    route: JSONList  # the route after the repair: [[peer, start, end], ...]
    replacements: JSONList | None = None  # the peers brought in
    replaced: JSONList | None = None  # the layers [a, b) replaced


@dataclass(frozen=True)
class Ban(TraceEvent):
    """The requester banned `remote` for `seconds` (`failure`: the kind that decided how long,
    peer/base/backoff.py `Failure`)."""

    kind: ClassVar[str] = "ban"
    remote: str
    reason: str
    seconds: float
    failure: str | None = None


@dataclass(frozen=True)
class Parole(TraceEvent):
    """The requester lifted its ban on `remote` (banned after `failure`: a drop or a timeout):
    it answered a probe and had advertised again since it failed (peer/base/backoff.py)."""

    kind: ClassVar[str] = "parole"
    remote: str
    failure: str


@dataclass(frozen=True)
class Misbehaviour(TraceEvent):
    """A spot check's verdict on `remote` (None: nobody convicted). `decided`: how ("by a
    tie-breaker", "by recomputing locally": peer/request/dispute.py); `convicted`: every peer
    convicted (both sides, when a recomputation finds both wrong); `recomputed_vs`: [[peer,
    largest difference from the requester's recomputation], ...] and `duration` what it took; an undecided dispute has
    `outcome` "undecided", `why`, and the `disputed` pair."""

    kind: ClassVar[str] = "misbehaviour"
    session: SessionId
    span: Span
    positions: JSONList
    tolerance: float
    accused_vs_checker: float
    remote: str | None = None
    outcome: str | None = None
    tie_breaker: str | None = None
    tie_agrees_with_checker: bool | None = None
    tie_agrees_with_accused: bool | None = None
    decided: str | None = None
    convicted: JSONList | None = None
    recomputed_vs: JSONList | None = None
    why: str | None = None
    disputed: JSONList | None = None
    duration: float | None = None  # seconds a local recomputation took (fetching the span's weights included)


@dataclass(frozen=True)
class Error(TraceEvent):
    """Something failed: a peer of a session (`reason`), a served step (`code`, `message`), or a check."""

    kind: ClassVar[str] = "error"
    session: SessionId | None = None
    remote: str | None = None
    reason: str | None = None
    code: str | None = None  # protocol/error_codes.py ErrorCode
    message: str | None = None
    check: str | None = None


@dataclass(frozen=True)
class Leave(TraceEvent):
    """The peer left the swarm."""

    kind: ClassVar[str] = "leave"
    span: Span | None = None


@dataclass(frozen=True)
class Drain(TraceEvent):
    """The operator drained the peer: no new sessions, running ones finish."""

    kind: ClassVar[str] = "drain"
    span: Span | None
    sessions: int


@dataclass(frozen=True)
class Pause(TraceEvent):
    """The operator paused compute: steps held, no new sessions."""

    kind: ClassVar[str] = "pause"
    span: Span | None
    sessions: int


@dataclass(frozen=True)
class Resume(TraceEvent):
    """The operator resumed: sessions accepted again."""

    kind: ClassVar[str] = "resume"
    span: Span | None


@dataclass(frozen=True)
class Audit(TraceEvent):
    """One node's tensor-shard audit of one step (peer/plan/audit.py)."""

    kind: ClassVar[str] = "audit"
    session: SessionId
    step: int
    span: Span
    role: str
    group: str
    count: int
    hidden: int
    records: JSONList
    index: int | None = None  # the rank; None for the requester


@dataclass(frozen=True)
class Unknown(TraceEvent):
    """A stored row no class fits (an older or newer trace): kept as read, with why."""

    kind_name: str  # `kind` is the class's; this is the row's
    columns: dict
    detail: dict
    problem: str
    kind: ClassVar[str] = "unknown"


EVENT_TYPES: tuple[type[TraceEvent], ...] = (
    Join, Advertise, Claim, Move, Connect, Disconnect, Rtt, SessionOpen, SessionClose, SessionRevoked, Forward,
    Push, Receive, Result, Failover, Ban, Parole, Misbehaviour, Error, Leave, Drain, Pause, Resume, Audit,
)
BY_KIND: dict[str, type[TraceEvent]] = {cls.kind: cls for cls in EVENT_TYPES}
# What a person reading a peer's events (the TUI's Events panel, the web view's Peer page) does not
# want in the way, though the trace keeps it: the per-step events (one per token per hop), the
# periodic ones (an advertisement every few seconds, an RTT per neighbour per ping round: the lists
# were mostly `rtt duration 0.0039…`), and a spot check's audit rows. Asked for by name, they show.
ROUTINE_KINDS: tuple[type[TraceEvent], ...] = (Forward, Push, Receive, Advertise, Result, Audit, Rtt)
NOTABLE_KINDS: tuple[type[TraceEvent], ...] = tuple(k for k in EVENT_TYPES if k not in ROUTINE_KINDS)


@dataclass(frozen=True)
class Stamped:
    """One stored event: its row id (0 when not stored), when, who, and the event."""

    id: int
    mono_ns: int
    wall: float
    peer: str
    event: TraceEvent

    @property
    def kind(self) -> str:
        event = self.event
        return event.kind_name if isinstance(event, Unknown) else event.kind


# --- checking values --------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_span(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and len(v) == 2 and _is_int(v[0]) and _is_int(v[1])


def _is_session(v: Any) -> bool:
    return isinstance(v, (bytes, bytearray)) or (isinstance(v, str) and bool(v) and not v.lower().strip(_HEX))


_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "str": (lambda v: isinstance(v, str), "a str"),
    "int": (_is_int, "an int >= 0"),
    "float": (_is_float, "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "a bool"),
    "Span": (_is_span, "a (start, end) pair of ints >= 0"),
    "SessionId": (_is_session, "bytes or a hex str"),
    "JSONList": (lambda v: isinstance(v, (list, tuple)), "a list"),
}


@dataclass(frozen=True)
class _Field:
    name: str
    annotation: str  # its type, without " | None": a key of _CHECKS
    key: str  # the detail key, or the column name
    column: bool
    check: Callable[[Any], bool]
    want: str
    optional: bool
    required: bool  # no default: the constructor needs it
    slot: int  # its index in ROW_COLUMNS (span: of span_start); -1 for a detail key


def _spec(cls: type[TraceEvent]) -> tuple[_Field, ...]:
    out = []
    for f in dataclasses.fields(cls):
        annotation = str(f.type)
        base, optional = annotation.removesuffix(" | None"), annotation.endswith(" | None")
        if base not in _CHECKS:
            raise TypeError(f"{cls.__name__}.{f.name}: annotation {annotation!r} is not one of {sorted(_CHECKS)!r}")
        check, want = _CHECKS[base]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        column = f.name in COLUMN_FIELDS
        slot = ROW_COLUMNS.index("span_start" if f.name == "span" else f.name) if column else -1
        out.append(_Field(f.name, base, f.name if column else f.metadata.get("key", f.name), column, check, want,
                          optional, required, slot))
    return tuple(out)


SPECS: dict[type[TraceEvent], tuple[_Field, ...]] = {cls: _spec(cls) for cls in EVENT_TYPES}


def field_names(cls: type[TraceEvent]) -> tuple[str, ...]:
    """The fields of an event class (what an emitter may pass)."""
    return tuple(f.name for f in SPECS[cls])


# --- to and from a row ------------------------------------------------------------------


def encode(event: TraceEvent) -> tuple[str, tuple, str | None]:
    """(kind, the values of `ROW_COLUMNS`, detail as JSON text or None). On every emit: kept lean.

    Raises BadTraceField naming the kind, field and value for a value of the wrong type, and
    UnknownEventKind for anything that is not an instance of one of `EVENT_TYPES`.
    """
    cls = type(event)
    spec = SPECS.get(cls)
    if spec is None:
        raise UnknownEventKind(f"{event!r} is not an event of tessera.store.events (one of EVENT_TYPES)")
    columns: list[Any] = [None] * len(ROW_COLUMNS)
    detail: dict[str, Any] = {}
    values = event.__dict__
    for f in spec:
        value = values[f.name]
        if value is None:
            if not f.optional:
                raise BadTraceField(f"{cls.kind} event: {f.name} must be {f.want}, got None")
            continue
        if not f.check(value):
            raise BadTraceField(f"{cls.kind} event: {f.name} must be {f.want}"
                                f"{' or None' if f.optional else ''}, got {value!r}")
        slot = f.slot
        if slot < 0:
            detail[f.key] = value
        elif slot == 0:  # session
            columns[0] = bytes(value).hex() if isinstance(value, (bytes, bytearray)) else value.lower()
        elif slot == 2:  # span
            columns[2], columns[3] = int(value[0]), int(value[1])
        elif slot == 5:  # duration
            columns[5] = float(value)
        else:
            columns[slot] = value
    if cls is Connect and event.link not in CONNECT_KINDS:  # type: ignore[attr-defined]
        raise BadTraceField(f"connect event: link must be one of {CONNECT_KINDS!r}, got {event.link!r}")  # type: ignore[attr-defined]
    if not detail:
        return cls.kind, tuple(columns), None
    try:
        text = json.dumps(detail, separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise NotJSON(f"{cls.kind} event: detail {detail!r} is not JSON ({error})") from None
    return cls.kind, tuple(columns), text


def decode(kind: str, columns: dict[str, Any], detail: dict[str, Any]) -> TraceEvent:
    """The event of one stored row; `Unknown` when no class fits it (see the module docstring).

    `columns` holds the six column names with ``span_start``/``span_end``; `detail` is decoded JSON.
    """
    cls = BY_KIND.get(kind)
    if cls is None:
        return Unknown(kind, dict(columns), dict(detail), f"no event class has kind {kind!r}")
    spec = SPECS[cls]
    detail = dict(detail)
    start, end = columns.get("span_start"), columns.get("span_end")
    if start is None and end is None and isinstance(detail.get("span"), list) and "span" in {f.name for f in spec}:
        start, end = detail.pop("span")  # the legacy shape: a span in the detail
    values: dict[str, Any] = {}
    for f in spec:
        if f.name == "span":
            value = None if start is None and end is None else (start, end)
        elif f.column:
            value = columns.get(f.name)
        else:
            value = detail.pop(f.key, None)
        if value is None:
            if f.required and not f.optional:
                return Unknown(kind, dict(columns), dict(detail), f"{kind}: {f.name} is missing")
            if f.required:
                values[f.name] = None
            continue
        if not f.check(value):
            return Unknown(kind, dict(columns), dict(detail), f"{kind}: {f.name} must be {f.want}, got {value!r}")
        values[f.name] = tuple(value) if f.name == "span" else value
    if detail:
        return Unknown(kind, dict(columns), dict(detail), f"{kind}: no field for detail keys {sorted(detail)!r}")
    return cls(**values)


def stamped(row: dict[str, Any]) -> Stamped:
    """A `Stamped` event from a trace row as sqlite gives it (``detail`` as JSON text or None).

    Raises BadTraceRow when the row has no usable time or peer.
    """
    wall, mono_ns, peer = row.get("wall"), row.get("mono_ns"), row.get("peer")
    if not (_is_float(wall) and isinstance(mono_ns, int) and isinstance(peer, str) and peer):
        raise BadTraceRow(f"trace row {row.get('id')!r}: wall {wall!r}, mono_ns {mono_ns!r} and peer {peer!r}"
                          " must be a finite time, an int and a non-empty peer id")
    text = row.get("detail")
    try:
        detail = json.loads(text) if text else {}
    except (TypeError, ValueError):
        detail = {"": text}  # kept verbatim in an Unknown below
    columns = {name: row.get(name) for name in ROW_COLUMNS}
    kind = row.get("kind")
    if not isinstance(detail, dict) or "" in detail:
        event: TraceEvent = Unknown(str(kind), columns, {"": text}, f"detail is not a JSON object: {text!r}")
    else:
        event = decode(str(kind), columns, detail)
    return Stamped(int(row.get("id") or 0), mono_ns, float(wall), peer, event)


def row_fields(event: TraceEvent) -> tuple[dict[str, Any], dict[str, Any]]:
    """The column values and the detail of an event as stored (for generic readers: export, the TUI)."""
    if isinstance(event, Unknown):
        return dict(event.columns), dict(event.detail)
    _, columns, text = encode(event)
    return dict(zip(ROW_COLUMNS, columns)), json.loads(text) if text else {}
