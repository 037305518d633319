"""Does the swarm view converge? Drive a sequence of events over simulated peers running
the real gossip (peer/net/gossip.py) and measure how long their views take to agree.

    outcome = run_sequence(5, [Event("move", after=1.0, target=2), Event("crash", after=0.5)])
    outcome.worst_periods   # gossip periods from the last change until every pair agreed

The peers are `SimPeer`s (peer/sim/peer.py: the real `PeerNode`, its `Gossip` and
`ViewKeeper`) on the memory transport under trio's MockClock, each with its own view
(``view="gossip"``). Events: join, leave (graceful), crash (connections reset),
vanish (silent), move (a new span), memory (a new memory offer, as the TUI's `m` key
does on a real peer), partition (the live peers split in two; links between the
halves cut) and heal (every cut mended).

What is measured. Every POLL seconds the observer takes, for each live peer, the set
of live records it holds, as (peer, span, state, free memory) — what placement and
routing read, without the refresh-only fields (seq, expiry, load, RTTs) — and the
truth: each live peer's own current record (a peer that joined but has not advertised
yet has none, and its group cannot agree yet: a change under way). Two live peers are *in touch* when no
cut separates them and one of them knows the other's address (its view or its
address book); the groups of peers in touch, transitively, must each agree: every
member holds the same set, and it includes every member's current record. The *last
change* is the last event, or the last time any live peer's own record changed (a
move drains, loads and serves over several seconds; a leave drains first), or the
groups changed (a peer joined or died, or two peers on one side of a partition that
the cut had separated from everything they knew learned of each other). The
outcome's `worst_periods` is (the poll from which the views agreed to the end − last
change) / gossip period. Before the bound has passed, views may agree and part again: the
observer compares what routing reads, not versions, so two copies of a record can look
alike while one of them, older, is about to expire (a peer back from a partition). Such a
flicker only moves the agreement later. `agreed_throughout` is False if the views parted
once the bound had passed with nothing changed; `stale` lists records of dead peers still
held a record-lifetime after they died (it must be empty).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import trio

from tessera.peer.net.gossip import bound_seconds as gossip_bound
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.net.memory import MemoryNetwork
from tessera.peer.sim.schedule import run_deterministic
from tessera.peer.sim.peer import SimPeer, memory_for
from tessera.peer.sim.policies import get_policy
from tessera.peer.sim.report import Recorder
from tessera.peer.sim.scenario import PeerPlan
from tessera.peer.sim.stage import sim_spec, sim_model_id
from tessera.peer.sim.world import Timings, World, assign_identities

EVENT_KINDS = ("join", "leave", "crash", "vanish", "move", "memory", "partition", "heal")
POLL = 0.05  # seconds of simulated time between observations (a fortieth of a 2 s period)
LATENCY = 0.01  # one way, seconds: a continent's worth of loopback
# Short periods (a real peer gossips every 2 s and checks its record every 3 s): the same code
# paths in fewer simulated seconds. Records live 30 s, renewed at half: long enough that a
# renewal reaches everyone before the record it replaces expires (B(64) is 17 periods here),
# short enough that a partition outlasts it in a test. No spontaneous rebalancing: every move
# is an event, so "the last change" is known.
CONVERGENCE_TIMINGS = Timings(record_ttl=30.0, advertise_interval=1.5, gossip_interval=1.0, ping_interval=2.5,
                              rebalance_interval=1e9, leave_grace=1.0, move_grace=1.0, load_seconds_per_layer=0.02)
NUM_LAYERS = 30


def bound_seconds(n: int, timings: Timings) -> float:
    """How long after the last change `n` peers' views must agree, and from when on they must
    stay agreed: B(N) of peer/net/gossip.py, and the observer's poll."""
    return gossip_bound(n, timings.gossip_interval, timings.ping_interval) + POLL


def bound_periods(n: int, timings: Timings = CONVERGENCE_TIMINGS) -> float:
    return bound_seconds(n, timings) / timings.gossip_interval


@dataclass(frozen=True)
class Event:
    """One thing that happens, `after` seconds after the previous event.

    target: picks a live peer (modulo their count); value: a capacity in layers (memory,
    join) or the seed of a partition's split.
    """

    kind: str
    after: float
    target: int = 0
    value: int = 0


@dataclass
class Outcome:
    peers: int = 0  # peers that ever ran
    events: int = 0
    last_change: float = 0.0
    converged_at: float | None = None
    worst_periods: float | None = None  # None: never agreed after the last change
    agreed_throughout: bool = True
    stale: list[str] = field(default_factory=list)
    end: float = 0.0


def content(info) -> tuple:
    return (info.peer_id, info.start, info.end, info.state, info.free_memory)


class _Run:
    def __init__(self, initial: int, events: Sequence[Event], seed: int, timings: Timings) -> None:
        self.initial = initial
        self.events = list(events)
        self.timings = timings
        self.rng = random.Random(seed)
        spec = sim_spec(NUM_LAYERS, 64)
        self.world = World(network=MemoryNetwork(LinkSpec(latency=LATENCY, bandwidth=125e6)), spec=spec,
                           model_id=sim_model_id(spec), timings=timings, policy=get_policy("default"),
                           view_mode="gossip", seed=seed, recorder=Recorder(NUM_LAYERS, trio.current_time))
        total = initial + sum(e.kind == "join" for e in events)
        self.identities = assign_identities([f"p{i:02d}" for i in range(total)], seed)
        self.group: dict[str, int] = {}  # label -> side of the current partition (all 0 when whole)
        self.died: dict[str, float] = {}  # label -> when it stopped running
        self.outcome = Outcome(peers=total, events=len(events))
        self.last_truth: dict[str, tuple | None] = {}
        self.last_groups: frozenset = frozenset()

    # -- events ---------------------------------------------------------------------------------

    def live(self) -> list[SimPeer]:
        return [p for p in self.world.peers.values() if p.alive]

    def start_peer(self, nursery: trio.Nursery, capacity: int) -> None:
        label = f"p{len(self.world.peers):02d}"
        plan = PeerPlan(label, join_at=trio.current_time(), throughput=self.rng.choice((50.0, 100.0, 200.0)),
                        capacity_layers=capacity)
        peer = SimPeer(self.world, plan, self.identities[label])
        self.world.peers[label] = peer
        self.world.labels[peer.peer_id] = label
        # it joins through the earliest live peer (world.bootstrap_addrs): on that one's side
        first = next((p for p in self.world.peers.values() if p.alive and p.transport is not None), None)
        side = self.group.get(first.label, 0) if first is not None else 0
        self.group[label] = side
        for other, their_side in self.group.items():
            if their_side != side and other != label:
                self.world.network.cut(peer.peer_id, self.world.peers[other].peer_id)
        nursery.start_soon(self._run_peer, peer)

    async def _run_peer(self, peer: SimPeer) -> None:
        try:
            await peer.run()
        finally:
            self.died.setdefault(peer.label, trio.current_time())

    def changed(self) -> None:
        """A change the peers' own records do not show (a crash, a cut, a heal)."""
        self.outcome.last_change = trio.current_time()
        self.outcome.converged_at = None

    def apply(self, event: Event, nursery: trio.Nursery) -> None:
        live = [p for p in self.live() if p.span is not None]
        kind = event.kind
        if kind == "join":
            self.start_peer(nursery, 4 + event.value % 27)
            return
        if kind == "heal":
            self.world.network.cuts.clear()
            self.group = {label: 0 for label in self.group}
            self.changed()
            return
        if kind == "partition":  # replaces any partition in place: two sides, newly drawn
            self.world.network.cuts.clear()
            split = random.Random(event.value)
            sides = {p.label: split.randrange(2) for p in self.live()}  # joining ones too: no bridges
            for label in self.group:
                self.group[label] = sides.get(label, self.group[label])
            peers = self.world.peers
            for a in sides:
                for b in sides:
                    if a < b and sides[a] != sides[b]:
                        self.world.network.cut(peers[a].peer_id, peers[b].peer_id)
            self.changed()
            return
        if len(live) <= 1:
            return  # keep one peer: a swarm of none agrees trivially
        peer = live[event.target % len(live)]
        if kind == "leave":
            peer.stop()
        elif kind in ("crash", "vanish"):
            peer.crash(silent=kind == "vanish")
            self.died.setdefault(peer.label, trio.current_time())
            self.changed()
        elif kind == "move" and peer.serving:
            start = event.value % NUM_LAYERS
            span = (start, min(NUM_LAYERS, start + peer.capacity))
            if span != peer.span:
                nursery.start_soon(peer.move_to, span, "event")
        elif kind == "memory" and peer.serving:
            layers = 2 + event.value % 29
            nursery.start_soon(peer.set_memory_offered, memory_for(PeerPlan("x", 0.0, 1.0, layers), self.world))

    # -- observation ------------------------------------------------------------------------------

    def truth(self) -> dict[str, tuple | None]:
        """Each live peer's own current record (None: joined, not advertised yet)."""
        out: dict[str, tuple | None] = {}
        for p in self.live():
            own = p.keeper.known.get(p.peer_id)
            out[p.label] = content(own.info) if own is not None else None
        return out

    def held(self, peer: SimPeer) -> frozenset:
        peer.keeper.prune()  # what expired by now (as the peer's next tick would)
        root = peer.keeper.root
        if root is None:
            return frozenset()
        held = root.memo.get("content")  # the same set of entries is the same node: computed once
        if held is None:
            held = root.memo["content"] = frozenset(content(k.info) for k in peer.keeper.live().values())
        return held

    def knows(self, peer: SimPeer) -> frozenset:
        """The peers whose address `peer` has: its view, its join addresses, its graveyard."""
        root = peer.keeper.root
        ids = root.memo.get("ids") if root is not None else frozenset()
        if ids is None:
            ids = root.memo["ids"] = frozenset(peer.keeper.known)
        return ids | peer.keeper.seeds.keys() | peer.keeper.graves.keys()

    def groups_in_touch(self) -> list[list[SimPeer]]:
        live = self.live()
        parent = {p.label: p.label for p in live}
        knows = {p.label: self.knows(p) for p in live}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for a in live:
            for b in live:
                if a.label < b.label and self.group.get(a.label) == self.group.get(b.label) and (
                        b.peer_id in knows[a.label] or a.peer_id in knows[b.label]):
                    parent[find(a.label)] = find(b.label)
        out: dict[str, list[SimPeer]] = {}
        for p in live:
            out.setdefault(find(p.label), []).append(p)
        return list(out.values())

    def agree(self, truth: dict[str, tuple]) -> bool:
        for members in self.groups_in_touch():
            sets = [self.held(p) for p in members]
            if any(s != sets[0] for s in sets[1:]):
                return False
            if any(truth.get(p.label) not in sets[0] for p in members):
                return False
        return True

    async def observe(self, until: trio.Event) -> None:
        while not until.is_set():
            now = trio.current_time()
            truth = self.truth()
            groups = frozenset(frozenset(p.label for p in g) for g in self.groups_in_touch())
            if truth != self.last_truth or groups != self.last_groups:
                self.last_truth, self.last_groups = truth, groups
                self.outcome.last_change = now
                self.outcome.converged_at = None
            if self.agree(truth):
                if self.outcome.converged_at is None:
                    self.outcome.converged_at = now
            elif self.outcome.converged_at is not None:
                if now > self.outcome.last_change + bound_seconds(len(self.world.peers), self.timings):
                    self.outcome.agreed_throughout = False  # agreed past the bound, then split with nothing changed
                self.outcome.converged_at = None
            await trio.sleep(POLL)

    # -- the run ----------------------------------------------------------------------------------

    async def main(self) -> Outcome:
        t = self.timings
        async with trio.open_nursery() as nursery:
            for i in range(self.initial):
                self.start_peer(nursery, 4 + self.rng.randrange(27))
                await trio.sleep(0.1)  # one after another, as LocalSwarm starts them
            done = trio.Event()
            nursery.start_soon(self.observe, done)
            for event in self.events:
                await trio.sleep(event.after)
                self.apply(event, nursery)
            # Long enough for a leave (drain + grace), a move (drain, load every layer, serve), the
            # views to agree, and every dead peer's last record to expire.
            settle = (t.leave_grace + t.move_grace + NUM_LAYERS * t.load_seconds_per_layer
                      + 6 * t.gossip_interval + 2 * t.advertise_interval)
            await trio.sleep(settle)
            while trio.current_time() < self.outcome.last_change + settle:
                await trio.sleep(settle)  # a move or leave still under way when the first settle ended
            await trio.sleep(t.record_ttl)
            self.outcome.end = trio.current_time()
            done.set()
            ttl_gone = t.record_ttl + 1.2 * t.advertise_interval  # its last refresh, then a lifetime
            for p in self.live():
                for k in p.keeper.live().values():
                    label = self.world.labels.get(k.info.peer_id, k.info.peer_id)
                    if label in self.died and self.outcome.end - self.died[label] > ttl_gone:
                        self.outcome.stale.append(f"{p.label} holds {label}'s record "
                                                  f"{self.outcome.end - self.died[label]:.1f} s after it died")
            for p in self.world.peers.values():
                if p.alive:
                    p.crash(silent=False)
            nursery.cancel_scope.cancel()
        o = self.outcome
        if o.converged_at is not None:
            o.worst_periods = max(0.0, o.converged_at - o.last_change) / t.gossip_interval
        return o


def run_sequence(initial: int, events: Sequence[Event], *, seed: int = 0,
                 timings: Timings = CONVERGENCE_TIMINGS) -> Outcome:
    """Start `initial` peers, apply `events`, and measure (see the module docstring)."""
    run = _Run(initial, events, seed, timings)
    return run_deterministic(run.main, seed=seed)


__all__ = ["bound_periods", "bound_seconds", "CONVERGENCE_TIMINGS", "EVENT_KINDS", "Event", "Outcome", "run_sequence"]
