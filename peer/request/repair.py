"""Keeping a generation alive while peers refuse, fail or vanish.

`ResilientSession` wraps a `RouteSession`. Opening routes around peers that
refuse (busy, draining). A step that fails — a reset stream (the peer's process
died), an error message, or a deadline derived from the route's advertised
speeds — is repaired and sent again:

1. The failed peer is banned for this requester (30 s, doubling per repeat, across answers).
2. Only the failed span [a, b) is re-routed — over one or several replacement
   peers, with any cut points (`route(start=a, end=b, source=upstream, sink=downstream)`).
3. The replacements are opened and linked among themselves; the downstream
   neighbour accepts the new incoming link; the replacements are fed, in ONE
   prefill-shaped step, the inputs of layer a for every position so far. The
   requester holds them: it fed layer 0 itself, and every other boundary from
   the taps (copies of each span's output). The replay stops at layer b
   (`stop_layer`), so peers downstream — whose caches are intact — see nothing.
4. The upstream neighbour is relinked to push to the first replacement.
5. The failed step is sent again from its start position; every peer writes
   those positions afresh (a write at p is a rollback to p), so the answer is
   the one an undisturbed run gives.

Two failures, adjacent or not, repair region by region; a replacement that
fails during repair is banned and the region re-routed.

Revocation (`Swarm.revoke`) is a failure the requester chooses: the peer is
denied by the requester's policy, told to drop the session (SessionRevoke),
marked failed, and the next step repairs around it by the steps above.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import trio

from tessera.store import events
from tessera.protocol.messages import Relink

from tessera.peer.base.errors import NoRoute, PeerError, PeerFailed, RouteLost, SessionRefused
from tessera.peer.request.policy import RequesterPolicy
from tessera.peer.request.chain_state import HopState, StepSlot, peer_bytes
from tessera.peer.request.chain import RouteSession, route_summary
from tessera.peer.plan.routing import Route
from tessera.peer.request.ports import REFUSED_BACKOFF, StepChecker, SwarmPort
from tessera.peer.request.segmented import SegmentedSession, has_groups


MAX_OPEN_ATTEMPTS = 5
MAX_REPAIRS_PER_STEP = 6  # a step is given up after this many repairs (each bans a peer)
# A live upstream peer's taps trail its pushes by one send; if they have not reached
# the failed step's position after this long, that peer is treated as failed too.
TAP_WAIT = 3.0
# A relink is one message and an ack from a live neighbour (which may dial the replacement).
RELINK_TIMEOUT = 10.0


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
                 policy: RequesterPolicy | None = None) -> None:
        self.swarm = swarm
        self.request_policy = policy  # narrows the requester's own policy for this answer
        self.max_length = max_length
        self.route_wait = route_wait
        self.current: RouteSession | None = None
        self.routes: list[Route] = []
        self.failovers = 0
        self.epoch = 0  # bumped by every repair: steps sent before it are superseded
        self.confirmed = 0  # positions [0, confirmed) have been answered
        # after a repair that rebuilt every later cache (a peer caught returning wrong
        # activations): the clean last-layer hidden states of the positions so far, so that
        # the generation loop can tell whether tokens it already gave out were affected
        self.rebuilt: torch.Tensor | None = None
        self.checker: StepChecker | None = None  # spot checks (peer/request/verify.py), if asked for

    @property
    def policy(self) -> RequesterPolicy:
        """Who may compute this answer, now: read at every routing, so a revocation counts at once."""
        return self.swarm.policy.narrowed(self.request_policy)

    def uses(self, peer: str) -> bool:
        """Whether `peer` computes a part of this answer now."""
        session = self.current
        if isinstance(session, SegmentedSession):
            return any(h.peer_id == peer or peer in h.members for h in session.hops)
        return session is not None and any(h.peer == peer for h in session.hops)

    async def revoke(self, peer: str) -> None:
        """Take `peer` out of this session now (its policy already denies it): it is told to drop
        the session and marked failed; the step waiting on it, or the next one, repairs around it."""
        session = self.current
        routes = session.segments if isinstance(session, SegmentedSession) else [session]
        for part in routes:
            if isinstance(part, RouteSession):  # a tensor-shard group's rank is not revoked mid-answer
                for state in [h for h in part.hops if h.peer == peer]:
                    await part.revoke_hop(state)

    def ban(self, peer: str, reason: str, *, seconds: float | None = None) -> None:
        if not self.policy.admits(peer):
            return  # revoked or denied: never used again by this answer anyway
        # the strikes live in the swarm's Backoff, so a peer failing again in a later answer
        # is banned for twice as long, not for BAN_BASE again
        duration = self.swarm.bans.register_failure(peer, self.swarm.clock(), seconds=seconds)
        self.swarm.ctx.tracer.emit(events.Ban(remote=peer, reason=reason[:200], seconds=duration))

    # -- opening ----------------------------------------------------------------------

    async def open(self) -> None:
        last_error: Exception | None = None
        for _ in range(MAX_OPEN_ATTEMPTS):
            chosen = await self.swarm.wait_for_route(self.route_wait, policy=self.policy)
            # a route with tensor-shard group hops runs in segments (peer/request/segmented.py)
            kind = SegmentedSession if has_groups(chosen) else RouteSession
            session = kind(self.swarm.ctx, chosen, max_length=self.max_length)
            try:
                await session.open()
            except SessionRefused as refused:
                self.ban(refused.peer, f"refused: {refused.code}", seconds=REFUSED_BACKOFF)
                last_error = refused
                continue
            except PeerFailed as failed:
                self.ban(failed.peer, failed.reason)
                last_error = failed
                continue
            self.current = session
            self.routes.append(chosen)
            return
        raise NoRoute(f"could not open a session after {MAX_OPEN_ATTEMPTS} routes: {last_error}")

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
        repairs = 0
        while output is None:
            repairs += 1
            if repairs > MAX_REPAIRS_PER_STEP:
                raise failure
            await self.repair(failure, pending.start_pos)
            try:
                output = await self.current.step(pending.hidden, pending.start_pos)
            except PeerFailed as error:
                failure = error
        self.confirmed = pending.start_pos + pending.hidden.shape[0]
        if self.checker is not None:
            await self.checker.after_step(self.confirmed)
        return output

    async def cancel(self, pending: "Pending") -> None:
        if self.current is not None and pending.epoch == self.epoch and pending.step is not None:
            await self.current.cancel(pending.step)

    async def repair(self, failure: PeerFailed, position: int, *, through_end: bool = False) -> None:
        """Replace every failed hop of the current session; `position` = positions already answered.

        `through_end`: the replay runs on through every later hop too, rebuilding their
        caches (after a peer was caught returning wrong activations, their inputs were wrong).
        """
        session = self.current
        assert session is not None
        if isinstance(session, SegmentedSession):  # tensor-shard groups: the failed segment is re-routed
            self.routes.append(await session.repair(self, failure, position))
            self.failovers += 1
            self.epoch += 1
            return
        started = time.perf_counter()
        self.ban(failure.peer, failure.reason)
        replaced: list[str] = []
        attempts = 0
        while True:
            failed = [i for i, h in enumerate(session.hops)
                      if h.failure or self.swarm.is_banned(h.peer) or not self.policy.admits(h.peer)]
            if not failed:
                break
            attempts += 1
            if attempts > MAX_REPAIRS_PER_STEP:
                raise PeerFailed(session.hops[failed[0]].peer, "could not repair the route")
            j = failed[-1]
            i = j
            while i - 1 in failed:
                i -= 1
            a = session.hops[i].hop.start
            if not await self.wait_inputs(session, a, position):
                upstream = session.hops[i - 1]
                upstream.failure = upstream.failure or "its taps stopped arriving"
                self.ban(upstream.peer, upstream.failure)
                continue
            try:
                new = await self.replace(session, i, j, position, through_end=through_end)
            except SessionRefused as refused:
                self.ban(refused.peer, f"refused: {refused.code}", seconds=REFUSED_BACKOFF)
                continue
            except PeerFailed as failed_peer:
                self.ban(failed_peer.peer, failed_peer.reason)
                continue
            replaced += [h.peer for h in new]
        self.failovers += 1
        self.epoch += 1
        session.route = Route(tuple(h.hop for h in session.hops), session.route.cost_ms)
        self.routes.append(session.route)
        self.swarm.ctx.tracer.emit(events.Failover(
            session=session.session_id, remote=failure.peer, duration=time.perf_counter() - started,
            reason=failure.reason[:200], position=position, replacements=replaced,
            route=[[h.hop.peer_id, h.hop.start, h.hop.end] for h in session.hops],
        ))

    async def wait_inputs(self, session: RouteSession, layer: int, position: int) -> bool:
        """Wait (briefly) until the inputs of `layer` are held for positions [0, position)."""
        with trio.move_on_after(TAP_WAIT):
            while session.history.known(layer) < position:
                await session.tap_arrived.wait()
        return session.history.known(layer) >= position

    async def replace(
        self, session: RouteSession, i: int, j: int, position: int, *, through_end: bool = False
    ) -> list[HopState]:
        """Re-route hops i..j (layers [a, b)), rebuild the replacements' caches, relink the neighbours."""
        hops = session.hops
        a, b = hops[i].hop.start, hops[j].hop.end
        up = hops[i - 1] if i > 0 else None
        down = hops[j + 1] if j + 1 < len(hops) else None
        dead = [h.peer for h in hops[i : j + 1]]
        try:
            chosen = await self.swarm.wait_for_route(
                self.route_wait, start=a, end=b, source=up.peer if up else None, sink=down.peer if down else None,
                exclude=dead, groups=False,  # replacements are chained peer to peer; groups need the requester
                policy=self.policy,
            )
        except NoRoute as lost:
            # mid-way, not at the start: the request failed in the swarm (HTTP 502), naming what is gone
            reasons = "; ".join(f"{h.peer}: {h.failure}" for h in hops[i : j + 1] if h.failure) or "failed"
            raise RouteLost(
                f"lost layers [{a}, {b}) mid-way ({reasons}) and no other peer took them within "
                f"{self.route_wait:g} s", lost.missing or [(a, b)],
            ) from None
        new, into, out = await session.open_hops(
            list(chosen.hops), prev=up.peer if up else None, next_=down.peer if down else None
        )
        try:
            if down is not None:
                # first, so that the link stream the last replacement opened is accepted at once
                await self.relink(session, down, Relink(
                    session.session_id, None, (), in_key=session.seal(out, down.peer), prev_peer=peer_bytes(new[-1].peer),
                ))
            if through_end and up is not None:
                await self.relink_up(session, up, new, into)
            if position > 0:
                # one prefill-shaped step rebuilds every replacement's KV cache; it stops at b
                # (or runs on to the end, rebuilding every later cache too)
                stop = self.swarm.spec.num_layers if through_end else b
                replayed = await session.run(
                    new[0], session.history.at(a).upto(position), 0, stop_layer=stop,
                    hops=list(chosen.hops), tap_from=new[-1].peer if down is not None and not through_end else None,
                )
                if through_end:
                    self.rebuilt = replayed  # the clean final hidden states of [0, position)
            if up is not None and not through_end:
                await self.relink_up(session, up, new, into)
        except BaseException:
            for state in new:
                session.ctx.nursery.start_soon(session.close_hop, state, "replacement abandoned")
            raise
        old = hops[i : j + 1]
        session.retired_attestations += [a for state in old for a in state.attested]
        session.hops[i : j + 1] = new
        for state in old:
            # in the background: a dead peer's stream may take a while to give up
            session.ctx.nursery.start_soon(session.close_hop, state, "replaced after a failure")
        return new

    async def relink_up(self, session: RouteSession, up: HopState, new: list[HopState], into: tuple[int, bytes]) -> None:
        await self.relink(session, up, Relink(
            session.session_id, peer_bytes(new[0].peer), self.swarm.keeper.addrs(new[0].peer),
            out_key=session.seal(into, up.peer),
        ))

    async def relink(self, session: RouteSession, state: HopState, msg: Relink) -> None:
        """Send a live neighbour its new link and wait for its ack. Raises PeerFailed."""
        acked = state.acked
        try:
            await state.channel.send(msg)
        except PeerError as error:
            raise PeerFailed(state.peer, f"relink: {error}") from None
        with trio.move_on_after(RELINK_TIMEOUT):
            await acked.wait()
        if state.failure is not None or not acked.is_set():
            raise PeerFailed(state.peer, f"relink not acknowledged: {state.failure or 'timeout'}")

    async def finish(self) -> None:
        """The answer is complete: run the closing spot check over what no check covered
        (a peer caught now still leads to a repair, so the caller can tell whether tokens
        already given out were affected)."""
        if self.checker is not None and self.checker.policy.final_check:
            await self.checker.final(self.confirmed)

    async def close(self) -> None:
        if self.checker is not None:
            await self.checker.close()
        if self.current is not None:
            await self.current.close()

    def summary(self) -> dict:
        checks = {"checks": self.checker.summary()} if self.checker is not None else {}
        return {**checks,
            "route": route_summary(self.routes[-1]) if self.routes else [],
            "routes": [route_summary(r) for r in self.routes],
            "failovers": self.failovers,
        }
