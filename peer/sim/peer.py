"""A simulated volunteer: `peer/node/peer_node.py`'s lifecycle over the memory transport, with no weights.

In the order a real peer goes: join (pull the view, or read the shared one),
claim a span (the placement policy; `default` is choose_span, as node.py),
advertise it as LOADING, "load" it (a modelled delay), serve it with the real
`StageServer` — its compute swapped for the cost model (peer/sim/stage.py) —
then advertise, gossip, ping and reconsider placement on jittered periods until
told to leave (drain, then go) or crashed by the scenario.

What differs from node.py, and why: no data dir or sqlite store per peer (a
thousand of them would cost more than the simulation); records carry simulated
times; jitter comes from a per-peer seeded RNG (determinism); the idle-session
reaper is not run (it measures idleness on the wall clock; simulated requesters
always close their sessions).
"""

from __future__ import annotations

import trio

from tessera.store import events
from tessera.protocol.crypto import sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import Neighbour, PeerRecord, SignedRecord

from tessera.peer.base.ids import peer_id_text
from tessera.peer.base.errors import PeerError
from tessera.peer.net.gossip import Gossip, Pinger, material
from tessera.peer.net.memory import MemoryTransport, open_memory_transport
from tessera.peer.node.config import KV_RESERVE_FRACTION, capacity_in_layers
from tessera.peer.serve.server import StageServer
from tessera.peer.serve.limits import ServerLimits
from tessera.peer.plan.view import DRAINING, LEAVING, LOADING, SERVING, PeerInfo, Reachability
from tessera.peer.sim.scenario import PeerPlan
from tessera.peer.sim.stage import FLOAT32_BYTES, SimStage, cost_model
from tessera.peer.sim.world import World, node_rng

# Jitter of every periodic task, as node.py: +-20 %.
JITTER = 0.2


def memory_for(plan: PeerPlan, world: World) -> int:
    """Bytes a peer offers so that `capacity_in_layers` gives its planned capacity (cf. demo.memory_for_layers)."""
    layer = world.spec.layer_bytes(FLOAT32_BYTES)
    return int((plan.capacity_layers + 0.5) * layer / (1 - KV_RESERVE_FRACTION))


class SimPeer:
    """One simulated peer (see the module docstring)."""

    def __init__(self, world: World, plan: PeerPlan, identity: Identity) -> None:
        self.world = world
        self.plan = plan
        self.label = plan.label
        self.identity = identity
        self.peer_id = peer_id_text(identity.peer_id)
        self.throughput = plan.throughput
        self.memory_bytes = memory_for(plan, world)
        self.capacity = capacity_in_layers(world.spec, self.memory_bytes, FLOAT32_BYTES)
        self.rng = node_rng(world.seed, "peer", plan.label)
        self.keeper = world.new_keeper()
        self.tracer = world.tracer(self.peer_id)
        self.state = LOADING
        self.span: tuple[int, int] | None = None
        self.stage: SimStage | None = None
        self.server: StageServer | None = None
        self.transport: MemoryTransport | None = None
        self.gossip: Gossip | None = None
        self.pinger: Pinger | None = None
        self.seq = 0
        self._own: SignedRecord | None = None
        self._own_info: PeerInfo | None = None  # this peer as its latest record shows it
        self.stopping = trio.Event()
        self.scope = trio.CancelScope()
        self.alive = False
        self.exit: str | None = None  # how it went: "left", "crashed" or "vanished"

    @property
    def serving(self) -> bool:
        return self.alive and self.state == SERVING

    def _set_state(self, state: str) -> None:
        self.state = state
        self.world.recorder.peer_changed(self)

    # -- advertising (node.make_record / node.advertise, on simulated time) -------------------

    def make_record(self) -> SignedRecord | None:
        if self.span is None or self.transport is None:
            return None
        now = trio.current_time()
        self.seq = max(self.seq + 1, int(now * 1000))
        used = self.stage.weight_bytes if self.stage else 0
        neighbours = sorted(self.pinger.rtt_ms.items())[:64] if self.pinger else []
        record = PeerRecord(
            peer_id=self.identity.peer_id, name=self.label[:64], model_id=self.world.model_id,
            start=self.span[0], end=self.span[1], shard_index=0, shard_count=1,
            throughput=self.throughput, free_memory=max(0, self.memory_bytes - used),
            load=self.server.load if self.server else 0.0, max_sessions=self.plan.max_sessions,
            state=self.state, reachability=Reachability.PUBLIC, addrs=tuple(self.transport.addrs()[:16]),
            neighbours=tuple(Neighbour(self.world.id_bytes(p), rtt) for p, rtt in neighbours),
            issued_at=now, expires_at=now + self.world.timings.record_ttl, seq=self.seq,
        )
        self._own = sign_record(self.identity, record)
        self._own_info = None  # filled from the keeper's copy on merge (one decode, not two)
        return self._own

    async def advertise(self) -> None:
        before = self.keeper.known.get(self.peer_id)
        signed = self.make_record()
        if signed is None:
            return
        self.keeper.merge([signed])
        known = self.keeper.known.get(self.peer_id)
        self._own_info = known.info if known is not None and known.signed is signed else None
        # as node.advertise: a change is announced at once, a refresh travels with the next tick
        if self.gossip is not None and (before is None or known is None
                                        or material(before.record) != material(known.record)):
            await self.gossip.announce()
        self.tracer.emit(events.Advertise(span=self.span, state=self.state,
                                          load=self.server.load if self.server else 0.0))

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self) -> None:
        world = self.world
        with self.scope:
            async with open_memory_transport(world.network, self.peer_id) as transport:
                self.transport = transport
                self.alive = True
                self.pinger = Pinger(transport)
                if world.view_mode == "gossip":
                    self.gossip = Gossip(transport, self.keeper, own_record=lambda: self._own,
                                         interval=world.timings.gossip_interval)
                self.tracer.emit(events.Join(addrs=transport.addrs(), model=world.model_id))
                world.recorder.peer_changed(self)
                try:
                    async with trio.open_nursery() as nursery:
                        await self._join()
                        await self._claim_and_load()
                        self.server = StageServer(
                            transport, self.identity, self.stage, tracer=self.tracer,
                            limits=ServerLimits(max_sessions=self.plan.max_sessions,
                                                kv_budget=int(self.memory_bytes * KV_RESERVE_FRACTION)),
                        )
                        self.server.run_compute = cost_model(lambda: self.server.stage, self.throughput)
                        self._set_state(SERVING)
                        await self.advertise()
                        nursery.start_soon(self._advertise_forever)
                        nursery.start_soon(self._ping_forever)
                        if self.gossip is not None:
                            nursery.start_soon(self._gossip_forever)
                        if world.policy.moves and self.plan.span is None:
                            nursery.start_soon(self._rebalance_forever)
                        await self.stopping.wait()
                        await self._leave()
                        nursery.cancel_scope.cancel()
                finally:
                    self.alive = False
                    world.recorder.peer_changed(self)

    def stop(self) -> None:
        """Leave gracefully (as Ctrl-C does)."""
        self.stopping.set()

    def crash(self, *, silent: bool) -> None:
        """Die at once: connections reset (a killed process) or go quiet (a vanished machine)."""
        self.world.network.crash(self.peer_id, silent=silent)
        self.alive = False
        self.exit = "vanished" if silent else "crashed"
        self.world.recorder.peer_changed(self)
        self.scope.cancel()

    async def _join(self) -> None:
        if self.gossip is None:
            return  # the shared view needs no pulling
        for addr in self.world.bootstrap_addrs(exclude=self.peer_id):
            self.keeper.remember(addr)  # as node.py: a join address is re-dialled for good
            try:
                peer = await self.transport.connect(addr)
                self.tracer.emit(events.Connect(remote=peer, link=self.transport.connection_kind(peer) or "direct"))
                await self.gossip.exchange(peer)
            except PeerError:
                continue  # a bootstrap peer that just left; the others will do
        await self._connect_known()

    async def _connect_known(self) -> None:
        await self.gossip.connect_known(self._connected)

    def _connected(self, peer_id: str) -> None:
        self.tracer.emit(events.Connect(remote=peer_id, link="direct"))

    async def _claim_and_load(self) -> None:
        if self.plan.span is not None:
            span = self.plan.span
        else:
            span = self.world.policy.claim(self.keeper.snapshot(), me=self.peer_id, capacity_layers=self.capacity,
                                           throughput=self.throughput, rng=self.rng)
        self.span = (int(span[0]), int(span[1]))
        self.tracer.emit(events.Claim(span=self.span, throughput=self.throughput, capacity=self.capacity))
        self.world.recorder.claim(self)
        await self.advertise()  # LOADING: others see the claim before the weights are in
        self.stage = await self._load(*self.span, seconds=self.plan.load_seconds)

    async def _load(self, start: int, end: int, *, seconds: float | None = None) -> SimStage:
        await trio.sleep(seconds if seconds is not None else (end - start) * self.world.timings.load_seconds_per_layer)
        return SimStage(self.world.spec, start, end)

    async def move_to(self, span: tuple[int, int], reason: str) -> None:
        """node.move_to: drain (a grace for running sessions), load the new span, serve it."""
        old = self.span
        server = self.server
        server.accepting = False
        self._set_state(DRAINING)
        await self.advertise()
        await server.drain(self.world.timings.move_grace)
        self.span = span
        self._set_state(LOADING)
        self.tracer.emit(events.Move(span=span, moved_from=list(old) if old else None, reason=reason))
        self.world.recorder.move(self, old, span, reason)
        await self.advertise()
        stage = await self._load(*span)
        for session in list(server.sessions.values()):
            server.drop(session, "peer moved its span")
        self.stage = server.stage = stage
        server.accepting = True
        self._set_state(SERVING)
        await self.advertise()

    async def set_memory_offered(self, memory_bytes: int) -> None:
        """node.set_memory_offered: re-claim a span that fits the new offer (a move if it
        changes), else re-advertise (the record's free memory changed)."""
        self.memory_bytes = memory_bytes
        self.capacity = capacity_in_layers(self.world.spec, memory_bytes, FLOAT32_BYTES)
        if self.plan.span is not None or self.state != SERVING:
            await self.advertise()
            return
        view = self.keeper.snapshot().without([self.peer_id])
        span = self.world.policy.claim(view, me=self.peer_id, capacity_layers=self.capacity,
                                       throughput=self.throughput, rng=self.rng)
        span = (int(span[0]), int(span[1]))
        if span != self.span:
            await self.move_to(span, "memory offered changed")
        else:
            await self.advertise()

    async def _rebalance_forever(self) -> None:
        timings = self.world.timings
        while True:
            await trio.sleep(timings.rebalance_interval * self.rng.uniform(1 - JITTER, 1 + JITTER))
            if self.state != SERVING:
                continue
            plan = self.world.policy.rebalance(self.keeper.snapshot(), own=self._own_info, me=self.peer_id,
                                               span=self.span, capacity_layers=self.capacity,
                                               throughput=self.throughput, rng=self.rng)
            if plan is not None and plan != self.span:
                await self.move_to(plan, "rebalance")

    async def _leave(self) -> None:
        """node._leave: no new sessions, tell the swarm, let running sessions finish, go."""
        with trio.CancelScope(shield=True):
            self._set_state(LEAVING if not self.server or not self.server.sessions else DRAINING)
            if self.server:
                self.server.accepting = False
            await self.advertise()
            if self.server:
                await self.server.drain(self.world.timings.leave_grace)
                for session in list(self.server.sessions.values()):  # past the grace: end them now
                    self.server.drop(session, "peer left")
            self._set_state(LEAVING)
            await self.advertise()
            self.exit = "left"
            self.tracer.emit(events.Leave(span=self.span))

    async def _advertise_forever(self) -> None:
        interval = self.world.timings.advertise_interval
        while True:
            await trio.sleep(interval * self.rng.uniform(1 - JITTER, 1 + JITTER))
            await self.advertise()

    async def _gossip_forever(self) -> None:
        # peers started together tick apart (an RNG of its own: the peer's jitter stays as it was)
        await trio.sleep(self.gossip.interval * node_rng(self.world.seed, "gossip", self.label).random())
        await self.gossip.run(self._connected)

    async def _ping_forever(self) -> None:
        interval = self.world.timings.ping_interval
        # Start at a random phase: a thousand peers that joined together must not ping in lockstep.
        await trio.sleep(interval * self.rng.random())
        while True:
            await self.pinger.ping_all()
            await trio.sleep(interval)
