"""What the web view remembers of a swarm over time: who came, changed and went, and token rates.

A swarm view is a snapshot: a peer whose process died is simply absent once its
advertisement expires. The pages need more — "peer2 is gone", the events of one peer,
a tokens/s sparkline — so one sampler, `SwarmWatch`, looks at the observer's view
every `WATCH_INTERVAL` and keeps:

- the changes between consecutive views (`changes`, a pure function): a peer joined,
  changed state, moved its span, went (its record expired or it left), came back;
- the peers gone, with what they last advertised, for `GONE_KEPT` seconds;
- per peer, a `RateSeries` of tokens/s from a cumulative counter the source gives
  (a peer counts what it served; a gateway what its own answers had through each peer).

Every tick bumps `version` and wakes whoever waits in `wait_update` (the pages' event
streams), so a stream sends at most once per tick and never polls.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import trio

from tessera.peer.plan.view import LEAVING, PeerInfo, SwarmView

# Seconds between samples: a peer that dies shows as gone at most this long after its record
# expires (RECORD_TTL, 15 s by default), and a person reads a page no faster.
WATCH_INTERVAL = 1.0
GONE_KEPT = 600.0  # seconds a gone peer stays listed ("last seen ... ago")
MAX_GONE = 64  # gone peers kept at most (a churning swarm must not grow this without bound)
KEPT_CHANGES = 500  # changes kept (all peers together)
SPARK_POINTS = 120  # rate samples kept per peer: two minutes at one a second


@dataclass(frozen=True)
class Change:
    """One thing that changed about a peer between two views. `what`: joined, state, moved, gone, back, note."""

    at: float
    peer_id: str
    what: str
    text: str

    def as_dict(self) -> dict:
        return {"at": self.at, "peer_id": self.peer_id, "what": self.what, "text": self.text}


def span_text(p: PeerInfo) -> str:
    shard = f" rank {p.shard_index}/{p.shard_count} of {p.shard_group!r}" if p.shard_count > 1 else ""
    return f"[{p.start}, {p.end}){shard}"


def changes(old: SwarmView | None, new: SwarmView, at: float, *, known_gone: frozenset[str] = frozenset()) -> list[Change]:
    """What changed from `old` to `new` (None: the first view: every peer "joined"), in peer-id
    order. `known_gone`: peers already reported gone; one that reappears is "back"."""
    before = {p.peer_id: p for p in old.peers} if old is not None else {}
    after = {p.peer_id: p for p in new.peers}
    out: list[Change] = []
    for pid in sorted(before.keys() | after.keys()):
        was, now = before.get(pid), after.get(pid)
        if was is None and now is not None:
            what = "back" if pid in known_gone else "joined"
            out.append(Change(at, pid, what, f"{'came back' if what == 'back' else 'joined'}: {now.state} {span_text(now)}"))
        elif was is not None and now is None:
            why = "it said it was leaving" if was.state == LEAVING else "its advertisement expired (no word from it)"
            out.append(Change(at, pid, "gone", f"gone: {why}; it served {span_text(was)}"))
        elif was is not None and now is not None:
            if (was.start, was.end) != (now.start, now.end):
                out.append(Change(at, pid, "moved", f"moved: {span_text(was)} -> {span_text(now)}"))
            if was.state != now.state:
                out.append(Change(at, pid, "state", f"{was.state} -> {now.state}"))
    return out


class RateSeries:
    """Tokens/s from a cumulative counter: one rate per sample, the last `keep` of them.

    A sample's rate is the counter's growth since the previous sample over the time
    between them; a counter that goes down (a restarted peer) starts the series over.
    """

    def __init__(self, keep: int = SPARK_POINTS) -> None:
        self.points: collections.deque[tuple[float, float]] = collections.deque(maxlen=keep)
        self.last: tuple[float, int] | None = None
        self.peak = 0.0

    def add(self, at: float, total: int) -> None:
        last = self.last
        if last is not None and at <= last[0]:
            return
        self.last = (at, total)
        if last is None:
            return
        if total < last[1]:
            self.points.clear()
            self.peak = 0.0
            return
        rate = (total - last[1]) / (at - last[0])
        self.points.append((at, rate))
        self.peak = max(self.peak, rate)

    def as_dict(self) -> dict:
        return {"points": [[round(at, 2), round(rate, 2)] for at, rate in self.points],
                "now": round(self.points[-1][1], 2) if self.points else 0.0, "peak": round(self.peak, 2),
                "total": self.last[1] if self.last else 0}


class WatchedSource(Protocol):
    """What the watch samples (sources.py: a gateway's requester, or a peer)."""

    def view(self) -> SwarmView: ...

    def token_counts(self, view: SwarmView) -> Mapping[str, int]:
        """Per peer id (of `view`, or others), a cumulative count of tokens (see the module docstring)."""
        ...


class SwarmWatch:
    """The sampler (see the module docstring). Run `run()` in a nursery for the view's life."""

    def __init__(self, source: WatchedSource, *, clock: Callable[[], float], interval: float = WATCH_INTERVAL) -> None:
        self.source = source
        self.clock = clock
        self.interval = interval
        self.view: SwarmView | None = None
        self.changes: collections.deque[Change] = collections.deque(maxlen=KEPT_CHANGES)
        self.gone: dict[str, tuple[float, PeerInfo]] = {}  # peer id -> (when it went, what it last advertised)
        self.rates: dict[str, RateSeries] = {}
        self.version = 0
        self._updated = trio.Event()

    def note(self, peer_id: str, text: str) -> None:
        """An event about a peer that no view shows (a gateway's answer through it)."""
        self.changes.append(Change(self.clock(), peer_id, "note", text))

    def tick(self) -> None:
        """Take one sample now."""
        now = self.clock()
        view = self.source.view()
        for change in changes(self.view, view, now, known_gone=frozenset(self.gone)):
            self.changes.append(change)
            if change.what == "gone":
                last = self.view.get(change.peer_id) if self.view is not None else None
                if last is not None:
                    self.gone[change.peer_id] = (now, last)
            elif change.what == "back":
                self.gone.pop(change.peer_id, None)
        for pid, (went, _) in list(self.gone.items()):
            if now - went > GONE_KEPT:
                del self.gone[pid]
        while len(self.gone) > MAX_GONE:
            del self.gone[min(self.gone, key=lambda pid: self.gone[pid][0])]
        for pid, total in self.source.token_counts(view).items():
            self.rates.setdefault(pid, RateSeries()).add(now, total)
        for pid in [pid for pid in self.rates if view.get(pid) is None and pid not in self.gone]:
            del self.rates[pid]  # gone longer than GONE_KEPT: its sparkline goes with it
        self.view = view
        self.version += 1
        self._updated.set()
        self._updated = trio.Event()

    async def wait_update(self, seen: int) -> int:
        """Wait until a sample newer than version `seen` exists; return the current version."""
        while self.version <= seen:
            await self._updated.wait()
        return self.version

    async def run(self) -> None:
        # A sampler, not a wait for a condition: an expired record changes nothing in the
        # keeper (it is filtered out on reading), so only a clock can see a peer go.
        while True:
            self.tick()
            await trio.sleep(self.interval)

    def gone_entries(self) -> list[dict]:
        """The gone peers for the Swarm page, the latest first."""
        return [
            {"peer_id": pid, "name": p.name, "span": [p.start, p.end], "shard": [p.shard_index, p.shard_count],
             "group": p.shard_group, "state": "gone", "last_state": str(p.state), "gone_at": went,
             "last_seen": p.issued_at}
            for pid, (went, p) in sorted(self.gone.items(), key=lambda item: -item[1][0])
        ]

    def changes_of(self, peer_id: str | None = None, limit: int = 100) -> list[dict]:
        """The latest changes (of one peer, or all), oldest first."""
        picked = [c for c in self.changes if peer_id is None or c.peer_id == peer_id]
        return [c.as_dict() for c in picked[-limit:]]

    def rate_of(self, peer_id: str) -> dict | None:
        series = self.rates.get(peer_id)
        return series.as_dict() if series is not None else None

