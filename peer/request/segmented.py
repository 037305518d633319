"""A route with tensor-shard group hops, as the requester drives it: segments joined at the requester.

A route such as ``peer A [0, 10) -> group G [10, 20) -> peer B [20, 30)`` runs as
*segments*: each maximal run of plain hops is a `RouteSession` (its peers push
straight to each other, as in any route), and each group hop is a `GroupSession`.
The requester is the junction between segments: it takes A's output, scatters the
slices into G, gathers G's output slices — the compatibility gather, outside the
group's interval — and feeds B. Unsharded peers stay exactly as they are; the
price is one extra requester round trip at each group boundary.

`SegmentedSession` offers what `ResilientSession` (peer/request/repair.py) drives: `open`,
`submit`/`wait`/`step`/`cancel`, `close` — and its own `repair`. Steps run strictly
in order through one worker; the requester keeps the input of every segment, so
when a peer dies (a plain hop or any rank of a group) the failed segment's span
``[a, b)`` is re-routed as a whole — onto a replica, another group, or a mix — the
replacements are opened, fed the inputs of layer a for every position so far in
one prefill-shaped step, and spliced in; the other segments never notice. The
failed step is then sent again from its start, and every peer writes those
positions afresh, so the answer is the one an undisturbed run gives.
"""

from __future__ import annotations

import math
import os
import time
from typing import Union

import torch
import trio

from tessera.store import events
from tessera.peer.base.errors import PeerError, PeerFailed, SessionRefused
from tessera.peer.request.history import RouteHistory
from tessera.peer.request.chain import STEP_TIMEOUT_FLOOR, RouteSession
from tessera.peer.request.chain_state import RequesterContext, StepSlot
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.request.group import GroupSession
from tessera.peer.request.ports import REFUSED_BACKOFF, RepairPort


Segment = Union[RouteSession, GroupSession]
MAX_SEGMENT_REPAIRS = 6  # re-routes of one failed segment before the step is given up


def has_groups(route: Route) -> bool:
    return any(h.members for h in route.hops)


def build_segments(ctx: RequesterContext, route: Route, *, max_length: int) -> list[Segment]:
    """Runs of plain hops as route sessions, each group hop as a group session (not opened yet)."""
    segments: list[Segment] = []
    run: list[Hop] = []
    for hop in route.hops:
        if hop.members:
            if run:
                segments.append(RouteSession(ctx, Route(tuple(run), math.nan), max_length=max_length))
                run = []
            segments.append(GroupSession(ctx, hop, max_length=max_length))
        else:
            run.append(hop)
    if run:
        segments.append(RouteSession(ctx, Route(tuple(run), math.nan), max_length=max_length))
    return segments


def span_of(segment: Segment) -> tuple[int, int]:
    if isinstance(segment, GroupSession):
        return segment.hop.start, segment.hop.end
    return segment.route.hops[0].start, segment.route.hops[-1].end


def peers_of(segment: Segment) -> list[str]:
    if isinstance(segment, GroupSession):
        return segment.members
    return list(segment.route.peer_ids)


def hops_of(segment: Segment) -> list[Hop]:
    return [segment.hop] if isinstance(segment, GroupSession) else list(segment.route.hops)


async def open_segments(segments: list[Segment]) -> None:
    """Open every segment at once; on any failure close those that opened and raise the first error."""
    errors: list[PeerError] = []

    async def one(segment: Segment) -> None:
        try:
            await segment.open()
        except (PeerFailed, SessionRefused) as error:
            errors.append(error)

    async with trio.open_nursery() as nursery:
        for segment in segments:
            nursery.start_soon(one, segment)
    if errors:
        with trio.CancelScope(shield=True):
            for segment in segments:
                await segment.close("another segment of the route failed to open")
        raise errors[0]


class SegmentedSession:
    """A session over a route that contains group hops (see module docstring)."""

    def __init__(self, ctx: RequesterContext, route: Route, *, max_length: int) -> None:
        self.ctx = ctx
        self.route = route
        self.max_length = max_length
        self.session_id = os.urandom(16)
        self.segments = build_segments(ctx, route, max_length=max_length)
        self.inputs = RouteHistory(max_length, ctx.hidden_size)  # what entered each segment
        self.pending: dict[int, StepSlot] = {}
        self.failure: PeerFailed | None = None  # set by a failed step, cleared by `repair`
        self._queue_in, self._queue_out = trio.open_memory_channel[tuple[int, torch.Tensor, int]](math.inf)
        self._next_step = 0
        self._at: Segment | None = None  # the segment the worker is waiting on
        self._worker = trio.CancelScope()
        self.retired: list[Segment] = []  # segments replaced after a failure (closed)
        self.closed = False

    @property
    def hops(self) -> list[Hop]:
        return [h for s in self.segments for h in hops_of(s)]

    async def open(self) -> None:
        """Open every segment. Raises SessionRefused or PeerFailed (nothing stays open)."""
        await open_segments(self.segments)
        self.ctx.nursery.start_soon(self._work)
        self.ctx.tracer.emit(events.SessionOpen(session=self.session_id,
                                                route=[[h.peer_id, h.start, h.end] for h in self.route.hops],
                                                segments=len(self.segments), max_length=self.max_length))

    # -- stepping -------------------------------------------------------------------------

    async def submit(self, hidden: torch.Tensor, start_pos: int) -> tuple[int, StepSlot]:
        """Queue a step (steps run in order, one at a time). Raises PeerFailed if the route is broken."""
        if self.failure is not None:
            raise self.failure
        self._next_step += 1
        slot = self.pending[self._next_step] = StepSlot()
        slot.sent_at = time.perf_counter()
        self._queue_in.send_nowait((self._next_step, hidden, start_pos))
        return self._next_step, slot

    async def wait(self, step: int, slot: StepSlot, n: int, start_pos: int, *, hops: list[Hop] | None = None) -> torch.Tensor:
        """A queued step's output [T, H]. Raises PeerFailed naming the peer that failed."""
        try:
            with trio.move_on_after(self.step_timeout(n)) as waited:
                await slot.done.wait()
            if waited.cancelled_caught:
                at = self._at or self.segments[0]
                raise PeerFailed(peers_of(at)[0], f"step {step} timed out in the segment {span_of(at)}")
            if slot.error is not None:
                raise slot.error
            assert slot.value is not None
            self.ctx.tracer.emit(events.Result(session=self.session_id, step=step,
                                               duration=time.perf_counter() - slot.sent_at, start_pos=start_pos, n_tokens=n))
            return slot.value
        finally:
            self.pending.pop(step, None)

    async def step(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        step, slot = await self.submit(hidden, start_pos)
        return await self.wait(step, slot, hidden.shape[0], start_pos)

    async def cancel(self, step: int) -> None:
        """Drop a queued step that has not started (a started one runs to its end: a group
        cannot drop a step on some ranks and not others)."""
        self.pending.pop(step, None)

    def step_timeout(self, n: int) -> float:
        """A backstop: every segment's own deadline, back to back, plus the floor."""
        return STEP_TIMEOUT_FLOOR + sum(s.step_timeout(n) for s in self.segments)

    async def _work(self) -> None:
        with self._worker:
            async for step, hidden, start_pos in self._queue_out:
                slot = self.pending.get(step)
                if slot is None:
                    continue  # cancelled before it started
                if self.failure is not None:
                    slot.fail(self.failure)  # sent before the failure; the caller re-sends after repair
                    continue
                try:
                    slot.complete(await self._through(self.segments, hidden, start_pos))
                except PeerFailed as failure:
                    self.failure = failure
                    slot.fail(failure)
                except ValueError as gap:  # positions that skip past what was sent (a caller's bug): this step only
                    slot.fail(PeerError(f"step at position {start_pos}: {gap}"))

    async def _through(self, segments: list[Segment], x: torch.Tensor, start_pos: int) -> torch.Tensor:
        for segment in segments:
            self.inputs.at(span_of(segment)[0]).write(start_pos, x)
            self._at = segment
            x = await segment.step(x, start_pos)
        self._at = None
        return x

    # -- failover ---------------------------------------------------------------------------

    def _segment_of(self, peer: str) -> int:
        return next((k for k, s in enumerate(self.segments) if peer in peers_of(s)),
                    self.segments.index(self._at) if self._at in self.segments else 0)

    async def repair(self, resilient: RepairPort, failure: PeerFailed, position: int) -> Route:
        """Re-route the failed segment's span, rebuild its caches, splice it in; returns the new route.

        `position` = positions already answered (their inputs are replayed). Raises PeerFailed
        when no replacement holds after MAX_SEGMENT_REPAIRS tries, NoRoute when none exists.
        """
        started = time.perf_counter()
        resilient.ban(failure.peer, failure.reason)
        k = self._segment_of(failure.peer)
        a, b = span_of(self.segments[k])
        last: PeerError = failure
        for _ in range(MAX_SEGMENT_REPAIRS):
            chosen = await resilient.swarm.wait_for_route(resilient.route_wait, start=a, end=b, policy=resilient.policy)
            new = build_segments(self.ctx, chosen, max_length=self.max_length)
            try:
                await open_segments(new)
                if position > 0:
                    # one prefill-shaped step per new segment rebuilds its caches
                    await self._through(new, self.inputs.at(a).upto(position), 0)
            except SessionRefused as refused:
                resilient.ban(refused.peer, f"refused: {refused.code}", seconds=REFUSED_BACKOFF)
                last = refused
                continue
            except PeerFailed as failed:
                for segment in new:
                    self.ctx.nursery.start_soon(segment.close, "replacement abandoned")
                resilient.ban(failed.peer, failed.reason)
                last = failed
                continue
            old = self.segments[k]
            self.segments[k : k + 1] = new
            self.retired.append(old)
            self.ctx.nursery.start_soon(old.close, "replaced after a failure")
            break
        else:
            raise PeerFailed(getattr(last, "peer", failure.peer), f"could not repair layers [{a}, {b}): {last}")
        self.failure = None
        self.route = Route(tuple(self.hops), math.nan)
        self.ctx.tracer.emit(events.Failover(
            session=self.session_id, remote=failure.peer, duration=time.perf_counter() - started,
            reason=failure.reason[:200], position=position, replaced=[a, b],
            route=[[h.peer_id, h.start, h.end] for h in self.route.hops],
        ))
        return self.route

    # -- closing ------------------------------------------------------------------------------

    async def close(self, reason: str = "done") -> None:
        if self.closed:
            return
        self.closed = True
        self._worker.cancel()
        with trio.CancelScope(shield=True):
            for segment in self.segments:
                await segment.close(reason)
