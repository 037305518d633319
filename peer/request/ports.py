"""The requester's ports: what its parts need of each other, as small Protocols.

The swarm client (`Swarm`), the session that repairs a generation (`ResilientSession`),
the spot checker (`SpotChecker`) and the segmented route each depend on these interfaces,
not on each other's classes, so the request layer has no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from tessera.peer.base.backoff import Backoff
from tessera.protocol.attest import MisbehaviourReport
from tessera.stages.spec import ModelSpec

from tessera.peer.base.errors import PeerFailed
from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.plan.routing import Route
from tessera.peer.plan.view import SwarmView
from tessera.peer.request.chain_state import RequesterContext
from tessera.peer.request.chain import RouteSession

# A peer that refused (busy, draining) is skipped for this long by this requester.
REFUSED_BACKOFF = 10.0
# A peer that failed is banned for this long, doubling with each further failure (peer/base/backoff.py).
BAN_BASE = 30.0
BAN_CAP = 3600.0


@dataclass
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
    bans: Backoff  # who this requester avoids, and until when on `clock`; kept across answers
    clock: Callable[[], float]  # the clock `bans` runs on

    def view(self) -> SwarmView: ...

    def is_banned(self, peer: str) -> bool: ...

    async def wait_for_route(self, timeout: float = ..., **plan_args) -> Route: ...

    async def publish_report(self, report: MisbehaviourReport) -> int: ...


class RepairPort(Protocol):
    """What the spot checker and a segmented route use of the session that repairs a generation."""

    swarm: SwarmPort
    max_length: int
    route_wait: float
    current: RouteSession | None
    confirmed: int

    def ban(self, peer: str, reason: str, *, seconds: float | None = None) -> None: ...

    async def repair(self, failure: PeerFailed, position: int, *, through_end: bool = False) -> None: ...

    async def wait_inputs(self, session: RouteSession, layer: int, position: int) -> bool: ...


class StepChecker(Protocol):
    """What the repairing session asks of its spot checker (a `SpotChecker`)."""

    policy: CheckPolicy

    async def after_step(self, end_pos: int) -> None: ...

    async def final(self, end_pos: int) -> None: ...

    async def close(self) -> None: ...

    def summary(self) -> dict: ...
