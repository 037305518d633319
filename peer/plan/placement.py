"""Placement: which span of layers a peer claims, and when it moves to another.

Everything here is a pure function of a `SwarmView` snapshot: no I/O, no clock, no
randomness (ties are broken by a hash of the peer id). Peers are read in peer-id
order, so the same swarm gives bit-identical sums however the view was assembled —
Petals found that float noise from an unsorted sum is enough to make servers reload
blocks for nothing.

The throughput model
--------------------
A peer's advertised ``throughput`` is tokens/s through ONE layer. Serving n layers,
it pushes ``throughput / n`` tokens/s through its whole span, so every layer of the
span gains that much capacity. A layer's capacity is the sum over the non-leaving
peers that claim it; the swarm's **bottleneck** is the minimum over layers (0 if any
layer is uncovered: no chain exists at all).

A worked example (L = 6 layers)::

    peer  span     throughput   per layer
    a     [0, 4)   40           10
    b     [2, 6)   20            5
    layer capacity:  10 10 15 15 5 5      bottleneck 5 (layers 4, 5)

A peer ``c`` joins with memory for 2 layers and throughput 30 (+15 per layer). Its
candidate windows and the swarm's capacities, sorted, if it took each::

    [0, 2)  5  5 15 15 25 25       [3, 5)   5 10 10 15 20 30
    [1, 3)  5  5 10 15 25 30       [4, 6)  10 10 15 15 20 20   <- best
    [2, 4)  5  5 10 10 30 30

``choose_span`` picks ``[4, 6)``: it is the only window that lifts the weakest
layers, and the bottleneck goes from 5 to 10. Later, ``plan_move`` for ``a`` asks:
would the bottleneck rise by more than REBALANCE_MIN_GAIN if ``a`` re-placed itself?
Removing ``a`` uncovers layers 0 and 1, so ``a`` never moves while it is their only
server, whatever the gain elsewhere. ``b`` may leave (``a`` and ``c`` still cover
everything): re-placed, it takes ``[0, 4)`` and every layer carries 15, a bottleneck
1.5 times the current 10 — above the 1.25 bar, so ``plan_move`` says move.

Criteria (and why)
------------------
``choose_span`` ranks the windows of length ``min(capacity_layers, L)`` by, in order:

1. most uncovered layers filled — a gap means no route exists, so nothing else counts;
2. the swarm's capacity profile after the join, compared **leximin**: the higher
   bottleneck wins, then the higher second-weakest layer, and so on. This is "lift
   the weakest layer", measured by the same bottleneck ``plan_move`` uses to judge a
   move, so where a peer joins and where it would move to never disagree. (Petals
   minimises the sorted capacities inside the window instead; on random profiles the
   two pick the same windows — ours states the outcome rather than the proxy.)
3. the most layers the peer already holds on disk (``held``) — a span it holds costs a
   load (seconds), one it lacks a download (minutes for a big model). When the window
   fills a gap this comes before criterion 2: while a gap lasts no route exists, so
   the window that restores service soonest wins over a better-balanced one;
4. windows whose ends sit on a capacity step (or the model's ends) — so joiners pack
   gaps edge to edge instead of leaving slivers, and chains need fewer hops;
5. a rendezvous hash of ``(me, start)`` — exactly tied windows are split among peers
   that join at the same moment, and each peer's choice is stable.

After churn, the one peer elected to fill a gap (`gap_filler`) is, among those that
fill the most uncovered layers, the one that holds most of its window on disk, so a
death costs a load, not a download.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from tessera.peer.plan.view import LEAVING, SERVING, PeerInfo, SwarmView, layers_held

__all__ = [
    "REBALANCE_MIN_GAIN",
    "Coverage",
    "layer_capacity",
    "layer_counts",
    "bottleneck",
    "coverage_summary",
    "choose_span",
    "gap_filler",
    "plan_move",
]

# A move must raise the swarm's bottleneck by more than this fraction. Two reasons
# for 25%: (1) throughput is a short one-layer benchmark; on shared machines we
# expect such timings to spread by about ±10% between runs, so the ratio of two
# bottlenecks can drift by up to 1.1/0.9 ≈ 1.22 from noise alone, and noise must
# never justify a reload; (2) a move reloads weights
# (seconds to minutes) and drops this peer's sessions, so it has to buy something
# clear. Petals' default (balance_quality=0.75) asks for 1/0.75 ≈ +33%, measured
# after an optimistic re-plan of every server; we judge one concrete move, so a
# slightly lower bar gives a similar effect.
REBALANCE_MIN_GAIN = 0.25

# Capacities are rounded to this many significant digits before windows are
# compared. Sums of the same terms in a different grouping differ around the 16th
# digit; 9 digits erases that noise (so mathematically equal windows tie exactly and
# the peer-id hash decides) and is far finer than any throughput we can measure.
CAPACITY_SIG_DIGITS = 9


@dataclass(frozen=True)
class Coverage:
    """How well a swarm covers its model, layer by layer.

    capacity:   tokens/s each layer can carry (sum of throughput / num_layers over
                the non-leaving peers that claim it).
    counts:     how many non-leaving peers claim each layer.
    bottleneck: min(capacity), or 0.0 when a layer is uncovered.
    gaps:       uncovered ranges, half-open, in order.
    """

    capacity: tuple[float, ...]
    counts: tuple[int, ...]
    bottleneck: float
    gaps: tuple[tuple[int, int], ...]

    @property
    def covered(self) -> bool:
        """Whether every layer has at least one server."""
        return not self.gaps

    @property
    def uncovered(self) -> int:
        """How many layers nobody serves."""
        return sum(1 for c in self.counts if c == 0)


def _claims(view: SwarmView) -> list[tuple[PeerInfo, int, int]]:
    """Non-leaving peers in peer-id order, with their span clipped to [0, L)."""
    out = []
    for p in sorted(view.peers, key=lambda p: p.peer_id):
        start, end = max(p.start, 0), min(p.end, view.num_layers)
        if p.state != LEAVING and end > start:
            out.append((p, start, end))
    return out


def layer_capacity(view: SwarmView) -> list[float]:
    """Tokens/s each layer of the model can carry (see the module docstring)."""
    caps = [0.0] * max(view.num_layers, 0)
    for p, start, end in _claims(view):
        per_layer = max(p.throughput, 0.0) / p.num_layers
        for layer in range(start, end):
            caps[layer] += per_layer
    return caps


def layer_counts(view: SwarmView) -> list[int]:
    """How many non-leaving peers claim each layer."""
    counts = [0] * max(view.num_layers, 0)
    for _, start, end in _claims(view):
        for layer in range(start, end):
            counts[layer] += 1
    return counts


def bottleneck(view: SwarmView) -> float:
    """The swarm's throughput: min layer capacity, 0.0 if a layer is uncovered."""
    return coverage_summary(view).bottleneck


def coverage_summary(view: SwarmView) -> Coverage:
    """Per-layer capacity and counts, the bottleneck and the gaps, in one pass."""
    caps = layer_capacity(view)
    counts = layer_counts(view)
    gaps: list[tuple[int, int]] = []
    for layer, count in enumerate(counts):
        if count:
            continue
        if gaps and gaps[-1][1] == layer:
            gaps[-1] = (gaps[-1][0], layer + 1)
        else:
            gaps.append((layer, layer + 1))
    neck = 0.0 if gaps or not caps else min(caps)
    return Coverage(tuple(caps), tuple(counts), neck, tuple(gaps))


def _quantize(x: float) -> float:
    return float(f"{x:.{CAPACITY_SIG_DIGITS}g}")


def _rendezvous(me: str, start: int) -> bytes:
    """Highest-random-weight hashing: each peer ranks the windows in its own order."""
    return hashlib.sha256(f"{me}\x00{start}".encode()).digest()


def choose_span(
    view: SwarmView, *, me: str, capacity_layers: int, throughput: float,
    held: tuple[tuple[int, int], ...] = (),
) -> tuple[int, int]:
    """The span ``[start, end)`` a joining peer should claim.

    The window has length ``min(capacity_layers, L)``; it is chosen by the criteria in
    the module docstring (gaps first, then the weakest layers, then layers held on
    disk — before the weakest layers when filling a gap —, then clean edges, then a
    hash of ``me``). ``held`` is ``me``'s layer ranges on disk (merged, as in
    `PeerInfo.held`). ``me``'s own entry in the view, if any, is ignored.

    Raises ValueError if ``capacity_layers < 1``. A model with no layers gives (0, 0).
    """
    if capacity_layers < 1:
        raise ValueError(f"capacity_layers must be at least 1, got {capacity_layers!r}")
    num_layers = view.num_layers
    if num_layers <= 0:
        return (0, 0)
    k = min(capacity_layers, num_layers)
    others = view.without([me])
    summary = coverage_summary(others)
    gain = max(throughput, 0.0) / k
    base = [_quantize(c) for c in summary.capacity]
    raised = [_quantize(c + gain) for c in summary.capacity]
    hole = [1 if c == 0 else 0 for c in summary.counts]
    # Boundaries where the capacity steps (a gap's edge is one): the model's ends and
    # every b with a different capacity or coverage on each side.
    edges = {0, num_layers}
    for b in range(1, num_layers):
        if base[b - 1] != base[b] or hole[b - 1] != hole[b]:
            edges.add(b)

    best_key: tuple | None = None
    best_start = 0
    for start in range(num_layers - k + 1):
        end = start + k
        filled = sum(hole[start:end])
        profile = sorted(base[:start] + raised[start:end] + base[end:])
        aligned = (start in edges) + (end in edges)
        have = layers_held(held, start, end)
        key = (-filled, -have if filled else 0, tuple(-x for x in profile), -have, -aligned, _rendezvous(me, start))
        if best_key is None or key < best_key:
            best_key, best_start = key, start
    return (best_start, best_start + k)


def gap_filler(view: SwarmView) -> str | None:
    """The one peer that should move into a gap now, or None (no gap, or nobody free).

    Candidates are SERVING peers all of whose layers have another server (moving
    them opens no gap). Every peer computes the same answer from the same snapshot,
    so exactly one of them moves per view instead of all rushing into the same gap
    (and then rebalancing back out of it). Preferred, in order: the one that can
    fill the most uncovered layers (fewest reloads), the one that holds most of such
    a window on disk (a load, not a download: `PeerInfo.held`), the one whose own
    layers stay strongest without it (take from the richest), then a hash of its id. The next
    candidate is elected once the mover's new claim shows in the view — or once an
    elected peer that never moves ages out of the view.
    """
    summary = coverage_summary(view)
    if not summary.gaps:
        return None
    hole = [1 if c == 0 else 0 for c in summary.counts]
    fills: dict[int, tuple[int, list[int]]] = {}  # window length -> most uncovered layers it can cover, and where
    best: tuple | None = None
    elected = None
    for p, start, end in _claims(view):
        if p.state != SERVING or any(summary.counts[layer] < 2 for layer in range(start, end)):
            continue
        k = min(p.num_layers, view.num_layers)
        if k not in fills:
            filled = [sum(hole[s : s + k]) for s in range(view.num_layers - k + 1)]
            most = max(filled)
            fills[k] = (most, [s for s, f in enumerate(filled) if f == most])
        most, starts = fills[k]
        have = max(p.held_in(s, s + k) for s in starts) if p.held else 0
        per_layer = max(p.throughput, 0.0) / p.num_layers
        remaining = min(summary.capacity[layer] - per_layer for layer in range(start, end))
        key = (-most, -have, -_quantize(remaining), _rendezvous(p.peer_id, summary.gaps[0][0]))
        if best is None or key < best:
            best, elected = key, p.peer_id
    return elected


def plan_move(
    view: SwarmView,
    *,
    me: str,
    capacity_layers: int,
    throughput: float,
    threshold: float = REBALANCE_MIN_GAIN,
) -> tuple[int, int] | None:
    """The span ``me`` should move to now, or None to stay where it is.

    ``me`` is re-placed with `choose_span` as if it joined the swarm without itself,
    and the move is taken only when:

    - **it never opens a gap**: every layer ``me`` serves is also served by another
      non-leaving peer. No exception, not even to fill a bigger gap elsewhere: a gap
      anywhere means no route exists, so trading one gap for a smaller one restores
      no service, costs a reload, and lets two sole servers chase each other's gaps.
      Gaps are filled by redundant peers (below) and by joiners (`choose_span`).
    - **while layers are uncovered**: ``me`` is the swarm's `gap_filler` (one peer
      per snapshot, chosen the same way by every peer) and the move fills at least
      one uncovered layer (the bottleneck is 0 before and possibly after, so it
      cannot be the test). `choose_span` fills the most uncovered layers first, so
      the weakest coverage is re-covered first.
    - **when everything is covered**: the bottleneck after the move exceeds the
      current one by more than ``threshold`` (relative; REBALANCE_MIN_GAIN).

    Every move taken raises (uncovered layers fewer, or else bottleneck × (1 +
    threshold)), so a swarm applying moves one at a time settles after finitely many,
    and a settled swarm makes none. Rebalancing moves (not gap fills) are judged per
    peer, so two peers planning from the same snapshot at the same moment may both
    move: callers re-check on a jittered period and re-read the view after any move
    is announced (as Petals does).

    Only a SERVING peer with a non-empty span moves: a loading peer finishes loading
    first, and a draining or leaving one is on its way out.

    Raises ValueError if ``me`` is not in the view, or on a bad argument.
    """
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    mine = view.get(me)
    if mine is None:
        raise ValueError(f"me={me!r} is not in the swarm view")
    if mine.state != SERVING or mine.num_layers <= 0:
        return None
    others = coverage_summary(view.without([me]))
    start, end = max(mine.start, 0), min(mine.end, view.num_layers)
    if any(others.counts[layer] == 0 for layer in range(start, end)):
        return None  # I am the only server of some layer: leaving it opens a gap.

    now = coverage_summary(view.replace(replace(mine, throughput=throughput)))
    if now.uncovered and gap_filler(view) != me:
        return None
    new = choose_span(view, me=me, capacity_layers=capacity_layers, throughput=throughput, held=mine.held)
    if new == mine.span:
        return None
    after = coverage_summary(view.replace(replace(mine, start=new[0], end=new[1], throughput=throughput)))
    if now.uncovered:
        return new if after.uncovered < now.uncovered else None
    return new if after.bottleneck > now.bottleneck * (1.0 + threshold) else None
