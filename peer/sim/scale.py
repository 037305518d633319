"""Membership at scale: N simulated peers running the real gossip, what it costs each, how fast it agrees.

    result = measure_scale(10_000, seed=1)
    result.line()   # 'scale N=10000: connections per peer max 23 mean 11.9; membership bytes ...'

Every peer is the real `PeerNode` with its own `ViewKeeper`, `Gossip` and `Membership`
(peer/sim/peer.py) on the memory transport under trio's MockClock. The run:

1. Formation. The N peers start at once on planned spans (the layers dealt round, so
   placement has nothing to decide), each alone: it advertises into its own view. When
   all serve, each peer's view is given every peer's record at once (`ViewKeeper.adopt`
   of the union of their own records) — the view every one of them would hold after its
   join pull, without simulating N pulls of N records (N^2/2 records decoded: hours at
   10,000). From here on everything is the peers' own code.
2. Settling, SETTLE_PERIODS: each peer draws its neighbours, dials them, gossips.
3. The window (at least WINDOW_S of simulated time), over which bytes and connections are
   measured: STEADY_PERIODS of nothing, then a burst — BURST joins (real ones: each
   new peer joins through the earliest live peers and pulls the whole view), BURST leaves
   (half graceful, a quarter crashed, a quarter vanished) and BURST moves — and then
   until the views agree, and on to the window's end.

Convergence is measured as in peer/sim/convergence.py, with the whole swarm as one
group: every POLL the observer looks whether every live peer holds the same set (the
same trie root: same records, same departures), with every live peer's own current
record in it and no live record of a peer that died; the last change is the burst's
last event or the last time a live peer's own record changed (a move drains, loads and
serves; a joiner loads and serves). Convergence = (first agreement after the last
change − last change) / gossip period.

The burst is the same size at every N, so that the figures compare what the protocol
costs a peer as the swarm grows, not how many changes a bigger swarm makes: every
change costs every peer about one copy of it, at any N.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field

import trio

from tessera.peer.net import record_set as rs
from tessera.peer.net.gossip import bound_seconds
from tessera.peer.net.memory import MemoryNetwork
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.plan.view import SERVING
from tessera.peer.sim.peer import SimPeer
from tessera.peer.sim.policies import get_policy
from tessera.peer.sim.report import Recorder
from tessera.peer.sim.scenario import BANDWIDTHS, ONE_WAY_S, REGIONS, PeerPlan
from tessera.peer.sim.schedule import run_deterministic
from tessera.peer.sim.stage import sim_model_id, sim_spec
from tessera.peer.sim.world import Timings, World, assign_identities

NUM_LAYERS = 30
# A real peer's periods (peer/node/config.py), but for pings (RTT probes for routing, not
# membership: every 5 s to every connection would be most of the run's work; off) and
# rebalancing (spans are planned; off).
SCALE_TIMINGS = Timings(record_ttl=86400.0, advertise_interval=3.0, gossip_interval=2.0, ping_interval=1e9,
                        rebalance_interval=1e9, leave_grace=2.0, move_grace=2.0, load_seconds_per_layer=0.05)
SETTLE_PERIODS = 5
STEADY_PERIODS = 5
WINDOW_S = 60.0
BURST = 8
POLL_PERIODS = 0.25  # the observer looks four times a period


@dataclass
class ScaleResult:
    n: int
    connections_max: int = 0
    connections_mean: float = 0.0
    neighbours_max: int = 0
    bytes_per_minute_max: float = 0.0
    bytes_per_minute_mean: float = 0.0
    convergence_periods: float | None = None
    bound_periods: float = 0.0
    window_s: float = 0.0
    wall_s: float = 0.0
    simulated_s: float = 0.0
    peers_measured: int = 0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        conv = f"{self.convergence_periods:.1f}" if self.convergence_periods is not None else "none"
        return (f"scale N={self.n}: connections per peer max {self.connections_max} mean {self.connections_mean:.1f}; "
                f"membership bytes per peer per minute max {self.bytes_per_minute_max:.1e} "
                f"mean {self.bytes_per_minute_mean:.1e}; convergence {conv} periods; wall {self.wall_s:.0f} s")


def planned_span(i: int, capacity: int) -> tuple[int, int]:
    """Spans dealt round the layers, so that every layer is covered many times over."""
    start = (i * capacity) % NUM_LAYERS
    start = min(start, NUM_LAYERS - capacity)
    return (start, start + capacity)


class _Scale:
    def __init__(self, n: int, seed: int, timings: Timings, burst: int) -> None:
        self.n = n
        self.seed = seed
        self.timings = timings
        self.burst = burst
        self.rng = random.Random(f"tessera-scale:{seed}")
        spec = sim_spec(NUM_LAYERS, 64)
        self.regions: dict[str, tuple[int, float]] = {}
        self.world = World(network=MemoryNetwork(self.link), spec=spec, model_id=sim_model_id(spec), timings=timings,
                           policy=get_policy("default"), view_mode="gossip", seed=seed,
                           recorder=Recorder(NUM_LAYERS, trio.current_time))
        labels = [f"p{i:05d}" for i in range(n + burst)]
        self.identities = assign_identities(labels, seed)
        self.died: set[str] = set()  # peer ids of peers that stopped
        self.result = ScaleResult(n)

    def link(self, a: str, b: str) -> LinkSpec:
        ra, ba = self.regions.get(a, (0, 125e6))
        rb, bb = self.regions.get(b, (0, 125e6))
        return LinkSpec(latency=ONE_WAY_S[ra][rb], bandwidth=min(ba, bb))

    def new_peer(self, nursery: trio.Nursery, *, joins: bool) -> SimPeer:
        i = len(self.world.peers)
        label = f"p{i:05d}"
        capacity = self.rng.randint(6, 15)
        plan = PeerPlan(label, join_at=trio.current_time(), throughput=round(400 * math.exp(self.rng.gauss(0, 0.6)), 3),
                        capacity_layers=capacity, span=planned_span(i, capacity),
                        region=self.rng.randrange(len(REGIONS)), bandwidth=self.rng.choice(BANDWIDTHS))
        peer = SimPeer(self.world, plan, self.identities[label], joins=joins)
        self.world.peers[label] = peer
        self.world.labels[peer.peer_id] = label
        self.regions[peer.peer_id] = (plan.region, plan.bandwidth)
        nursery.start_soon(self._run_peer, peer)
        return peer

    async def _run_peer(self, peer: SimPeer) -> None:
        try:
            await peer.run()
        finally:
            self.died.add(peer.peer_id)

    def live(self) -> list[SimPeer]:
        return [p for p in self.world.peers.values() if p.alive]

    # -- observation ---------------------------------------------------------------------------

    def truth(self) -> tuple:
        """Each live peer's own current record version (what a change changes)."""
        out = []
        for p in self.live():
            entry = p.keeper.entry(p.peer_id)
            out.append((p.label, entry.seq if entry is not None and not entry.dead else None))
        return tuple(out)

    def agreed(self) -> bool:
        live = self.live()
        if not live:
            return True
        roots = {id(p.keeper.root) for p in live}  # interned: the same set is the same node
        if len(roots) != 1:
            return False
        root = live[0].keeper.root
        for p in live:
            own = p.node._own
            entry = rs.get(root, p.node.identity.peer_id)
            if own is None or entry is None or entry.dead or entry.value.signed.signature != own.signature:
                return False
        for peer_id in self.died:
            entry = live[0].keeper.entry(peer_id)
            if entry is not None and not entry.dead and entry.value.record.state != "leaving":
                return False
        return True

    def sample_connections(self, samples: list[int], neighbours: list[int]) -> None:
        for p in self.live():
            samples.append(len(p.transport.connected()))
            if p.node.gossip is not None:
                neighbours.append(len(p.node.gossip.membership.neighbours()))

    # -- the run -----------------------------------------------------------------------------------

    async def main(self) -> ScaleResult:
        period = self.timings.gossip_interval
        res = self.result
        async with trio.open_nursery() as nursery:
            first = [self.new_peer(nursery, joins=False) for _ in range(self.n)]
            while not all(p.alive and p.state == SERVING and p.node._own is not None for p in first):
                await trio.sleep(period / 2)
            base = rs.build(p.keeper.entry(p.peer_id) for p in first)
            for p in first:
                p.keeper.adopt(base)
            await trio.sleep(SETTLE_PERIODS * period)
            # the window
            start = trio.current_time()
            sent = {p.label: p.node.gossip.bytes_sent for p in first}
            connections: list[int] = []
            neighbours: list[int] = []
            for _ in range(STEADY_PERIODS):
                self.sample_connections(connections, neighbours)
                await trio.sleep(period)
            # the burst, spread over one period
            victims = self.rng.sample(first, 2 * self.burst)
            leavers, movers = victims[: self.burst], victims[self.burst:]
            modes = ["graceful", "graceful", "crash", "vanish"]
            events = ([("join", None)] * self.burst + [("leave", p) for p in leavers] + [("move", p) for p in movers])
            self.rng.shuffle(events)
            last_change = trio.current_time()
            for k, (kind, peer) in enumerate(events):
                await trio.sleep(period / len(events))
                if kind == "join":
                    self.new_peer(nursery, joins=True)
                elif kind == "leave":
                    mode = modes[k % len(modes)]
                    if mode == "graceful":
                        peer.stop()
                    else:
                        peer.crash(silent=mode == "vanish")
                        self.died.add(peer.peer_id)
                elif peer.serving:
                    start_layer = self.rng.randrange(NUM_LAYERS - peer.capacity + 1)
                    nursery.start_soon(peer.move_to, (start_layer, start_layer + peer.capacity), "burst")
                last_change = trio.current_time()
            # until the views agree (or the bound has passed three times over), sampling as we go
            # pings are off here: a vanished peer is found by exchanges alone (D as with a 2-period ping)
            res.bound_periods = bound_seconds(len(self.world.peers), period, 2 * period) / period
            deadline = last_change + 3 * res.bound_periods * period + 60.0
            truth = self.truth()
            agreed_at = None
            polls = 0
            while trio.current_time() < deadline:
                await trio.sleep(POLL_PERIODS * period)
                polls += 1
                if polls % int(1 / POLL_PERIODS) == 0:
                    self.sample_connections(connections, neighbours)
                now_truth = self.truth()
                if now_truth != truth:
                    truth, last_change, agreed_at = now_truth, trio.current_time(), None
                if self.agreed():
                    if agreed_at is None:
                        agreed_at = trio.current_time()
                    if trio.current_time() - agreed_at >= 2 * period:
                        break  # agreed, and stayed so
                else:
                    agreed_at = None
            if agreed_at is not None:
                res.convergence_periods = max(0.0, agreed_at - last_change) / period
            while trio.current_time() < start + WINDOW_S:
                self.sample_connections(connections, neighbours)
                await trio.sleep(period)
            end = trio.current_time()
            minutes = (end - start) / 60.0
            rates = [(p.node.gossip.bytes_sent - sent[p.label]) / minutes for p in first if p.alive]
            res.window_s = end - start
            res.peers_measured = len(rates)
            res.bytes_per_minute_max = max(rates)
            res.bytes_per_minute_mean = statistics.fmean(rates)
            res.connections_max = max(connections)
            res.connections_mean = statistics.fmean(connections)
            res.neighbours_max = max(neighbours)
            res.simulated_s = end
            for p in self.live():
                p.crash(silent=False)
            nursery.cancel_scope.cancel()
        return res


def measure_scale(n: int, *, seed: int = 1, timings: Timings = SCALE_TIMINGS, burst: int = BURST) -> ScaleResult:
    """Run the scale measurement (see the module docstring) for `n` peers."""
    began = time.perf_counter()
    result = run_deterministic(_Scale(n, seed, timings, burst).main, seed=seed)
    result.wall_s = time.perf_counter() - began
    return result


__all__ = ["ScaleResult", "measure_scale", "SCALE_TIMINGS", "BURST", "WINDOW_S"]
