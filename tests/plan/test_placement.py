"""Placement: which span a joining peer claims, and when a serving peer moves."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.peer.plan.placement import (
    REBALANCE_MIN_GAIN,
    bottleneck,
    choose_span,
    coverage_summary,
    gap_filler,
    layer_capacity,
    plan_move,
)
from tessera.peer.plan.view import DRAINING, LEAVING, LOADING, SERVING, PeerInfo, SwarmView, merge_spans

MODEL = "m"
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def peer(pid: str, start: int, end: int, throughput: float = 100.0, **kw) -> PeerInfo:
    return PeerInfo(pid, MODEL, start, end, throughput, **kw)


def join(view: SwarmView, pid: str, k: int, throughput: float) -> SwarmView:
    start, end = choose_span(view, me=pid, capacity_layers=k, throughput=throughput)
    return view.replace(peer(pid, start, end, throughput))


def settle(view: SwarmView, max_rounds: int = 40) -> tuple[SwarmView, int, int]:
    """Apply plan_move to every peer, one move at a time, until a round moves nobody.

    Checks on every move: no layer becomes uncovered, and the swarm strictly improves
    (fewer uncovered layers, or else the bottleneck up by more than the threshold).
    Returns (settled view, rounds taken, moves made); fails if it does not settle.
    """
    moves = 0
    for rounds in range(1, max_rounds + 1):
        moved = False
        for p in [q for q in view.peers]:
            p = view.get(p.peer_id)
            target = plan_move(view, me=p.peer_id, capacity_layers=p.num_layers, throughput=p.throughput)
            if target is None:
                continue
            before = coverage_summary(view)
            view = view.replace(replace(p, start=target[0], end=target[1]))
            after = coverage_summary(view)
            holes_before = {i for i, c in enumerate(before.counts) if c == 0}
            holes_after = {i for i, c in enumerate(after.counts) if c == 0}
            assert holes_after <= holes_before, f"{p.peer_id} -> {target} opened a gap"
            if before.uncovered:
                assert after.uncovered < before.uncovered
            else:
                assert after.bottleneck > before.bottleneck * (1 + REBALANCE_MIN_GAIN)
            moves += 1
            moved = True
        if not moved:
            return view, rounds, moves
    pytest.fail(f"placement did not settle within {max_rounds} rounds ({moves} moves)")


# -- the throughput model ------------------------------------------------------------


def test_docstring_example():
    view = SwarmView.of(6, [peer("a", 0, 4, 40.0), peer("b", 2, 6, 20.0)])
    summary = coverage_summary(view)
    assert summary.capacity == (10.0, 10.0, 15.0, 15.0, 5.0, 5.0)
    assert summary.bottleneck == 5.0 and summary.covered
    assert choose_span(view, me="c", capacity_layers=2, throughput=30.0) == (4, 6)
    view = view.replace(peer("c", 4, 6, 30.0))
    assert plan_move(view, me="a", capacity_layers=4, throughput=40.0) is None  # sole server of 0, 1
    assert plan_move(view, me="b", capacity_layers=4, throughput=20.0) == (0, 4)
    assert bottleneck(view.replace(peer("b", 0, 4, 20.0))) == 15.0


def test_capacity_counts_states_and_clips():
    view = SwarmView.of(
        4,
        [
            peer("a", 0, 2, 10.0),
            peer("b", 0, 2, 10.0, state=LEAVING),  # gone for placement
            peer("c", 1, 3, 10.0, state=DRAINING),  # still holds its layers
            peer("d", 2, 3, 10.0, state=LOADING),  # has claimed them
            peer("e", 3, 9, 60.0),  # a bad span is clipped; capacity per its own length
        ],
    )
    assert layer_capacity(view) == [5.0, 10.0, 15.0, 10.0]
    summary = coverage_summary(view)
    assert summary.counts == (1, 2, 2, 1)
    assert summary.gaps == () and summary.bottleneck == 5.0


def test_gaps_and_zero_bottleneck():
    view = SwarmView.of(10, [peer("a", 2, 4), peer("b", 5, 7)])
    summary = coverage_summary(view)
    assert summary.gaps == ((0, 2), (4, 5), (7, 10))
    assert list(summary.gaps) == view.gaps()
    assert summary.uncovered == 6 and summary.bottleneck == 0.0 and not summary.covered
    assert coverage_summary(SwarmView.of(3, [])).gaps == ((0, 3),)


# -- choose_span ---------------------------------------------------------------------


def test_a_new_peer_fills_a_gap_before_a_weak_layer():
    # layers 6, 7 carry almost nothing, but 8, 9 carry nothing at all
    view = SwarmView.of(10, [peer("a", 0, 6, 6000.0), peer("b", 6, 8, 0.01)])
    assert choose_span(view, me="new", capacity_layers=2, throughput=1.0) == (8, 10)
    # with room for 4 it covers the gap and the weak layers
    assert choose_span(view, me="new", capacity_layers=4, throughput=1.0) == (6, 10)


def test_prefers_the_window_covering_most_uncovered_layers():
    view = SwarmView.of(12, [peer("a", 1, 5), peer("b", 9, 12)])
    # gaps [0, 1) and [5, 9): a window of 3 fills 3 layers only inside [5, 9)
    start, end = choose_span(view, me="x", capacity_layers=3, throughput=50.0)
    assert 5 <= start and end <= 9
    assert (start, end) in {(5, 8), (6, 9)}  # and sits on an edge of the gap


def test_lifts_the_weakest_layer_when_covered():
    view = SwarmView.of(8, [peer("a", 0, 8, 800.0), peer("b", 0, 4, 400.0)])  # [0,4) 200, [4,8) 100
    assert choose_span(view, me="c", capacity_layers=4, throughput=400.0) == (4, 8)
    assert choose_span(view, me="c", capacity_layers=20, throughput=400.0) == (0, 8)


def test_own_entry_is_ignored():
    view = SwarmView.of(8, [peer("a", 0, 4), peer("me", 4, 8)])
    assert choose_span(view, me="me", capacity_layers=4, throughput=100.0) == (4, 8)
    assert choose_span(view.without(["me"]), me="me", capacity_layers=4, throughput=100.0) == (4, 8)


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity_layers"):
        choose_span(SwarmView.of(4, []), me="x", capacity_layers=0, throughput=1.0)
    assert choose_span(SwarmView.of(0, []), me="x", capacity_layers=3, throughput=1.0) == (0, 0)
    with pytest.raises(ValueError, match="not in the swarm view"):
        plan_move(SwarmView.of(4, []), me="x", capacity_layers=2, throughput=1.0)
    view = SwarmView.of(4, [peer("x", 0, 4)])
    with pytest.raises(ValueError, match="threshold"):
        plan_move(view, me="x", capacity_layers=4, throughput=1.0, threshold=-0.1)


def test_exact_ties_spread_by_peer_id():
    empty = SwarmView.of(30, [])
    chosen = {choose_span(empty, me=f"peer-{i}", capacity_layers=10, throughput=1.0) for i in range(40)}
    # an empty model: only the windows on an edge of the gap, and both of them
    assert chosen == {(0, 10), (20, 30)}
    # a swarm with two equally weak halves
    halves = SwarmView.of(8, [peer("a", 0, 8, 800.0), peer("b", 0, 8, 800.0)])
    chosen = {choose_span(halves, me=f"peer-{i}", capacity_layers=4, throughput=5.0) for i in range(40)}
    assert chosen == {(0, 4), (4, 8)}
    # ... and each peer keeps its own choice
    assert len({choose_span(halves, me="peer-7", capacity_layers=4, throughput=5.0) for _ in range(5)}) == 1


def test_same_view_any_order_same_answer():
    rng = random.Random(5)
    starts = rng.choices(range(14), k=12)
    peers = [peer(f"p{i}", s, s + rng.randint(1, 6), rng.uniform(1, 100)) for i, s in enumerate(starts)]
    answers = set()
    for _ in range(10):
        rng.shuffle(peers)
        view = SwarmView(20, tuple(peers))  # deliberately not sorted
        answers.add((choose_span(view, me="new", capacity_layers=5, throughput=30.0), tuple(layer_capacity(view))))
    assert len(answers) == 1


@st.composite
def swarms(draw, *, min_peers: int = 0, max_layers: int = 16, gaps: bool = True):
    num_layers = draw(st.integers(1, max_layers))
    n = draw(st.integers(min_peers, 8))
    peers = []
    for i in range(n):
        k = draw(st.integers(1, num_layers))
        start = draw(st.integers(0, num_layers - k))
        throughput = draw(st.sampled_from([10.0, 25.0, 40.0, 100.0]) | st.floats(0.5, 500.0))
        peers.append(peer(f"p{i:02d}", start, start + k, throughput))
    view = SwarmView.of(num_layers, peers)
    if not gaps:
        for j, (s, e) in enumerate(view.gaps()):  # patch every gap with a filler
            view = view.replace(peer(f"f{j:02d}", s, e, draw(st.floats(1.0, 200.0))))
    return view


@FAST
@given(view=swarms(), k=st.integers(1, 20), throughput=st.floats(0.5, 500.0), data=st.data())
def test_choose_span_fills_most_gaps_then_maximises_bottleneck(view, k, throughput, data):
    num_layers = view.num_layers
    start, end = choose_span(view, me="new", capacity_layers=k, throughput=throughput)
    assert end - start == min(k, num_layers) and 0 <= start and end <= num_layers

    def outcome(s: int) -> tuple[int, float]:
        after = coverage_summary(view.replace(peer("new", s, s + end - start, throughput)))
        return after.uncovered, after.bottleneck

    results = {s: outcome(s) for s in range(num_layers - (end - start) + 1)}
    fewest = min(u for u, _ in results.values())
    assert results[start][0] == fewest
    best = max(b for u, b in results.values() if u == fewest)
    assert results[start][1] >= best * (1 - 1e-9)
    # order-independent
    shuffled = list(view.peers)
    data.draw(st.randoms(use_true_random=False)).shuffle(shuffled)
    unsorted = SwarmView(num_layers, tuple(shuffled))
    assert choose_span(unsorted, me="new", capacity_layers=k, throughput=throughput) == (start, end)


@FAST
@given(
    num_layers=st.integers(1, 40),
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    throughputs=st.lists(st.floats(1.0, 1000.0), min_size=12, max_size=12),
)
def test_joining_one_by_one_covers_the_model_once_capacity_suffices(num_layers, sizes, throughputs):
    view = SwarmView.of(num_layers, [])
    total = 0
    for i, k in enumerate(sizes):
        view = join(view, f"peer-{i:02d}", k, throughputs[i])
        total += min(k, num_layers)
        # gaps only shrink, and as soon as the memory adds up there are none
        assert coverage_summary(view).uncovered == max(num_layers - total, 0)


# -- plan_move -----------------------------------------------------------------------


def balanced(num_layers: int = 30, span: int = 10, copies: int = 2, throughput: float = 100.0) -> SwarmView:
    peers = [
        peer(f"p{start:02d}-{c}", start, start + span, throughput)
        for start in range(0, num_layers, span)
        for c in range(copies)
    ]
    return SwarmView.of(num_layers, peers)


def test_a_stable_balanced_swarm_never_moves():
    view = balanced()
    for _ in range(20):
        for p in view.peers:
            assert plan_move(view, me=p.peer_id, capacity_layers=p.num_layers, throughput=p.throughput) is None


def test_small_noise_in_throughput_moves_nobody():
    rng = random.Random(1)
    view = SwarmView.of(30, [replace(p, throughput=p.throughput * rng.uniform(0.9, 1.1)) for p in balanced().peers])
    settled, rounds, moves = settle(view)
    assert moves == 0 and rounds == 1


def test_after_a_peer_leaves_another_moves_to_recover_and_it_settles():
    view = balanced(num_layers=12, span=4)  # [0,4) [4,8) [8,12), two copies each
    view = view.without(["p04-0", "p04-1"])  # both servers of [4, 8) leave
    assert view.gaps() == [(4, 8)]
    # all four could fill it without opening a gap; exactly one (the same for all) does
    plans = {p.peer_id: plan_move(view, me=p.peer_id, capacity_layers=4, throughput=100.0) for p in view.peers}
    movers = [pid for pid, plan in plans.items() if plan is not None]
    assert movers == [gap_filler(view)] and plans[movers[0]] == (4, 8)
    settled, rounds, moves = settle(view)
    assert settled.gaps() == [] and moves == 1 and rounds == 2
    # the peer left alone on its span stays put
    twin = {"p00-0": "p00-1", "p00-1": "p00-0", "p08-0": "p08-1", "p08-1": "p08-0"}[movers[0]]
    assert plan_move(settled, me=twin, capacity_layers=4, throughput=100.0) is None


def test_the_gap_filler_is_taken_from_the_strongest_coverage():
    view = SwarmView.of(12, [peer(f"a{i}", 0, 4) for i in range(3)] + [peer(f"c{i}", 8, 12) for i in range(2)])
    assert view.gaps() == [(4, 8)]
    assert gap_filler(view) in {"a0", "a1", "a2"}  # [0, 4) keeps two servers, [8, 12) would keep one
    # ... unless another can fill more of the gap: 2-layer peers on [0, 2), [2, 4)
    view = SwarmView.of(
        12,
        [peer(f"a{i}", 0, 2) for i in range(3)]
        + [peer(f"b{i}", 2, 4) for i in range(3)]
        + [peer(f"c{i}", 8, 12) for i in range(2)],
    )
    assert view.gaps() == [(4, 8)] and gap_filler(view) in {"c0", "c1"}
    assert gap_filler(balanced()) is None  # no gap, nobody elected
    alone = SwarmView.of(12, [peer("a", 0, 4), peer("b", 8, 12)])
    assert gap_filler(alone) is None  # nobody can move without opening a gap


def test_a_draining_peer_still_counts_but_does_not_move():
    view = balanced(num_layers=12, span=4).without(["p04-0", "p04-1"])
    view = view.replace(replace(view.get("p00-0"), state=DRAINING))
    assert plan_move(view, me="p00-0", capacity_layers=4, throughput=100.0) is None
    mover = gap_filler(view)
    assert mover in {"p00-1", "p08-0", "p08-1"}  # p00-1 may go: the draining one still covers
    assert plan_move(view, me=mover, capacity_layers=4, throughput=100.0) == (4, 8)


def test_leaving_peers_no_longer_cover():
    view = balanced(num_layers=12, span=4).without(["p04-0"])
    view = view.replace(replace(view.get("p04-1"), state=LEAVING))
    assert coverage_summary(view).gaps == ((4, 8),)
    assert gap_filler(view) != "p04-1"
    assert plan_move(view, me=gap_filler(view), capacity_layers=4, throughput=100.0) == (4, 8)


def test_the_weakest_coverage_is_filled_first():
    # gaps [0, 2) and [5, 8); x is redundant on [2, 5) and can fill 3 layers
    view = SwarmView.of(12, [peer("c", 2, 5), peer("d", 8, 12), peer("x", 2, 5)])
    assert view.gaps() == [(0, 2), (5, 8)]
    mover, stayer = gap_filler(view), {"c": "x", "x": "c"}[gap_filler(view)]
    assert plan_move(view, me=stayer, capacity_layers=3, throughput=100.0) is None
    assert plan_move(view, me=mover, capacity_layers=3, throughput=100.0) == (5, 8)
    # the other, now alone on [2, 5), stays; the remaining gap waits for a joiner
    view = view.replace(peer(mover, 5, 8))
    assert plan_move(view, me=stayer, capacity_layers=3, throughput=100.0) is None
    assert choose_span(view, me="new", capacity_layers=2, throughput=1.0) == (0, 2)


def test_never_moves_off_layers_only_it_serves_even_for_a_bigger_gap():
    view = SwarmView.of(30, [peer("a", 0, 12), peer("b", 10, 20)])  # b alone on [12, 20); [20, 30) empty
    assert plan_move(view, me="b", capacity_layers=12, throughput=100.0) is None
    assert plan_move(view, me="a", capacity_layers=12, throughput=100.0) is None


def test_threshold_is_a_clear_margin():
    # capacity [12]*4 + [13]*4; b re-placed on [4, 8) would give [10]*4 + [15]*4: worse.
    view = SwarmView.of(8, [peer("a", 0, 8, 80.0), peer("b", 0, 4, 8.0), peer("c", 4, 8, 12.0)])
    assert plan_move(view, me="b", capacity_layers=4, throughput=8.0) is None
    view = SwarmView.of(8, [peer("a", 0, 8, 80.0), peer("b", 0, 4, 4.0), peer("c", 0, 4, 4.0)])
    # [0,4) 12, [4,8) 10: b moving gives [0,4) 11, [4,8) 11: +10% — below the bar ...
    assert plan_move(view, me="b", capacity_layers=4, throughput=4.0) is None
    # ... unless the caller lowers it.
    assert plan_move(view, me="b", capacity_layers=4, throughput=4.0, threshold=0.05) == (4, 8)
    assert plan_move(view, me="b", capacity_layers=4, throughput=4.0, threshold=0.10) is None  # strict


def test_only_serving_peers_move():
    view = balanced(num_layers=12, span=4).without(["p04-0", "p04-1"])
    for state in (LOADING, DRAINING, LEAVING):
        moved = view.replace(replace(view.get("p00-0"), state=state))
        assert plan_move(moved, me="p00-0", capacity_layers=4, throughput=100.0) is None
    assert view.get("p00-0").state == SERVING


@FAST
@given(view=swarms(min_peers=1))
def test_rebalancing_settles_never_opens_a_gap_and_then_stays(view):
    settled, rounds, _ = settle(view)
    for _ in range(3):  # and a settled swarm stays settled
        for p in settled.peers:
            assert plan_move(settled, me=p.peer_id, capacity_layers=p.num_layers, throughput=p.throughput) is None


@FAST
@given(
    num_layers=st.integers(4, 30),
    sizes=st.lists(st.integers(2, 12), min_size=4, max_size=10),
    leaver=st.integers(0, 9),
    data=st.data(),
)
def test_a_swarm_built_by_joins_recovers_after_a_leave(num_layers, sizes, leaver, data):
    view = SwarmView.of(num_layers, [])
    for i, k in enumerate(sizes):
        view = join(view, f"peer-{i:02d}", k, data.draw(st.floats(10.0, 100.0)))
    view, _, _ = settle(view)
    gone = view.peers[leaver % len(view.peers)].peer_id
    before_moves = view.without([gone])
    after, _, _ = settle(before_moves)
    # nobody who could fill a gap without opening one is left idle
    if after.gaps():
        for p in after.peers:
            assert plan_move(after, me=p.peer_id, capacity_layers=p.num_layers, throughput=p.throughput) is None
    assert coverage_summary(after).uncovered <= coverage_summary(before_moves).uncovered


# -- layers held on disk: a re-claim costs a load, not a download ---------------------


def test_held_ranges_are_sorted_and_merged():
    assert merge_spans([(10, 15), (0, 5), (5, 8), (12, 20), (3, 3)]) == ((0, 8), (10, 20))
    assert merge_spans([]) == ()
    info = peer("a", 0, 4, held=merge_spans([(0, 4), (6, 9)]))
    assert [info.held_in(0, 12), info.held_in(2, 7), info.held_in(4, 6)] == [7, 3, 0]


def test_a_gap_is_filled_by_a_peer_that_holds_its_layers_on_disk():
    view = balanced(num_layers=12, span=4).without(["p04-0", "p04-1"])
    fallback = gap_filler(view)
    holder = next(p for p in ("p00-0", "p00-1", "p08-0", "p08-1") if p != fallback)
    view = view.replace(replace(view.get(holder), held=((0, 8),)))  # it fetched [4, 8) once
    assert gap_filler(view) == holder
    plans = {p.peer_id: plan_move(view, me=p.peer_id, capacity_layers=4, throughput=100.0) for p in view.peers}
    assert {pid for pid, plan in plans.items() if plan is not None} == {holder}
    assert plans[holder] == (4, 8)
    # holding layers elsewhere buys nothing: the filler is chosen as before
    elsewhere = view.replace(replace(view.get(holder), held=((0, 4),)))
    assert gap_filler(elsewhere) == fallback


def test_filling_the_most_uncovered_layers_still_comes_first():
    # 2-layer peers on [0, 2) and [2, 4) can fill only half of the gap [4, 8), held or not
    view = SwarmView.of(
        12,
        [peer(f"a{i}", 0, 2, held=((0, 8),)) for i in range(3)]
        + [peer(f"b{i}", 2, 4, held=((0, 8),)) for i in range(3)]
        + [peer(f"c{i}", 8, 12) for i in range(2)],
    )
    assert view.gaps() == [(4, 8)] and gap_filler(view) in {"c0", "c1"}


def test_a_peer_filling_a_gap_takes_the_window_it_holds():
    view = SwarmView.of(30, [peer("a", 0, 20), peer("b", 25, 30)])  # gap [20, 25)
    plain = choose_span(view, me="j", capacity_layers=10, throughput=100.0)
    assert plain == (15, 25)
    assert choose_span(view, me="j", capacity_layers=10, throughput=100.0, held=((20, 30),)) == (20, 30)
    # filling the gap comes first: a window held whole that fills none is not taken
    assert choose_span(view, me="j", capacity_layers=10, throughput=100.0, held=((0, 10),)) == plain


def test_with_everything_covered_held_layers_only_break_ties():
    covered = SwarmView.of(12, [peer("a", 0, 12)])
    assert choose_span(covered, me="j", capacity_layers=4, throughput=100.0) in {(0, 4), (8, 12)}
    assert choose_span(covered, me="j", capacity_layers=4, throughput=100.0, held=((5, 9),)) == (5, 9)
    # layers [6, 12) are the weakest: a joiner lifts them even if it holds [0, 4) only
    uneven = SwarmView.of(12, [peer("a", 0, 12), peer("b", 0, 6)])
    assert choose_span(uneven, me="j", capacity_layers=4, throughput=100.0, held=((0, 4),)) in {(6, 10), (8, 12)}
