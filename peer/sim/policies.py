"""Placement policies a simulation can swap: where a joining peer claims, and when it moves.

A policy answers the two questions `peer/node/peer_node.py` asks of placement, as pure
functions of a swarm view (plus, for the random one, the peer's own seeded RNG):

- ``claim(view, me=..., capacity_layers=..., throughput=...)`` -> the span to claim on joining;
- ``rebalance(snapshot, own=..., me=..., span=..., capacity_layers=..., throughput=...)`` -> a
  span to move to now, or None. Called on a jittered period, only while the peer is
  serving; it judges `with_own(snapshot, own)`: the view plus the peer's own latest entry.

``default`` is exactly what a real peer does (peer/plan/placement.py: `choose_span`
at join, `plan_move` on each rebalance check, a move only when the plan
differs from the current span). The others are baselines to compare it with:

- ``random``: a uniformly random window at join; never moves. What a swarm gets
  without placement at all.
- ``petals``: Petals' block selection (server/block_selection.py), in our
  throughput model: join where the *sorted* capacities of the window are
  smallest (the weakest window); move when an optimistic re-plan of every peer
  (greedy passes, seeded order) would raise the swarm's bottleneck so that
  current / new < PETALS_BALANCE_QUALITY, and never when leaving would disjoin
  the swarm.
- ``recorded`` (replay only): the span the trace says the peer claimed, and the
  moves it recorded, at their times; no decisions of its own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from tessera.peer.node.parts import Placement
from tessera.peer.plan.placement import REBALANCE_MIN_GAIN, Coverage, choose_span, coverage_summary, gap_filler, layer_capacity, plan_move
from tessera.peer.plan.view import SERVING, PeerInfo, SwarmView

from tessera.peer.sim.errors import UnknownPolicy

# How simulated nodes learn the swarm view: real gossip, or one shared keeper (peer/sim/world.py).
VIEW_MODES = ("shared", "gossip")

# Petals' default balance_quality: move only if the swarm would get 1/0.75 = 1.33x faster.
PETALS_BALANCE_QUALITY = 0.75
PETALS_EPS = 1e-3
# Petals repeats greedy passes until nobody moves; we cap them (a pass is O(peers x layers)).
PETALS_MAX_PASSES = 8


class PlacementPolicy(Placement, Protocol):
    """A real peer's `Placement` (peer/node/parts.py), with a name for reports."""

    name: str


def with_own(snapshot: SwarmView, own: PeerInfo | None) -> SwarmView:
    """The view a peer judges from: the snapshot with its own latest entry (node.py merges its own at once)."""
    return snapshot.replace(own) if own is not None else snapshot


class DefaultPolicy:
    """peer/plan/placement.py, called the way peer/node/peer_node.py calls it.

    `rebalance` first runs a cheap exact pre-check (`cannot_move`) against coverage
    computed once per shared snapshot: a thousand peers each calling `plan_move`
    (O(peers x layers)) every period is what makes a big simulation slow, and in a big
    swarm almost no single peer can lift the bottleneck by REBALANCE_MIN_GAIN. Only
    when the pre-check cannot rule a move out is `plan_move` itself asked; so the
    answer is always plan_move's (tests/sim/test_sim.py checks the two agree).
    """

    name = "default"
    moves = True

    def __init__(self) -> None:
        self._shared: tuple[SwarmView, Coverage, str | None, dict[str, PeerInfo]] | None = None

    def claim(self, view, *, me, capacity_layers, throughput, rng, held=()):
        return choose_span(view, me=me, capacity_layers=capacity_layers, throughput=throughput, held=held)

    def rebalance(self, snapshot, *, own, me, span, capacity_layers, throughput, rng):
        if own is not None and self.cannot_move(snapshot, own, capacity_layers=capacity_layers,
                                                throughput=throughput):
            return None
        plan = plan_move(with_own(snapshot, own), me=me, capacity_layers=capacity_layers, throughput=throughput)
        return plan if plan is not None and plan != span else None

    def cannot_move(self, snapshot: SwarmView, mine: PeerInfo, *, capacity_layers: int, throughput: float) -> bool:
        """True only where plan_move(with_own(snapshot, mine), ...) is certain to return None.

        The shortcut holds only while `mine` is, for placement, the entry the snapshot has.
        """
        if mine.state != SERVING or mine.num_layers <= 0:
            return True  # plan_move: only a serving peer with a span moves
        if self._shared is None or self._shared[0] is not snapshot:
            summary = coverage_summary(snapshot)
            by_id = {p.peer_id: p for p in snapshot.peers}
            self._shared = (snapshot, summary, gap_filler(snapshot) if summary.gaps else None, by_id)
        _, now, filler, by_id = self._shared
        theirs = by_id.get(mine.peer_id)
        if theirs is None or (theirs.start, theirs.end, theirs.throughput, theirs.state) != (
                mine.start, mine.end, throughput, mine.state):
            return False
        start, end = max(mine.start, 0), min(mine.end, snapshot.num_layers)
        if any(now.counts[layer] < 2 for layer in range(start, end)):
            return True  # the only server of a layer never moves
        if now.gaps:
            return filler != mine.peer_id  # one elected peer fills a gap; plan_move decides for it
        # Covered: a move must lift every layer to above `bar`. Layers that others alone keep
        # at or below it must all fit in the new window, and gain enough from this peer.
        k = min(capacity_layers, snapshot.num_layers)
        per_layer, gain = mine.throughput / mine.num_layers, throughput / k
        bar = now.bottleneck * (1.0 + REBALANCE_MIN_GAIN)
        safe = bar * (1.0 - 1e-9) - 1e-12  # sums in another order differ in the last digits
        weak = [layer for layer, cap in enumerate(now.capacity)
                if cap - (per_layer if start <= layer < end else 0.0) <= safe]
        if not weak:
            return False
        if weak[-1] - weak[0] + 1 > k:
            return True  # no window of this peer's length covers every weak layer
        return any(now.capacity[layer] - (per_layer if start <= layer < end else 0.0) + gain <= safe
                   for layer in weak)  # this peer cannot lift some weak layer above the bar


class RandomPolicy:
    """A random window of the peer's length; never moves."""

    name = "random"
    moves = False

    def claim(self, view, *, me, capacity_layers, throughput, rng, held=()):
        k = min(capacity_layers, view.num_layers)
        start = rng.randrange(view.num_layers - k + 1)
        return (start, start + k)

    def rebalance(self, snapshot, *, own, me, span, capacity_layers, throughput, rng):
        return None


def _weakest_start(caps: list[float], k: int) -> int:
    """Petals' _choose_best_start: the window whose sorted capacities are smallest."""
    return min((sorted(caps[i : i + k]), i) for i in range(len(caps) - k + 1))[1]


class PetalsPolicy:
    """Petals-style weakest-window placement with an optimistic whole-swarm re-plan."""

    name = "petals"
    moves = True

    def claim(self, view, *, me, capacity_layers, throughput, rng, held=()):
        k = min(capacity_layers, view.num_layers)
        start = _weakest_start(layer_capacity(view.without([me])), k)
        return (start, start + k)

    def rebalance(self, snapshot, *, own, me, span, capacity_layers, throughput, rng):
        view = with_own(snapshot, own)
        mine = view.get(me)
        if mine is None or mine.state != SERVING:
            return None
        view = view.replace(replace(mine, throughput=throughput))
        caps = layer_capacity(view)
        initial = min(caps) if caps else 0.0
        spans = {p.peer_id: [p.start, p.end - p.start, p.throughput / max(p.num_layers, 1)]
                 for p in view.peers if p.state == SERVING and p.end > p.start}
        start, length, per_layer = spans[me]
        for layer in range(start, start + length):
            caps[layer] -= per_layer * (1 + PETALS_EPS)
        if initial > PETALS_EPS and min(caps) <= 0:
            return None  # leaving would disjoin the swarm
        new_start = _weakest_start(caps, length)
        if new_start == start:
            return None  # already in its best place
        _place(caps, spans[me], new_start)
        order = sorted(spans)
        for _ in range(PETALS_MAX_PASSES):
            rng.shuffle(order)
            moved = False
            for pid in order:
                entry = spans[pid]
                s, n, w = entry
                for layer in range(s, s + n):
                    caps[layer] -= w * (1 + PETALS_EPS)  # (1 + eps): prefer staying on near-ties
                best = _weakest_start(caps, n)
                moved = moved or best != s
                _place(caps, entry, best)
            if not moved:
                break
        new = min(caps)
        if new < initial or new < PETALS_EPS:
            return None
        return (new_start, new_start + length) if initial / new < PETALS_BALANCE_QUALITY - PETALS_EPS else None


def _place(caps: list[float], entry: list, new_start: int) -> None:
    """Put a peer that was taken out of `caps` (by w * (1 + eps)) back, at `new_start`."""
    s, n, w = entry
    for layer in range(s, s + n):
        caps[layer] += w * PETALS_EPS
    entry[0] = new_start
    for layer in range(new_start, new_start + n):
        caps[layer] += w


class RecordedPolicy:
    """Replay only: the span the trace recorded (the engine applies recorded moves)."""

    name = "recorded"
    moves = False

    def claim(self, view, *, me, capacity_layers, throughput, rng, held=()):
        raise UnknownPolicy("the recorded policy takes spans from a trace; use it with `tessera replay`")

    def rebalance(self, snapshot, *, own, me, span, capacity_layers, throughput, rng):
        return None


POLICIES: dict[str, type] = {p.name: p for p in (DefaultPolicy, RandomPolicy, PetalsPolicy, RecordedPolicy)}


def get_policy(name: str) -> PlacementPolicy:
    """A policy by name. Raises UnknownPolicy naming the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise UnknownPolicy(f"unknown placement policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


__all__ = ["PlacementPolicy", "DefaultPolicy", "RandomPolicy", "PetalsPolicy", "RecordedPolicy",
           "POLICIES", "get_policy"]
