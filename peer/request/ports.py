"""The requester's ports: what its parts need of each other, as small Protocols.

The swarm client (`Swarm`) and the session that repairs a generation (`ResilientSession`)
depend on these interfaces, not on each other's classes, so the request layer has no import
cycle: `SwarmPort` (the `Swarm`, which imports the session it drives), `Segment` and `RouteRun`
(two implementations each), and `Checkable` (what the spot checker reads of a chain).

A route runs as **segments** (`Segment`): a chain of plain hops whose peers push to each
other (`RouteSession`, peer/request/chain.py) or one tensor-shard group the requester
scatters into and gathers from (`GroupSession`, peer/request/group.py). The requester feeds
every segment's first layer and reads its last, so it holds every segment's inputs. A route
of plain hops is one segment, driven directly; a route with groups is several, joined at the
requester (`SegmentedSession`, peer/request/segmented.py). Both are a `RouteRun`.

Who decides. ONE place decides what happens after a failure — whom to ban, how long to wait,
which route replaces what, what is replayed: `ResilientSession` (peer/request/repair.py).
Below it nothing calls back up. A segment *reports* (`failed_run`: which of its hops failed;
`failures`: what each reported; `gap`: the span that must be routed again, and between
which ends) and *offers* (`open`, `patch`: replacements for a run of its hops on a route it is
given, rebuilt from the history it holds; `inputs`: what rebuilds a segment put in its place).
The spot checker (peer/request/verify.py) reports a conviction; the session bans and repairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import torch

from tessera.peer.base.backoff import Bans
from tessera.protocol.attest import MisbehaviourReport
from tessera.protocol.records import LoadReport
from tessera.stages.families.spec.model import ModelSpec

from tessera.peer.base.errors import PeerFailed
from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.plan.cost import Spread
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.plan.view import SwarmView
from tessera.peer.request.dispute import SpanWeights
from tessera.peer.request.chain_state import AttestedStep, HopState, RequesterContext, StepSlot
from tessera.peer.request.history import RouteHistory
from tessera.peer.request.policy import RequesterPolicy

@dataclass(frozen=True)
class CheckPolicy:
    """rate: fraction of steps checked; final_check: check the rest when the session ends."""

    rate: float = 0.1
    seed: int | None = None
    final_check: bool = True


class SwarmPort(Protocol):
    """What a generation's session and its spot checker use of the `Swarm` that opened them."""

    ctx: RequesterContext
    spec: ModelSpec
    keeper: ViewKeeper
    peer_id: str
    model_id: str
    bans: Bans  # who this requester avoids, why, and until when on `clock`; kept across answers
    policy: RequesterPolicy  # who may compute this requester's answers
    clock: Callable[[], float]  # the clock `bans` runs on
    span_weights: SpanWeights | None  # loads a disputed span's weights to recompute it (None: it cannot)
    dispute_memory: int  # bytes it may spend on that (peer/request/dispute.py DISPUTE_MEMORY)

    def view(self) -> SwarmView: ...

    def is_banned(self, peer: str) -> bool: ...

    def draw(self) -> Spread | None: ...  # the next draw of the requester's seeded routing stream

    async def ask_loads(self, peers: Sequence[str]) -> None: ...  # ping them: their echoes say their load

    async def wait_for_route(self, timeout: float = ..., **plan_args) -> Route: ...

    def covered_but_busy(self, **plan_args) -> bool: ...  # only busy peers block a route (a queue to wait in)

    async def publish_report(self, report: MisbehaviourReport) -> int: ...


@dataclass
class Replacement:
    """What replacing a segment's failed hops produced.

    segments: what now carries the segment's span, in order (`[segment]` itself when it was
    patched in place). peers: the peers brought in. replayed: when the replay of the inputs
    so far ran (positions [0, position) > 0), the hidden states where it stopped — the end of
    `segments` for a `through_end` repair, else None.
    """

    segments: list[Segment]
    peers: list[str]
    replayed: torch.Tensor | None = None


@dataclass(frozen=True)
class Gap:
    """What a segment's failed hops leave to be routed again: layers [start, end), entered from
    `source` and left to `sink` (None: this requester), avoiding `exclude` (the segment's live
    peers: a peer runs one hop of a session). `in_place`: the segment patches itself onto a
    route for the gap (`Segment.patch`: a chain relinks its live neighbours); else the gap is
    its whole span, and new segments built on the route take its place (a group cannot swap a
    rank). `groups`: tensor-shard groups may be hops of that route (only between this
    requester's ends). `why`: what the failed hops reported, for the error when no route comes."""

    start: int
    end: int
    source: str | None = None
    sink: str | None = None
    exclude: tuple[str, ...] = ()
    in_place: bool = True
    groups: bool = False
    why: str = "failed"


class Checkable(Protocol):
    """What the spot checker needs of a chain of plain hops (a `RouteSession`): who computed
    each span (and signed it), and the hidden states it held at every cut."""

    session_id: bytes
    hops: list[HopState]
    history: RouteHistory  # inputs of every hop, from the requester and the taps
    retired_attestations: list[AttestedStep]  # of hops a repair replaced

    async def wait_known(self, layer: int, position: int) -> bool: ...


class Segment(Protocol):
    """A piece of a route that the requester feeds at its first layer and reads at its last:
    a chain of plain hops (`RouteSession`) or one tensor-shard group (`GroupSession`).

    A segment records its own inputs (what the requester sent it), so whatever fails in it
    can be rebuilt from the requester's copy. It reports and offers; it decides nothing
    (the module docstring).
    """

    session_id: bytes

    @property
    def span(self) -> tuple[int, int]: ...  # layers [start, end)

    @property
    def route_hops(self) -> list[Hop]: ...  # as routed: each plain hop, or the one group hop

    @property
    def peers(self) -> list[str]: ...  # every peer computing in it (a group: its ranks)

    # max_waits (peer -> seconds): the queue each peer may have (RouteSession.open); a group ignores them
    async def open(self, *, max_waits: Mapping[str, float] | None = None) -> None: ...

    async def step(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor: ...

    def step_timeout(self, n_tokens: int) -> float: ...

    async def close(self, reason: str = "done") -> None: ...

    async def revoke(self, peer: str) -> None: ...

    def failed_run(self, is_out: Callable[[str], bool]) -> tuple[int, int] | None:
        """The last run [i, j] of `route_hops` that failed or whose peer `is_out`; None if none."""
        ...

    def failures(self, i: int, j: int) -> list[PeerFailed]:
        """What the peers of hops i..j reported or were seen to do (one per failed peer)."""
        ...

    async def inputs_ready(self, i: int, position: int) -> PeerFailed | None:
        """Wait (briefly) until the inputs of hop i are held for [0, position); else the failure
        of whoever should have delivered them (marked failed here; the repair loop bans it)."""
        ...

    def said(self) -> dict[str, LoadReport]:
        """What its peers said of their load as they accepted (peer -> report; a peer that said
        nothing is not in it)."""
        ...

    def gap(self, i: int, j: int) -> Gap:
        """What replacing hops i..j needs routed (see `Gap`)."""
        ...

    def inputs(self, position: int) -> torch.Tensor:
        """The hidden states this segment was fed at its first layer, positions [0, position)."""
        ...

    async def patch(self, i: int, j: int, route: Route, position: int, *, through_end: bool = False,
                    room: float | None = None) -> Replacement:
        """Put `route` (for `gap(i, j)`) in place of hops i..j: open it, relink the live
        neighbours, rebuild the replacements' caches from the inputs of positions [0, position).
        `through_end`: the replay also runs on through this segment's later hops. `room`: replay
        only on replacements that said a step would wait at most this long (else SessionRefused,
        busy). Only for a gap `in_place`. Raises SessionRefused or PeerFailed (what it opened is
        closed again)."""
        ...

    def checkable(self) -> Checkable | None:
        """What the spot checker compares, or None with the reason in the implementation."""
        ...


class RouteRun(Protocol):
    """A whole route's session, as `ResilientSession` drives it: a `RouteSession` (a route of
    plain hops: one segment) or a `SegmentedSession` (a route with groups)."""

    session_id: bytes
    route: Route
    pending: dict[int, StepSlot]

    @property
    def segments(self) -> list[Segment]: ...

    async def open(self, *, began: float | None = None, max_waits: Mapping[str, float] | None = None) -> None: ...

    async def submit(self, hidden: torch.Tensor, start_pos: int) -> tuple[int, StepSlot]: ...

    async def wait(self, step: int, slot: StepSlot, n: int, start_pos: int) -> torch.Tensor: ...

    async def step(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor: ...

    async def cancel(self, step: int) -> None: ...

    async def close(self, reason: str = "done") -> None: ...

    def splice(self, segment: Segment, replacement: Replacement) -> None:
        """Put `replacement` where `segment` was (closing `segment` if it left)."""
        ...

    def repaired(self) -> Route:
        """The route after a repair (steps may be sent again)."""
        ...

    async def replay_after(self, segments: list[Segment], hidden: torch.Tensor) -> torch.Tensor:
        """Feed `hidden` (positions [0, T)) through every segment after `segments`; the output at
        the route's end (a `through_end` repair rebuilding every later cache)."""
        ...
