"""Keeping a generation alive while peers refuse, fail or vanish: the one place that decides.

`ResilientSession` wraps a route's session — a `RouteSession` for a route of plain
hops, a `SegmentedSession` for one with tensor-shard groups; both are a `RouteRun`
made of `Segment`s (peer/request/ports.py). It alone decides what happens after a
failure: whom to ban and for how long, how long to wait for a route, which route
replaces what, what is spliced in and what is replayed. The segments below it report
(which hops failed, what each reported, the span left to route) and offer (open a
route in place of hops, rebuild from the history they hold); the spot checker reports
a conviction; nothing below calls back up.

Opening routes around peers that refuse (busy, draining). A step that fails — a reset
stream (the peer's process died), an error message, or a deadline derived from the
route's advertised speeds — is repaired by ONE loop (`repair`) and sent again:

1. The failed peer is avoided by this requester as its failure says (peer/base/backoff.py:
   a peer that dropped or timed out is banned, doubling per repeat across answers, but
   re-probed and used again if it comes back while the route is awaited; a refusal —
   busy, draining — is no failure: that peer is skipped for its retry-after, and another
   tried; a liar is banned for a day).
2. Each segment is asked for its last run of failed hops (`failed_run`) and what they
   reported (`failures`: each is banned as its own failure says), and for the span they
   leave (`gap`) [a, b): in a chain of plain hops, between its live neighbours, to be
   routed over one or several replacement peers with any cut points
   (`route(start=a, end=b, source=upstream, sink=downstream)`); a group's whole span,
   between the requester's ends. This loop routes it (`reroute`).
3. A chain patches itself onto that route (`RouteSession.patch`): the replacements are
   opened and linked among themselves; the downstream neighbour accepts the new incoming
   link; the replacements are fed, in ONE prefill-shaped step, the inputs of layer a for
   every position so far. The requester holds them: it fed each segment's first layer
   itself, and every other boundary from the taps (copies of each span's output). The
   replay stops at layer b (`stop_layer`), so peers downstream — whose caches are intact —
   see nothing. A group is replaced by new segments built on the route and rebuilt from the
   inputs it was sent (`rebuild`), then spliced in.
4. The upstream neighbour is relinked to push to the first replacement.
5. The failed step is sent again from its start position; every peer writes
   those positions afresh (a write at p is a rollback to p), so the answer is
   the one an undisturbed run gives.

Two failures, adjacent or not, repair region by region; a replacement that
fails during repair is banned and the region re-routed (tests/request/). All the waiting
for routes of one open or one repair shares ONE deadline, ROUTE_WAIT (the route wait
given) from its start: refusals retried elsewhere do not each get a fresh wait.

Revocation (`Swarm.revoke`) is a failure the requester chooses: the peer is
denied by the requester's policy, told to drop the session (SessionRevoke),
marked failed, and the next step repairs around it by the steps above.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

import torch
import trio

from tessera.store import events
from tessera.protocol.error_codes import QUEUE_LONGER

from tessera.peer.base.backoff import BUSY_WAIT, Failure
from tessera.peer.base.errors import (DisputeUndecided, NoRoute, OpenUnanswered, PeerError, PeerFailed, RouteLost,
                                      SessionRefused)
from tessera.peer.request.failures import refusal_failure
from tessera.peer.request.policy import RequesterPolicy
from tessera.peer.request.chain_state import StepSlot
from tessera.peer.request.chain import STEP_TIMEOUT_FLOOR
from tessera.peer.request.loads import no_room
from tessera.peer.plan.cost import Reported, Spread
from tessera.peer.plan.routing import Route
from tessera.peer.request.ports import Gap, Replacement, RouteRun, Segment, SwarmPort
from tessera.peer.request.segmented import build_segments, open_segments, run_through, session_for
from tessera.peer.request.verify import Conviction, SpotChecker


log = logging.getLogger(__name__)

# Routes tried to open a session, and replacements tried in one repair, before giving up; a
# refusal (busy, draining) or a leaving notice does not count: it bans no one, and the route
# wait bounds those.
MAX_OPEN_ATTEMPTS = 5
MAX_REPAIRS_PER_STEP = 6  # a step is given up after this many repairs of failures (each bans a peer)
# Repairs of sessions that peers took back for room (reclaimed while idle, handed back: REFUSED,
# no strike) count apart, against this bound: lack of room is not a failure, and each repair's
# route wait bounds it. Counted with the failures, replacements reclaimed in turn used the limit
# up at 50 requesters, load 0.8 (bench/load.py): 2 and 3 answers of 1,000 lost at seeds 2 and 3;
# counted apart, none.
MAX_REFUSED_REPAIRS_PER_STEP = 3 * MAX_REPAIRS_PER_STEP
# An open tells each peer the queue the route was priced with (plus BOUNCE_WAIT: `max_waits`); a
# peer whose step would wait longer refuses (QUEUE_LONGER), and the route is chosen again, now
# priced with what it said (many requesters that heard nothing yet pick the same peer at once:
# the first answer each gets is news). At most MAX_BOUNCES an open: then the route is taken as
# it is, queue and all. A refusal costs a round trip and no session (the hops likeliest to refuse
# are asked first: loads.py `open_order`), so an open may hear several. With 50 requesters at
# load 0.8 (bench/load.py, seed 1), idlest first: 2 bounces gave p90 85.8 s and 17.36 sessions an
# answer, 4 gave 65.3 s and 12.14, 8 60.7 s and 11.33, 16 57.0 s and 10.42; at load 0.5, seed 2,
# 2 gave 50.2 s and 9.67, 8 41.9 s and 8.32. With a full peer asked first, 8 against 16: load 0.8
# 52.7 s, 9.94 against 49.9 s, 9.04; with churn 59.0 s, 9.93 against 55.9 s, 9.84; load 0.5
# 31.2 s, 5.90 against 30.7 s, 5.75; 2 requesters never bounced that often (the same figures).
# BOUNCE_WAIT: a step's deadline floor (the slack every step has), as for REPLAY_ROOM below.
BOUNCE_WAIT = STEP_TIMEOUT_FLOOR
MAX_BOUNCES = 16
# Before an open, the peers of the route chosen whose word about their load is not fresh
# (peer/request/loads.py FRESH) are pinged, and the route chosen again with what they said; at
# most this many rounds (each costs a round trip; the second catches the peers a first re-route
# brought in).
MAX_LOAD_ASKS = 2
# A failover replays its history only on replacements that said, as they accepted, that a step
# would wait at most this long in their queue: the slack every step's deadline has (chain.py
# STEP_TIMEOUT_FLOOR). A replacement deep in other requesters' work is busy for this purpose:
# skipped for the wait it said, and another tried (a replay stuck in a queue stalls the answer,
# and on a busy peer times out and adds a failover).
REPLAY_ROOM = STEP_TIMEOUT_FLOOR


def max_waits(route: Route, priced: dict[str, Reported]) -> dict[str, float]:
    """The queue each plain hop of `route` may have for the route to be worth what routing priced
    it at (`priced`: peer -> Reported, what it knew): the wait it was priced with, plus BOUNCE_WAIT.
    A group's ranks are not asked (a group is routed as one hop, its ranks' queues unpriced)."""
    return {h.peer_id: (priced[h.peer_id].wait_ms / 1000.0 if h.peer_id in priced else 0.0) + BOUNCE_WAIT
            for h in route.hops if not h.members}


class Superseded(Exception):
    """A step was sent before a failover repaired the route; it must be sent again."""


class AnswerRewound(PeerError):
    """Tokens already given out were computed from a peer's wrong activations.

    `valid` of them are right; the clean computation continues with `token` instead.
    `Swarm.complete` recovers by regenerating from there; a streaming consumer decides.
    """

    def __init__(self, valid: int, token: int) -> None:
        super().__init__(f"a peer was caught returning wrong activations; the answer diverged after {valid} tokens")
        self.valid = valid
        self.token = token


@dataclass
class Pending:
    """A step in flight: what was sent, and how to wait for it."""

    hidden: torch.Tensor
    start_pos: int
    epoch: int
    step: int | None = None
    slot: StepSlot | None = None
    failure: PeerFailed | None = None


class ResilientSession:
    """A generation's session that survives peers refusing, dying and hanging."""

    def __init__(self, swarm: SwarmPort, *, max_length: int, route_wait: float,
                 busy_wait: float = BUSY_WAIT, policy: RequesterPolicy | None = None) -> None:
        self.swarm = swarm
        self.request_policy = policy  # narrows the requester's own policy for this answer
        self.max_length = max_length
        self.route_wait = route_wait
        # past the route wait, how long an open or repair keeps waiting while only busy peers
        # stand between it and a route (peer/base/backoff.py BUSY_WAIT: a full swarm is a queue)
        self.busy_wait = busy_wait
        self.current: RouteRun | None = None
        self.routes: list[Route] = []
        self.failovers = 0
        self.epoch = 0  # bumped by every repair: steps sent before it are superseded
        self.confirmed = 0  # positions [0, confirmed) have been answered
        # after a repair that rebuilt every later cache (a peer caught returning wrong
        # activations): the clean last-layer hidden states of the positions so far, so that
        # the generation loop can tell whether tokens it already gave out were affected
        self.rebuilt: torch.Tensor | None = None
        self.checker: SpotChecker | None = None  # spot checks (peer/request/verify.py), if asked for
        self.deadline = math.inf  # trio time when the current open's or repair's wait for routes gives up
        self.busy_deadline = math.inf  # ... and when it gives up though only busy peers block it
        self.paroled: set[str] = set()  # the only covers of a span paroled in the current wait
        self.spread: Spread | None = None  # the current open's or repair's draw of routing's spread
        self.routes_chosen = 0  # routes chosen in the current open or repair (each its own turn of the draw)
        self.avoided: Counter[str] = Counter()  # how often this answer avoided a peer, by Failure value

    @property
    def policy(self) -> RequesterPolicy:
        """Who may compute this answer, now: read at every routing, so a revocation counts at once."""
        return self.swarm.policy.narrowed(self.request_policy)

    def uses(self, peer: str) -> bool:
        """Whether `peer` computes a part of this answer now."""
        session = self.current
        return session is not None and any(peer in segment.peers for segment in session.segments)

    async def revoke(self, peer: str) -> None:
        """Take `peer` out of this session now (its policy already denies it): it is told to drop
        the session and marked failed; the step waiting on it, or the next one, repairs around it."""
        if self.current is not None:
            for segment in list(self.current.segments):
                await segment.revoke(peer)  # a group's rank is not revoked mid-answer: GroupSession.revoke

    def ban(self, peer: str, reason: str, *, failure: Failure, seconds: float | None = None) -> None:
        """Avoid `peer` as `failure` says (peer/base/backoff.py). A refusal skips it for `seconds`
        (its retry-after) and is traced as an error, not a ban."""
        if not self.policy.admits(peer):
            return  # revoked or denied: never used again by this answer anyway
        # the advertisement it had when it failed: a newer one is what proves a comeback
        info = self.swarm.keeper.snapshot().get(peer)
        # the strikes live in the swarm's Bans, so a peer failing again in a later answer
        # is banned for twice as long, not for BAN_BASE again
        duration = self.swarm.bans.register(peer, self.swarm.clock(), failure, seconds=seconds,
                                            mark=info.issued_at if info is not None else 0.0)
        self.avoided[failure.value] += 1
        # why, in the peer's own words (its error code and message) where it gave them: `-v` and the trace
        if failure is Failure.REFUSED:
            log.info("skipping peer %s for %g s (%s): %s", peer, duration, failure.value, reason)
            self.swarm.ctx.tracer.emit(events.Error(remote=peer, reason=f"{reason[:180]} (skipped {duration:g} s)"))
        else:
            log.info("banning peer %s for %g s (%s): %s", peer, duration, failure.value, reason)
            self.swarm.ctx.tracer.emit(events.Ban(remote=peer, reason=reason[:200], seconds=duration,
                                                  failure=failure.value))

    def answered(self, peers) -> None:
        """`peers` answered their opens: an open one of them ends unanswered later is a skip again."""
        for peer in peers:
            self.swarm.bans.answered_open(peer)

    def ban_for(self, error: SessionRefused | PeerFailed) -> Failure:
        """Avoid the peer an open or a repair failed on, as its failure says; returns the kind."""
        if isinstance(error, SessionRefused):
            self.swarm.bans.answered_open(error.peer)
            failure = refusal_failure(error.code)
            self.ban(error.peer, f"refused: {error.code}: {error.message}", failure=failure, seconds=error.retry_after)
        elif isinstance(error, OpenUnanswered):
            # out of room for unadmitted streams, or gone: a skip the first time, a strike the next
            failure = self.swarm.bans.unanswered_open(error.peer)
            self.ban(error.peer, error.reason, failure=failure)
        else:
            failure = error.failure
            self.ban(error.peer, error.reason, failure=failure)
        return failure

    def remaining(self) -> float:
        """Seconds left to wait for routes in the current open or repair (ROUTE_WAIT in all)."""
        return max(0.0, self.deadline - trio.current_time())

    def begin_wait(self) -> None:
        """An open or a repair starts: one route wait for all of it, one parole in it for the
        only cover of a span (peer/base/backoff.py), and one draw of the requester's seeded stream
        for routing's spread: the n-th route it chooses (after a refusal, a load asked, a bounce)
        uses that draw's n-th turn (Spread.again), so how many draws a run takes from the stream
        depends on its opens and repairs, not on how often each re-routed (a replay, whose timings
        differ a little, draws alike), and a re-route does not meet the same factors again."""
        self.deadline = trio.current_time() + self.route_wait
        self.busy_deadline = self.deadline + self.busy_wait
        self.paroled = set()
        self.spread = self.swarm.draw()
        self.routes_chosen = 0

    async def wait_for_route(self, **plan_args) -> Route:
        """A route within the current wait: chosen by this answer's policy and the next turn of the
        wait's draw (routing's spread), the only cover of a span paroled once."""
        spread = None if self.spread is None else self.spread.again(self.routes_chosen)
        self.routes_chosen += 1
        while True:
            try:
                return await self.swarm.wait_for_route(self.remaining(), policy=self.policy, spread=spread,
                                                       paroled=self.paroled, **plan_args)
            except NoRoute:
                now = trio.current_time()
                if now >= self.busy_deadline or not self.swarm.covered_but_busy(policy=self.policy, **plan_args):
                    raise
                # every layer is served, by peers that said busy: queue for another route wait
                log.info("every layer is covered by busy peers: waiting for room (%.0f s more at most)",
                         self.busy_deadline - now)
                self.deadline = min(now + self.route_wait, self.busy_deadline)

    # -- opening ----------------------------------------------------------------------

    async def open(self) -> None:
        """Open a session on a route, waiting up to the route wait for one; peers that refuse
        are skipped and others tried. Raises NoRoute."""
        last_error: Exception | None = None
        failures = bounces = asked = 0
        began = trio.current_time()  # the answer's start, traced with the open that carries it
        self.begin_wait()
        while failures < MAX_OPEN_ATTEMPTS:
            priced = self.swarm.ctx.loads.reported()  # what routing knows of the peers' queues
            chosen = await self.wait_for_route()
            stale = self.swarm.ctx.loads.stale([p for h in chosen.hops for p in (h.members or (h.peer_id,))])
            if stale and asked < MAX_LOAD_ASKS:
                # a ping is cheaper than a session: hear how busy they are now, and route again
                asked += 1
                await self.swarm.ask_loads(stale)
                continue
            # a route with tensor-shard group hops runs in segments (peer/request/segmented.py)
            session = session_for(self.swarm.ctx, chosen, max_length=self.max_length)
            limits = max_waits(chosen, priced) if bounces < MAX_BOUNCES and self.remaining() > 0 else None
            try:
                await session.open(began=began, max_waits=limits)
            except SessionRefused as error:
                if error.code == QUEUE_LONGER:
                    # a peer's queue is longer than the route was priced with: what it said is
                    # priced now (its refusal carried it: peer/request/loads.py), so the next
                    # route weighs it; no one is avoided
                    bounces += 1
                    log.info("routing again: %s", error)
                    continue
                failures += self.ban_for(error) is not Failure.REFUSED
                last_error = error
                continue
            except PeerFailed as error:
                failures += self.ban_for(error) is not Failure.REFUSED
                last_error = error
                continue
            self.answered(p for segment in session.segments for p in segment.peers)
            self.current = session
            self.routes.append(chosen)
            return
        raise NoRoute(f"could not open a session after {MAX_OPEN_ATTEMPTS} failed routes: {last_error}")

    # -- stepping ---------------------------------------------------------------------

    async def step(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        """One step through the chain, repaired and re-sent as often as peers fail."""
        return await self.wait(await self.submit(hidden, start_pos))

    async def submit(self, hidden: torch.Tensor, start_pos: int) -> "Pending":
        """Send a step without waiting; several may be in flight (speculative blocks)."""
        assert self.current is not None, "open() first"
        pending = Pending(hidden, start_pos, self.epoch)
        try:
            pending.step, pending.slot = await self.current.submit(hidden, start_pos)
        except PeerFailed as failure:
            pending.failure = failure  # repaired when waited for
        return pending

    async def wait(self, pending: "Pending") -> torch.Tensor:
        """A submitted step's output, repairing the route and re-sending as often as peers fail.

        Raises Superseded for a step sent before a repair that another step triggered:
        the caller re-sends it if it still wants it (speculative blocks are redrafted).
        """
        assert self.current is not None, "open() first"
        if pending.epoch != self.epoch:
            raise Superseded(f"step at position {pending.start_pos} was sent before a failover")
        failure = pending.failure
        output = None
        if failure is None:
            try:
                output = await self.current.wait(pending.step, pending.slot, pending.hidden.shape[0], pending.start_pos)
            except PeerFailed as error:
                failure = error
        repairs = refused = 0
        while output is None:
            if failure.failure is Failure.REFUSED:
                refused += 1
            else:
                repairs += 1
            if repairs > MAX_REPAIRS_PER_STEP or refused > MAX_REFUSED_REPAIRS_PER_STEP:
                raise failure
            await self.repair(failure, pending.start_pos)
            try:
                output = await self.current.step(pending.hidden, pending.start_pos)
            except PeerFailed as error:
                failure = error
        self.confirmed = pending.start_pos + pending.hidden.shape[0]
        for segment in self.current.segments:  # served: a later link reset of theirs is a skip again
            for peer in segment.peers:
                self.swarm.bans.served(peer)
        if self.checker is not None:
            await self.convicted(await self.checker.after_step(self.current, self.confirmed))
        return output

    async def convicted(self, convictions: list[Conviction]) -> None:
        """A spot check proved peers returned wrong activations: avoid each for a day and, if one
        computes a part of this answer, repair around it, replaying through to the end (every
        cache after it was built from its wrong outputs); `rebuilt` then holds the clean states.

        An unproven conviction (one side of a dispute nobody could decide: peer/request/dispute.py)
        avoids its peer as DISPUTED instead; if no route around it comes within the route wait, the
        answer ends with DisputeUndecided, naming both sides and why — never going on with either."""
        if not convictions:
            return
        failures = [PeerFailed(c.peer, c.reason, Failure.LIED if c.proven else Failure.DISPUTED) for c in convictions]
        used = [f for f in failures if self.uses(f.peer)]
        for failure in failures:
            if not used or failure is not used[0]:  # the repair bans the one it repairs for
                self.ban(failure.peer, failure.reason, failure=failure.failure)
        if not used:
            return
        try:
            await self.repair(used[0], self.confirmed, through_end=True)  # one repair replaces every banned hop
        except (RouteLost, PeerFailed) as lost:  # no route around them, or none that held
            unproven = next((c for c in convictions if not c.proven), None)
            if unproven is None:
                raise
            raise DisputeUndecided(f"{unproven.reason}; no other peer serves those layers, so the answer stops here "
                                   f"rather than go on with either ({lost})",
                                   lost.missing if isinstance(lost, RouteLost) else []) from None

    async def cancel(self, pending: "Pending") -> None:
        if self.current is not None and pending.epoch == self.epoch and pending.step is not None:
            await self.current.cancel(pending.step)

    def is_out(self, peer: str) -> bool:
        """Whether `peer` may no longer compute this answer: banned, revoked or denied."""
        return self.swarm.is_banned(peer) or not self.policy.admits(peer)

    def failed_segment(self) -> tuple[Segment, int, int] | None:
        """The last segment with failed hops, and its last run of them [i, j]."""
        assert self.current is not None
        for segment in reversed(self.current.segments):
            run = segment.failed_run(self.is_out)
            if run is not None:
                return segment, *run
        return None

    async def repair(self, failure: PeerFailed, position: int, *, through_end: bool = False) -> None:
        """Replace every failed hop of the current session; `position` = positions already answered.

        The one repair loop, for segments of any kind (module docstring). `through_end`: the
        replay runs on through every later hop too, rebuilding their caches (after a peer was
        caught returning wrong activations, their inputs were wrong); `rebuilt` then holds the
        clean last-layer hidden states of [0, position).
        Raises PeerFailed when the route cannot be repaired, RouteLost when a span has no peer.
        """
        session = self.current
        assert session is not None
        started = time.perf_counter()
        self.begin_wait()
        self.ban(failure.peer, failure.reason, failure=failure.failure)
        replaced: list[str] = []
        # room is asked of the replacements once a repair: a peer that said it had none is skipped
        # for the wait it said and another tried; after that the route found is taken as it is
        # (the only cover of a span, queue and all, is better than no answer)
        room: float | None = REPLAY_ROOM
        last: PeerError = failure
        attempts = 0
        while (found := self.failed_segment()) is not None:
            segment, i, j = found
            if attempts >= MAX_REPAIRS_PER_STEP:
                raise PeerFailed(getattr(last, "peer", failure.peer), f"could not repair the route: {last}",
                                 getattr(last, "failure", failure.failure))
            blamed = await segment.inputs_ready(i, position)
            if blamed is not None:
                self.ban(blamed.peer, blamed.reason, failure=blamed.failure)
                last = blamed
                attempts += 1
                continue
            for reported in segment.failures(i, j):
                if not self.swarm.is_banned(reported.peer):
                    # failed with the one being repaired (two at once): avoided as its own failure says
                    self.ban(reported.peer, reported.reason, failure=reported.failure)
            gap = segment.gap(i, j)
            try:
                chosen = await self.reroute(gap)
                if gap.in_place:
                    replacement = await segment.patch(i, j, chosen, position, through_end=through_end, room=room)
                else:
                    replacement = await self.rebuild(chosen, segment.inputs(position), position,
                                                     through_end=through_end, room=room)
                session.splice(segment, replacement)
                if through_end and replacement.replayed is not None:
                    self.rebuilt = await session.replay_after(replacement.segments, replacement.replayed)
            except (SessionRefused, PeerFailed) as error:
                attempts += self.ban_for(error) is not Failure.REFUSED
                last = error
                room = None
                continue
            self.answered(replacement.peers)
            replaced += replacement.peers
        self.failovers += 1
        self.epoch += 1
        route = session.repaired()
        self.routes.append(route)
        self.swarm.ctx.tracer.emit(events.Failover(
            session=session.session_id, remote=failure.peer, duration=time.perf_counter() - started,
            reason=failure.reason[:200], position=position, replacements=replaced,
            route=[[h.peer_id, h.start, h.end] for h in route.hops],
        ))

    # -- the pieces of a repair ------------------------------------------------------------

    async def reroute(self, gap: Gap) -> Route:
        """A route for what a segment's failed hops left (`gap`), waiting within the repair's
        route wait. Raises RouteLost (naming what failed) when none came in time."""
        try:
            return await self.wait_for_route(start=gap.start, end=gap.end, source=gap.source, sink=gap.sink,
                                             exclude=gap.exclude, groups=gap.groups)
        except NoRoute as lost:
            # mid-way, not at the start: the request failed in the swarm (HTTP 502), naming what is gone
            raise RouteLost(
                f"lost layers [{gap.start}, {gap.end}) mid-way ({gap.why}) and no other peer took them within "
                f"{self.route_wait:g} s: {lost}", lost.missing or [(gap.start, gap.end)],
            ) from None

    async def rebuild(self, chosen: Route, inputs: torch.Tensor, position: int, *,
                      through_end: bool = False, room: float | None = None) -> Replacement:
        """New segments on `chosen` (any mix of plain hops and groups, between the requester's
        ends), opened and fed `inputs` (positions [0, position)) in one step each: what takes
        the place of a segment that cannot patch itself (a group). `room`: as `Segment.patch`'s.
        Raises SessionRefused or PeerFailed (nothing stays open)."""
        new = build_segments(self.swarm.ctx, chosen, max_length=self.max_length)
        await open_segments(new)
        replayed = None
        try:
            if position > 0:
                for segment in new:
                    if room is not None:
                        no_room(segment.said(), room)
                # one prefill-shaped step per new segment rebuilds its caches
                out = await run_through(new, inputs, 0)
                replayed = out if through_end else None
        except BaseException:
            for segment in new:
                self.swarm.ctx.nursery.start_soon(segment.close, "replacement abandoned")
            raise
        return Replacement(new, [p for segment in new for p in segment.peers], replayed)

    async def finish(self) -> None:
        """The answer is complete: run the closing spot check over what no check covered
        (a peer caught now still leads to a repair, so the caller can tell whether tokens
        already given out were affected)."""
        if self.checker is not None and self.checker.policy.final_check:
            for _ in range(MAX_REPAIRS_PER_STEP):  # each round convicts a peer, or ends
                convictions = await self.checker.final(self.current, self.confirmed)
                if not convictions:
                    break
                await self.convicted(convictions)

    async def close(self) -> None:
        if self.checker is not None:
            await self.checker.close()
        if self.current is not None:
            await self.current.close()

    def summary(self) -> dict:
        checks = {"checks": self.checker.summary()} if self.checker is not None else {}
        return {**checks,
            "route": self.routes[-1].summary() if self.routes else [],
            "routes": [r.summary() for r in self.routes],
            "failovers": self.failovers,
        }
