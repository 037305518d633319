"""What peers have told this requester of their load, and how much of it still holds.

A peer's record changes its `load` only when it crosses a band (peer/net/gossip.py
`material`), so between records a requester learns of a peer's load from what already
flows between them (peer/serve/load.py): the echo of its pings, the accept of each session
it opens there, a refusal for lack of room, and the notice that a step of its is queued.
`LoadBook` keeps the latest of these per peer with when it came, and gives routing what
holds now (`reported`): the load as said, and the wait less the time since (the queue drains
at the peer's speed; a wait said 3 s ago of 5 s is 2 s now). A report older than REPORT_TTL
is dropped: the record's load is then the best there is.

What an open makes of it: the order in which a new route's hops are asked (`open_order`: a
full one first, then the idlest-looking), and whether replacements that said their queue have
room to replay a session's history (`no_room`).
"""

from __future__ import annotations

from typing import Callable, Mapping

from tessera.protocol.error_codes import BUSY
from tessera.protocol.records import LoadReport

from tessera.peer.base.errors import SessionRefused
from tessera.peer.plan.cost import Reported
from tessera.peer.plan.routing import Hop

# How long a peer's word about its load is used. A busy peer's queue turns over in a few of
# its steps (seconds on a CPU: peer/serve/load.py); after 30 s — a route wait, and ten of a
# requester's refreshes — what it said is history, and its record (re-signed when its load
# crosses a band) is the better guess.
REPORT_TTL = 30.0
# A peer's word younger than this is fresh: an open does not ping it first (`LoadBook.stale`). A
# requester pings the peers it is connected to every refresh (2 s: peer/request/client.py), so
# a peer it uses is fresh; one it has not heard from lately is asked before its answer goes there.
# 0.5 s was tried (bench/load.py, 100 peers, 1,000 answers): with 50 requesters at load 0.5
# without churn, fewer opens bounced off a queue they were not priced with (p90 lower at seeds
# 1-3: 30.1 -> 27.4 s at seed 1), but at 0.5 with churn and at 0.8 the 50 requesters did worse
# (seed 1, load 0.8: 991 -> 979 of 1,000 completed, 37.2 -> 40.5 sessions an answer): not kept.
FRESH = 2.0
# Waits are rounded to this (ms) before routing sees them, and loads to 1/LOAD_STEPS: routes
# are memoised per view and what routing reads (peer/request/client.py `Swarm.plan`), and
# differences this small never change a route worth having.
WAIT_ROUNDING_MS = 50.0
LOAD_STEPS = 32


class LoadBook:
    """The latest load report of each peer, on `clock` (see the module docstring)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.heard: dict[str, tuple[float, LoadReport]] = {}

    def report(self, peer: str, report: LoadReport | None) -> None:
        """`peer` said `report` (None: said nothing)."""
        if report is not None:
            self.heard[peer] = (self.clock(), report)

    def queued(self, peer: str, wait: float) -> None:
        """`peer` said a step of ours waits `wait` seconds in its queue: its wait, at least."""
        now = self.clock()
        said = self.heard.get(peer)
        if said is None:
            self.heard[peer] = (now, LoadReport(sessions=0, max_sessions=0, wait=wait))
        else:
            at, report = said
            left = max(0.0, report.wait - (now - at))
            if wait > left:
                self.heard[peer] = (now, LoadReport(report.sessions, report.max_sessions, report.waiting_opens,
                                                    report.steps_waiting, wait))

    def stale(self, peers: list[str] | tuple[str, ...]) -> list[str]:
        """Those of `peers` not heard from in the last FRESH seconds."""
        now = self.clock()
        return [p for p in peers if p not in self.heard or now - self.heard[p][0] > FRESH]

    def reported(self) -> dict[str, Reported]:
        """What routing prices now, per peer whose word still holds (rounded: see WAIT_ROUNDING_MS)."""
        now = self.clock()
        out: dict[str, Reported] = {}
        stale = []
        for peer, (at, report) in self.heard.items():
            age = now - at
            if age > REPORT_TTL:
                stale.append(peer)
                continue
            load = report.sessions / report.max_sessions if report.max_sessions > 0 else 0.0
            wait_ms = round(max(0.0, report.wait - age) * 1000.0 / WAIT_ROUNDING_MS) * WAIT_ROUNDING_MS
            load = round(load * LOAD_STEPS) / LOAD_STEPS
            if load > 0 or wait_ms > 0:
                out[peer] = Reported(load, wait_ms)
        for peer in stale:
            del self.heard[peer]
        return out


# -- what an open makes of it -------------------------------------------------------------------


def open_order(hops: list[Hop], reported: Mapping[str, Reported]) -> list[int]:
    """The order to open `hops` in one by one (their indices): those most likely to refuse first,
    so that a refusal costs no other peer a session. That is, first, a peer that said every slot
    of it was held (load 1): it admits only when a session ends or idles past its grace, else
    refuses busy after waiting for one, and asked last it did so with the others' sessions
    opened and held meanwhile, then closed unused (bench/load.py, 50 requesters at load 0.8,
    seed 1: 3,868 sessions closed so, beside 1,482 busy refusals). Then the idlest-looking: a
    peer this requester last heard was idle is where every other requester that heard the same
    is headed too, so it is the one whose queue most likely grew since (of the hops whose accept
    said a longer queue than priced, 99% had been priced with no wait and 75% as empty). Asking
    the busiest first instead did worse (the same run: 999/1000, p90 67.0 s, 11.97 sessions an
    answer, against 1000/1000, 52.7 s, 9.94 this way and 60.7 s, 11.33 idlest first alone)."""
    idle = Reported(0.0, 0.0)
    said = [reported.get(h.peer_id, idle) for h in hops]
    return sorted(range(len(hops)), key=lambda i: (said[i].load < 1.0, said[i].load, said[i].wait_ms, i))


def no_room(said: dict[str, LoadReport], room: float) -> None:
    """Raise SessionRefused(busy) for the first peer whose accept (`said`: peer -> its report)
    said a step would wait longer than `room` seconds (one that said nothing has room)."""
    for peer, report in said.items():
        if report.wait > room:
            raise SessionRefused(peer, BUSY, f"a step would wait {report.wait:.1f} s in its queue (more than "
                                 f"{room:g} s): no room to replay this session's history", retry_after=report.wait)


__all__ = ["LoadBook", "REPORT_TTL", "FRESH", "open_order", "no_room"]
