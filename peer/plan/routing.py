"""Routing: which chain of peers carries a request through layers [start, end).

A pure function of a `SwarmView` snapshot and what the requester adds to it (its own
sessions, the loads peers reported to it, and a `Spread`'s salt): no I/O, no clock, and no
randomness but the salt it is given. Peers are read in peer-id order and ties are broken
by peer id, so the same inputs give the same chain however they were assembled.

The cost of a chain (milliseconds of one decode step through it)
----------------------------------------------------------------
For each hop, peer p running n layers, entered from node ``prev``::

    rtt(prev, p) + n * 1000 / p.throughput * (1 + load_penalty * p.load + own(p))

where ``prev`` is ``source`` for the first hop; plus ``rtt(last, sink)`` at the end
(``sink`` defaults to ``source``: the last peer answers the requester, a ring);
``own(p)`` is OWN_SESSION_PENALTY per session the requester already runs on p (none
unless it says: `route`'s ``own_sessions``). A peer that reported its load to the
requester (`route`'s ``reported``, cost.py `Reported`) is priced at the higher of its
advertised and reported load, and the wait it reported is added, spread over its span
(``+ wait_ms * n / span``: a hop that runs the whole span pays the whole wait).

Spread (`route`'s ``spread``): among chains of nearly the same price the requester
chooses at random, each peer weighted by its spare capacity — every price per layer is
multiplied by a seeded draw (cost.py `Spread`, SPREAD_WIDTH says why it does not herd) —
so that requesters that see the same swarm do not all take the one cheapest chain.
``rtt(a, b)`` is a's measured ``rtt_ms[b]`` or b's ``rtt_ms[a]`` (their mean if both),
else ``default_rtt_ms``. Sending to oneself costs nothing.

A peer serving ``[s, e)`` computes any sub-span of it (stages/sessions.py), so a chain
may enter it at any layer it holds and leave it before its end: a hand-over happens
where the peer before it ends (it runs the tail of its span: what a requester needs to
re-route a failed span ``[a, b)`` over replacements with other cut points,
``route(view, start=a, end=b, source=<peer before>, sink=<peer after>)``) or where the
peer after it starts (it runs the head of its span: what lets ``--prefer`` keep a
non-preferred peer to the layers no preferred peer holds). A chain never uses a peer
twice. Exact ties go to fewer hops, then to smaller peer ids, then to later cuts.

A worked example (L = 4, default RTT 100 ms, no load)::

    peer  span    throughput (tokens/s per layer)   compute per layer
    a     [0, 2)  100                               10 ms
    b     [2, 4)  100                               10 ms
    c     [0, 4)   20                               50 ms
    a and b measured 5 ms to the requester r; nothing else is measured.

    r -> a -> b -> r   5 + 20 + rtt(a, b)=100 + 20 + 5  = 150 ms
    r -> c -> r        100 + 200 + 100                  = 400 ms   -> route = a, b

If a has also measured b at 10 ms, a -> b costs 10 and the chain 60 ms. Excluding
a gives ``r -> c[0, 2) -> b -> r`` = 100 + 100 + 100 + 20 + 5 = 325 ms: c runs only the
layers b does not hold and hands over at b's first layer; excluding b as well gives
``r -> c -> r`` (400 ms); excluding a and c leaves layers [0, 2) uncovered and the answer
is ``Route((), inf)``, whose ``ok`` is False.

The search
----------
`peer/plan/chains.py`: a sweep over the boundaries where spans start or end, pricing
every tail and head hand-over (unmeasured links at the default RTT from the best exit,
measured ones one by one: O(sum of span lengths + measured RTT entries) a pass, not
O(peers²)), and a branch-and-bound over it for the rare relaxed chain that would use a
peer twice. Peers that share a span and have measured no round trip (nor been measured)
differ only in speed and id: the search takes the few of each such pool a chain could use
(chains.py `Pool`), which is most of a big swarm (1,000 simulated peers: a quarter searched,
3.8 -> 1.2 ms a call on views captured from bench/simulate.py, every answer the same).
`bench/routing.py` times a call at 1,000 peers against the tail-only search.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from tessera.peer.plan.chains import Candidate, Links, Pool, cheapest_chain, links_between, pools_of
from tessera.peer.plan.cost import (
    DEFAULT_RTT_MS, FULL_LOAD, LOAD_PENALTY, Reported, Spread, hop_compute_ms, ms_per_layer, rtt_ms, spare,
)
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

    def summary(self) -> list[dict]:
        """Its hops as a report shows them (a requester's answer, the web view)."""
        return [{"peer": h.peer_id, "start": h.start, "end": h.end} for h in self.hops]


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


def covered_but_busy(view: SwarmView, *, start: int = 0, end: int | None = None,
                     avoided: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether layers [start, end) would be routable but for peers that are only busy: every
    layer is claimed by a peer not in `avoided` that is unusable for no reason but "busy" (all
    its slots taken) or usable. The caller leaves out of `avoided` the peers it skips for a
    refusal (busy or full, with a retry-after), so that True means: the swarm is full, wait."""
    end = view.num_layers if end is None else end
    open_or_busy = SwarmView(view.num_layers, tuple(
        p for p in view.peers if p.peer_id not in avoided and unusable_reason(p) in (None, "busy")))
    counts = replica_coverage(open_or_busy)
    return end > start and all(counts[layer] > 0 for layer in range(start, end))


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


def why_not_preferred(
    view: SwarmView,
    chosen: Route,
    *,
    prefer: frozenset[str] | set[str],
    source: str,
    sink: str | None = None,
    exclude: frozenset[str] = frozenset(),
    **prices: float,
) -> list[str]:
    """Why each hop of `chosen` on a peer outside `prefer` is there, in the cost model's terms;
    one sentence per such hop (none when every hop is preferred, or nothing is). Pass the view
    `chosen` was routed on (a policy's priced view) and the same `source`, `sink`, `exclude` and
    prices (`default_rtt_ms`, `load_penalty`). The reasons, first that applies:

    - no preferred peer holds (some of) its layers: '... no preferred peer holds [0, 10)';
    - the preferred peers holding them take no sessions now ('... b1c2d3e4 draining');
    - they could, but no chain through them is cheaper: the cheapest without this peer costs
      more, or would need a peer twice ('a chain avoiding it costs 40,310 ms against 10,250 ms').
    """
    if not prefer:
        return []
    out = []
    for hop in chosen.hops:
        if hop.peer_id in prefer or hop.group:
            continue
        what = f"layers [{hop.start}, {hop.end}) on {hop.peer_id[-8:]} (not preferred)"
        holders = [p for p in view.peers if p.peer_id in prefer and p.start < hop.end and hop.start < p.end]
        usable = [p for p in holders if unusable_reason(p, exclude) is None and p.shard_count == 1]
        bare = [layer for layer in range(hop.start, hop.end) if not any(p.start <= layer < p.end for p in usable)]
        if bare:
            merged: list[tuple[int, int]] = []
            for layer in bare:
                if merged and merged[-1][1] == layer:
                    merged[-1] = (merged[-1][0], layer + 1)
                else:
                    merged.append((layer, layer + 1))
            where = ", ".join(f"[{a}, {b})" for a, b in merged)
            idle = [f"{p.peer_id[-8:]} {unusable_reason(p, exclude) or 'a shard rank'}" for p in holders if p not in usable]
            out.append(f"{what}: no preferred peer takes sessions for {where}"
                       + (f" (preferred but not taking sessions: {', '.join(idle)})" if idle else
                          " (no preferred peer holds them)"))
            continue
        without = route(view, start=chosen.hops[0].start, end=chosen.hops[-1].end, source=source, sink=sink,
                        exclude=frozenset(exclude) | {hop.peer_id}, **prices)
        if without.ok:
            out.append(f"{what}: preferred peers hold them, but the cheapest chain avoiding it costs "
                       f"{without.cost_ms:,.0f} ms against {chosen.cost_ms:,.0f} ms")
        else:
            out.append(f"{what}: preferred peers hold them, but no chain of distinct peers avoids it "
                       "(each peer runs one piece of a route)")
    return out


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
    own_sessions: Mapping[str, int] | None = None,
    reported: Mapping[str, Reported] | None = None,
    spread: Spread | None = None,
    groups: bool = False,
    head_handovers: bool = True,
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

    A hop may be any sub-span of its peer's span, handed over where the peer before it ends
    or where the next one starts; a peer is in a chain at most once (see the module
    docstring). ``head_handovers=False`` keeps every hop running to its peer's end (the
    chains of before; a baseline for bench/routing.py). ``own_sessions``: the sessions the
    requester already runs on each peer, each priced as a step ahead of ours
    (cost.py `OWN_SESSION_PENALTY`), so that its concurrent answers spread out.
    ``reported``: the loads peers reported to the requester (cost.py `Reported`), priced as the
    module docstring says. ``spread``: choose among chains of nearly the same price by this
    draw (cost.py `Spread`); without it the cheapest chain, ties broken as below.

    Exact ties go to the chain with fewer hops, then to the smaller sequence of peer
    ids, then to later cut points. Returns ``Route((), inf)`` when no chain covers the
    range, and ``Route((), 0.0)`` for an empty range.

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
    prepared = _prepared(view, start, end, load_penalty)
    peers: Mapping[str, PeerInfo] = prepared.peers
    group_of: dict[str, ShardGroup] = {}
    if groups and prepared.has_ranks:  # tensor-shard groups, each as one synthetic peer (peer/plan/groups.py)
        peers, group_of = with_group_peers(
            peers, source=source, default_rtt_ms=default_rtt_ms, load_penalty=load_penalty,
            usable=lambda p: unusable_reason(p, exclude) is None,
        )

    pools: tuple[Pool, ...] = ()
    skip: frozenset[str] = frozenset()
    if group_of:  # the candidates of this call's peers, groups among them
        candidates, span_of = _candidates(peers, start, end, load_penalty, exclude, group_of)
        links = _measured_links(peers, span_of)
    else:
        # the same candidates, prepared once per view and range: only `exclude` is applied here
        candidates = [c for c in prepared.candidates if c.pid not in exclude] if exclude else list(prepared.candidates)
        links, pools = prepared.links, prepared.pools
        if pools:  # a pooled peer that is this call's source or sink, that either of them measured, or
            # that is priced by its own sessions is not interchangeable with the rest of its pool
            # (chains.Pool): it is searched one by one
            ends = [info.rtt_ms for node in {source, sink} if (info := peers.get(node)) is not None]
            singled = ({source, sink, *(own_sessions or ()), *(reported or ()), *(q for rtts in ends for q in rtts)}
                       & prepared.pooled.keys())
            skip = exclude | singled
            candidates.extend(prepared.pooled[pid] for pid in sorted(singled - exclude))
    own_sessions = own_sessions or {}
    reported = reported or {}
    if own_sessions or reported:  # few peers (running answers, recent reports): repriced per call, the rest as prepared
        candidates = [replace(c, per_layer=ms_per_layer(peers[c.pid], load_penalty, own_sessions.get(c.pid, 0),
                                                        reported.get(c.pid)))
                      if c.pid in own_sessions or c.pid in reported else c for c in candidates]
    if spread is not None:
        def drawn(c: Candidate) -> Candidate:
            share = spare(peers[c.pid], own_sessions.get(c.pid, 0), reported.get(c.pid))
            return Candidate(c.pid, c.lo, c.hi, c.per_layer * spread.factor(c.pid, share), c.stops_early)

        candidates = [drawn(c) for c in candidates]
        if spread.width >= 0:  # every draw's factor is at least 1: a pool's members are drawn as far as read
            pools = tuple(Pool(pool.lo, pool.hi, _DrawnMembers(pool.members, drawn)) for pool in pools)
        else:
            pools = tuple(Pool(pool.lo, pool.hi, tuple(sorted((drawn(c) for c in pool.members),
                                                              key=lambda c: (c.per_layer, c.pid))))
                          for pool in pools)
    if skip - exclude:
        candidates.sort(key=lambda c: c.pid)

    best = cheapest_chain(
        candidates, start=start, end=end, links=links, default_rtt_ms=default_rtt_ms,
        # rtt_ms(peers, source, q) and rtt_ms(peers, q, sink) for many q: the source's and the
        # sink's own maps looked up once (the same arithmetic as cost.rtt_ms; see _rtt_from)
        from_source=_rtt_from(peers, source, default_rtt_ms), to_sink=_rtt_from(peers, sink, default_rtt_ms),
        heads=head_handovers, pools=pools, skip=skip,
    )
    if best is None:
        return NO_ROUTE
    cost, _, ids, _, entries = best
    hops = []
    for i, pid in enumerate(ids):
        until = entries[i + 1] if i + 1 < len(ids) else end
        g = group_of.get(pid)
        hops.append(Hop(pid, entries[i], until, group=g.name, members=g.member_ids) if g else Hop(pid, entries[i], until))
    return Route(tuple(hops), cost)


class _DrawnMembers(Sequence[Candidate]):
    """A pool's members at a spread's prices, sorted by (per_layer, pid) as `Pool` promises, each
    drawn only when the search reads that far.

    The search reads the first few of each pool (chains.py FIRST_KEEP, and the next one for the
    gap) and all of them only when it must widen, yet drawing every member of every pool was
    most of a call at 1,000 peers (a pool per span, hundreds of members each, one draw a member
    a call). A draw's factor is at least 1 (cost.Spread.factor: 1 + width * E / spare with
    width, E >= 0), so a member's drawn price is at least its prepared one, and `members` come
    sorted by that: once the next undrawn member's prepared price is above the cheapest drawn
    one not yet handed out, no undrawn member can come before it. The order handed out is
    therefore exactly that of sorting every drawn member, and so are the values (each member
    drawn by the same function, once)."""

    def __init__(self, members: Sequence[Candidate], draw: Callable[[Candidate], Candidate]) -> None:
        self._members = members
        self._draw = draw
        self._next = 0  # members[:_next] are drawn
        self._heap: list[tuple[float, str, Candidate]] = []  # drawn, not yet handed out
        self._sorted: list[Candidate] = []  # handed out, in order

    def _one_more(self) -> bool:
        members, heap = self._members, self._heap
        n = len(members)
        while self._next < n and (not heap or members[self._next].per_layer <= heap[0][0]):
            c = self._draw(members[self._next])
            self._next += 1
            heapq.heappush(heap, (c.per_layer, c.pid, c))  # peer ids are distinct: the tuple never compares c
        if not heap:
            return False
        self._sorted.append(heapq.heappop(heap)[2])
        return True

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[Candidate]:
        i = 0
        while i < len(self._sorted) or self._one_more():
            yield self._sorted[i]
            i += 1

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice) or index < 0:
            while self._one_more():
                pass
            return tuple(self._sorted)[index]
        while index >= len(self._sorted) and self._one_more():
            pass
        return self._sorted[index]


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
_links_memo: tuple[tuple, Links] | None = None


def _measured_links(peers: Mapping[str, PeerInfo], span_of: Mapping[str, tuple[int, int]]) -> Links:
    """Measured links between usable peers that could hand over to each other (their run
    spans overlap or touch): ``pairs[q][p] = pairs[p][q] =`` the resolved RTT (cost.rtt_ms),
    indexed by where each could carry a hand-over (chains.links_between)."""
    global _links_memo
    key = tuple((pid, lo, hi, peers[pid].rtt_ms) for pid, (lo, hi) in span_of.items())
    memo = _links_memo
    if memo is not None and memo[0] == key:
        return memo[1]
    pairs: dict[str, dict[str, float]] = {}
    for a, (ia, ea) in span_of.items():
        mine = peers[a].rtt_ms
        for b in mine.keys() & span_of.keys():
            ib, eb = span_of[b]
            if b == a or ib > ea or ia > eb:
                continue  # no layer boundary where one could hand over to the other
            back = peers[b].rtt_ms.get(a)
            rtt = mine[b] if back is None else (mine[b] + back) / 2.0
            pairs.setdefault(a, {})[b] = rtt
            pairs.setdefault(b, {})[a] = rtt
    links = links_between(span_of, pairs)
    _links_memo = (key, links)
    return links


def _candidates(peers: Mapping[str, PeerInfo], start: int, end: int, load_penalty: float,
                exclude: frozenset[str] = frozenset(), group_of: Mapping[str, ShardGroup] | None = None,
                ) -> tuple[list[Candidate], dict[str, tuple[int, int]]]:
    """The usable peers, in peer-id order, with the layers of [start, end) they could run, and
    those layers by peer id. A tensor-shard group (in `group_of`) runs its span to the end: its
    ranks stop where the group does."""
    candidates: list[Candidate] = []
    span_of: dict[str, tuple[int, int]] = {}
    for pid in sorted(peers):
        c = _candidate(peers[pid], start, end, load_penalty, exclude, group_of is None or pid not in group_of)
        if c is not None:
            candidates.append(c)
            span_of[pid] = (c.lo, c.hi)
    return candidates, span_of


def _candidate(p: PeerInfo, start: int, end: int, load_penalty: float, exclude: frozenset[str] = frozenset(),
               stops_early: bool = True) -> Candidate | None:
    """`p` as a candidate over [start, end), or None when it is unusable or holds none of it."""
    if p.shard_count != 1 or unusable_reason(p, exclude) is not None:
        return None
    lo, hi = max(p.start, start), min(p.end, end)
    return Candidate(p.peer_id, lo, hi, ms_per_layer(p, load_penalty), stops_early=stops_early) if lo < hi else None


@dataclass(frozen=True)
class _Prepared:
    """What `route` reads of one view for one range, whatever `exclude`, source and sink are:
    the peers by id, the plain peers usable in their own right (`unusable_reason` without a
    ban: serving, measured, a free slot, unsharded) over [start, end) — those that are
    interchangeable but for speed and id in `pools` (chains.Pool; `pooled` finds each by id),
    the rest as candidates in peer-id order — and the measured links between them."""

    view: SwarmView  # held, so that the id this is filed under is not reused while it is kept
    peers: Mapping[str, PeerInfo]
    has_ranks: bool  # some peer is a tensor-shard rank (groups may form)
    candidates: tuple[Candidate, ...]
    pools: tuple[Pool, ...]
    pooled: Mapping[str, Candidate]
    links: Links
    by_info: Mapping[int, Candidate | None]  # id(PeerInfo of `view`) -> it as a candidate (None: not one)
    infos: tuple[int, ...]  # id() of each candidate's PeerInfo, in candidate order


# Routes on one view, a requester's many (an open, a refusal's re-plan, each repair's
# re-route of a span, with different exclusions, sources and sinks), redid the same O(N)
# work per call: index the peers, sort them, check each one's state and price its layers,
# and index the measured links (a third of a call at 1,000 peers). `_prepared` does it once
# per (view, range, load penalty). Why it is never stale: a SwarmView is immutable (frozen,
# its PeerInfos frozen, their rtt_ms never mutated once built: the same promise the link
# memo above relies on), an entry is found only by the view's identity and the entry holds
# that very view (so its id cannot be reused by another object while the entry exists), and
# everything else it depends on is in the key. Excluded peers are dropped from the
# candidates per call; the links keep them, which changes nothing: the search only looks a
# link up between two candidates (chains.py `_Search`). Bounded: the least recently used
# entry goes (a view a round, per requester, a few ranges each).
#
# A new view mostly holds the very PeerInfo objects of the one before it (a record that did
# not change is not rebuilt: 99% of them, a round to the next, in bench/simulate.py), so a
# peer's candidate is taken over from the latest entry for the same range where its
# PeerInfo is the same object (that entry's view holds it, so its id is not reused).
_PREPARED_ENTRIES = 64
_prepared_memo: OrderedDict[tuple[int, int, int, float], _Prepared] = OrderedDict()


def _prepared(view: SwarmView, start: int, end: int, load_penalty: float) -> _Prepared:
    key = (id(view), start, end, load_penalty)
    hit = _prepared_memo.get(key)
    if hit is not None and hit.view is view:
        _prepared_memo.move_to_end(key)
        return hit
    peers = {p.peer_id: p for p in view.peers}
    before = next((e for k, e in reversed(_prepared_memo.items()) if k[1:] == key[1:]), None)
    known = before.by_info if before is not None else {}
    by_info: dict[int, Candidate | None] = {}
    candidates: list[Candidate] = []
    span_of: dict[str, tuple[int, int]] = {}
    for pid in sorted(peers):
        p = peers[pid]
        c = known[id(p)] if id(p) in known else _candidate(p, start, end, load_penalty)
        by_info[id(p)] = c
        if c is not None:
            candidates.append(c)
            span_of[pid] = (c.lo, c.hi)
    infos = tuple(id(peers[c.pid]) for c in candidates)
    if before is not None and before.infos == infos:
        # the same candidates (the very PeerInfos: `before` holds them), so the same pools and
        # links: a view that differs only in peers that are not candidates (a requester's own
        # entry, whose RTTs change as it measures) is prepared in one pass over the peers
        singles, pools, pooled, links = before.candidates, before.pools, before.pooled, before.links
    else:
        # a candidate that measured or was measured by another candidate is searched one by one;
        # one measured only by a node that is no candidate matters only when that node is the
        # source or the sink, which route() singles out per call
        measured = {pid for c in candidates if (rtts := peers[c.pid].rtt_ms) for pid in (c.pid, *rtts)}
        singles, pool_list = pools_of(candidates, measured)
        pools, pooled = tuple(pool_list), {c.pid: c for pool in pool_list for c in pool.members}
        links = _measured_links(peers, span_of)
    prepared = _Prepared(view, peers, any(p.shard_count > 1 for p in peers.values()), tuple(singles), pools,
                         pooled, links, by_info, infos)
    _prepared_memo[key] = prepared
    _prepared_memo.move_to_end(key)
    while len(_prepared_memo) > _PREPARED_ENTRIES:
        _prepared_memo.popitem(last=False)
    return prepared
