"""The scale measurement (peer/sim/scale.py) on a small swarm: the real membership holds each
peer's connections within its bound, the views agree within B(N) after a burst of joins,
leaves and moves, and the same seed gives the same figures."""

from __future__ import annotations

import dataclasses

from tessera.peer.net.gossip import PULL_CONCURRENCY
from tessera.peer.net.membership import MAX_CONNECTIONS
from tessera.peer.sim.scale import measure_scale


def figures(result) -> dict:
    return {k: v for k, v in dataclasses.asdict(result).items() if k != "wall_s"}


def test_a_small_swarm_stays_within_the_bounds_and_repeats_itself() -> None:
    first = measure_scale(40, seed=3, burst=4)
    print(first.line())
    assert first.connections_max <= MAX_CONNECTIONS + PULL_CONCURRENCY  # a newcomer pulling its view
    assert first.neighbours_max <= MAX_CONNECTIONS
    assert first.convergence_periods is not None and first.convergence_periods <= first.bound_periods, first
    assert first.bytes_per_minute_mean > 0
    assert figures(measure_scale(40, seed=3, burst=4)) == figures(first)
