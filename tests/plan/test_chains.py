"""The chain search's pools: peers interchangeable but for speed and id (peer/plan/chains.py `Pool`)
are searched as the few a chain can use, and the answer is the one the search over everyone gives."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.peer.plan import chains
from tessera.peer.plan.chains import Candidate, Pool, cheapest_chain, links_between, pools_of
from tessera.peer.plan.routing import route, route_cost
from tessera.peer.plan.view import SwarmView

from tests.plan.test_routing import REQ, all_chains, peer

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEFAULT = 100.0


@st.composite
def crowded(draw):
    """Candidates over up to 6 layers on a few spans, many peers a span, most measured by
    nobody; speeds with exact ties and neighbouring floats; some measured pairs and
    source/sink round trips; some peers skipped (banned)."""
    layers = draw(st.integers(1, 6))
    spans = draw(st.lists(st.tuples(st.integers(0, layers - 1), st.integers(1, layers)).map(
        lambda t: (min(t), max(t)) if t[0] < t[1] else (t[0], t[0] + 1)).filter(lambda s: s[1] <= layers),
        min_size=1, max_size=4))
    base = draw(st.sampled_from([1.0, 2.5, 10.0, 1e-3]))
    cands = []
    for i in range(draw(st.integers(1, 14))):
        lo, hi = draw(st.sampled_from(spans))
        speed = draw(st.sampled_from([base, base, math.nextafter(base, math.inf), base * 3, base * 1000]))
        cands.append(Candidate(f"p{i:02d}", lo, hi, speed))
    ids = [c.pid for c in cands]
    measured_ids = draw(st.sets(st.sampled_from(ids), max_size=3))
    pairs: dict[str, dict[str, float]] = {}
    for a in sorted(measured_ids):
        for b in sorted(draw(st.sets(st.sampled_from(ids), max_size=2))):
            if a != b:
                rtt = draw(st.sampled_from([0.0, 1.0, 50.0, 300.0]))
                pairs.setdefault(a, {})[b] = pairs.setdefault(b, {})[a] = rtt
    source_rtt = {pid: draw(st.sampled_from([0.0, 5.0, 500.0])) for pid in sorted(draw(st.sets(st.sampled_from(ids), max_size=2)))}
    start = draw(st.integers(0, layers - 1))
    end = draw(st.integers(start + 1, layers))
    skip = frozenset(draw(st.sets(st.sampled_from(ids), max_size=3)))
    return cands, pairs, source_rtt, start, end, skip


def clipped(cands: list[Candidate], start: int, end: int) -> list[Candidate]:
    return [Candidate(c.pid, max(c.lo, start), min(c.hi, end), c.per_layer) for c in cands
            if max(c.lo, start) < min(c.hi, end)]


@FAST
@given(case=crowded(), heads=st.booleans(), default=st.sampled_from([1.0, DEFAULT]), first_keep=st.integers(1, 3))
def test_searching_the_pools_answers_what_searching_everyone_does(case, heads, default, first_keep):
    """Whatever a search first keeps of each pool (chains.FIRST_KEEP): too few for the chain
    found are noticed, and more are searched."""
    kept_first, chains.FIRST_KEEP = chains.FIRST_KEEP, first_keep
    try:
        _pools_answer_as_everyone(case, heads, default)
    finally:
        chains.FIRST_KEEP = kept_first


def _pools_answer_as_everyone(case, heads, default):
    cands, pairs, source_rtt, start, end, skip = case
    cands = clipped(cands, start, end)
    spans = {c.pid: (c.lo, c.hi) for c in cands}
    pairs = {a: {b: rtt for b, rtt in theirs.items() if b in spans} for a, theirs in pairs.items() if a in spans}
    links = links_between(spans, pairs)
    measured = set(pairs) | {q for v in pairs.values() for q in v} | set(source_rtt)
    kw = dict(start=start, end=end, links=links, default_rtt_ms=default, heads=heads, max_branches=10_000,
              from_source=lambda q: source_rtt.get(q, default), to_sink=lambda q: source_rtt.get(q, default))
    everyone = cheapest_chain([c for c in cands if c.pid not in skip], **kw)
    singles, pools = pools_of(cands, measured)
    assert cheapest_chain([c for c in singles if c.pid not in skip], pools=pools, skip=skip, **kw) == everyone
    assert sorted([*(c.pid for c in singles), *(c.pid for p in pools for c in p.members)]) == sorted(spans)


def crowded_view(seed: int, n: int = 12, layers: int = 5) -> SwarmView:
    rng = random.Random(seed)
    spans = [(0, 2), (2, 5), (0, 5), (3, 4)]
    peers = []
    for i in range(n):
        lo, hi = rng.choice(spans)
        measured = {REQ: rng.choice([5.0, 50.0])} if rng.random() < 0.2 else {}
        peers.append(peer(f"p{i}", lo, hi, rng.choice([100.0, 200.0, 400.0]), rtt_ms=measured))
    # the requester's own entry (as a Swarm adds it): no layers, its measured round trips
    mine = {f"p{i}": rng.choice([1.0, 20.0]) for i in rng.sample(range(n), rng.randrange(0, 4))}
    peers.append(peer(REQ, 0, 0, 0.0, state="requester", rtt_ms=mine))
    return SwarmView.of(layers, peers)


def test_routes_through_pools_match_every_chain_priced_by_hand():
    """Routing a crowded view (pools formed) with bans, a peer as the source or the sink, and
    the requester's own sessions: the answer is the cheapest of every allowed chain."""
    for seed in range(100):
        view = crowded_view(seed)
        ids = [p.peer_id for p in view.peers if p.peer_id != REQ]
        rng = random.Random(seed)
        source, sink = rng.choice([REQ, REQ, *ids]), rng.choice([None, *ids])
        exclude = frozenset(rng.sample(ids, rng.randrange(0, 3)))
        own = {pid: 1 for pid in rng.sample(ids, rng.randrange(0, 3))}
        priced = SwarmView.of(view.num_layers, [replace(p, throughput=p.throughput / (1 + own.get(p.peer_id, 0)))
                                                for p in view.peers])  # one own session on a peer: its compute twice over
        r = route(view, source=source, sink=sink, exclude=exclude, own_sessions=own)
        chains_ = all_chains(view, 0, view.num_layers, exclude)
        if not chains_:
            assert not r.ok
            continue
        best = min((route_cost(priced, c, source=source, sink=sink), len(c), tuple(h.peer_id for h in c),
                    tuple(-h.start for h in c)) for c in chains_)
        assert (r.cost_ms, len(r.hops), r.peer_ids, tuple(-h.start for h in r.hops)) == best, seed


def test_a_big_crowded_view_is_searched_over_the_few_a_chain_can_use(monkeypatch):
    """1,000 unmeasured peers on 12 spans: the search sees a fraction of them, and answers what
    it answers over all of them."""
    rng = random.Random(3)
    spans = [(a, min(a + w, 30)) for a in range(0, 30, 5) for w in (5, 10)]
    view = SwarmView.of(30, [peer(f"q{i:04d}", *rng.choice(spans), rng.uniform(50.0, 500.0)) for i in range(1000)])
    seen: list[int] = []
    real = chains._Search.__init__

    def counting(self, candidates, *args):
        seen.append(len(candidates))
        real(self, candidates, *args)

    monkeypatch.setattr(chains._Search, "__init__", counting)
    r = route(view, source=REQ)
    assert r.ok and seen and max(seen) < 100  # at most (width + 1) // 2 a span: 12 spans of 5 or 10 layers
    monkeypatch.setattr(chains, "pools_of", lambda cands, measured: (list(cands), []))
    from tessera.peer.plan import routing
    routing._prepared_memo.clear()
    monkeypatch.setattr(routing, "pools_of", chains.pools_of)
    seen.clear()
    assert route(view, source=REQ) == r and max(seen) == 1000


@pytest.mark.parametrize("first_keep", [1, 2])
def test_a_chain_may_use_two_peers_of_one_span_around_a_faster_one(monkeypatch, first_keep):
    """Two of a pool's peers in one chain, with a much faster peer nested between them: the
    pool keeps (hi - lo + 1) // 2 of its peers, not just its fastest — also when the search
    first keeps one (the chain it then finds, m1 alone, is priced high enough for 16 hops)."""
    monkeypatch.setattr(chains, "FIRST_KEEP", first_keep)
    view = SwarmView.of(3, [peer("m1", 0, 3, 1.0), peer("m2", 0, 3, 1.0), peer("m3", 0, 3, 0.5), peer("x", 1, 2, 1000.0)])
    r = route(view, source=REQ)
    assert [(h.peer_id, h.start, h.end) for h in r.hops] == [("m1", 0, 1), ("x", 1, 2), ("m2", 2, 3)]
    assert r.cost_ms == 4 * 100.0 + 2 * 1000.0 + 1.0


def test_a_chain_may_use_three_peers_of_one_span_when_two_were_first_kept(monkeypatch):
    """Three of a pool's peers in one chain, with a faster peer nested between each two: the
    search first keeps two (chains.FIRST_KEEP), finds m1, x, m2 (877.5 ms), and that price
    allows a chain through more of the pool, so it searches more and finds the cheaper one."""
    monkeypatch.setattr(chains, "FIRST_KEEP", 2)
    # Tight: the chain found leaves 877.5 - 11 * 10 = 767.5 ms above the fastest compute, room for
    # 767.5 // 200 = 3 more pool peers at two default round trips each — but for only one at four
    # (dividing by 4 * default, or halving the bound, misses the answer). The pool's peers
    # (62.5 ms a layer) beat x and y (10) by 52.5 ms a layer: more than 2 * 100 / 4, so each nested
    # peer pays for its two round trips, and less than 4 * 100 / 7, so the price found stays low.
    view = SwarmView.of(11, [*(peer(f"m{i}", 0, 11, 16.0) for i in range(1, 8)),  # 7 > (11 + 1) // 2: a pool
                             peer("x", 1, 5, 100.0), peer("y", 6, 10, 100.0)])
    r = route(view, source=REQ)
    assert [(h.peer_id, h.start, h.end) for h in r.hops] == [
        ("m1", 0, 1), ("x", 1, 5), ("m2", 5, 6), ("y", 6, 10), ("m3", 10, 11)]
    assert r.cost_ms == 6 * 100.0 + 3 * 62.5 + 8 * 10.0


def test_a_pooled_peer_the_requester_measured_is_searched_by_itself():
    """Three peers of one one-layer span, measured by nobody but the requester, which measured
    the slowest at 1 ms: that one is the cheapest chain, though a pool of them keeps only the
    fastest."""
    view = SwarmView.of(1, [peer("a", 0, 1, 400.0), peer("b", 0, 1, 300.0), peer("c", 0, 1, 200.0),
                            peer(REQ, 0, 0, 0.0, state="requester", rtt_ms={"c": 1.0})])
    r = route(view, source=REQ)
    assert r.peer_ids == ("c",) and r.cost_ms == 1.0 + 5.0 + 1.0


def test_speeds_that_round_to_one_price_are_searched_in_full():
    """Two peers of one span whose ms per layer are neighbouring floats: the chains through them
    cost the same after rounding, so the smaller id wins (routing's tie-break) although the other
    is (by an ulp) faster and alone would be kept."""
    slow = 10.0
    fast = math.nextafter(slow, 0.0)
    view = SwarmView.of(1, [peer("a", 0, 1, 1000.0 / slow), peer("z", 0, 1, 1000.0 / fast)])
    assert 1000.0 / view.get("z").throughput < 1000.0 / view.get("a").throughput  # z is faster by an ulp
    r = route(view, source=REQ)
    assert route_cost(view, r.hops, source=REQ) == route_cost(view, [type(r.hops[0])("z", 0, 1)], source=REQ)
    assert r.peer_ids == ("a",)
    pool = Pool(0, 1, (Candidate("z", 0, 1, fast), Candidate("a", 0, 1, slow)))
    assert chains._thinned([pool], frozenset()) == ([pool.members[0]], slow - fast)
    assert not chains._clear_of_rounding(slow - fast, r.cost_ms, 1)
    assert chains._clear_of_rounding(1e-6, r.cost_ms, 1)
