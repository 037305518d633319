"""Waiting for a route: what blocks one, said to a person, and bringing back the peers whose
return would end the wait.

A requester asks its `Swarm` for a route (`Swarm.wait_for_route`); when routing finds none,
the wait here re-plans on every change that could give one — the view changed, a ban or a
skip ended, a banned peer that dropped or timed out answers a probe (a comeback), the only
cover of a missing span is due its one parole in this wait (peer/base/backoff.py) — and
refreshes the view after each wake. When it gives up, NoRoute names the layers nobody usable
covers and, for each peer that is there but not usable, why (`why_no_route`). A repair that
finds only busy peers in its way waits in their queue instead (`covered_but_busy`).

A probe of a banned peer is one ping of the requester's `Pinger` (peer/net/pinger.py): a stream
and one round trip, dialling the peer's advertised addresses if the old connection died with the
old process (a restarted peer listens on a new port), within PROBE_TIMEOUT.

The wait reads the requester's bans and view; it plans through the requester (`plan`, whose
memo and spread draws are the requester's) and refreshes through it (one refresh shared by
every waiting answer). Nothing here decides a route itself: peer/plan/routing.py does.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Sequence

import trio

from tessera.protocol.admission import MAX_SESSIONS_PER_REQUESTER
from tessera.store import events
from tessera.store.trace import Tracer

from tessera.peer.base.backoff import COMEBACK, PROBE_INTERVAL, PROBE_TIMEOUT, SOLE_PAROLE, Bans, Failure
from tessera.peer.base.errors import NoRoute
from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.net.transport import Transport
from tessera.peer.plan.routing import Route, covered_but_busy, why_no_route
from tessera.peer.plan.view import SwarmView
from tessera.peer.request.policy import RequesterPolicy, explain_gaps

log = logging.getLogger(__name__)

WAIT_REPORT_INTERVAL = 1.0  # how often a requester waiting for a route says what it waits for


class RouteWait:
    """One requester's waiting for routes (see module docstring). `plan(**plan_args)` routes on
    the requester's view as it is now; `view()` is that view with the requester in it;
    `refresh()` pulls a fresher view and loads; `policy()` is who may compute its answers now
    (a revocation narrows it); `at_own_limit()` the peers holding as many of its sessions as
    one admits; `clock` what `bans` run on; `ping` the requester's `Pinger.ping` (the RTT, or None)."""

    def __init__(self, *, keeper: ViewKeeper, bans: Bans, clock: Callable[[], float], transport: Transport,
                 tracer: Tracer, num_layers: int, plan: Callable[..., Route], view: Callable[[], SwarmView],
                 refresh: Callable[[], Awaitable[None]], refresh_interval: float,
                 policy: Callable[[], RequesterPolicy], at_own_limit: Callable[[], tuple[str, ...]],
                 ping: Callable[..., Awaitable[float | None]]) -> None:
        self.keeper = keeper
        self.bans = bans
        self.clock = clock
        self.transport = transport
        self.tracer = tracer
        self.num_layers = num_layers
        self.plan = plan
        self.view = view
        self.refresh = refresh
        self.refresh_interval = refresh_interval
        self.policy = policy
        self.at_own_limit = at_own_limit
        self.ping = ping

    async def wait(self, timeout: float, *, paroled: set[str] | None = None,
                   on_wait: Callable[[str], None] | None = None, **plan_args) -> Route:
        """A route, waiting up to `timeout` s (Swarm.wait_for_route says the rest); `on_wait`, if
        given, hears what it waits for once a second."""
        began = trio.current_time()
        next_report = began + WAIT_REPORT_INTERVAL
        with trio.move_on_after(timeout):
            while True:
                chosen = self.plan(**plan_args)
                if chosen.ok:
                    return chosen
                if await self.probe_comebacks(**plan_args):
                    continue  # someone is back: plan again at once
                sole = self._sole_covers(paroled, **plan_args) if paroled is not None else []
                if sole and await self.parole_sole_covers(sole, paroled):
                    continue
                wake = self.refresh_interval
                now = self.clock()
                ban_ends = self.bans.next_end(now)
                if ban_ends is not None:
                    wake = min(wake, ban_ends - now)
                if self._awaited_comebacks(**plan_args):
                    wake = min(wake, PROBE_INTERVAL)
                for peer in sole:  # wake when a parole falls due (probed again every PROBE_INTERVAL)
                    wake = min(wake, max(self.bans.sole_parole_at(peer) - now, 0.0) or PROBE_INTERVAL)
                if on_wait is not None:
                    now = trio.current_time()
                    if now >= next_report:
                        on_wait(f"waiting for a route ({now - began:.0f} s of {timeout:.0f} s): "
                                + self.why_no_route(**plan_args)[1])
                        next_report = now + WAIT_REPORT_INTERVAL
                    wake = min(wake, next_report - now)
                with trio.move_on_after(wake):
                    await self.keeper.wait_changed()
                await self.refresh()
        gaps, why = self.why_no_route(**plan_args)
        raise NoRoute(f"no route through the swarm after {timeout:.0f} s: {why}", gaps)

    # -- what blocks a route ------------------------------------------------------------

    def why_no_route(self, *, start: int = 0, end: int | None = None, exclude: Sequence[str] = (),
                     policy: RequesterPolicy | None = None, **_: object) -> tuple[list[tuple[int, int]], str]:
        """The uncovered layers, and a sentence saying what blocks a route: layers only peers
        the policy excludes cover (request/policy.py `explain_gaps`), else routing.why_no_route."""
        now = self.clock()
        banned = {peer: self._avoided_words(peer, now) for peer in self.bans.banned(now)}
        view = self.keeper.snapshot()
        policy = self.policy().narrowed(policy)
        if policy.restricts:
            gaps, why = explain_gaps(view.without(set(banned) | set(exclude)), policy)
            if gaps:
                return gaps, why
        # the other peers excluded hold this session already (a repair's live neighbours)
        held = {p: "in this session" for p in exclude if p not in banned}
        held |= {p: f"holds {MAX_SESSIONS_PER_REQUESTER} of this requester's sessions, the most it admits"
                 for p in self.at_own_limit() if p not in banned and p not in held}
        return why_no_route(view, start=start, end=end, banned=banned | held)

    def covered_but_busy(self, *, start: int = 0, end: int | None = None, exclude: Sequence[str] = (),
                         policy: RequesterPolicy | None = None, **_: object) -> bool:
        """Whether what blocks a route over [start, end) is only busy peers: peers this requester
        skips for a refusal (busy, full: Failure.REFUSED, no strike) or that advertise every slot
        taken cover every layer (peer/plan/routing.py `covered_but_busy`): a queue to wait in."""
        now = self.clock()
        avoided = {p for p in self.bans.banned(now) if self.bans.failure(p) is not Failure.REFUSED}
        view = self.policy().narrowed(policy).apply(self.view(), keep=(self.transport.peer_id,))
        return covered_but_busy(view, start=start, end=end, avoided=avoided | set(exclude))

    def _avoided_words(self, peer: str, now: float) -> str:
        """Why `peer` is avoided, for a person: 'refused a session: skipped for 3 s more',
        'banned (timed-out) for 25 s more'."""
        left = max(0.0, self.bans.until(peer) - now)
        failure = self.bans.failure(peer)
        if failure is Failure.REFUSED:
            return f"refused a session: skipped for {left:.0f} s more"
        return f"banned ({failure.value if failure else 'failed'}) for {left:.0f} s more"

    # -- peers whose return would give a route --------------------------------------------

    def _awaited_comebacks(self, *, start: int = 0, end: int | None = None, exclude: Sequence[str] = (),
                           policy: RequesterPolicy | None = None, **_: object) -> list[str]:
        """Banned peers that dropped or timed out, admitted by the policy, whose latest record
        serves some layer of [start, end): those whose return would give a route."""
        end = self.num_layers if end is None else end
        now = self.clock()
        policy = self.policy().narrowed(policy)
        view = self.keeper.snapshot()
        out = []
        for peer in self.bans.banned(now):
            avoided = self.bans.why.get(peer)
            info = view.get(peer)
            if (avoided is not None and avoided.failure in COMEBACK and info is not None and info.routable
                    and info.start < end and start < info.end and peer not in exclude and policy.admits(peer)):
                out.append(peer)
        return out

    async def probe_comebacks(self, **plan_args) -> bool:
        """Probe the awaited comebacks (`_awaited_comebacks`) that have signed a new record since
        they failed — a restarted peer advertises again, a resumed one re-signs its record —
        and were not probed in the last PROBE_INTERVAL; parole those that answer (their bans
        end, their strikes stay: peer/base/backoff.py). Returns whether any was paroled."""
        now = self.clock()
        view = self.keeper.snapshot()
        fresh = [p for p in self._awaited_comebacks(**plan_args)
                 if view.get(p).issued_at > self.bans.why[p].mark]
        due = self.bans.comeback_candidates(now, fresh)
        if not due:
            return False
        back = await self._answering(due, now)
        for peer in back:
            if self.bans.parole(peer, self.clock()):
                self.tracer.emit(events.Parole(remote=peer, failure=self.bans.why[peer].failure.value))
        return bool(back)

    def _sole_covers(self, paroled: set[str], *, start: int = 0, end: int | None = None,
                     exclude: Sequence[str] = (), policy: RequesterPolicy | None = None, **_: object) -> list[str]:
        """Banned peers (for a failure that allows it: backoff.SOLE_PAROLE) that had no parole in
        this wait, admitted by the policy, whose latest record serves some layer of [start, end)
        that no usable peer covers: the only covers of what is missing (sorted)."""
        now = self.clock()
        policy = self.policy().narrowed(policy)
        banned = [p for p in self.bans.banned(now) if self.bans.failure(p) in SOLE_PAROLE and p not in paroled
                  and p not in exclude and policy.admits(p)]
        if not banned:
            return []
        gaps, _ = self.why_no_route(start=start, end=end, exclude=exclude, policy=policy)
        view = self.keeper.snapshot()
        out = []
        for peer in banned:
            info = view.get(peer)
            if info is not None and info.routable and any(info.start < b and a < info.end for a, b in gaps):
                out.append(peer)
        return sorted(out)

    async def _answering(self, due: list[str], now: float) -> list[str]:
        """Those of `due` (banned peers whose probe is due) that answer a probe now, all probed at
        once and marked probed at `now`; sorted, so that paroles go in one order every run."""
        back: list[str] = []

        async def probe(peer: str) -> None:
            if await self.ping(peer, addrs=self.keeper.addrs(peer), timeout=PROBE_TIMEOUT) is not None:
                back.append(peer)

        for peer in due:
            self.bans.probed(peer, now)
        async with trio.open_nursery() as nursery:
            for peer in due:
                nursery.start_soon(probe, peer)
        return sorted(back)

    async def parole_sole_covers(self, sole: list[str], paroled: set[str]) -> bool:
        """Probe those of `sole` whose parole is due (peer/base/backoff.py `Bans.sole_parole_due`);
        parole those that answer, once in this wait (`paroled`). Returns whether any was paroled."""
        now = self.clock()
        due = [p for p in sole if self.bans.sole_parole_due(p, now)]
        if not due:
            return False
        back = await self._answering(due, now)
        for peer in back:
            failure = self.bans.failure(peer)
            if failure is not None and self.bans.parole(peer, self.clock(), sole=True):
                paroled.add(peer)
                log.info("paroling peer %s once (banned %s): the only cover of layers this answer needs", peer,
                         failure.value)
                self.tracer.emit(events.Parole(remote=peer, failure=failure.value))
        return bool(back)


__all__ = ["RouteWait", "WAIT_REPORT_INTERVAL"]
