"""What every simulated peer and requester shares: the network, the clock, the view, the settings.

The shared view
---------------
With real gossip (peer/net/gossip.py) every node holds its own `ViewKeeper` and swaps
whole views with its neighbours: O(N) per exchange, O(N^2) per round — fine for
the tens of peers a real swarm has, far too slow for a thousand simulated ones.
So a large simulation (``view="shared"``) gives every node one `SharedViewKeeper`:
each advertisement is still built and signed by the peer (`tessera.protocol.crypto.sign_record`)
and verified on the way in (`ViewKeeper.merge`), once; and every node sees it at
the start of the next round (`Timings.view_round`: a gossip round in a small swarm,
the few rounds a record takes to cross a big one). That is idealised dissemination
(no lost or partial rounds), said so in every report. Small simulations and
replays can run real gossip over the memory transport instead (``view="gossip"``).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any

import trio

from tessera.protocol.keys import Identity
from tessera.stages.families.spec.model import ModelSpec
from tessera.store.events import TraceEvent

from tessera.peer.base.ids import peer_id_text
from tessera.peer.request.client import DEFAULT_ROUTE_WAIT, REFRESH_INTERVAL
from tessera.peer.net.gossip import GOSSIP_INTERVAL, ViewKeeper
from tessera.peer.node.config import ADVERTISE_INTERVAL, LEAVE_GRACE, MOVE_GRACE, PING_INTERVAL, REBALANCE_INTERVAL
from tessera.peer.plan.view import SwarmView
from tessera.peer.sim.policies import VIEW_MODES

# Unix time that simulated time 0 is written as, in a simulation's own trace
# (2025-01-01T00:00:00Z; a fixed value so that traces of the same run are identical).
SIM_EPOCH = 1735689600.0


@dataclass(frozen=True)
class Timings:
    """The periods and grace times simulated peers use. Defaults: a real peer's (peer/node/peer_node.py)."""

    # A shared view (no gossip) has nobody to report a dead peer gone: its record goes when it
    # expires, so records live a minute (renewed at half) rather than a real peer's day.
    # Gossip runs (view="gossip") remove them by departure reports, as real peers do.
    record_ttl: float = 60.0
    advertise_interval: float = ADVERTISE_INTERVAL
    ping_interval: float = PING_INTERVAL
    rebalance_interval: float = REBALANCE_INTERVAL
    gossip_interval: float = GOSSIP_INTERVAL
    leave_grace: float = LEAVE_GRACE
    move_grace: float = MOVE_GRACE
    requester_refresh: float = REFRESH_INTERVAL
    route_wait: float = DEFAULT_ROUTE_WAIT
    # The shared view (see the module docstring) refreshes this often: one gossip round when
    # everyone swaps with everyone (a small swarm), log_fanout(N) rounds in a big one.
    view_round: float = GOSSIP_INTERVAL
    # Loading a span's weights (reading them from disk or fetching them); a real peer's
    # load of a SmolLM2 layer from a warm page cache takes ~0.1 s, a cold download far more.
    load_seconds_per_layer: float = 0.2
    # A request still running after this long is cut off and counted as failed.
    request_timeout: float = 900.0

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


def large_swarm_timings() -> Timings:
    """Periods for a thousand peers: Petals-like (re-announce every ~15 s, rebalance every
    2 minutes) rather than a small swarm's seconds — the O(N) work of each check, repeated
    by N peers, is what a big swarm cannot afford, in simulation or for real. A record
    reaches everyone in about log_8(1000) ~ 3.3 gossip rounds of 2 s (each peer swapping
    with ~8 neighbours), so the shared view refreshes every 8 s."""
    return Timings(record_ttl=60.0, advertise_interval=15.0, ping_interval=60.0, rebalance_interval=120.0,
                   requester_refresh=30.0, view_round=8.0)


class SharedViewKeeper(ViewKeeper):
    """One `ViewKeeper` for every simulated node (see the module docstring).

    `merge` verifies at once; `snapshot` changes at most once per round (`round_seconds`,
    Timings.view_round) or when a record in it expires, so a view is shared — and its
    routes memoised — by everyone in the round, as gossip would have spread it.
    """

    def __init__(self, *, model_id: str, num_layers: int, round_seconds: float) -> None:
        super().__init__(model_id=model_id, num_layers=num_layers, clock=trio.current_time)
        self.round_seconds = round_seconds
        self._snap: SwarmView | None = None
        self._snap_root: object = None
        self._snap_round = -1
        self._snap_valid_until = -math.inf

    def snapshot(self) -> SwarmView:
        now = self.clock()
        this_round = int(now // self.round_seconds)
        snap = self._snap
        if snap is not None and now < self._snap_valid_until and (
                self.root is self._snap_root or this_round == self._snap_round):
            return snap
        self._snap = super().snapshot()  # prunes what expired
        self._snap_root = self.root
        self._snap_valid_until = self.root.ends if self.root is not None else math.inf
        self._snap_round = this_round
        return self._snap


class SimTracer:
    """A tracer for simulated nodes: counts events by kind; writes them (on simulated time) if asked.

    Peer code calls ``emit(event)`` as on a real peer. With a `writer` (a
    tessera.store.trace.TraceWriter) the event is stored with this node's id and the
    simulated clock (SIM_EPOCH + trio time), so `tessera trace export` draws a simulation.
    """

    def __init__(self, peer: str, counts: dict[str, int], writer: Any = None) -> None:
        self.peer = peer
        self.counts = counts
        self.writer = writer

    def emit(
        self, event: TraceEvent, *, peer: str | None = None, wall: float | None = None, mono_ns: int | None = None
    ) -> None:
        kind = event.kind
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.writer is not None:
            now = trio.current_time()
            self.writer.emit(event, peer=peer or self.peer, wall=SIM_EPOCH + now, mono_ns=int(now * 1e9))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def bind(self, peer: str) -> None:
        pass  # made with its node's id already

    def __enter__(self) -> "SimTracer":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def derive_seed(seed: int, *parts: object) -> bytes:
    """32 bytes from a seed and a name: identities and RNGs that depend on nothing else."""
    text = ":".join(["tessera-sim", str(seed), *map(str, parts)])
    return hashlib.sha256(text.encode()).digest()


def node_rng(seed: int, *parts: object) -> random.Random:
    return random.Random(derive_seed(seed, *parts))


def assign_identities(labels: list[str], seed: int, *, kind: str = "peer") -> dict[str, Identity]:
    """A fresh identity per label, handed out so that peer-id order follows label order.

    Routing and placement break ties by peer id; a replay gives recorded peers new keys
    (it cannot sign as them), and keeping their order keeps the tie-breaks the same.
    """
    identities = [Identity.from_seed(derive_seed(seed, kind, i)) for i in range(len(labels))]
    identities.sort(key=lambda ident: peer_id_text(ident.peer_id))
    return dict(zip(sorted(labels), identities))


@dataclass
class World:
    """The shared state of one simulation run."""

    network: Any  # MemoryNetwork
    spec: ModelSpec
    model_id: str
    timings: Timings
    policy: Any  # PlacementPolicy
    view_mode: str
    seed: int
    recorder: Any  # report.Recorder
    keeper: SharedViewKeeper | None = None
    trace_writer: Any = None
    nursery: trio.Nursery | None = None
    peers: dict[str, Any] = field(default_factory=dict)  # label -> SimPeer (alive or not)
    labels: dict[str, str] = field(default_factory=dict)  # peer id -> label

    def tracer(self, peer_id: str) -> SimTracer:
        return SimTracer(peer_id, self.recorder.event_counts, self.trace_writer)

    def label(self, peer_id: str) -> str:
        return self.labels.get(peer_id, peer_id)

    def in_labels(self, text: str) -> str:
        """`text` (an error) with every simulated node's peer id replaced by its label: the ids
        are the simulation's own (`assign_identities`), the report names nodes by label. One pass:
        a replay's labels are peer ids too, and one may be another node's simulated id."""
        if not self.labels:
            return text
        ids = re.compile("|".join(re.escape(peer_id) for peer_id in sorted(self.labels, key=len, reverse=True)))
        return ids.sub(lambda m: self.labels[m.group(0)], text)

    def new_keeper(self) -> ViewKeeper:
        """The keeper a new node uses: the shared one, or its own (real gossip)."""
        if self.keeper is not None:
            return self.keeper
        return ViewKeeper(model_id=self.model_id, num_layers=self.spec.num_layers, clock=trio.current_time)

    def bootstrap_addrs(self, *, exclude: str = "", limit: int = 3) -> list[str]:
        """Addresses of the earliest-joined peers still running (the join addresses a newcomer is
        given: a peer listens, and gossips, from its first moment, serving or not)."""
        out = []
        for peer in self.peers.values():
            if peer.peer_id != exclude and peer.alive and peer.transport is not None:
                out.extend(peer.transport.addrs()[:1])
                if len(out) >= limit:
                    break
        return out


__all__ = ["Timings", "large_swarm_timings", "SharedViewKeeper", "SimTracer", "World", "SIM_EPOCH",
           "VIEW_MODES", "assign_identities", "derive_seed", "node_rng"]
