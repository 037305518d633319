"""Routing: which chain of peers carries a request through layers [start, end).

A pure function of a `SwarmView` snapshot: no I/O, no clock, no randomness. Peers
are read in peer-id order and ties are broken by peer id, so the same view gives the
same chain however it was assembled.

The cost of a chain (milliseconds of one decode step through it)
----------------------------------------------------------------
For each hop, peer p running n layers, entered from node ``prev``::

    rtt(prev, p) + n * 1000 / p.throughput * (1 + load_penalty * p.load)

where ``prev`` is ``source`` for the first hop; plus ``rtt(last, sink)`` at the end
(``sink`` defaults to ``source``: the last peer answers the requester, a ring).
``rtt(a, b)`` is a's measured ``rtt_ms[b]`` or b's ``rtt_ms[a]`` (their mean if both),
else ``default_rtt_ms``. Sending to oneself costs nothing.

A peer serving ``[s, e)`` may be entered at any boundary ``b`` with ``s <= b < e`` and
then runs ``[b, min(e, end))``: a chain may use the tail of a span, which is what a
requester needs to re-route a failed span ``[a, b)`` over replacements with other cut
points (``route(view, start=a, end=b, source=<peer before>, sink=<peer after>)``).

A worked example (L = 4, default RTT 100 ms, no load)::

    peer  span    throughput (tokens/s per layer)   compute per layer
    a     [0, 2)  100                               10 ms
    b     [2, 4)  100                               10 ms
    c     [0, 4)   20                               50 ms
    a and b measured 5 ms to the requester r; nothing else is measured.

    r -> a -> b -> r   5 + 20 + rtt(a, b)=100 + 20 + 5  = 150 ms
    r -> c -> r        100 + 200 + 100                  = 400 ms   -> route = a, b

If a has also measured b at 10 ms, a -> b costs 10 and the chain 60 ms. Excluding
a gives ``r -> c -> r``; excluding c too leaves layers [0, 2) uncovered and the answer
is ``Route((), inf)``, whose ``ok`` is False.

The search
----------
States are (layer boundary, last peer). Because a peer entered at ``b`` always runs to
its own end, the state after a hop is (exit of p, p) — one per peer — and every edge
goes to a strictly later boundary. The graph is a DAG, so Dijkstra's priority queue
is unnecessary: settling states in boundary order is the same shortest-path search.
For a peer q exiting at e, each entry boundary b contributes::

    min over peers p exiting at b of  dist(p) + rtt(p, q)   (+ q's compute from b to e)

Peers without a measured RTT to q all pay the same ``default_rtt_ms``, so the best of
them is the first of b's arrivals sorted by distance; the measured pairs are looked
up one by one. A call costs O(sum of span lengths + measured RTT entries), not
O(peers²). Measured on a shared 2-core box (where a bare 20,000-step Python loop
takes 1.2 ms): 1,000 peers, 30-100 layers, 20 measured neighbours each — 4-6 ms
per call, 11-12 ms when the measured-link index must be rebuilt (see
`_measured_links`).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from tessera.peer.plan.cost import DEFAULT_RTT_MS, FULL_LOAD, LOAD_PENALTY, ms_per_layer, hop_compute_ms, rtt_ms
from tessera.peer.plan.groups import ShardGroup, replica_coverage, with_group_peers
from tessera.peer.plan.view import SERVING, PeerInfo, SwarmView

__all__ = [
    "DEFAULT_RTT_MS",
    "LOAD_PENALTY",
    "Hop",
    "Route",
    "NO_ROUTE",
    "rtt_ms",
    "hop_compute_ms",
    "route",
    "route_cost",
]

@dataclass(frozen=True)
class Hop:
    """One peer of a chain: it runs layers ``[start, end)``.

    A tensor-shard group as one hop (only with ``route(..., groups=True)``): ``peer_id`` is
    the group's hop id (``tessera.peer.plan.groups.group_hop_id``), ``group`` its name and
    ``members`` its ranks' peer ids in rank order; empty for a plain peer.
    """

    peer_id: str
    start: int
    end: int
    group: str = ""
    members: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Route:
    """A chain of hops covering ``[hops[0].start, hops[-1].end)``, and its estimated
    cost in ms per step. ``Route((), inf)`` means no chain exists; check ``ok``."""

    hops: tuple[Hop, ...]
    cost_ms: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.cost_ms)

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(h.peer_id for h in self.hops)


NO_ROUTE = Route((), math.inf)


def route_cost(
    view: SwarmView,
    hops: Iterable[Hop],
    *,
    source: str,
    sink: str | None = None,
    default_rtt_ms: float = DEFAULT_RTT_MS,
    load_penalty: float = LOAD_PENALTY,
) -> float:
    """The cost in ms of a given chain, by the formula in the module docstring.

    Returns inf if the hops are not contiguous, a hop is empty, or its peer is missing
    from the view, does not claim the hop's layers, or has no throughput. The peers'
    state and load are priced, not checked (a replay may price a recorded chain whose
    peers have since started draining). An empty chain costs ``rtt(source, sink)``.
    """
    peers = {p.peer_id: p for p in view.peers}
    sink = source if sink is None else sink
    total, prev, at = 0.0, source, None
    for hop in hops:
        p = peers.get(hop.peer_id)
        if p is None or p.throughput <= 0 or not p.start <= hop.start < hop.end <= p.end:
            return math.inf
        if at is not None and hop.start != at:
            return math.inf
        link = rtt_ms(peers, prev, hop.peer_id, default_rtt_ms)
        total = total + link + hop.num_layers * ms_per_layer(p, load_penalty)  # same order as route()
        prev, at = hop.peer_id, hop.end
    return total + rtt_ms(peers, prev, sink, default_rtt_ms)


def unusable_reason(p: PeerInfo, exclude: frozenset[str] | set[str] = frozenset()) -> str | None:
    """Why a new session would not be routed through `p` now; None when it would.

    The one definition of "accepts sessions": `route` uses it, and so do `swarm status`
    (what it counts as coverage) and the requester's wait for a route (what it says it is
    waiting for). A reason is "banned" (in `exclude`: this requester avoids it), the
    peer's state when not serving ("draining" — paused peers say so too —, "leaving",
    "loading"), "busy" (every session slot taken) or "unmeasured" (no speed yet).
    """
    if p.peer_id in exclude:
        return "banned"
    if not p.routable:
        return p.state if p.state != SERVING else "no layers"
    if p.throughput <= 0:
        return "unmeasured"
    if p.load >= FULL_LOAD:
        return "busy"
    return None


def routable_view(view: SwarmView, exclude: frozenset[str] | set[str] = frozenset()) -> SwarmView:
    """Only the peers `route` would use (see `unusable_reason`)."""
    return SwarmView(view.num_layers, tuple(p for p in view.peers if unusable_reason(p, exclude) is None))


def why_no_route(
    view: SwarmView,
    *,
    start: int = 0,
    end: int | None = None,
    banned: frozenset[str] | set[str] | Mapping[str, str] = frozenset(),
    unreachable: frozenset[str] | set[str] = frozenset(),
) -> tuple[list[tuple[int, int]], str]:
    """What stands between a requester and a route over [start, end): the layer ranges no
    usable peer covers, and a sentence naming them and, for each peer that claims a layer
    there (every peer not taking sessions, when nothing is uncovered), why it is not used:
    its `unusable_reason`, "banned" (this requester's ban; `banned` may map each peer to
    its own words, e.g. "busy: skipped for 5 s") or "unreachable" (a failed dial)."""
    end = view.num_layers if end is None else end
    reasons: dict[str, str] = {}
    for p in view.peers:
        said = banned.get(p.peer_id) if isinstance(banned, Mapping) else None
        why = (said or "banned" if p.peer_id in banned else "unreachable" if p.peer_id in unreachable
               else unusable_reason(p))
        if why is not None:
            reasons[p.peer_id] = why
    usable = SwarmView(view.num_layers, tuple(p for p in view.peers if p.peer_id not in reasons))
    counts = replica_coverage(usable)
    gaps: list[tuple[int, int]] = []
    for layer in range(start, end):
        if counts[layer] == 0:
            if gaps and gaps[-1][1] == layer:
                gaps[-1] = (gaps[-1][0], layer + 1)
            else:
                gaps.append((layer, layer + 1))

    def touches_gap(p: PeerInfo) -> bool:
        return any(p.start < b and a < p.end for a, b in gaps)

    blockers = [f"{p.name or p.peer_id[-8:]} [{p.start},{p.end}) {reasons[p.peer_id]}"
                for p in view.peers if p.peer_id in reasons and (touches_gap(p) or not gaps)]
    text = "uncovered layers: " + (", ".join(f"[{a}, {b})" for a, b in gaps) if gaps else "none")
    if blockers:
        text += "; not taking sessions: " + ", ".join(blockers)
    elif gaps:
        text += " (no peer claims them)"
    else:
        text += " (every layer has a usable peer; no chain of them joins source to sink)"
    return gaps, text


def route(
    view: SwarmView,
    *,
    start: int = 0,
    end: int | None = None,
    source: str,
    sink: str | None = None,
    exclude: frozenset[str] = frozenset(),
    default_rtt_ms: float = DEFAULT_RTT_MS,
    load_penalty: float = LOAD_PENALTY,
    groups: bool = False,
) -> Route:
    """The cheapest chain from ``source`` through layers ``[start, end)`` to ``sink``.

    ``end`` defaults to the model's layer count; ``sink`` to ``source``. Only
    `PeerInfo.routable` peers (state serving, non-empty span) that are not in
    ``exclude``, have a positive throughput and a free session slot (load < 1) are
    used; so are only unsharded peers (``shard_count == 1``): one shard of a
    tensor-sharded span cannot run the span alone — unless ``groups``: then every
    complete group of usable ranks is one more candidate hop, priced as entered from and
    left to ``source`` (the requester, which scatters into and gathers out of a group;
    see ``peer/plan/groups.py``), so pass it only when ``source`` is the requester. A
    group hop has ``members``; excluding any rank (or the group's hop id) drops the group.
    The source and sink need not be
    in the view (a requester usually is not; it may add itself with an empty span
    to contribute its own RTT measurements).

    Exact ties go to the chain with fewer hops, then to the smaller sequence of peer
    ids. Returns ``Route((), inf)`` when no chain covers the range, and
    ``Route((), 0.0)`` for an empty range.

    Raises ValueError unless ``0 <= start <= end <= num_layers``.
    """
    num_layers = view.num_layers
    end = num_layers if end is None else end
    if not 0 <= start <= end <= num_layers:
        raise ValueError(f"need 0 <= start <= end <= {num_layers}, got start={start!r} end={end!r}")
    sink = source if sink is None else sink
    exclude = frozenset(exclude)
    if start == end:
        return Route((), 0.0)
    peers = {p.peer_id: p for p in view.peers}
    group_of: dict[str, ShardGroup] = {}
    if groups:  # tensor-shard groups, each as one synthetic peer (peer/plan/groups.py)
        peers, group_of = with_group_peers(
            peers, source=source, default_rtt_ms=default_rtt_ms, load_penalty=load_penalty,
            usable=lambda p: unusable_reason(p, exclude) is None,
        )

    # The usable peers, in peer-id order, grouped by the boundary where they exit.
    exits: dict[int, list[tuple[str, int, float]]] = defaultdict(list)
    span_of: dict[str, tuple[int, int]] = {}  # the layers each usable peer would run
    for pid in sorted(peers):
        p = peers[pid]
        if p.shard_count != 1 or unusable_reason(p, exclude) is not None:
            continue
        lo, hi = max(p.start, start), min(p.end, end)
        if lo < hi:
            exits[hi].append((pid, lo, ms_per_layer(p, load_penalty)))
            span_of[pid] = (lo, hi)

    into = _measured_links(peers, span_of)
    # rtt_ms(peers, source, q) and rtt_ms(peers, q, sink) for many q: the source's and the
    # sink's own maps looked up once (the same arithmetic as cost.rtt_ms; see _rtt_from)
    from_source = _rtt_from(peers, source, default_rtt_ms)
    to_sink = _rtt_from(peers, sink, default_rtt_ms)

    # label[pid] = (cost, hops, peer ids) of the best chain ending with pid;
    # arrivals[b] = (cost, hops, ids, pid) of the peers exiting at b, best first, and
    # via_default[b] = the best of them's cost + default_rtt_ms (what an unmeasured
    # link from it costs before compute). Candidates compare as (cost, hops, ids).
    # `reached` lists, in order, the boundaries someone exits at: only those can be
    # entered from (at any other b, via_default[b] is inf and nothing is priced).
    inf = math.inf
    label: dict[str, tuple[float, int, tuple[str, ...]]] = {}
    arrivals: list[list[tuple[float, int, tuple[str, ...], str]]] = [[] for _ in range(end + 1)]
    via_default = [inf] * (end + 1)
    reached: list[int] = []
    nothing: dict[str, tuple[float, int]] = {}
    for e in sorted(exits):
        for qid, lo, per_layer in exits[e]:
            measured = into.get(qid, nothing)
            best_cost, best_n, best_ids = inf, 0, ()
            if lo == start:  # entered straight from the source
                best_cost, best_n = from_source(qid) + (e - start) * per_layer, 1
            for b in reached[bisect_left(reached, lo):]:  # b < e: reached holds exits before e only
                c = via_default[b] + (e - b) * per_layer
                if c > best_cost or c == inf:
                    continue  # nobody there beats best (sorted)
                arr = arrivals[b]
                cost, n, ids, pid = arr[0]
                if pid in measured:  # its link is priced below; take the best unmeasured one
                    cost, n, ids, pid = next((x for x in arr if x[3] not in measured), (inf, 0, (), ""))
                    c = cost + default_rtt_ms + (e - b) * per_layer
                if c < best_cost or (c == best_cost and (n + 1, ids) < (best_n, best_ids)):
                    best_cost, best_n, best_ids = c, n + 1, ids
            for pid, (rtt, b) in measured.items():
                if pid in label:
                    cost, n, ids = label[pid]
                    c = cost + rtt + (e - b) * per_layer
                    if c < best_cost or (c == best_cost and (n + 1, ids) < (best_n, best_ids)):
                        best_cost, best_n, best_ids = c, n + 1, ids
            if best_cost < inf:
                label[qid] = (best_cost, best_n, best_ids + (qid,))
        if e == end:  # the last boundary: only the final choice below reads it, and min needs no order
            arrivals[e] = [(*label[qid], qid) for qid, _, _ in exits[e] if qid in label]
            continue
        arrivals[e] = sorted((*label[qid], qid) for qid, _, _ in exits[e] if qid in label)
        if arrivals[e]:
            via_default[e] = arrivals[e][0][0] + default_rtt_ms
            reached.append(e)

    finals = [(cost + to_sink(ids[-1]), n, ids) for cost, n, ids, _ in arrivals[end]]
    if not finals:
        return NO_ROUTE
    cost, _, ids = min(finals)
    hops, at = [], start
    for pid in ids:
        g = group_of.get(pid)
        hops.append(Hop(pid, at, span_of[pid][1], group=g.name, members=g.member_ids) if g else Hop(pid, at, span_of[pid][1]))
        at = span_of[pid][1]
    return Route(tuple(hops), cost)


def _rtt_from(peers: Mapping[str, PeerInfo], a: str, default_rtt_ms: float) -> Callable[[str], float]:
    """``lambda b: rtt_ms(peers, a, b, default_rtt_ms)`` with a's own map looked up once.

    rtt(a, b) = rtt(b, a) (the mean of two measurements is symmetric in exact arithmetic
    as in floats), so this serves the link into a sink as well as the one out of a source.
    """
    pa = peers.get(a)
    mine = pa.rtt_ms if pa is not None else {}

    def rtt(b: str) -> float:
        if a == b:
            return 0.0
        pb = peers.get(b)
        x = mine.get(b)
        y = pb.rtt_ms.get(a) if pb is not None else None
        if x is None:
            return default_rtt_ms if y is None else y
        return x if y is None else (x + y) / 2.0

    return rtt


# The measured-link index is the larger part of a call in a big swarm (it reads every
# RTT entry of every usable peer), and it depends only on the usable peers' ids, run
# spans and RTT maps — not on loads, throughputs or the sink. route() remembers the
# last one (one slot) keyed by exactly those, so repeated calls on one view, or on a
# new view where only loads changed, skip it. The key compares by value (with
# Python's identity shortcut making the usual case cheap), so the memo changes no
# result — provided a PeerInfo's rtt_ms mapping is not mutated after it is built,
# which a frozen snapshot promises anyway.
_links_memo: tuple[tuple, dict[str, dict[str, tuple[float, int]]]] | None = None


def _measured_links(
    peers: Mapping[str, PeerInfo], span_of: Mapping[str, tuple[int, int]]
) -> dict[str, dict[str, tuple[float, int]]]:
    """Measured links p -> q between usable peers where p can hand over to q (q can be
    entered where p exits): ``into[q] = {p: (resolved rtt, where p exits)}``."""
    global _links_memo
    key = tuple((pid, lo, hi, peers[pid].rtt_ms) for pid, (lo, hi) in span_of.items())
    memo = _links_memo
    if memo is not None and memo[0] == key:
        return memo[1]
    into: dict[str, dict[str, tuple[float, int]]] = {}
    for a, (ia, ea) in span_of.items():
        mine = peers[a].rtt_ms
        for b in mine.keys() & span_of.keys():
            ib, eb = span_of[b]
            if ib <= ea < eb:
                src, dst, at = a, b, ea
            elif ia <= eb < ea:
                src, dst, at = b, a, eb
            else:
                continue
            back = peers[b].rtt_ms.get(a)
            into.setdefault(dst, {})[src] = (mine[b] if back is None else (mine[b] + back) / 2.0, at)
    _links_memo = (key, into)
    return into
