"""The search behind `routing.route`: the cheapest chain of distinct peers through [start, end).

Pure: no I/O, no clock, no randomness; candidates come sorted by peer id and every
tie is broken by (hops, peer ids, later cut points), so one input gives one answer.

Which chains there are
----------------------
A peer that loaded layers [s, e) computes any sub-span of them (stages/engine/sessions.py), so
a chain is a sequence of distinct peers p1..pk and cut points
``start = c0 < c1 < ... < ck = end`` with ``s(pi) <= c(i-1)`` and ``ci <= e(pi)``. The
cost (routing.py's docstring) is linear in each cut point for a fixed sequence of peers,
so a cheapest chain puts every cut at an end of its feasible range: where the peer before
it ends (a *tail* hand-over: the next peer is entered mid-span, as routing always could)
or where the peer after it starts (a *head* hand-over: the one before leaves early). The
search takes exactly those chains — every cut is ``e(p_i)`` or ``s(p_i+1)`` — which is
what lets ``--prefer`` work: a non-preferred peer whose span starts earlier runs only the
layers no preferred peer holds, then hands over at the preferred peer's first layer.
(The linear argument leaves out only chains that squeeze a hop to one layer between two
others, cheaper solely through RTTs that break the triangle inequality.) A
tensor-shard group runs to the end of its span: it is never left early.

The search
----------
A sweep over the boundaries where something starts or ends. Each peer keeps its best
*entry* (cost so far including the link into it, where it was entered); every exit from
it at b costs that plus (b - entry) layers of its compute — one slope per peer, so the
best entry is the best at every exit. At each boundary b: the peers ending there exit
(tail), every peer that has been entered may exit early if some peer starts at b (head),
and entries are priced from those exits: unmeasured links at the default RTT from the
best exit, measured ones (``pairs``) one by one. That is O(sum of span lengths +
measured pairs) per pass, as before head hand-overs.

A chain must not use a peer twice (a requester opens one session per peer and route).
The sweep cannot see that — a peer left early at b may be entered again later — so its
answer is a lower bound, and a branch-and-bound over it finds the cheapest chain of
distinct peers: when the best relaxed chain uses peer q at [x1, y1) and again at
[x2, y2), every chain of distinct peers either keeps q within [.., x2), or within
[y1, ..), or runs q across the whole of [y1, x2] (then no cut lies in [y1, x2]); each
branch excludes the relaxed chain, so the branches' bounds only rise, and the first
chain of distinct peers taken from the queue is the cheapest. In the swarms we see a
relaxed chain almost never repeats a peer (it pays two extra round trips to do so),
and one pass is the whole search. After MAX_BRANCHES passes the best chain of distinct
peers found so far wins against the tail-only chain (which never repeats a peer).

Interchangeable candidates (`Pool`)
-----------------------------------
In a big swarm most peers run one of a few dozen spans and have measured nobody (nor has
anybody measured them): to the search they differ only in speed and id, and the sweep's
cost is proportional to how many run across each boundary. Among such peers with one
(clipped) span [lo, hi), a chain of distinct peers uses at most ``(hi - lo + 1) // 2``: two
of them are never adjacent (the cut between them would be where the first ends or the
second starts, hi or lo, and both run layers strictly between), so each but the first
needs a layer of another peer between it and the one before. Hence only that many of the
fastest can be in the answer: were a slower one in it, one of the kept ones would be
unused, and putting it in the slower one's place keeps every cut and every round trip
(all at the default), costs no more (float arithmetic rounds monotonically) and, at an
equal price, sorts first (pools are ordered by (ms per layer, peer id)) — a better chain,
a contradiction. `cheapest_chain` searches over the kept ones and falls back to everyone
in the two cases that argument does not cover: the branch-and-bound ran out of passes
(its best-so-far answer depends on the candidates), or a kept and a left-out speed differ
by so little that rounding could make two chains' different prices equal (`_clear_of_rounding`).

The same argument holds for any number k of a pool's fastest, as long as no chain that could
be the answer uses more than k of it — and the price of any chain found bounds that: every
member but the first is entered, and every one but the last left, over a link at the default
round trip, so a chain using k of them pays 2 (k - 1) of those on top of its compute
(`_pool_members_needed`). The search first keeps FIRST_KEEP of each pool and widens only
when the price of what it found allows a chain to use more (at 1,000 peers: 126 candidates
a search instead of 260, and one search a route in bench/simulate.py).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import AbstractSet, Callable, Mapping, Sequence

# Relaxed passes one search may run before settling for the best chain of distinct peers
# found so far. Each pass costs about what a whole route() cost before head hand-overs
# (a few ms at 1,000 peers); a revisit needs a peer nested in another's span that is
# cheaper by more than two round trips, and each branch removes one such nesting.
MAX_BRANCHES = 32

# How many of each pool's fastest a search first keeps (`cheapest_chain`), before the price of
# what it finds bounds how many a cheaper chain could use (`_pool_members_needed`), where a
# pool's width allows (hi - lo + 1) // 2 (3 to 8 in bench/simulate.py).
FIRST_KEEP = 2


@dataclass(frozen=True, slots=True)
class Candidate:
    """A usable peer as the search sees it: the layers [lo, hi) it could run in this range
    (its span clipped to it), its ms per layer, and whether it may be left before hi."""

    pid: str
    lo: int
    hi: int
    per_layer: float
    stops_early: bool = True


@dataclass(frozen=True, slots=True)
class Pool:
    """Candidates interchangeable but for speed and id (module docstring): one clipped span
    [lo, hi), all may be left early, and no measured round trip to or from any of them (none
    is the source or the sink either). `members` sorted by (per_layer, pid): a tuple, or a
    sequence that sorts as it is read (routing.py's spread draws)."""

    lo: int
    hi: int
    members: Sequence[Candidate]

    @property
    def keep(self) -> int:
        """How many of one span a chain of distinct peers can use."""
        return (self.hi - self.lo + 1) // 2


def pools_of(candidates: Sequence[Candidate], measured: AbstractSet[str]) -> tuple[list[Candidate], list[Pool]]:
    """Split `candidates` into those searched one by one and `Pool`s: peers not in `measured`
    (every node that measured a round trip or was measured) that share a span with more of
    their kind than a chain can use. The first list keeps the input's order."""
    by_span: dict[tuple[int, int], list[Candidate]] = defaultdict(list)
    for c in candidates:
        if c.pid not in measured and c.stops_early:
            by_span[(c.lo, c.hi)].append(c)
    pools = [Pool(lo, hi, tuple(sorted(group, key=lambda c: (c.per_layer, c.pid))))
             for (lo, hi), group in sorted(by_span.items()) if len(group) > (hi - lo + 1) // 2]
    pooled = {c.pid for pool in pools for c in pool.members}
    return [c for c in candidates if c.pid not in pooled], pools


# A chain so far: (cost in ms, hops, peer ids, negated entry boundaries, entry boundaries).
# Tuples compare in tie-break order: cost, then fewer hops, then peer ids, then later cuts.
Label = tuple[float, int, tuple[str, ...], tuple[int, ...], tuple[int, ...]]
Bounds = dict[str, tuple[int, int]]


def cheapest_chain(
    candidates: Sequence[Candidate],
    *,
    start: int,
    end: int,
    from_source: Callable[[str], float],
    to_sink: Callable[[str], float],
    links: Links,
    default_rtt_ms: float,
    max_branches: int = MAX_BRANCHES,
    heads: bool = True,
    pools: Sequence[Pool] = (),
    skip: AbstractSet[str] = frozenset(),
) -> Label | None:
    """The cheapest chain of distinct candidates through [start, end) (see the module
    docstring): ``(cost, hops, ids, -entries, entries)``, or None when none exists.
    `links`: the measured RTTs between candidates (`links_between`). `heads=False`: only tail
    hand-overs (every hop runs to its peer's end; what routing did before, and never repeats a
    peer): a baseline for bench/routing.py. The candidates are `candidates` (sorted by peer id)
    and the members of `pools` not in `skip`; the caller promises what `Pool` says of those."""
    search_args = (start, end, from_source, to_sink, links, default_rtt_ms, max_branches, heads)
    if pools:
        widest = max(pool.keep for pool in pools)
        cap = min(FIRST_KEEP, widest)
        while True:
            kept, gap = _thinned(pools, skip, cap)
            if kept is None:  # nobody left out
                break
            searched = sorted([*candidates, *kept], key=_peer_id)
            label, exact = _branch_and_bound(searched, *search_args)
            if not exact or (label is not None and not _clear_of_rounding(gap, label[0], end - start)):
                break
            if cap >= widest:  # every pool kept what any chain can use
                return label
            if label is not None:
                needed = _pool_members_needed(label[0], end - start, searched, default_rtt_ms)
                if needed <= cap:  # no chain that could beat this one uses more of a pool than were kept
                    return label
                cap = min(needed, widest)
            else:
                cap = widest  # no chain through so few: no price to bound the hops with
        candidates = sorted([*candidates, *(c for pool in pools for c in pool.members if c.pid not in skip)],
                            key=_peer_id)
    return _branch_and_bound(candidates, *search_args)[0]


def _pool_members_needed(cost: float, layers: int, searched: Sequence[Candidate], default_rtt_ms: float) -> float:
    """How many members of one pool a chain priced at most `cost` can use (inf: no bound).

    Such a chain computes `layers` layers at no less than the fastest candidate's ms per layer
    (left-out pool members are slower than the kept ones), and its other costs are round
    trips, none below 0. Of one pool it uses k members, no two adjacent (module docstring),
    and nobody measured a round trip to or from them: each but the first is entered, and each
    but the last is left, over a link at the default — 2 (k - 1) different hand-overs. So
    cost >= layers * fastest + 2 (k - 1) * default, and k <= 1 + (cost - layers * fastest) /
    (2 * default). The chain found is priced at most `cost`, so the cheapest chain is too.
    The margins (1e-9, relative) dwarf the rounding of sums of a few hundred terms (~1e-14).
    Through `route` the way into the first member and out of the last cost the default too
    (a pooled peer is nobody's end, and no end measured it), which would allow one member
    fewer; the bound does not count on it, so it holds for any `from_source` and `to_sink`.
    """
    if not default_rtt_ms > 0 or not math.isfinite(cost):
        return math.inf
    fastest = min(c.per_layer for c in searched)
    return 1 + max(0, math.floor((cost * (1 + 1e-9) - layers * fastest * (1 - 1e-9)) / (2 * default_rtt_ms * (1 - 1e-9))))


def _peer_id(c: Candidate) -> str:
    return c.pid


def _thinned(pools: Sequence[Pool], skip: AbstractSet[str], cap: float = math.inf) -> tuple[list[Candidate] | None, float]:
    """The fastest `keep` (at most `cap`) members of each pool (those in `skip` aside), or None
    when that leaves nobody out; and the smallest positive difference between a left-out
    member's ms per layer and a kept one's below it (inf if there is none)."""
    kept: list[Candidate] = []
    gap, left_out = math.inf, False
    for pool in pools:
        keep, taken, top, below = min(pool.keep, cap), 0, -math.inf, None  # top: the slowest kept; below: the next one down
        members = pool.members
        for i, c in enumerate(members):
            if c.pid in skip:
                continue
            if taken < keep:
                if c.per_layer != top and taken:
                    below = top
                kept.append(c)
                taken, top = taken + 1, c.per_layer
                continue
            left_out = True
            if c.per_layer > top:
                gap = min(gap, c.per_layer - top)
            else:  # a tie with the slowest kept: the kept below it, and the next faster left out, bound it
                if below is not None:
                    gap = min(gap, top - below)
                above = next((d.per_layer for d in members[i + 1:] if d.per_layer > top and d.pid not in skip), None)
                if above is not None:
                    gap = min(gap, above - top)
            break
    return (kept if left_out else None), gap


def _clear_of_rounding(gap: float, cost: float, layers: int) -> bool:
    """Whether two chains whose exact prices differ by at least `gap` can not both come out at
    `cost`. A chain's price is summed in at most 3 operations a hop (an exit's product and sum,
    the link into the next) plus the source's and the sink's links, over at most `layers` hops,
    each rounding by at most 2**-53 of a partial sum no larger than `cost`: two such sums that
    round to one value lie within twice that of each other. Checked with room to spare."""
    return gap > cost * (4 * layers + 8) * 2.0 ** -52


def _branch_and_bound(candidates: Sequence[Candidate], start: int, end: int, from_source: Callable[[str], float],
                      to_sink: Callable[[str], float], links: Links, default_rtt_ms: float, max_branches: int,
                      heads: bool) -> tuple[Label | None, bool]:
    """The module docstring's search over `candidates`, and whether its answer is exact (False:
    it ran out of passes and settled for the best chain of distinct peers found)."""
    search = _Search(candidates, start, end, from_source, to_sink, links, default_rtt_ms)
    if not heads:
        return search.solve({}, frozenset(), heads=False), True
    root = search.solve({}, frozenset(), heads=True)
    if root is None:
        return None, True
    queue: list[tuple[Label, int, Bounds, frozenset[int]]] = [(root, 0, {}, frozenset())]
    found: Label | None = None  # the best chain of distinct peers seen (not yet proven cheapest)
    pushed = passes = 0
    while queue and passes < max_branches:
        label, _, bounds, no_cut = heapq.heappop(queue)
        repeat = _first_repeat(label, end)
        if repeat is None:
            return label, True
        passes += 1
        pid, (x1, y1), (x2, _y2) = repeat
        lo, hi = bounds.get(pid, search.span(pid))
        for child_bounds, child_no_cut in (
            ({**bounds, pid: (lo, min(hi, x2))}, no_cut),  # q stays before its second piece
            ({**bounds, pid: (max(lo, y1), hi)}, no_cut),  # q stays after its first piece
            (bounds, no_cut | set(range(y1, x2 + 1))),  # q runs across [y1, x2]: nobody hands over there
        ):
            child = search.solve(child_bounds, child_no_cut, heads=True)
            if child is None:
                continue
            if _first_repeat(child, end) is None and (found is None or child < found):
                found = child
            pushed += 1
            heapq.heappush(queue, (child, pushed, child_bounds, child_no_cut))
    tail_only = search.solve({}, frozenset(), heads=False)  # never repeats a peer
    answer = min(x for x in (found, tail_only) if x is not None) if (found or tail_only) else None
    return answer, not queue  # an emptied queue: no branch left, so no chain of distinct peers was missed


def _first_repeat(label: Label, end: int) -> tuple[str, tuple[int, int], tuple[int, int]] | None:
    """The first peer a chain uses twice, with the layers of its first two pieces."""
    ids, entries = label[2], label[4]
    seen: dict[str, int] = {}
    for j, pid in enumerate(ids):
        if pid in seen:
            i = seen[pid]
            exit_j = entries[j + 1] if j + 1 < len(ids) else end
            return pid, (entries[i], entries[i + 1]), (entries[j], exit_j)
        seen[pid] = j
    return None


@dataclass(frozen=True)
class Links:
    """Measured RTTs between candidates, and where each could carry a hand-over.

    pairs[q][p]:  the RTT between p and q (symmetric), for any two that could hand over;
    tail_out[q]:  (r, rtt) for every r that q's end falls strictly inside (r entered mid-span there);
    head_in[r]:   (q, rtt) for every q running across or ending at r's first layer (lo_q < lo_r <= hi_q).
    """

    pairs: Mapping[str, Mapping[str, float]]
    tail_out: Mapping[str, tuple[tuple[str, float], ...]]
    head_in: Mapping[str, tuple[tuple[str, float], ...]]


def links_between(spans: Mapping[str, tuple[int, int]], pairs: Mapping[str, Mapping[str, float]]) -> Links:
    """`Links` for candidates running `spans` (peer -> [lo, hi)) with measured RTTs `pairs`."""
    tail_out: dict[str, list[tuple[str, float]]] = defaultdict(list)
    head_in: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for q, theirs in pairs.items():
        lo_q, hi_q = spans[q]
        for r, rtt in sorted(theirs.items()):
            lo_r, hi_r = spans[r]
            if lo_r < hi_q < hi_r:
                tail_out[q].append((r, rtt))
            if lo_q < lo_r <= hi_q:
                head_in[r].append((q, rtt))
    return Links(pairs, {q: tuple(v) for q, v in tail_out.items()}, {r: tuple(v) for r, v in head_in.items()})


class _Search:
    """One range's candidates and prices; `solve` runs one relaxed pass under given limits."""

    def __init__(self, candidates: Sequence[Candidate], start: int, end: int, from_source: Callable[[str], float],
                 to_sink: Callable[[str], float], links: Links, default_rtt_ms: float) -> None:
        self.candidates = candidates
        self.spans = {c.pid: (c.lo, c.hi) for c in candidates}
        self.start, self.end = start, end
        self.from_source, self.to_sink = from_source, to_sink
        self.links = links
        self.default = default_rtt_ms
        self.boundaries = sorted({start, end} | {c.lo for c in candidates} | {c.hi for c in candidates})
        self.starts_at: dict[int, list[Candidate]] = defaultdict(list)
        self.ends_at: dict[int, list[Candidate]] = defaultdict(list)
        for c in candidates:
            self.starts_at[c.lo].append(c)
            self.ends_at[c.hi].append(c)

    def span(self, pid: str) -> tuple[int, int]:
        return self.spans[pid]

    def solve(self, bounds: Bounds, no_cut: frozenset[int], *, heads: bool) -> Label | None:
        """The cheapest chain (peers may repeat) where each candidate computes only layers
        within `bounds` (default: its span), nobody hands over at a boundary in `no_cut`, and,
        unless `heads`, every hop runs to its peer's end (the tail-only chains)."""
        start, end, default, inf = self.start, self.end, self.default, math.inf
        pairs, tail_out, head_in = self.links.pairs, self.links.tail_out, self.links.head_in
        nothing: Mapping[str, float] = {}
        # Per candidate, the numbers the sweep reads at every boundary, in one list (the hot loop
        # reads no dict but this one): [ms per layer, end, may leave early, lowest layer allowed,
        # highest allowed, cost paid when entered (inf: not yet), entered at, cost at its end if run there].
        # An exit at b costs `cost in + (b - entered at) * per layer`: route_cost's arithmetic.
        rec: dict[str, list] = {}
        bounded = bool(bounds)
        for c in self.candidates:
            lo, hi = bounds.get(c.pid, (c.lo, c.hi))
            rec[c.pid] = [c.per_layer, c.hi, c.stops_early, lo, hi, inf, 0, inf]
        # How each candidate was entered: (hops, node), a node being (peer, entered at, the node
        # before it or None) — shared and never changed, so a chain costs one small tuple a hop and
        # its ids are spelled out only where a tie or the answer needs them (`spelled`).
        path: dict[str, tuple[int, tuple]] = {}

        def spelled(n: int, node: tuple) -> tuple[int, tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
            ids, entries = [], []
            while node is not None:
                ids.append(node[0])
                entries.append(node[1])
                node = node[2]
            ids.reverse()
            entries.reverse()
            return n, tuple(ids), tuple(-e for e in entries), tuple(entries)

        def label_of(q: str, at: int) -> Label:
            x = rec[q]
            return (x[5] + (at - x[6]) * x[0], *spelled(*path[q]))

        def cheapest(ranked: list[tuple[float, str]], measured: Mapping[str, float], at: int) -> tuple[float, str] | None:
            """The best of the exits `ranked` ((cost, peer), sorted) without a measured link to the
            peer being entered; exact ties go by the chains' order."""
            low, tied = inf, []
            for cost, q in ranked:
                if cost > low:
                    break
                if q not in measured:
                    low = cost
                    tied.append(q)
            if not tied:
                return None
            if len(tied) == 1:
                return low, tied[0]
            best = min(label_of(q, at) for q in tied)
            return best[0], best[2][-1]

        def offer(r: str, at: int, cost_in: float, q: str | None) -> None:
            """`r` entered at `at` after the chain ending with `q` (None: the source), `cost_in` paid so far."""
            x = rec[r]
            if not x[3] <= at < x[4]:
                return
            key = cost_in + (x[1] - at) * x[0]
            if key > x[7]:
                return  # the usual case, decided without building a chain
            if q is None:
                new = (1, (r, at, None))
            else:
                n, node = path[q]
                new = (n + 1, (r, at, node))
            if key < x[7] or spelled(*new) < spelled(*path[r]):  # an exact tie: the chains' order decides
                x[5], x[6], x[7] = cost_in, at, key
                path[r] = new

        open_: dict[str, list] = {}  # the records of the peers running across b (lo < b < hi)
        finals: dict[str, float] = {}  # peers ending at `end` -> their cost with the link to the sink
        for b in self.boundaries:
            tails: dict[str, float] = {}  # peers ending at b -> their exit cost there
            for c in self.ends_at.get(b, ()):
                x = open_.pop(c.pid, None) or rec[c.pid]
                if x[5] != inf and b <= x[4]:
                    tails[c.pid] = x[5] + (b - x[6]) * x[0]
            if b == end:
                to_sink = self.to_sink
                finals = {q: cost + to_sink(q) for q, cost in tails.items()}
                break
            starting = [c.pid for c in self.starts_at.get(b, ()) if rec[c.pid][3] <= b < rec[c.pid][4]]
            if b == start:
                for r in starting:
                    offer(r, b, self.from_source(r), None)
            elif b not in no_cut and (tails or starting):
                if starting:
                    # First the peers starting at b (nothing here changes a running peer's entry, which
                    # their links read): entered from a tail, or (heads) from anyone running across b.
                    def leaving_cost(q: str) -> float | None:
                        if q in tails:
                            return tails[q]
                        x = open_.get(q)
                        if heads and x is not None and x[5] != inf and x[6] < b <= x[4] and x[2]:
                            return x[5] + (b - x[6]) * x[0]
                        return None

                    low, low_id, ties = inf, "", 0
                    exits = [(cost, q) for q, cost in tails.items()]  # every way to leave at b: (cost, peer)
                    for q, cost in tails.items():
                        if cost < low:
                            low, low_id, ties = cost, q, 0
                        elif cost == low:
                            ties += 1
                    if heads:
                        for pid, x in open_.items():
                            if x[5] != inf and x[6] < b <= x[4] and x[2]:
                                cost = x[5] + (b - x[6]) * x[0]
                                exits.append((cost, pid))
                                if cost < low:
                                    low, low_id, ties = cost, pid, 0
                                elif cost == low:
                                    ties += 1
                    ranked: list[tuple[float, str]] = []  # `exits` sorted: only for a tie or a measured best
                    for r in starting:
                        measured = pairs.get(r, nothing)
                        if low < inf and not ties and low_id not in measured:
                            best: tuple[float, str] | None = (low, low_id)
                        else:
                            ranked = ranked or sorted(exits)
                            best = cheapest(ranked, measured, b)
                        if best is not None:
                            offer(r, b, best[0] + default, best[1])
                        x = rec[r]
                        for q, rtt in head_in.get(r, ()):
                            cost = leaving_cost(q)
                            if cost is not None and cost + rtt + (x[1] - b) * x[0] <= x[7]:
                                offer(r, b, cost + rtt, q)
                if tails:
                    # Then the peers whose span goes on past b take over where the tails end.
                    ranked_tails = sorted((cost, q) for q, cost in tails.items())
                    cost, first_id = cheapest(ranked_tails, nothing, b)
                    base = cost + default
                    for pid, x in open_.items():
                        if base + (x[1] - b) * x[0] > x[7]:
                            continue  # cannot beat its entry even from the cheapest tail
                        if bounded and not x[3] <= b < x[4]:
                            continue
                        measured = pairs.get(pid, nothing)
                        if first_id not in measured:
                            offer(pid, b, base, first_id)
                        else:
                            best = cheapest(ranked_tails, measured, b)
                            if best is not None:
                                offer(pid, b, best[0] + default, best[1])
                    for q, cost in tails.items():
                        for r, rtt in tail_out.get(q, ()):
                            x = open_.get(r)
                            if x is not None and cost + rtt + (x[1] - b) * x[0] <= x[7]:
                                offer(r, b, cost + rtt, q)
            for c in self.starts_at.get(b, ()):
                open_[c.pid] = rec[c.pid]
        # the cheapest; its chain spelled out only for it and any exact tie (the tie-break order)
        low = min(finals.values(), default=inf)
        if not math.isfinite(low):
            return None
        return min((low, *label_of(q, end)[1:]) for q, total in finals.items() if total == low)


__all__ = ["Candidate", "Label", "Links", "Pool", "pools_of", "links_between", "cheapest_chain", "MAX_BRANCHES"]
