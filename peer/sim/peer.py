"""A simulated volunteer: the real `PeerNode` (peer/node/peer_node.py) on simulated parts.

Its whole lifecycle — join, claim, advertise LOADING, load, serve with the real
`StageServer`, advertise, gossip, ping, rebalance, drain and leave — is PeerNode's.
What a simulation gives it instead of a volunteer's parts (peer/node/parts.py), and why:

- the memory transport (peer/net/memory.py) on the world's network;
- a weightless stage and the cost model (peer/sim/stage.py `SimCompute`);
- trio's clock (MockClock): records carry simulated times;
- no sqlite store (a thousand of them would cost more than the simulation), the
  world's counting tracer, and the shared view keeper in ``view="shared"`` (then no gossip);
- jitter from a per-peer seeded RNG (determinism), with random first phases for pings
  and gossip so that peers started together do not act in lockstep;
- the scenario's placement policy (peer/sim/policies.py);
- a simulated disk (peer/sim/disk.py): the whole model, or the layers the plan says,
  with downloads of the rest at the peer's link speed;
- no NAT probes, misbehaviour reports or idle-session reaper (it measures idleness on
  the wall clock; simulated requesters always close their sessions).

`SimPeer` adds what the scenario drives (crash, vanish) and tells the recorder of every change.
"""

from __future__ import annotations

import random

import trio

from tessera.protocol.keys import Identity

from tessera.peer.base.ids import peer_id_text
from tessera.peer.net.memory import open_memory_transport
from tessera.peer.node.config import KV_RESERVE_FRACTION, PeerConfig
from tessera.peer.node.parts import NodeParts, NodeWatch, Pacing
from tessera.peer.node.peer_node import PeerNode
from tessera.peer.plan.view import SERVING
from tessera.peer.sim.disk import SimDisk
from tessera.peer.sim.scenario import PeerPlan
from tessera.peer.sim.stage import FLOAT32_BYTES, SimCompute
from tessera.peer.sim.world import World, node_rng


def memory_for(plan: PeerPlan, world: World) -> int:
    """Bytes a peer offers so that `capacity_in_layers` gives its planned capacity (cf. demo.memory_for_layers)."""
    layer = world.spec.layer_bytes(FLOAT32_BYTES)
    return int((plan.capacity_layers + 0.5) * layer / (1 - KV_RESERVE_FRACTION))


class SimPacing(Pacing):
    """Seeded jitter; the first ping at a random phase of its period, the first gossip tick
    at one drawn from an RNG of its own (so that the peer's other draws stay as they were)."""

    def __init__(self, rng: random.Random, gossip_rng: random.Random) -> None:
        super().__init__(rng)
        self.gossip_rng = gossip_rng

    def first_ping(self, interval: float) -> float:
        return interval * self.rng.random()

    def first_gossip(self, interval: float) -> float:
        return interval * self.gossip_rng.random()


class SimPeer(NodeWatch):
    """One simulated peer (see the module docstring): a `PeerNode`, and the world watching it."""

    def __init__(self, world: World, plan: PeerPlan, identity: Identity, *, joins: bool = True) -> None:
        self.world = world
        self.joins = joins  # with gossip: joins through the earliest live peers (False: starts alone)
        self.plan = plan
        self.label = plan.label
        self.peer_id = peer_id_text(identity.peer_id)
        self.scope = trio.CancelScope()
        self.alive = False
        self.exit: str | None = None  # how it went: "left", "crashed" or "vanished"
        t = world.timings
        config = PeerConfig(
            model=world.model_id, name=plan.label, memory_gb=memory_for(plan, world) / (1 << 30),
            layers=tuple(plan.span) if plan.span is not None else None, max_sessions=plan.max_sessions,
            record_ttl=t.record_ttl, advertise_interval=t.advertise_interval, ping_interval=t.ping_interval,
            rebalance_interval=t.rebalance_interval, gossip_interval=t.gossip_interval,
            leave_grace=t.leave_grace, move_grace=t.move_grace,
            allow_alone=True,  # bootstrap peers that all just left: serve (as the first peer does)
        )
        compute = SimCompute(world.spec, world.model_id, plan.throughput,
                             load_seconds_per_layer=t.load_seconds_per_layer, first_load_seconds=plan.load_seconds,
                             compute_throughput=plan.compute_throughput)
        self.disk = SimDisk(world.spec.num_layers, world.spec.layer_bytes(FLOAT32_BYTES), plan.bandwidth, plan.disk)
        self.node = PeerNode(config, NodeParts(
            open_transport=lambda: open_memory_transport(world.network, self.peer_id),
            identity=identity, compute=compute, keeper=world.new_keeper(), tracer=world.tracer,
            clock=trio.current_time, placement=world.policy, watch=self,
            pacing=SimPacing(node_rng(world.seed, "peer", plan.label), node_rng(world.seed, "gossip", plan.label)),
            gossip=world.view_mode == "gossip", nat=False, reports=False, reap_idle=False, weights=self.disk,
        ), out=lambda line: None)

    # what the engine, the recorder and the convergence checks read
    keeper = property(lambda self: self.node.keeper)
    transport = property(lambda self: self.node.transport)
    state = property(lambda self: self.node.state)
    span = property(lambda self: self.node.span)
    throughput = property(lambda self: self.plan.throughput)  # what SimCompute.measure tells the node
    capacity = property(lambda self: self.node.capacity)

    @property
    def serving(self) -> bool:
        return self.alive and self.node.state == SERVING

    async def run(self) -> None:
        if self.world.view_mode == "gossip" and self.joins:  # a newcomer joins through the earliest-joined live peers
            self.node.config.join = self.world.bootstrap_addrs(exclude=self.peer_id)
        with self.scope:
            await self.node.run()

    def stop(self) -> None:
        """Leave gracefully (as Ctrl-C does)."""
        self.node.stop()

    def crash(self, *, silent: bool) -> None:
        """Die at once: connections reset (a killed process) or go quiet (a vanished machine)."""
        self.world.network.crash(self.peer_id, silent=silent)
        self.alive = False
        self.exit = "vanished" if silent else "crashed"
        self.world.recorder.peer_changed(self)
        self.scope.cancel()

    async def move_to(self, span: tuple[int, int], reason: str) -> None:
        await self.node.move_to(span, reason)

    async def set_memory_offered(self, memory_bytes: int) -> None:
        await self.node.set_memory_offered(memory_bytes / (1 << 30))

    # -- NodeWatch: the recorder hears every change as it happens ---------------------------------

    def opened(self, node: PeerNode) -> None:
        self.alive = True
        self.world.recorder.peer_changed(self)

    def state_changed(self, node: PeerNode) -> None:
        self.world.recorder.peer_changed(self)

    def claimed(self, node: PeerNode) -> None:
        self.world.recorder.claim(self)

    def moved(self, node: PeerNode, old: tuple[int, int] | None, reason: str) -> None:
        self.world.recorder.move(self, old, node.span, reason)

    def left(self, node: PeerNode) -> None:
        self.exit = "left"

    def closed(self, node: PeerNode) -> None:
        self.alive = False
        self.world.recorder.peer_changed(self)
