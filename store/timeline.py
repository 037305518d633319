"""Merging several peers' traces into one timeline, with their clocks aligned.

Every database was written by one process with its own wall clock, and those clocks
disagree (NTP keeps them within milliseconds at best, seconds at worst; a laptop back from
sleep can be further off). We align them with what the traces already hold: every
``push`` from A to B has a matching ``receive`` at B (same session and step, see
store/trace.py). If A's clock reads ``x_A`` seconds ahead of true time and B's ``x_B``::

    d = receive.wall - push.wall = delay + (x_B - x_A)     with delay >= MIN_DELAY_S

so each link A->B bounds the offset difference: ``x_B - x_A <= w_AB = min(d) - MIN_DELAY_S``
(the fastest message gives the tightest bound). These difference constraints define all
offset vectors under which **every receive comes after its push**. With the reference's
offset fixed at 0, shortest paths give each clock's highest feasible offset ``U`` (paths
from the reference) and lowest ``L`` (minus paths back to it); both vectors are feasible,
so their midpoint is too. For two peers talking both ways this midpoint is exactly NTP's
estimate ``(min d_AB - min d_BA) / 2``; around a pipeline ring (requester -> A -> B ->
requester) it spreads the round trip evenly over the links. A clock bounded on one side
only takes that bound (the fastest message on its link is assumed to have taken
MIN_DELAY_S); a peer with no pairs keeps offset 0. A final relaxation pass repairs any
constraint the mixed cases left violated. If the constraints contradict each other (a
negative cycle: clocks drifted during the run, or a message was mis-paired), the estimate is
kept and `Timeline.non_causal` counts the pairs that stay out of order.

The clock domain is the database file (one writing process): a simulation that writes
hundreds of peers into one database on one clock gets no corrections among them. The
reference is the database with the most matched pairs (ties: its first peer id, then
path), so the same files always give the same timeline.
"""

from __future__ import annotations

import math
import sqlite3
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterable, Sequence

from tessera.store.errors import BadTimeWindow, BadTraceRow, NotATraceDatabase
from tessera.store.events import Push, Receive, TraceEvent, Unknown, stamped
from tessera.store.writer import TRACE_COLUMNS

# The least one-way delay we assume for a matched message: keeps every receive strictly
# after its push once aligned (a loopback hop takes tens of microseconds; this is one).
MIN_DELAY_S = 1e-6

COLUMNS = ("id", *TRACE_COLUMNS)  # as written by store/writer.py


@dataclass
class Event:
    """One stored trace event plus the database it came from and its aligned time.

    `t` is the aligned end of the event, in seconds since the timeline's origin (the
    earliest aligned start); `start` is ``t - duration``.
    """

    db: int
    id: int
    mono_ns: int
    wall: float
    peer: str
    event: TraceEvent
    t: float = 0.0

    @property
    def kind(self) -> str:
        """The stored kind (an `Unknown` event's own)."""
        return self.event.kind_name if isinstance(self.event, Unknown) else self.event.kind

    @property
    def duration(self) -> float | None:
        return self.event.duration

    @property
    def start(self) -> float:
        return self.t - (self.duration or 0.0)


@dataclass
class Timeline:
    """The merged, aligned events of several databases."""

    paths: list[Path]
    events: list[Event]  # sorted by aligned time (ties: by database label, then id)
    offsets: dict[int, float]  # db index -> seconds its clock read ahead of the reference
    reference: int | None  # db index whose clock is taken as true (None: no events)
    origin: float  # unix time (reference clock) of t = 0
    pairs: list[tuple[Event, Event]] = field(default_factory=list)  # (push, receive)
    non_causal: int = 0  # pairs whose receive is still not after the push

    @property
    def peers(self) -> list[str]:
        """Peer ids in order of their first event."""
        seen: dict[str, None] = {}
        for event in self.events:
            seen.setdefault(event.peer, None)
        return list(seen)

    def window(self, since: "When | None" = None, until: "When | None" = None,
               sessions: Sequence[str] = ()) -> "Timeline":
        """The events overlapping [since, until] (either open), of the sessions whose id starts
        with one of `sessions` (none given: every event), and the push/receive pairs with both
        ends kept; times stay on this timeline's axis. Raises BadTimeWindow for an empty window
        or one that keeps no event."""
        lo = -math.inf if since is None else since.on(self)
        hi = math.inf if until is None else until.on(self)
        if lo > hi:
            raise BadTimeWindow(f"--since ({lo:.3f} s) is after --until ({hi:.3f} s) on this timeline")
        wanted = tuple(s.lower() for s in sessions)

        def kept(e: Event) -> bool:
            if e.t < lo or e.start > hi:
                return False
            session = getattr(e.event, "session", None)
            return not wanted or (isinstance(session, str) and session.lower().startswith(wanted))

        events = [e for e in self.events if kept(e)]
        if not events:
            what = f"sessions {', '.join(sessions)}" if sessions else "events"
            raise BadTimeWindow(f"no {what} between {lo:.3f} s and {hi:.3f} s of this timeline "
                                f"(it spans 0 to {max((e.t for e in self.events), default=0.0):.3f} s)")
        ids = {id(e) for e in events}
        pairs = [(p, r) for p, r in self.pairs if id(p) in ids and id(r) in ids]
        return Timeline(self.paths, events, self.offsets, self.reference, self.origin, pairs,
                        sum(1 for p, r in pairs if r.t <= p.t))


@dataclass(frozen=True)
class When:
    """A point on a timeline: `seconds` since its first event, or a `wall` clock time (unix s,
    placed on the reference clock: `Timeline.origin`)."""

    seconds: float | None = None
    wall: float | None = None

    def on(self, timeline: Timeline) -> float:
        return self.seconds if self.seconds is not None else float(self.wall) - timeline.origin


def parse_when(text: str, *, today: datetime | None = None) -> When:
    """'12.5' (seconds since the first event), '2026-12-05T14:03:00' or '14:03[:00]' (local
    time; today's). Raises BadTimeWindow naming the text."""
    text = text.strip()
    try:
        return When(seconds=float(text))
    except ValueError:
        pass
    try:
        return When(wall=datetime.fromisoformat(text).timestamp())
    except ValueError:
        pass
    for form in ("%H:%M:%S", "%H:%M"):
        try:
            clock = datetime.strptime(text, form).time()
        except ValueError:
            continue
        day = (today or datetime.now()).date()
        return When(wall=datetime.combine(day, clock).timestamp())
    raise BadTimeWindow(f"{text!r} is not a time: give seconds since the first event (12.5), "
                        "a clock time (14:03 or 14:03:20, today) or an ISO date and time (2026-12-05T14:03:00)")


def read_events(path: Path, db: int = 0) -> list[Event]:
    """Every trace row of the database at `path`, in id order (opened read-only)."""
    path = Path(path)
    if not path.is_file():
        raise NotATraceDatabase(f"{str(path)!r} does not exist or is not a file")
    uri = path.resolve().as_uri() + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
    except sqlite3.Error as error:
        raise NotATraceDatabase(f"{str(path)!r} cannot be opened: {error}") from None
    try:
        rows = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM trace ORDER BY id").fetchall()
    except sqlite3.DatabaseError as error:
        raise NotATraceDatabase(f"{str(path)!r} has no readable trace table: {error}") from None
    finally:
        conn.close()
    events = []
    for row in rows:
        try:
            one = stamped(dict(zip(COLUMNS, row)))
        except BadTraceRow as error:
            raise BadTraceRow(f"{str(path)!r}: {error}") from None
        events.append(Event(db, one.id, one.mono_ns, one.wall, one.peer, one.event))
    return events


def match_pairs(events: Iterable[Event]) -> list[tuple[Event, Event]]:
    """Pair each push (sender side) with its receive (receiver side): the k-th push of a
    (session, step) on a link with the k-th receive of it."""
    pushes: dict[tuple, list[Event]] = defaultdict(list)
    receives: dict[tuple, list[Event]] = defaultdict(list)
    for e in events:
        ev = e.event
        if isinstance(ev, Push):
            pushes[(e.peer, ev.remote, ev.session, ev.step)].append(e)
        elif isinstance(ev, Receive):
            receives[(ev.remote, e.peer, ev.session, ev.step)].append(e)
    pairs = []
    for key in sorted(pushes, key=repr):
        sent = sorted(pushes[key], key=lambda e: (e.wall, e.id))
        got = sorted(receives.get(key, ()), key=lambda e: (e.wall, e.id))
        pairs.extend(zip(sent, got))
    return pairs


def _shortest(n: int, edges: dict[tuple[int, int], float], source: int) -> list[float]:
    """Bellman-Ford distances from `source` (inf where unreachable; stops after n rounds)."""
    dist = [math.inf] * n
    dist[source] = 0.0
    for _ in range(n):
        changed = False
        for (a, b), w in edges.items():
            if dist[a] + w < dist[b]:
                dist[b] = dist[a] + w
                changed = True
        if not changed:
            break
    return dist


def estimate_offsets(
    n: int, pairs: Sequence[tuple[Event, Event]], labels: Sequence[tuple]
) -> tuple[dict[int, float], int | None]:
    """Clock offset of each of `n` databases relative to a reference (see the module docstring).

    `labels[i]` orders databases for the choice of reference. Returns (offsets, reference).
    """
    edges: dict[tuple[int, int], float] = {}
    degree = [0] * n
    for push, receive in pairs:
        a, b = push.db, receive.db
        if a == b:
            continue
        w = (receive.wall - push.wall) - MIN_DELAY_S
        edges[(a, b)] = min(edges.get((a, b), math.inf), w)
        degree[a] += 1
        degree[b] += 1
    neighbours: dict[int, set[int]] = defaultdict(set)
    for a, b in edges:
        neighbours[a].add(b)
        neighbours[b].add(a)
    offsets = {i: 0.0 for i in range(n)}
    reference = None
    unplaced = set(range(n))
    while unplaced:
        ref = min(unplaced, key=lambda i: (-degree[i], labels[i]))
        reference = ref if reference is None else reference
        component, frontier = {ref}, [ref]
        while frontier:
            for m in neighbours[frontier.pop()]:
                if m not in component:
                    component.add(m)
                    frontier.append(m)
        unplaced -= component
        if len(component) == 1:
            continue
        upper = _shortest(n, edges, ref)
        lower = [-d for d in _shortest(n, {(b, a): w for (a, b), w in edges.items()}, ref)]
        x: dict[int, float | None] = {}
        for i in component:
            hi, lo = upper[i], lower[i]
            if math.isfinite(hi) and math.isfinite(lo):
                x[i] = (hi + lo) / 2
            elif math.isfinite(hi) or math.isfinite(lo):
                x[i] = hi if math.isfinite(hi) else lo
            else:
                x[i] = None
        # Clocks linked only through one-sided neighbours: walk out from placed ones.
        while any(v is None for v in x.values()):
            for (a, b), w in sorted(edges.items()):
                if a in x and b in x:
                    if x[a] is not None and x[b] is None:
                        x[b] = x[a] + w
                    elif x[b] is not None and x[a] is None:
                        x[a] = x[b] - w
        # Repair: lower any offset that still puts a receive before its push.
        for _ in range(len(component) + 1):
            changed = False
            for (a, b), w in edges.items():
                if a in x and x[a] + w < x[b] - 1e-12:  # type: ignore[operator]
                    x[b] = x[a] + w  # type: ignore[operator]
                    changed = True
            if not changed:
                break
        shift = x[ref]
        for i in component:
            offsets[i] = x[i] - shift  # type: ignore[operator]
    return offsets, reference


def _label(events: list[Event], path: Path) -> tuple:
    peers = sorted({e.peer for e in events})
    return (peers[0] if peers else "", str(path))


def load_timeline(db_paths: Sequence[Path | str]) -> Timeline:
    """Read, align and merge the traces of `db_paths` (see the module docstring)."""
    paths = [Path(p) for p in db_paths]
    per_db = [read_events(p, i) for i, p in enumerate(paths)]
    events = [e for evs in per_db for e in evs]
    pairs = match_pairs(events)
    labels = [_label(e, p) for e, p in zip(per_db, paths)]
    offsets, reference = estimate_offsets(len(paths), pairs, labels)
    rank = {db: r for r, db in enumerate(sorted(range(len(paths)), key=lambda i: labels[i]))}
    if not events:
        return Timeline(paths, [], offsets, None, 0.0, pairs)
    origin = min(e.wall - offsets[e.db] - (e.duration or 0.0) for e in events)
    for e in events:
        e.t = (e.wall - origin) - offsets[e.db]
    events.sort(key=lambda e: (e.t, rank[e.db], e.id))  # ties: not by argument order
    non_causal = sum(1 for push, receive in pairs if receive.t <= push.t)
    return Timeline(paths, events, offsets, reference, origin, pairs, non_causal)
