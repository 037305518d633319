"""The swarm view: what one peer currently believes about every other peer.

A `PeerInfo` is the verified, decoded content of one signed advertisement; a
`SwarmView` is an immutable snapshot of them. Placement and routing are pure
functions of a `SwarmView` (see `peer/plan/placement.py`, `peer/plan/routing.py`), so the
same snapshot always gives the same answer — in a live peer, in a simulation and
in a replay.

Spans are half-open everywhere: a peer with ``start=4, end=10`` serves layers
4, 5, ..., 9.
"""

from __future__ import annotations

from bisect import bisect_left
from enum import StrEnum

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Iterable, Mapping


class PeerState(StrEnum):
    """A peer's state, as advertised (the value is what gossip carries)."""

    SERVING = "serving"  # takes new sessions
    DRAINING = "draining"  # finishes running sessions, takes no new ones
    LEAVING = "leaving"  # about to disconnect; route around it now
    LOADING = "loading"  # has claimed a span, weights not loaded yet (counts for placement, not routing)


class Reachability(StrEnum):
    """How others can reach a peer, as advertised (peer/net/nat/reachability.py decides it)."""

    UNKNOWN = "unknown"  # not checked yet
    PUBLIC = "public"  # others dial it directly
    PRIVATE = "private"  # behind NAT; no punch tried yet
    HOLE_PUNCHED = "hole-punched"  # behind NAT; a punch has succeeded (meet it over a relay, expect direct)
    RELAYED = "relayed"  # behind NAT; punches failed: traffic stays relayed


SERVING = PeerState.SERVING
DRAINING = PeerState.DRAINING
LEAVING = PeerState.LEAVING
LOADING = PeerState.LOADING
STATES = tuple(PeerState)


@dataclass(frozen=True)
class PeerInfo:
    """One peer as the swarm sees it.

    peer_id:      libp2p peer id (base58 string).
    name:         human-chosen name, for display only.
    model_id:     hash of the model's config and weights manifest; peers chain only with
                  peers on the identical model.
    start, end:   the claimed span of layers, half-open ``[start, end)``.
    throughput:   measured decode speed through ONE layer, in tokens/s (1 / seconds per
                  layer-step). A span of n layers therefore runs a token in n / throughput s.
    free_memory:  bytes this peer still offers (for display and for the weakest-window choice).
    load:         fraction of its session slots in use, 0.0 .. 1.0.
    max_sessions: how many sessions it accepts at once.
    state:        one of STATES.
    reachability: one of Reachability ("unknown", "public", "private", "hole-punched", "relayed").
    addrs:        multiaddrs others can dial.
    rtt_ms:       measured round-trip times to neighbours, peer id -> milliseconds.
    expires_at:   time after which this record is stale (same clock as the view's `now`).
    issued_at:    when the peer signed this record (its "last seen").
    dtype:        the dtype it computes in (spot checks derive their tolerance from it).
    shard_index, shard_count: tensor-shard position inside a shard group (0, 1 = not sharded).
    shard_group:  the name of that group ("" when not sharded; see peer/plan/groups.py).
    device:       the kind of device it computes on ("cpu", "cuda", "mps").
    device_free:  bytes free on that device (CUDA's free VRAM; 0 when unknown).
    held:         layer ranges whose weights it has on disk, loaded or not, sorted and
                  merged (`merge_spans`); empty when it does not say.
    context_tokens: the longest context one session over its whole span fits in the memory it
                  keeps for session state (a span of linear-attention layers: the model's whole
                  context); 0 when it does not say.
    """

    peer_id: str
    model_id: str
    start: int
    end: int
    throughput: float
    name: str = ""
    free_memory: int = 0
    load: float = 0.0
    max_sessions: int = 16
    state: str = SERVING
    reachability: str = Reachability.PUBLIC
    addrs: tuple[str, ...] = ()
    rtt_ms: Mapping[str, float] = field(default_factory=dict)
    expires_at: float = float("inf")
    issued_at: float = 0.0
    dtype: str = "float32"
    shard_index: int = 0
    shard_count: int = 1
    shard_group: str = ""
    device: str = "cpu"
    device_free: int = 0
    held: tuple[tuple[int, int], ...] = ()
    context_tokens: int = 0

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.end)

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def held_in(self, start: int, end: int) -> int:
        """How many of the layers [start, end) it has on disk."""
        return layers_held(self.held, start, end)

    @property
    def routable(self) -> bool:
        """Whether a requester may open a new session here."""
        return self.state == SERVING and self.end > self.start


def merge_spans(spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Half-open ranges sorted, with overlapping and touching ones merged and empty ones dropped.

    >>> merge_spans([(10, 15), (0, 5), (5, 8), (12, 20), (3, 3)])
    ((0, 8), (10, 20))
    """
    out: list[tuple[int, int]] = []
    for start, end in sorted((s, e) for s, e in spans if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)


def layers_held(held: Iterable[tuple[int, int]], start: int, end: int) -> int:
    """How many of the layers [start, end) the merged ranges `held` cover."""
    return sum(max(0, min(end, e) - max(start, s)) for s, e in held)


_BY_ID = attrgetter("peer_id")  # a C-level sort key: a requester re-sorts its view for every route


@dataclass(frozen=True)
class SwarmView:
    """An immutable snapshot of the peers one node knows, for one model.

    num_layers: the model's decoder layer count (L); a full route covers [0, L).
    peers:      sorted by peer id, so that every function of the view is deterministic.
    """

    num_layers: int
    peers: tuple[PeerInfo, ...] = ()

    @staticmethod
    def of(num_layers: int, peers: Iterable[PeerInfo]) -> "SwarmView":
        return SwarmView(num_layers, tuple(sorted(peers, key=_BY_ID)))

    def get(self, peer_id: str) -> PeerInfo | None:
        """The peer's info (the first, if listed twice). A dict built on the first call: every step
        of a route session prices its hops with `get`, and a view may hold thousands of peers."""
        index = self.__dict__.get("_index")
        if index is None:
            index = {}
            for p in self.peers:
                index.setdefault(p.peer_id, p)
            object.__setattr__(self, "_index", index)  # a cache of a frozen value, not a change to it
        return index.get(peer_id)

    def without(self, peer_ids: Iterable[str]) -> "SwarmView":
        drop = set(peer_ids)
        return SwarmView(self.num_layers, tuple(p for p in self.peers if p.peer_id not in drop))

    def replace(self, info: PeerInfo) -> "SwarmView":
        """The view with `info` in place of its peer's entry (added if absent), still sorted:
        an insertion, not a sort (a requester adds itself to a view of thousands every route)."""
        rest = [p for p in self.peers if p.peer_id != info.peer_id]
        rest.insert(bisect_left(rest, info.peer_id, key=_BY_ID), info)
        return SwarmView(self.num_layers, tuple(rest))

    def live(self, now: float) -> "SwarmView":
        """The peers whose advertisement has not expired at `now`."""
        return SwarmView(self.num_layers, tuple(p for p in self.peers if p.expires_at > now))

    def coverage(self) -> list[int]:
        """How many peers (in any state but leaving) claim each layer."""
        counts = [0] * self.num_layers
        for p in self.peers:
            if p.state == LEAVING:
                continue
            for layer in range(max(p.start, 0), min(p.end, self.num_layers)):
                counts[layer] += 1
        return counts

    def gaps(self) -> list[tuple[int, int]]:
        """Uncovered layer ranges, half-open, in order."""
        out: list[tuple[int, int]] = []
        counts = self.coverage()
        layer = 0
        while layer < self.num_layers:
            if counts[layer] == 0:
                begin = layer
                while layer < self.num_layers and counts[layer] == 0:
                    layer += 1
                out.append((begin, layer))
            else:
                layer += 1
        return out
