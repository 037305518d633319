"""Routing: the cheapest chain of peers through a range of layers."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.peer.plan import routing
from tessera.peer.plan.cost import DEFAULT_RTT_MS, hop_compute_ms, rtt_ms
from tessera.peer.plan.routing import NO_ROUTE, Hop, Route, route, route_cost
from tessera.peer.plan.view import DRAINING, LEAVING, LOADING, STATES, PeerInfo, SwarmView

MODEL = "m"
REQ = "req"
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def peer(pid: str, start: int, end: int, throughput: float = 1000.0, **kw) -> PeerInfo:
    return PeerInfo(pid, MODEL, start, end, throughput, **kw)


def usable(p: PeerInfo, exclude=frozenset()) -> bool:
    return p.routable and p.peer_id not in exclude and p.throughput > 0 and p.load < 1.0


def all_chains(view: SwarmView, start: int, end: int, exclude=frozenset()):
    """Every chain the routing rule allows: distinct usable peers, each computing a sub-span
    of its span, every cut point where the peer before it ends or where the peer after it
    starts (peer/plan/chains.py)."""
    out = []
    peers = sorted((p for p in view.peers if usable(p, exclude)), key=lambda p: p.peer_id)

    def extend(at: int, hops: tuple[Hop, ...]) -> None:
        if at == end:
            out.append(hops)
            return
        used = {h.peer_id for h in hops}
        for p in peers:
            if p.peer_id in used or not p.start <= at < p.end:
                continue
            if hops and at != view.get(hops[-1].peer_id).end and at != p.start:
                continue  # the cut is neither where the last peer ends nor where this one starts
            ends = {min(p.end, end)} | {q.start for q in peers if at < q.start < min(p.end, end)}
            for until in sorted(ends):
                extend(until, hops + (Hop(p.peer_id, at, until),))

    extend(start, ())
    return out


def tail_chains(view: SwarmView, start: int, end: int, exclude=frozenset()):
    """The chains routing took before head hand-overs: each peer runs to the end of its span."""
    return [c for c in all_chains(view, start, end, exclude)
            if all(h.end == min(view.get(h.peer_id).end, end) for h in c)]


# -- the worked example and the basics -------------------------------------------------


def example() -> SwarmView:
    return SwarmView.of(
        4,
        [
            peer("a", 0, 2, 100.0, rtt_ms={REQ: 5.0}),
            peer("b", 2, 4, 100.0, rtt_ms={REQ: 5.0}),
            peer("c", 0, 4, 20.0),
        ],
    )


def test_docstring_example():
    view = example()
    r = route(view, source=REQ)
    assert r == Route((Hop("a", 0, 2), Hop("b", 2, 4)), 150.0) and r.ok and r.peer_ids == ("a", "b")
    assert route_cost(view, r.hops, source=REQ) == 150.0
    assert route_cost(view, (Hop("c", 0, 4),), source=REQ) == 400.0
    measured = view.replace(replace(view.get("a"), rtt_ms={REQ: 5.0, "b": 10.0}))
    assert route(measured, source=REQ).cost_ms == 60.0
    # without a, c runs only [0, 2) and hands over at b's first layer (a head hand-over)
    assert route(view, source=REQ, exclude=frozenset({"a"})) == Route((Hop("c", 0, 2), Hop("b", 2, 4)), 325.0)
    assert route(view, source=REQ, exclude=frozenset({"a", "b"})) == Route((Hop("c", 0, 4),), 400.0)
    r = route(view, source=REQ, exclude=frozenset({"a", "c"}))
    assert r == NO_ROUTE and not r.ok and r.hops == () and r.cost_ms == math.inf


def test_rtt_is_measured_either_way_or_default():
    peers = {
        "a": peer("a", 0, 1, rtt_ms={"b": 10.0, "c": 30.0}),
        "b": peer("b", 0, 1, rtt_ms={"a": 20.0}),
        "c": peer("c", 0, 1),
    }
    assert rtt_ms(peers, "a", "b") == rtt_ms(peers, "b", "a") == 15.0  # both: the mean
    assert rtt_ms(peers, "c", "a") == 30.0  # one side
    assert rtt_ms(peers, "b", "c") == DEFAULT_RTT_MS
    assert rtt_ms(peers, "b", "c", 7.0) == 7.0
    assert rtt_ms(peers, "a", "a") == 0.0
    assert rtt_ms(peers, "x", "y") == DEFAULT_RTT_MS  # neither in the view


def test_compute_and_load():
    assert hop_compute_ms(peer("a", 0, 4, 200.0), 4) == 20.0
    assert hop_compute_ms(peer("a", 0, 4, 200.0, load=0.5), 4) == 30.0
    assert hop_compute_ms(peer("a", 0, 4, 200.0, load=0.5), 4, load_penalty=0.0) == 20.0
    assert hop_compute_ms(peer("a", 0, 4, 0.0), 4) == math.inf


def test_rtt_changes_the_choice():
    near_a = SwarmView.of(4, [peer("a", 0, 4, rtt_ms={REQ: 10.0}), peer("b", 0, 4, rtt_ms={REQ: 50.0})])
    assert route(near_a, source=REQ).peer_ids == ("a",)
    near_b = SwarmView.of(4, [peer("a", 0, 4, rtt_ms={REQ: 50.0}), peer("b", 0, 4, rtt_ms={REQ: 10.0})])
    assert route(near_b, source=REQ).peer_ids == ("b",)
    # two fast halves with a measured 1 ms link beat one slow whole
    split = SwarmView.of(
        4,
        [peer("a", 0, 2, rtt_ms={"b": 1.0}), peer("b", 2, 4), peer("c", 0, 4, 100.0)],
    )
    assert route(split, source=REQ).peer_ids == ("a", "b")  # 100+2+1+2+100 < 100+40+100
    slow_link = split.replace(replace(split.get("a"), rtt_ms={"b": 500.0}))
    assert route(slow_link, source=REQ).peer_ids == ("c",)  # a measured slow link is not "default"


def test_load_changes_the_choice_and_full_peers_are_avoided():
    view = SwarmView.of(4, [peer("a", 0, 4, 100.0, load=0.5), peer("b", 0, 4, 100.0, load=0.25)])
    assert route(view, source=REQ).peer_ids == ("b",)
    assert route(view, source=REQ, load_penalty=0.0).peer_ids == ("a",)  # then a tie: by id
    full = SwarmView.of(4, [peer("a", 0, 4, 100.0, load=1.0)])
    assert route(full, source=REQ) == NO_ROUTE


@pytest.mark.parametrize("state", [DRAINING, LEAVING, LOADING])
def test_only_serving_peers_are_used(state):
    view = SwarmView.of(4, [peer("fast", 0, 4, 10_000.0, state=state), peer("slow", 0, 4, 10.0)])
    assert route(view, source=REQ).peer_ids == ("slow",)
    assert route(view, source=REQ, exclude=frozenset({"slow"})) == NO_ROUTE


def test_tensor_shards_are_not_whole_hops():
    view = SwarmView.of(4, [peer("s0", 0, 4, shard_count=2), peer("s1", 0, 4, shard_index=1, shard_count=2)])
    assert route(view, source=REQ) == NO_ROUTE


def test_excluded_peers_are_avoided():
    view = SwarmView.of(4, [peer("a", 0, 4), peer("b", 0, 4, 10.0)])
    assert route(view, source=REQ).peer_ids == ("a",)
    assert route(view, source=REQ, exclude=frozenset({"a"})).peer_ids == ("b",)
    assert route(view, source=REQ, exclude={"a"}).peer_ids == ("b",)  # any set will do


@pytest.mark.parametrize("state", [DRAINING, LEAVING, LOADING])
def test_covered_but_busy_counts_full_and_refusing_peers_as_a_queue_not_other_states(state):
    """Only busy peers between a requester and a route make it a queue to wait in (the
    requester's open waits BUSY_WAIT more then): full ones, and those it skips for a refusal
    (left out of `avoided` by the caller); a gap, a peer avoided for a failure, or one not
    serving is no queue."""
    view = SwarmView.of(4, [peer("full", 0, 2, load=1.0), peer("open", 2, 4)])
    assert route(view, source=REQ) == NO_ROUTE
    assert routing.covered_but_busy(view)
    assert routing.covered_but_busy(view, start=2)
    assert not routing.covered_but_busy(view, avoided={"open"})  # banned for a failure: a gap
    assert not routing.covered_but_busy(SwarmView.of(4, [peer("full", 0, 2, load=1.0)]))  # layers 2-3: nobody
    gone = SwarmView.of(4, [peer("full", 0, 2, load=1.0, state=state), peer("open", 2, 4)])
    assert not routing.covered_but_busy(gone)
    assert not routing.covered_but_busy(view, start=3, end=3)  # nothing asked: nothing to wait for


def test_a_gap_gives_no_route():
    view = SwarmView.of(10, [peer("a", 0, 4), peer("b", 5, 10)])
    assert route(view, source=REQ) == NO_ROUTE
    assert route(view, source=REQ, end=4).peer_ids == ("a",)  # but [0, 4) is fine
    assert route(view, source=REQ, start=5).peer_ids == ("b",)


def test_sub_span_entry():
    # b serves [2, 8) but the chain enters it at 5, where a ends
    view = SwarmView.of(8, [peer("a", 0, 5), peer("b", 2, 8)])
    assert route(view, source=REQ).hops == (Hop("a", 0, 5), Hop("b", 5, 8))
    # the end of the range cuts the last hop short
    assert route(view, source=REQ, end=6).hops == (Hop("a", 0, 5), Hop("b", 5, 6))
    # and a range starting inside a span enters it there
    assert route(view, source=REQ, start=3, end=4).hops == (Hop("a", 3, 4),)


def test_rerouting_a_failed_span_over_other_cut_points():
    # chain u[0,4) f[4,8) d[8,12); f dies. Replacements x[2,6), y[5,10) cut elsewhere.
    view = SwarmView.of(
        12,
        [peer("u", 0, 4), peer("f", 4, 8), peer("d", 8, 12), peer("x", 2, 6), peer("y", 5, 10, 500.0)],
    )
    r = route(view, start=4, end=8, source="u", sink="d", exclude=frozenset({"f"}))
    assert r.hops == (Hop("x", 4, 6), Hop("y", 6, 8))
    assert r.cost_ms == route_cost(view, r.hops, source="u", sink="d")
    assert r.cost_ms == DEFAULT_RTT_MS + 2 * 1.0 + DEFAULT_RTT_MS + 2 * 2.0 + DEFAULT_RTT_MS
    # without x nobody can take over at layer 4
    assert route(view, start=4, end=8, source="u", sink="d", exclude=frozenset({"f", "x"})) == NO_ROUTE


def test_the_ring_returns_to_the_source_by_default():
    view = SwarmView.of(2, [peer("a", 0, 2, rtt_ms={REQ: 3.0, "other": 50.0})])
    assert route(view, source=REQ).cost_ms == 3.0 + 2.0 + 3.0
    assert route(view, source=REQ, sink="other").cost_ms == 3.0 + 2.0 + 50.0


def test_empty_range_and_bad_ranges():
    view = example()
    assert route(view, source=REQ, start=2, end=2) == Route((), 0.0)
    for start, end in [(-1, 4), (3, 2), (0, 5)]:
        with pytest.raises(ValueError, match="start"):
            route(view, source=REQ, start=start, end=end)


def test_route_cost_rejects_bad_chains():
    view = example()
    assert route_cost(view, (Hop("a", 0, 2), Hop("c", 3, 4)), source=REQ) == math.inf  # not contiguous
    assert route_cost(view, (Hop("a", 0, 3),), source=REQ) == math.inf  # outside a's span
    assert route_cost(view, (Hop("zz", 0, 2),), source=REQ) == math.inf  # unknown peer
    assert route_cost(view, (Hop("a", 1, 1),), source=REQ) == math.inf  # empty hop
    assert route_cost(view, (), source=REQ, sink="a") == 5.0  # nothing to run


def test_exact_ties_prefer_fewer_hops_then_smaller_ids():
    # whole: 1 hop; halves: 2 hops with a free link between them — the same cost
    view = SwarmView.of(
        4,
        [peer("a-half", 0, 2, rtt_ms={"b-half": 0.0}), peer("b-half", 2, 4), peer("c-whole", 0, 4)],
    )
    assert route_cost(view, (Hop("a-half", 0, 2), Hop("b-half", 2, 4)), source=REQ) == route_cost(
        view, (Hop("c-whole", 0, 4),), source=REQ
    )
    assert route(view, source=REQ).peer_ids == ("c-whole",)
    twins = SwarmView.of(4, [peer("b", 0, 4), peer("a", 0, 4)])
    assert route(twins, source=REQ).peer_ids == ("a",)


def test_same_view_any_order_same_route():
    rng = random.Random(3)
    peers = [
        peer(f"p{i}", s, min(s + rng.randint(1, 8), 16), rng.choice([100.0, 200.0, 400.0]), load=rng.choice([0.0, 0.5]))
        for i, s in enumerate(rng.choices(range(16), k=30))
    ]
    routes = set()
    for _ in range(10):
        rng.shuffle(peers)
        routes.add(route(SwarmView(16, tuple(peers)), source=REQ))  # deliberately not sorted
    assert len(routes) == 1 and next(iter(routes)).ok


# -- against oracles ---------------------------------------------------------------


@st.composite
def small_views(draw, *, exact: bool):
    """Views of up to 6 peers over up to 6 layers. With ``exact``, every cost is a
    small dyadic number, so float sums are exact and ties are real ties."""
    num_layers = draw(st.integers(1, 6))
    ids = [f"p{i}" for i in range(draw(st.integers(0, 6)))]
    nodes = ids + [REQ, "sink"]
    rtt = st.sampled_from([0.0, 1.0, 4.0, 50.0, 100.0, 300.0]) if exact else st.floats(0.0, 400.0)
    peers = []
    for pid in ids:
        start = draw(st.integers(0, num_layers - 1))
        end = draw(st.integers(start + 1, num_layers))
        peers.append(
            peer(
                pid,
                start,
                end,
                draw(st.sampled_from([1000.0, 500.0, 250.0, 125.0]) if exact else st.floats(1.0, 2000.0)),
                load=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]) if exact else st.floats(0.0, 1.0)),
                state=draw(st.sampled_from(STATES) if draw(st.integers(0, 4)) == 0 else st.just("serving")),
                rtt_ms=draw(st.dictionaries(st.sampled_from(nodes), rtt, max_size=4)),
            )
        )
    start = draw(st.integers(0, num_layers - 1))
    end = draw(st.integers(start + 1, num_layers))
    exclude = frozenset(draw(st.lists(st.sampled_from(ids), max_size=2))) if ids else frozenset()
    source = draw(st.sampled_from([REQ, REQ, *ids]))  # a peer re-routing after its own hop
    sink = draw(st.sampled_from([None, "sink", *ids]))
    return SwarmView.of(num_layers, peers), start, end, exclude, source, sink


@FAST
@given(case=small_views(exact=True), default=st.sampled_from([0.0, 100.0]))
def test_matches_brute_force_including_ties(case, default):
    view, start, end, exclude, source, sink = case
    kw = dict(source=source, sink=sink, default_rtt_ms=default)
    chains = all_chains(view, start, end, exclude)
    r = route(view, start=start, end=end, exclude=exclude, **kw)
    if not chains:
        assert r == NO_ROUTE
        return
    best = min((route_cost(view, c, **kw), len(c), tuple(h.peer_id for h in c), tuple(-h.start for h in c))
               for c in chains)
    assert (r.cost_ms, len(r.hops), r.peer_ids, tuple(-h.start for h in r.hops)) == best
    assert r.hops in chains
    assert len(set(r.peer_ids)) == len(r.peer_ids)  # a peer is one session of a route: never twice
    assert r.cost_ms <= min(route_cost(view, c, **kw) for c in tail_chains(view, start, end, exclude))


@FAST
@given(case=small_views(exact=False), penalty=st.floats(0.0, 3.0))
def test_matches_brute_force_on_arbitrary_floats(case, penalty):
    view, start, end, exclude, source, sink = case
    kw = dict(source=source, sink=sink, load_penalty=penalty)
    chains = all_chains(view, start, end, exclude)
    r = route(view, start=start, end=end, exclude=exclude, **kw)
    if not chains:
        assert r == NO_ROUTE
        return
    assert r.hops in chains
    assert r.cost_ms == route_cost(view, r.hops, **kw)  # same arithmetic, bit for bit
    assert r.cost_ms == min(route_cost(view, c, **kw) for c in chains)


def dijkstra(view: SwarmView, *, source: str, default: float = DEFAULT_RTT_MS, heads: bool = True) -> float:
    """A plain Dijkstra over (boundary, last peer) states, trying every pair: with `heads`, a
    peer may be left at any later peer's start (peers may repeat: a lower bound); without,
    each runs to its end (the chains routing took before head hand-overs)."""
    peers = {p.peer_id: p for p in view.peers}
    live = [p for p in view.peers if usable(p)]
    starts = sorted({p.start for p in live})
    dist = {(0, source): 0.0}
    heap = [(0.0, 0, source)]
    best = math.inf
    while heap:
        d, at, last = heapq.heappop(heap)
        if d > dist.get((at, last), math.inf):
            continue
        if at == view.num_layers:
            best = min(best, d + rtt_ms(peers, last, source, default))
            continue
        for p in live:
            if not p.start <= at < p.end:
                continue
            if last in peers and at != peers[last].end and at != p.start:
                continue  # a cut where neither the last peer ends nor p starts
            exits = [p.end] + ([b for b in starts if at < b < p.end] if heads else [])
            for until in exits:
                nd = d + rtt_ms(peers, last, p.peer_id, default) + hop_compute_ms(p, until - at)
                if nd < dist.get((until, p.peer_id), math.inf):
                    dist[(until, p.peer_id)] = nd
                    heapq.heappush(heap, (nd, until, p.peer_id))
    return best


def random_view(n: int, num_layers: int, neighbours: int, seed: int) -> SwarmView:
    rng = random.Random(seed)
    ids = [f"peer{i:04d}" for i in range(n)]
    peers = []
    for pid in ids:
        k = rng.randint(max(1, num_layers // 10), max(1, num_layers // 3))
        start = rng.randint(0, num_layers - k)
        rtts = {other: rng.uniform(2.0, 250.0) for other in rng.sample(ids, neighbours) if other != pid}
        rtts[REQ] = rng.uniform(2.0, 250.0)
        peers.append(
            peer(pid, start, start + k, rng.uniform(20.0, 500.0), load=rng.random() * 0.9, rtt_ms=rtts,
                 state=DRAINING if rng.random() < 0.05 else "serving")
        )
    return SwarmView.of(num_layers, peers)


@pytest.mark.parametrize("seed", range(3))
def test_matches_plain_dijkstra_on_a_mid_sized_swarm(seed):
    view = random_view(120, 24, 15, seed)
    r = route(view, source=REQ)
    relaxed, tails = dijkstra(view, source=REQ), dijkstra(view, source=REQ, heads=False)
    assert r.ok and relaxed - 1e-9 <= r.cost_ms <= tails + 1e-9
    assert len(set(r.peer_ids)) == len(r.peer_ids)
    assert r.cost_ms == route_cost(view, r.hops, source=REQ)


def test_a_thousand_peer_swarm():
    view = random_view(1000, 60, 20, seed=7)
    r = route(view, source=REQ)
    assert r.ok and r.hops[0].start == 0 and r.hops[-1].end == 60
    assert r.cost_ms == route_cost(view, r.hops, source=REQ)
    assert route(view, source=REQ) == r  # and again (the memoised link index)
    # new views where loads changed (the link index is reused) or RTT maps are equal
    # copies (compared by value) give what a cold start gives
    rng = random.Random(1)
    for _ in range(3):
        loaded = SwarmView(60, tuple(replace(p, load=rng.random() * 0.99, rtt_ms=dict(p.rtt_ms)) for p in view.peers))
        warm = route(loaded, source=REQ)
        routing._links_memo = None
        routing._prepared_memo.clear()
        assert route(loaded, source=REQ) == warm
    # a fresh but equal view gives the same route
    assert route(SwarmView(60, tuple(reversed(view.peers))), source=REQ) == r
    # re-routing a middle span with the first choice excluded
    mid = r.hops[len(r.hops) // 2]
    again = route(view, start=mid.start, end=mid.end, source=REQ, exclude=frozenset({mid.peer_id}))
    assert mid.peer_id not in again.peer_ids


def test_a_view_prepared_once_routes_as_a_cold_one():
    """route() prepares a view once per range (routing._prepared) and applies exclusions, the
    source and the sink per call: every call on the prepared view answers what a cold call does,
    including exclusions that drop the first choice and sub-ranges with other ends."""
    view = random_view(150, 24, 10, seed=3)
    ids = [p.peer_id for p in view.peers]
    rng = random.Random(5)
    calls = [dict(source=REQ)]
    for _ in range(12):
        start = rng.randrange(0, 20)
        calls.append(dict(start=start, end=rng.randrange(start + 1, 25), source=rng.choice(ids + [REQ]),
                          sink=rng.choice(ids + [REQ]), exclude=frozenset(rng.sample(ids, rng.randrange(0, 40)))))
    first = route(view, source=REQ)
    calls.append(dict(source=REQ, exclude=frozenset(first.peer_ids[:1])))
    for kwargs in calls:
        warm = route(view, **kwargs)  # the view (and, after the first, this range) prepared already
        routing._prepared_memo.clear()
        routing._links_memo = None
        assert route(view, **kwargs) == warm
        assert not set(warm.peer_ids) & kwargs.get("exclude", frozenset())
    # an equal view that is another object is prepared afresh, and routes the same
    same = SwarmView(view.num_layers, tuple(view.peers))
    assert route(same, source=REQ) == first


def test_a_new_view_sharing_records_with_the_last_routes_as_a_cold_one():
    """A view that holds most of the last view's PeerInfo objects takes their candidates over
    (routing._prepared): the peers whose records changed are priced afresh."""
    view = random_view(150, 24, 0, seed=4)  # no measured links: most peers pooled
    first = route(view, source=REQ)
    chosen = view.get(first.peer_ids[0])
    for changed in (replace(chosen, load=1.0), replace(chosen, throughput=chosen.throughput / 50),
                    replace(chosen, start=0, end=24), replace(chosen, state=DRAINING)):
        route(view, source=REQ)  # the last prepared entry for this range is the old view's
        new = view.replace(changed)
        warm = route(new, source=REQ)
        routing._prepared_memo.clear()
        routing._links_memo = None
        assert route(new, source=REQ) == warm
        assert warm != first or changed.start == 0  # the change is seen (a wider span may still win)


def test_a_requesters_own_sessions_price_a_peer_as_a_step_queued_there():
    """`own_sessions`: each session the requester already runs on a peer adds one step of that
    peer's compute to its price (cost.py OWN_SESSION_PENALTY), so that a requester's concurrent
    answers spread over equivalent peers instead of queueing on the fastest."""
    view = SwarmView.of(30, [peer("a", 0, 30, 1000.0), peer("b", 0, 30, 900.0), peer("c", 0, 15, 2000.0)])
    assert route(view, source=REQ).peer_ids == ("a",)
    once = route(view, source=REQ, own_sessions={"a": 1})
    assert once.peer_ids == ("b",)
    # one session on a is a's compute twice over: what a at half its speed costs
    halved = SwarmView.of(30, [peer("a", 0, 30, 500.0), peer("b", 0, 30, 900.0), peer("c", 0, 15, 2000.0)])
    assert route(view, source=REQ, own_sessions={"a": 1, "b": 1}) == route(halved, source=REQ, own_sessions={"b": 1})
    assert route(view, source=REQ, own_sessions={"a": 1, "b": 1}).peer_ids == ("a",)  # 60 ms against b's 66.7
    # with the load penalty on top, and for peers that are not candidates (or have none running)
    loaded = view.replace(replace(view.get("b"), load=0.9))
    assert route(loaded, source=REQ, own_sessions={"a": 1}).peer_ids == ("a",)  # b: 1.11 ms x 1.9 a layer, a: 1 ms x 2
    assert route(view, source=REQ, own_sessions={"nobody": 3, "b": 0}) == route(view, source=REQ)
    assert route(view, start=15, source=REQ, own_sessions={"c": 5}) == route(view, start=15, source=REQ)  # c ends at 15
    # the cost it reports is the repriced one, and a prepared view is not changed by it
    assert once.cost_ms == 100.0 + 30 * 1000.0 / 900.0 + 100.0
    assert route(view, source=REQ).peer_ids == ("a",)
