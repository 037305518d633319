"""What a `PeerNode` runs on, handed to it by whoever builds it.

A peer's lifecycle (peer/node/peer_node.py) is the same code whether it runs as a
volunteer's process or as one of a thousand simulated peers; what differs is what it
stands on, and that is given, not built, by the node:

- `NodeParts.open_transport`: libp2p (peer/node/compose.py) or the memory transport;
- `Compute`, the stage loader: real weights and torch (peer/node/torch_compute.py) or
  the simulator's cost model (peer/sim/peer.py);
- `clock`: what records and uptime are dated with (the wall clock, or trio's MockClock);
- `keeper`, `tracer`, `store`: the view, the trace and the sqlite store (None: nothing kept);
- `Pacing`: the jitter of the periodic tasks (a seeded RNG makes a simulation repeatable);
- `Placement`: where to claim and when to move (peer/plan/placement.py by default);
- `NodeWatch`: told of every change of state (the simulator's recorder listens).

The composition root that wires libp2p + sqlite + torch is peer/node/compose.py.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncContextManager, Awaitable, Callable, Mapping, Protocol

from tessera.protocol.keys import Identity
from tessera.stages.kernels.quant import Quant
from tessera.stages.families.spec.model import ModelSpec
from tessera.store.trace import Tracer

from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.net.transport import Transport
from tessera.peer.plan.placement import choose_span, plan_move
from tessera.peer.plan.view import PeerInfo, SwarmView

# Jitter of every periodic task (advertise, rebalance): +-20 %, so that peers started
# together do not act in lockstep.
JITTER = 0.2


class Compute(Protocol):
    """The stage loader: what a peer computes with, and how it loads a span."""

    spec: ModelSpec
    model_id: str  # advertised: the model's id, tagged with the quantization
    quant: Quant
    itemsize: int  # bytes per weight element of the compute dtype
    dtype_name: str  # "float32", ... (advertised)
    device_type: str  # "cpu", "cuda", "mps" (advertised)
    device_name: str  # for status and the start-up lines
    last_check: str | None  # what the last load's weight check did (peer/weights/verify.py), for the log

    def prepare(self) -> None: ...

    def memory_offered(self, memory_gb: float | None) -> int: ...

    def device_memory(self) -> dict | None: ...

    async def measure(self) -> float: ...

    async def load(self, start: int, end: int) -> Any: ...

    def serve_with(self, server: Any) -> None: ...

    def describe(self) -> str: ...


class Placement(Protocol):
    """Where a joining peer claims, and whether (and where) a serving one moves (sim/policies.py has more)."""

    moves: bool  # False: the periodic rebalance check is not run at all

    def claim(self, view: SwarmView, *, me: str, capacity_layers: int, throughput: float,
              rng: random.Random, held: tuple[tuple[int, int], ...] = ()) -> tuple[int, int]: ...

    def rebalance(self, snapshot: SwarmView, *, own: PeerInfo | None, me: str, span: tuple[int, int],
                  capacity_layers: int, throughput: float, rng: random.Random) -> tuple[int, int] | None: ...


class PlanPlacement:
    """A real peer's placement: `choose_span` to join, `plan_move` on each rebalance check."""

    name = "default"
    moves = True

    def claim(self, view, *, me, capacity_layers, throughput, rng, held=()):
        return choose_span(view, me=me, capacity_layers=capacity_layers, throughput=throughput, held=held)

    def rebalance(self, snapshot, *, own, me, span, capacity_layers, throughput, rng):
        # a real keeper merges the peer's own record at once: `snapshot` already holds `own`
        plan = plan_move(snapshot, me=me, capacity_layers=capacity_layers, throughput=throughput)
        return plan if plan is not None and plan != span else None


class Pacing:
    """When a peer's periodic tasks run: jittered periods, first phases, and the RNG of both."""

    def __init__(self, rng: random.Random | None = None, gossip_rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()
        self.gossip_rng = gossip_rng or random.Random()  # who gossip draws as neighbours and partners

    def jittered(self, period: float) -> float:
        return period * self.rng.uniform(1 - JITTER, 1 + JITTER)

    def first_ping(self, interval: float) -> float | None:
        """Seconds before the first ping round; None: at once (a real peer measures its neighbours now)."""
        return None

    def first_gossip(self, interval: float) -> float:
        """Seconds before the first gossip tick (the join already exchanged views)."""
        return interval


class NodeWatch:
    """Told of a node's changes, at the moment they happen; every method does nothing here."""

    def opened(self, node: Any) -> None:
        """Its transport is up: it listens (and gossips) from now on."""

    def state_changed(self, node: Any) -> None:
        """`node.state` was set."""

    def claimed(self, node: Any) -> None:
        """It claimed `node.span` on joining."""

    def moved(self, node: Any, old: tuple[int, int] | None, reason: str) -> None:
        """It gave up `old` for `node.span` (the new span loads next)."""

    def left(self, node: Any) -> None:
        """It left gracefully (drained, told the swarm)."""

    def closed(self, node: Any) -> None:
        """Its transport is about to close: it runs no more."""


class Weights(Protocol):
    """A volunteer's model files as the swarm sees them (peer/weights/): served to others, and
    a claimed span fetched from them when this machine lacks it."""

    def serve(self, transport: Transport) -> None: ...

    async def ensure(self, transport: Transport, span: tuple[int, int], out: Callable[[str], None], *,
                     holders: Callable[[], Mapping[str, tuple[str, ...]]] = dict) -> None:
        """Have `span`'s weights on disk, fetching what is missing from the connected peers and
        from `holders()` (peer id -> addresses: the view's peers that hold layers of the span;
        called only when something is missing — it reads the whole view)."""
        ...

    def held_layers(self) -> tuple[tuple[int, int], ...]:
        """The layer ranges whose weights are on disk (advertised: re-claims prefer holders)."""
        ...

    def fetching(self) -> dict | None:
        """The fetch under way (label, bytes done and total, rate, ETA), or None."""
        ...


@dataclass
class NodeParts:
    """Everything a `PeerNode` is given (see the module docstring)."""

    open_transport: Callable[[], AsyncContextManager[Transport]]
    identity: Identity
    compute: Compute
    keeper: ViewKeeper
    tracer: Callable[[str], Tracer]  # given the peer id once the transport is up
    store: Any = None  # a tessera.store.db.PeerStore: claims, ledger, reports; None: not kept
    clock: Callable[[], float] = time.time  # records' issue and expiry times, uptime
    pacing: Pacing = field(default_factory=Pacing)
    placement: Placement = field(default_factory=PlanPlacement)
    watch: NodeWatch = field(default_factory=NodeWatch)
    # What a real peer runs beside serving and a simulated one leaves out:
    gossip: bool = True  # swap views with neighbours (False: the keeper is fed otherwise, e.g. one shared view)
    nat: bool = True  # reachability probes and relays (peer/net/nat/)
    reports: bool = True  # keep and forward misbehaviour reports (peer/request/reports.py)
    reap_idle: bool = True  # drop sessions idle on the wall clock (simulated requesters always close theirs)
    weights: Weights | None = None  # None: no files to serve or fetch (a bare test node; the simulator passes peer/sim/disk.py)
    # Tasks run beside the peer from the moment its transport is up until it stops, each given the
    # node (`tessera peer --web`: the web view, peer/http/web/); cancelled when the peer has left.
    services: list[Callable[[Any], Awaitable[None]]] = field(default_factory=list)
    # The lock on the data dir the identity and store come from (peer/node/data_dir.py `DataDirLock`),
    # released when the node stops; None: nothing on disk to guard (a simulated peer)
    data_dir_lock: Any = None


__all__ = ["Compute", "Placement", "PlanPlacement", "Pacing", "NodeWatch", "NodeParts", "JITTER"]
