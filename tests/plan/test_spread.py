"""Routing with what a requester hears and a seeded spread (peer/plan/cost.py `Reported`,
`Spread`): a reported queue raises a peer's price, chains of nearly the same price share the
answers in proportion to their spare room, one salt gives one route, and a chain much cheaper
than the rest is taken whatever the draw."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tessera.peer.plan.cost import (
    LOAD_BANDS, SPARE_FLOOR, SPREAD_WIDTH, Reported, Spread, load_band, load_resign_interval, ms_per_layer, spare,
)
from tessera.peer.plan.routing import route
from tessera.peer.plan.view import PeerInfo, SwarmView

REQ = "req"


def peer(pid: str, start: int, end: int, throughput: float = 100.0, *, load: float = 0.0,
         max_sessions: int = 16) -> PeerInfo:
    return PeerInfo(peer_id=pid, model_id="m", start=start, end=end, throughput=throughput, load=load,
                    max_sessions=max_sessions)


def shares(view: SwarmView, draws: int = 2000, **kw) -> Counter[str]:
    rng = random.Random(7)
    return Counter(route(view, source=REQ, spread=Spread(rng.getrandbits(64)), **kw).peer_ids[0] for _ in range(draws))


def test_a_reported_queue_is_priced() -> None:
    """Two equal peers; b said a step would wait 2 s: a is taken (by b's 2 s over its span), and
    b's higher reported load prices it as the record's would."""
    view = SwarmView.of(4, [peer("a", 0, 4), peer("b", 0, 4)])
    assert route(view, source=REQ).peer_ids == ("a",)  # a tie: by id
    assert route(view, source=REQ, reported={"a": Reported(wait_ms=2000.0)}).peer_ids == ("b",)
    chosen = route(view, source=REQ, reported={"a": Reported(wait_ms=2000.0)})
    assert chosen.cost_ms == pytest.approx(100 + 4 * 10.0 + 100)
    slow = route(view, source=REQ, reported={"a": Reported(wait_ms=2000.0)}, spread=None)
    assert slow == chosen
    base = ms_per_layer(view.get("a"), 1.0)
    assert ms_per_layer(view.get("a"), 1.0, reported=Reported(wait_ms=2000.0)) == pytest.approx(base + 2000.0 / 4)
    assert ms_per_layer(view.get("a"), 1.0, reported=Reported(load=0.5)) == pytest.approx(base * 1.5)
    assert ms_per_layer(peer("c", 0, 4, load=0.75), 1.0, reported=Reported(load=0.5)) == pytest.approx(base * 1.75)


def test_equal_chains_share_the_answers() -> None:
    """Four peers of one price: without a spread one takes every answer (a herd of requesters
    that see the same view); with it each takes a quarter."""
    view = SwarmView.of(4, [peer(p, 0, 4) for p in "abcd"])
    assert {route(view, source=REQ).peer_ids for _ in range(5)} == {("a",)}  # the tie goes by id
    got = shares(view)
    for pid in "abcd":
        assert abs(got[pid] / 2000 - 0.25) < 0.04, got


def test_among_equal_prices_the_draw_is_weighted_by_spare_room() -> None:
    """The exponential race behind the spread: the smallest of E_i / spare_i falls to i with
    probability spare_i / sum(spare): a peer with half the room is drawn half as often."""
    rng = random.Random(3)
    room = {"a": 0.5, "b": 1.0, "c": 1.0}
    wins = Counter(min(room, key=lambda p: Spread(salt).factor(p, room[p]))
                   for salt in (rng.getrandbits(64) for _ in range(4000)))
    for pid, weight in room.items():
        assert abs(wins[pid] / 4000 - weight / 2.5) < 0.03, wins


def test_own_sessions_and_reports_weigh_in_the_spread() -> None:
    view = SwarmView.of(4, [peer("a", 0, 4), peer("b", 0, 4)])
    got = shares(view, own_sessions={"a": 8})  # half of a's slots are ours: priced, and less room
    assert got["b"] > 0.9 * sum(got.values())
    assert spare(view.get("a"), 8) == pytest.approx(0.5)
    assert spare(view.get("a"), reported=Reported(load=0.99)) == SPARE_FLOOR


def test_a_much_cheaper_chain_wins_whatever_the_draw() -> None:
    """a computes 10x faster than b and c: a spread of SPREAD_WIDTH never makes the slow ones win."""
    view = SwarmView.of(30, [peer("a", 0, 30, 1000.0), peer("b", 0, 30, 100.0), peer("c", 0, 30, 100.0)])
    assert shares(view, draws=500) == Counter({"a": 500})
    assert SPREAD_WIDTH < 1.0


def test_one_salt_one_route_and_the_draw_is_the_peers_own() -> None:
    """Routing stays a pure function: the same view and salt give the same route, in any process
    (the draw hashes the peer id and the salt, not Python's salted hash); a peer's factor does not
    depend on who else is a candidate."""
    view = SwarmView.of(4, [peer(p, 0, 4) for p in "abcdefgh"])
    for salt in (1, 2**63 + 5, 12345):
        assert route(view, source=REQ, spread=Spread(salt)) == route(view, source=REQ, spread=Spread(salt))
    assert Spread(99).factor("a", 1.0) == Spread(99).factor("a", 1.0) > 1.0
    assert Spread(99).factor("a", 0.5) - 1 == pytest.approx(2 * (Spread(99).factor("a", 1.0) - 1))
    assert len({Spread(s).factor("a", 1.0) for s in range(50)}) == 50


def test_pooled_peers_are_spread_too() -> None:
    """A thousand-peer swarm's interchangeable peers (chains.Pool: one span, no round trips) are
    searched only a few at a time; the spread still reaches all of them."""
    view = SwarmView.of(10, [peer(f"p{i:03d}", 0, 10) for i in range(40)])
    got = shares(view, draws=800)
    assert len(got) == 40 and max(got.values()) < 60


def test_load_bands_and_the_bound_on_re_signing() -> None:
    assert [load_band(x) for x in (0.0, 0.49, 0.5, 0.74, 0.75, 0.99)] == [0, 0, 1, 1, 2, 2]
    assert LOAD_BANDS == (0.5, 0.75)
    # N peers each re-signing for load at most once per N / 10 s: 10 records a second swarm-wide
    for n in (100, 1000, 10_000):
        assert n / load_resign_interval(n) == pytest.approx(10.0)
