"""One definition of coverage for the TUI, `swarm status`, the web view and routing (issue 34, item 3)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.peer.plan.coverage import gaps_in, swarm_coverage
from tessera.peer.plan.routing import route
from tessera.peer.plan.view import DRAINING, LEAVING, LOADING, SERVING, PeerInfo, SwarmView


def peer(pid: str, start: int, end: int, state: str = SERVING, load: float = 0.0) -> PeerInfo:
    return PeerInfo(peer_id=pid, model_id="m", start=start, end=end, throughput=100.0, state=state, load=load)


def test_the_peers_own_state_wins_over_its_record():
    view = SwarmView.of(30, [peer("a", 0, 10), peer("b", 10, 30)])
    assert swarm_coverage(view).gaps == () and swarm_coverage(view).serving == 2
    draining = swarm_coverage(view, own=replace(view.get("a"), state=DRAINING))
    assert draining.replicas == (0,) * 10 + (1,) * 20 and draining.gaps == ((0, 10),)
    assert draining.serving == 1 and draining.peers == 2 and draining.aside == (("a", "draining"),)
    assert draining.claimed == (1,) * 30  # still claimed: placement does not re-fill a draining span
    left = swarm_coverage(view, own=replace(view.get("a"), state=LEAVING))
    assert left.serving == 1 and left.gaps == ((0, 10),) and left.claimed == (0,) * 10 + (1,) * 20
    newcomer = swarm_coverage(view, own=peer("c", 0, 30, state=LOADING))  # not in the view yet
    assert newcomer.peers == 3 and newcomer.serving == 2 and ("c", "loading") in newcomer.aside


def test_gaps_are_half_open_runs_of_zero():
    assert gaps_in([0, 0, 1, 0, 2, 0]) == ((0, 2), (3, 4), (5, 6))
    assert gaps_in([]) == ()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 8), st.sampled_from([SERVING, DRAINING, LEAVING, LOADING]),
                          st.sampled_from([0.0, 0.5, 1.0])), max_size=6))
def test_no_gap_exactly_when_routing_finds_a_route(peers):
    view = SwarmView.of(8, [peer(f"p{i}", a, max(a + 1, min(b + a, 8)), state, load)
                            for i, (a, b, state, load) in enumerate(peers)])
    coverage = swarm_coverage(view)
    assert coverage.complete == route(view, source="requester").ok
    assert all((count == 0) == any(a <= layer < b for a, b in coverage.gaps) for layer, count in enumerate(coverage.replicas))
