"""Tensor-shard groups in a swarm view: which are complete, what a group hop costs, coverage.

Pure functions of a `SwarmView`, like placement and routing. A peer started with
``--layers A:B --shard i/n --group NAME`` advertises ``shard_index=i, shard_count=n,
shard_group=NAME`` over span ``[A, B)``. A **group** is the peers advertising the
same (name, span, n); it is **complete** when every rank 0..n-1 is held by a usable
peer — then it can run its span, and routing may use it as one hop. If two peers
claim the same rank, the one with the smaller peer id serves it (deterministic), the
other is a spare.

What a group hop costs (ms per decode step), for the requester r::

    rtt(prev, r) + max_m rtt(r, m)               entered from the requester (the junction)
    + layers * (max_m ms_per_layer(m) / n         each rank computes 1/n of a layer
                + ROUNDS_PER_LAYER * max_(m, m') rtt(m, m'))
    + max_m rtt(m, r) + rtt(r, next)             and it returns to the requester

A group's input and output are hidden slices, and the requester is the junction that
scatters into it and gathers (the compatibility gather, outside the interval) out of
it, so a group hop is always entered from and left to the requester — routing prices
it that way (`group_as_peer`) and the requester runs it so (`peer/request/segmented.py`).

A worked example: a group of 3 whose members advertise 500 tokens/s per layer (2 ms
a layer) and measured 1 ms between each other, 5 ms from the requester, serving 10
layers: 5 + 10 * (2/3 + 4 * 1) + 5 = 56.7 ms — slower than one such peer (5 + 20 + 5
= 30 ms) on these numbers, as expected of a CPU group on a LAN: the group's point is
memory (each holds a third), and it wins on time only where compute dominates.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from tessera.peer.plan.cost import rtt_ms
from tessera.peer.plan.view import LEAVING, PeerInfo, SwarmView
from tessera.stages.shards.layout import ROUNDS_PER_LAYER  # exchanges per layer, each a round trip between the ranks

GROUP_PREFIX = "group:"


@dataclass(frozen=True)
class ShardGroup:
    """The ranks of one group that serve each index (peer ids, in rank order when complete)."""

    name: str
    start: int
    end: int
    count: int
    ranks: tuple[PeerInfo | None, ...]  # None: nobody usable holds that rank

    @property
    def hop_id(self) -> str:
        return group_hop_id(self.name, self.start, self.end, self.count)

    @property
    def complete(self) -> bool:
        return all(p is not None for p in self.ranks)

    @property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(p.peer_id if p is not None else "" for p in self.ranks)


def group_hop_id(name: str, start: int, end: int, count: int) -> str:
    """The id a group hop carries in a route (never a libp2p peer id: those are base58)."""
    return f"{GROUP_PREFIX}{name}[{start}:{end})/{count}"


def is_group_hop_id(peer_id: str) -> bool:
    return peer_id.startswith(GROUP_PREFIX)


def shard_groups(peers: Iterable[PeerInfo]) -> list[ShardGroup]:
    """Every group the given peers advertise (named, shard_count > 1), complete or not,
    sorted by hop id. Pass only the peers you would use (routing: usable ones)."""
    by_key: dict[tuple[str, int, int, int], dict[int, PeerInfo]] = defaultdict(dict)
    for p in sorted(peers, key=lambda p: p.peer_id):
        if p.shard_count <= 1 or not p.shard_group or not 0 <= p.shard_index < p.shard_count:
            continue
        ranks = by_key[(p.shard_group, p.start, p.end, p.shard_count)]
        ranks.setdefault(p.shard_index, p)  # the smaller peer id holds a doubly claimed rank
    groups = [
        ShardGroup(name, start, end, count, tuple(ranks.get(i) for i in range(count)))
        for (name, start, end, count), ranks in by_key.items()
    ]
    return sorted(groups, key=lambda g: g.hop_id)


def _rtt(peers: Mapping[str, PeerInfo], a: str, b: str, default_rtt_ms: float) -> float:
    return rtt_ms(peers, a, b, default_rtt_ms)


def group_as_peer(
    group: ShardGroup,
    peers: Mapping[str, PeerInfo],
    *,
    source: str,
    others: Iterable[str],
    default_rtt_ms: float,
    load_penalty: float,
) -> PeerInfo:
    """A complete group as one synthetic peer that `tessera.peer.plan.routing.route` can chain.

    Its per-layer time is the slowest rank's 1/n plus the collectives' round trips; its
    RTT to every other usable peer q (and to the source) goes through the requester
    `source`: rtt(source, group) + rtt(source, q). See the module docstring.
    """
    assert group.complete, "only a complete group can run its span"
    members = [p for p in group.ranks if p is not None]
    ids = [p.peer_id for p in members]
    slowest = max(1000.0 / p.throughput * (1.0 + load_penalty * max(p.load, 0.0)) if p.throughput > 0 else math.inf
                  for p in members)
    among = max((_rtt(peers, a, b, default_rtt_ms) for a in ids for b in ids if a < b), default=0.0)
    per_layer = slowest / group.count + ROUNDS_PER_LAYER * among
    to_source = max(_rtt(peers, source, m, default_rtt_ms) for m in ids)
    rtts = {q: to_source + _rtt(peers, source, q, default_rtt_ms) for q in others if q not in ids}
    rtts[source] = to_source
    return PeerInfo(
        peer_id=group.hop_id, model_id=members[0].model_id, start=group.start, end=group.end,
        throughput=1000.0 / per_layer if per_layer > 0 else math.inf, name=group.name,
        state=members[0].state, rtt_ms=rtts,
    )


def replica_coverage(view: SwarmView) -> list[int]:
    """How many complete replicas serve each layer: an unsharded peer counts once, a complete
    group once (not once per rank), an incomplete group not at all — so a layer at 0 has no
    way through it, whatever the ranks claim."""
    counts = [0] * view.num_layers
    live = [p for p in view.peers if p.state != LEAVING]
    spans = [(p.start, p.end) for p in live if p.shard_count == 1]
    spans += [(g.start, g.end) for g in shard_groups(live) if g.complete]
    for start, end in spans:
        for layer in range(max(start, 0), min(end, view.num_layers)):
            counts[layer] += 1
    return counts


def group_report(view: SwarmView) -> list[dict]:
    """Every group as plain data (for `swarm status`): its span, size, and who holds each rank."""
    live = [p for p in view.peers if p.state != LEAVING]
    return [
        {"group": g.name, "span": [g.start, g.end], "count": g.count, "complete": g.complete,
         "ranks": [p.peer_id if p is not None else None for p in g.ranks]}
        for g in shard_groups(live)
    ]


def with_group_peers(
    peers: Mapping[str, PeerInfo],
    *,
    source: str,
    usable: Callable[[PeerInfo], bool],
    default_rtt_ms: float,
    load_penalty: float,
) -> tuple[dict[str, PeerInfo], dict[str, ShardGroup]]:
    """`peers` plus one synthetic peer per complete group of usable ranks (for `route`),
    and the groups by their hop id. Ranks themselves stay in `peers` (route skips them)."""
    ranks = [p for p in peers.values() if p.shard_count > 1 and usable(p)]
    complete = [g for g in shard_groups(ranks) if g.complete]
    if not complete:
        return dict(peers), {}
    others = [pid for pid, p in peers.items() if p.shard_count == 1]
    out = dict(peers)
    synthetic = [group_as_peer(g, peers, source=source, others=others, default_rtt_ms=default_rtt_ms,
                               load_penalty=load_penalty) for g in complete]
    for a in synthetic:
        for b in synthetic:
            if a is not b:  # group to group: through the requester as well
                a.rtt_ms[b.peer_id] = a.rtt_ms[source] + b.rtt_ms[source]  # type: ignore[index]
        out[a.peer_id] = a
    return out, {g.hop_id: g for g in complete}
