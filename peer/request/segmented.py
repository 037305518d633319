"""A route with tensor-shard group hops, as the requester drives it: segments joined at the requester.

A route such as ``peer A [0, 10) -> group G [10, 20) -> peer B [20, 30)`` runs as
*segments*: each maximal run of plain hops is a `RouteSession` (its peers push
straight to each other, as in any route), and each group hop is a `GroupSession`.
The requester is the junction between segments: it takes A's output, scatters the
slices into G, gathers G's output slices — the compatibility gather, outside the
group's interval — and feeds B. Unsharded peers stay exactly as they are; the
price is one extra requester round trip at each group boundary.

`SegmentedSession` is a `RouteRun` (peer/request/ports.py): what `ResilientSession`
(peer/request/repair.py) drives — `open`, `submit`/`wait`/`step`/`cancel`, `close` — and
what its one repair loop needs: the segments, `splice`, `repaired`, `replay_after`. Steps
run strictly in order through one worker; every segment keeps the inputs it was sent, so
when a peer dies (a plain hop or any rank of a group) the repair loop has the failed
segment replace it: a run of plain hops is patched in place, between its live
neighbours, as in any route; a group's span ``[a, b)`` is re-routed as a whole — onto a
replica, another group, or a mix — and the replacements are fed the inputs of layer a
for every position so far in one prefill-shaped step and spliced in. The other segments
never notice. The failed step is then sent again from its start, and every peer writes
those positions afresh, so the answer is the one an undisturbed run gives.
"""

from __future__ import annotations

import math
import os
import time
from typing import Mapping

import torch
import trio

from tessera.store import events
from tessera.peer.base.backoff import Failure
from tessera.peer.base.errors import PeerError, PeerFailed, SessionRefused
from tessera.peer.request.chain import STEP_TIMEOUT_FLOOR, RouteSession
from tessera.peer.request.chain_state import RequesterContext, StepSlot, began_before
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.request.group import GroupSession
from tessera.peer.request.ports import Replacement, RouteRun, Segment


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
    return segment.span


def session_for(ctx: RequesterContext, route: Route, *, max_length: int) -> RouteRun:
    """The session that carries `route` (not opened yet): a route of plain hops is one
    segment, driven directly; one with tensor-shard groups runs in segments."""
    if has_groups(route):
        return SegmentedSession(ctx, route, max_length=max_length)
    return RouteSession(ctx, route, max_length=max_length)


async def run_through(segments: list[Segment], x: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Feed `x` (positions [start_pos, start_pos + T)) through `segments` in order; their output."""
    for segment in segments:
        x = await segment.step(x, start_pos)
    return x


async def open_segments(segments: list[Segment], max_waits: Mapping[str, float] | None = None) -> None:
    """Open every segment at once (each as its `open` says, given `max_waits`); on any failure close
    those that opened and raise the first error."""
    errors: list[PeerError] = []

    async def one(segment: Segment) -> None:
        try:
            await segment.open(max_waits=max_waits)
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
        return [h for s in self.segments for h in s.route_hops]

    async def open(self, *, began: float | None = None, max_waits: Mapping[str, float] | None = None) -> None:
        """Open every segment. Raises SessionRefused or PeerFailed (nothing stays open). `began`:
        when (trio's clock) the answer this session carries began, traced with the open;
        `max_waits`: as RouteSession.open's, for the plain segments."""
        await open_segments(self.segments, max_waits)
        self.ctx.nursery.start_soon(self._work)
        self.ctx.tracer.emit(events.SessionOpen(session=self.session_id, began_before=began_before(began),
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
                raise PeerFailed(at.peers[0], f"step {step} timed out in the segment {at.span}", Failure.TIMED_OUT)
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
        for segment in segments:  # each keeps the inputs it is sent
            self._at = segment
            x = await segment.step(x, start_pos)
        self._at = None
        return x

    # -- repair (the loop that calls these: ResilientSession.repair) ----------------------

    def splice(self, segment: Segment, replacement: Replacement) -> None:
        if replacement.segments == [segment]:
            return  # patched in place
        k = self.segments.index(segment)
        self.segments[k : k + 1] = replacement.segments
        self.retired.append(segment)
        self.ctx.nursery.start_soon(segment.close, "replaced after a failure")

    def repaired(self) -> Route:
        self.failure = None  # steps may be queued again
        self.route = Route(tuple(self.hops), math.nan)
        return self.route

    async def replay_after(self, segments: list[Segment], hidden: torch.Tensor) -> torch.Tensor:
        k = self.segments.index(segments[-1]) + 1
        return await self._through(self.segments[k:], hidden, 0)

    # -- closing ------------------------------------------------------------------------------

    async def close(self, reason: str = "done") -> None:
        if self.closed:
            return
        self.closed = True
        self._worker.cancel()
        with trio.CancelScope(shield=True):
            for segment in self.segments:
                await segment.close(reason)
