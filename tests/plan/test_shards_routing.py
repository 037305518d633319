"""Tensor-shard groups as routing hops, coverage by replicas, and the group's wire messages (pure)."""

from __future__ import annotations

import os

import pytest

from tessera.peer.plan.routing import Hop, route
from tessera.peer.plan.groups import group_as_peer, group_hop_id, replica_coverage, shard_groups
from tessera.peer.plan.view import PeerInfo, SwarmView
from tessera.protocol.codec import decode, encode
from tessera.protocol.errors import InconsistentFields
from tessera.protocol.messages import SealedKey
from tessera.protocol.shards import Collective, ShardOpen, ShardPeer

REQ = "req"


def peer(pid: str, start: int, end: int, throughput: float = 1000.0, **kw) -> PeerInfo:
    return PeerInfo(pid, "m", start, end, throughput, **kw)


def rank(pid: str, i: int, n: int, start: int = 0, end: int = 4, group: str = "g", **kw) -> PeerInfo:
    return peer(pid, start, end, shard_index=i, shard_count=n, shard_group=group, **kw)


def test_a_complete_group_is_one_hop_with_its_ranks_in_order():
    view = SwarmView.of(4, [rank("s2", 2, 3), rank("s0", 0, 3), rank("s1", 1, 3)])
    assert not route(view, source=REQ).ok  # groups off: ranks are not whole hops
    got = route(view, source=REQ, groups=True)
    assert got.hops == (Hop(group_hop_id("g", 0, 4, 3), 0, 4, group="g", members=("s0", "s1", "s2")),)


def test_an_incomplete_or_excluded_group_is_no_hop():
    ranks = [rank("s0", 0, 3), rank("s1", 1, 3), rank("s2", 2, 3)]
    assert not route(SwarmView.of(4, ranks[:2]), source=REQ, groups=True).ok
    assert not route(SwarmView.of(4, ranks), source=REQ, groups=True, exclude=frozenset({"s1"})).ok
    assert not route(SwarmView.of(4, [*ranks[:2], rank("x", 2, 3, group="other")]), source=REQ, groups=True).ok
    busy = [*ranks[:2], rank("s2", 2, 3, load=1.0)]
    assert not route(SwarmView.of(4, busy), source=REQ, groups=True).ok


def test_a_group_between_plain_peers_and_a_doubly_claimed_rank():
    view = SwarmView.of(6, [
        peer("a", 0, 2), rank("s0", 0, 2, 2, 4), rank("s1", 1, 2, 2, 4), rank("s1b", 1, 2, 2, 4), peer("b", 4, 6),
    ])
    got = route(view, source=REQ, groups=True)
    assert [(h.peer_id, h.start, h.end, h.members) for h in got.hops] == [
        ("a", 0, 2, ()), (group_hop_id("g", 2, 4, 2), 2, 4, ("s0", "s1")), ("b", 4, 6, ()),
    ]
    # a sub-span of the group is a hop too (a failover re-routes [3, 4) onto it)
    assert route(view, source=REQ, start=3, end=4, groups=True).hops[0].members == ("s0", "s1")


def test_the_group_cost_follows_the_worked_example():
    """Ranks at 500 tok/s per layer, 1 ms apart, 5 ms from the requester, 10 layers: 56.7 ms."""
    ids = ["s0", "s1", "s2"]
    ranks = [rank(p, i, 3, 0, 10, throughput=500.0, rtt_ms={q: 1.0 for q in ids if q != p}) for i, p in enumerate(ids)]
    me = PeerInfo(REQ, "m", 0, 0, 0.0, state="requester", rtt_ms={p: 5.0 for p in ids})
    view = SwarmView.of(10, [*ranks, me])
    (group,) = shard_groups(ranks)
    synthetic = group_as_peer(group, {p.peer_id: p for p in view.peers}, source=REQ, others=[], default_rtt_ms=100.0,
                              load_penalty=1.0)
    assert 10 * 1000.0 / synthetic.throughput == pytest.approx(10 * (2.0 / 3 + 4 * 1.0))
    assert route(view, source=REQ, groups=True).cost_ms == pytest.approx(5 + 10 * (2.0 / 3 + 4.0) + 5)


def test_coverage_counts_a_complete_group_once_and_an_incomplete_one_not_at_all():
    view = SwarmView.of(4, [peer("a", 0, 2), rank("s0", 0, 2, 0, 4), rank("s1", 1, 2, 0, 4), rank("t0", 0, 2, 2, 4, group="t")])
    assert replica_coverage(view) == [2, 2, 1, 1]
    assert view.coverage() == [3, 3, 3, 3]  # the per-peer count, for contrast


# -- the wire -------------------------------------------------------------------------------


def sealed(link: int) -> SealedKey:
    return SealedKey(link, os.urandom(72))


def shard_open(**changes) -> ShardOpen:
    fields = dict(
        session_id=os.urandom(16), start=10, end=20, max_length=64, requester=b"r" * 38, ephemeral_public=os.urandom(32),
        group="g", shard_index=1, in_key=sealed(1), out_key=sealed(2),
        others=(ShardPeer(b"a" * 38, ("/ip4/127.0.0.1/tcp/1",), sealed(3), sealed(4)),
                ShardPeer(b"c" * 38, (), sealed(5), sealed(6))),
    )
    return ShardOpen(**{**fields, **changes})


def test_shard_messages_round_trip():
    msg = shard_open()
    assert decode(encode(msg)) == msg
    assert msg.shard_count == 3 and [msg.rank_of(k) for k in range(2)] == [0, 2]
    frame = Collective(os.urandom(16), 7, 3, 1, 12, b"x" * 100)
    assert decode(encode(frame)) == frame


def test_shard_open_invariants():
    with pytest.raises(InconsistentFields, match="shard_index 3 is beyond a group of 3"):
        shard_open(shard_index=3)
    with pytest.raises(InconsistentFields, match="no other rank is listed"):
        shard_open(others=())
    with pytest.raises(InconsistentFields, match="layer range"):
        shard_open(start=20)


def test_a_route_with_groups_runs_as_segments_joined_at_the_requester():
    from tessera.peer.request.chain_state import RequesterContext
    from tessera.peer.request.chain import RouteSession
    from tessera.peer.plan.routing import Route
    from tessera.peer.request.segmented import build_segments, has_groups, span_of
    from tessera.peer.request.group import GroupSession

    ctx = RequesterContext(transport=None, identity=None, keeper=None, nursery=None, num_layers=8, hidden_size=64)
    group = Hop(group_hop_id("g", 2, 5, 2), 2, 5, group="g", members=("s0", "s1"))
    route = Route((Hop("a", 0, 1), Hop("b", 1, 2), group, Hop("c", 5, 8)), 0.0)
    segments = build_segments(ctx, route, max_length=16)
    assert has_groups(route) and not has_groups(Route((Hop("a", 0, 8),), 0.0))
    assert [type(s) for s in segments] == [RouteSession, GroupSession, RouteSession]
    assert [span_of(s) for s in segments] == [(0, 2), (2, 5), (5, 8)]
    assert segments[0].route.peer_ids == ("a", "b")  # plain hops still push straight to each other
    assert segments[1].width == 32 and segments[1].cols(1) == (32, 64)


def test_a_ranks_error_blames_the_rank_it_names():
    from tessera.peer.request.group import culprit

    members = ["12D3KooWA", "12D3KooWB", "12D3KooWC"]
    assert culprit("compute-failed: step 3: shard peer 12D3KooWC (rank 2) failed: its link closed", members,
                   "12D3KooWA") == "12D3KooWC"
    assert culprit("compute-failed: step 3: bad input", members, "12D3KooWA") == "12D3KooWA"
