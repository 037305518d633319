"""Reading a scenario back out of recorded traces (one or more peer/requester databases).

    scenario = from_trace(["peer0/tessera.db", "peer1/tessera.db", "requester.db"])
    report = simulate(scenario, policy="recorded", seed=0)

The databases are merged and clock-aligned (store/timeline.py); time 0 of the
replay is the first recorded event. What is taken from them, per event class
(store/events.py):

- `Join` (peer): when the peer started; its ``model`` is the model id. (Requester): when
  it had joined and pulled its first view; the replayed requester joins then (a trace
  without one: shortly before its first request).
- `Claim` (peer): the span claimed, ``throughput`` (tokens/s per layer) and
  ``capacity`` (layers its memory holds) — what placement needs, and what the
  replayed peer advertises (so routing weighs it as live routing did). The time from
  the claim to its first `Advertise` as serving is how long its load took.
- `Forward` (peer): how fast it computed. A replayed peer's steps run at its recorded
  forwards' layer-tokens over their compute seconds (a batch's seconds shared among
  its members), not at the claim's throughput: that is one measurement at start-up,
  and peers started together on one machine measure while the others import and load
  (a loopback swarm claimed 61 tokens/s per layer and computed at 999). At the claim,
  a replayed answer took many times its live time and ran into the peers' recorded
  leaves, which come only seconds after a test's last answer.
- `Move` (peer): span changes, re-applied at their times by the ``recorded`` policy.
- `Leave` (peer): a graceful leave. A peer that falls silent for longer than
  `SILENT_GONE_S` before the trace ends, without a leave, is replayed as killed.
- `SessionOpen` with a ``route`` (requester): a request, at the earliest event of
  its session anywhere, or when its answer began if that was earlier (``began_before``: a
  route wait, peers pinged for their load before the open); the route it took live.
- `Result` (requester): the prompt length is the first result's ``n_tokens``
  (at ``start_pos`` 0); the number of tokens is one more than the last decoded
  position minus the prompt (a failover's replay step re-covers positions
  already counted).
- `Rtt` (peer or requester): each link's one-way latency, half the fastest round trip a
  ping measured on it (what routing priced the link with).
- `Push`/`Receive` pairs: the one-way latency of a link no ping measured (the fastest
  message on it, clocks aligned) and, from pushes carrying ``n_tokens``, the hidden size.

Rows no event class fits (`Unknown`: an older or newer trace) are passed over.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from tessera.store.events import (
    Advertise, Claim, Failover, Forward, Join, Leave, Move, Push, Result, Rtt, SessionClose, SessionOpen,
)
from tessera.store.timeline import Event, load_timeline

from tessera.peer.sim.errors import TraceTooThin
from tessera.peer.sim.scenario import PeerPlan, RequestPlan, Scenario

# A peer silent this long before the trace ends (it advertises every few seconds while
# alive) and with no leave event was killed, not still running.
SILENT_GONE_S = 20.0
# Below this, an aligned delay is clock noise rather than a link's latency.
MIN_LATENCY_S = 50e-6
DEFAULT_LATENCY_S = 0.0005
DEFAULT_HIDDEN = 576
FLOAT32_BYTES = 4


def find_databases(paths: Iterable[Path | str]) -> list[Path]:
    """The files given, and every ``*.db`` under the directories given (sorted)."""
    out: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            out.extend(sorted(p for p in path.rglob("*.db") if p.is_file()))
        else:
            out.append(path)
    return out


def from_trace(paths: Sequence[Path | str], *, until: float | None = None) -> Scenario:
    """The scenario recorded in the databases at `paths` (files or directories).

    Raises tessera.store.errors.NotATraceDatabase for a file that is not one, TraceTooThin if
    no peer claimed a span.
    """
    dbs = find_databases(paths)
    timeline = load_timeline(dbs)
    events = [e for e in timeline.events if until is None or e.t <= until]
    by_peer: dict[str, list[Event]] = defaultdict(list)
    by_session: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        by_peer[e.peer].append(e)
        if e.event.session is not None:
            by_session[e.event.session].append(e)
    end = max((e.t for e in events), default=0.0)
    model_id = next((e.event.model for e in events if isinstance(e.event, Join) and e.event.model), None)
    computed = compute_throughputs(events)

    peers = []
    for label, evs in by_peer.items():
        claims = [e for e in evs if isinstance(e.event, Claim)]
        if not claims:
            continue  # a requester, or a peer that never claimed
        claim_at, claim = claims[0].t, claims[0].event
        assert isinstance(claim, Claim)
        join = next((e.t for e in evs if isinstance(e.event, Join)), evs[0].t)
        leave = next((e.t for e in evs if isinstance(e.event, Leave)), None)
        mode = "graceful"
        if leave is None and end - evs[-1].t > SILENT_GONE_S:
            leave, mode = evs[-1].t, "crash"
        moves = tuple((e.t, e.event.span) for e in evs if isinstance(e.event, Move))
        throughput = float(claim.throughput)
        span = claim.span
        capacity = int(claim.capacity or (span[1] - span[0]))
        serving = next((e.t for e in evs if isinstance(e.event, Advertise) and e.t >= claim_at
                        and e.event.state == "serving"), None)
        peers.append(PeerPlan(label=label, join_at=join, throughput=throughput if throughput > 0 else 1.0,
                              capacity_layers=max(1, capacity), leave_at=leave, leave_mode=mode, span=span,
                              moves=moves, load_seconds=None if serving is None else serving - claim_at,
                              compute_throughput=computed.get(label)))
    if not peers:
        raise TraceTooThin(f"no peer claimed a span in {[str(p) for p in dbs]}; nothing to replay")

    requests, requesters = [], []
    opens = [(e, e.event) for e in events if isinstance(e.event, SessionOpen) and e.event.route is not None]
    arrival_of = {s: min(x.t for x in evs) for s, evs in by_session.items()}
    for e, opened in opens:  # an answer began before its session's first event (a route wait, load pings)
        if opened.began_before is not None:
            arrival_of[opened.session] = min(arrival_of[opened.session], e.t - opened.began_before)
    for e, opened in sorted(opens, key=lambda o: (arrival_of[o[1].session], o[0].peer, o[1].session)):
        session = by_session[opened.session]
        mine = [x for x in session if x.peer == e.peer]
        if any(isinstance(x.event, SessionOpen) and x.event.route is not None and x.t < e.t for x in mine):
            continue  # a second open of the same session (a re-route) is not a new request
        results = [(x.t, x.event) for x in mine if isinstance(x.event, Result)]
        prompt = next((r.n_tokens for _, r in results if r.start_pos == 0), None)
        if not prompt:
            continue  # no step ever came back: nothing says how long the prompt was
        last = max(r.start_pos + r.n_tokens for _, r in results)
        tokens = max(1, 1 + last - prompt)
        if e.peer not in requesters:
            requesters.append(e.peer)
        route = tuple((str(p), int(a), int(b)) for p, a, b in opened.route)  # type: ignore[union-attr]
        arrival = arrival_of[opened.session]
        closed = next((x.t for x in mine if isinstance(x.event, SessionClose)), None)
        recorded = {"latency": None if closed is None else closed - arrival,
                    "ttft": min(t for t, _ in results) - arrival,
                    "failovers": sum(1 for x in mine if isinstance(x.event, Failover))}
        requests.append(RequestPlan(len(requests), arrival, e.peer, int(prompt), int(tokens),
                                    recorded_route=route, max_length=opened.max_length, recorded=recorded))

    joined = {label: next((e.t for e in by_peer[label] if isinstance(e.event, Join)), None) for label in requesters}
    num_layers = max([p.span[1] for p in peers] + [h[2] for r in requests for h in r.recorded_route or ()])
    latencies = link_latencies(timeline.pairs, [e for e in events if isinstance(e.event, Rtt)])
    hidden = hidden_size(events)
    meta = {"databases": [str(p) for p in dbs], "trace_end_s": end, "clock_offsets_s": dict(
        sorted((str(timeline.paths[i]), off) for i, off in timeline.offsets.items())),
        "hidden_size_inferred": hidden is not None, "until": until,
        "compute_throughput": {p.label: round(p.compute_throughput, 3) for p in sorted(peers, key=lambda p: p.label)
                               if p.compute_throughput is not None}}
    return Scenario(
        "replay", num_layers, hidden or DEFAULT_HIDDEN, model_id, tuple(sorted(peers, key=lambda p: p.join_at)),
        tuple(requests), tuple(requesters), meta=meta,
        requester_joins={label: t for label, t in joined.items() if t is not None},
        link_latency=latencies,
        default_latency=statistics.median(latencies.values()) if latencies else DEFAULT_LATENCY_S,
    )


def compute_throughputs(events: Iterable[Event]) -> dict[str, float]:
    """Per peer, the tokens/s through one layer its recorded forward steps ran at: their
    n_tokens x layers over their compute seconds, a batch's seconds shared equally among the
    steps it held (each of them records the whole batch's). Peers with no timed step are absent."""
    work: dict[str, float] = defaultdict(float)
    seconds: dict[str, float] = defaultdict(float)
    for e in events:
        step = e.event
        if isinstance(step, Forward) and step.n_tokens and step.duration > 0:
            work[e.peer] += step.n_tokens * (step.span[1] - step.span[0])
            seconds[e.peer] += step.duration / max(1, step.batch or 1)
    return {peer: work[peer] / seconds[peer] for peer in work if work[peer] > 0}


def link_latencies(pairs: Iterable[tuple[Event, Event]], rtts: Iterable[Event] = ()) -> dict[tuple[str, str], float]:
    """One-way latency per directed link: half the fastest round trip a ping measured on it,
    either way (`Rtt` events: what routing priced the link with), else its fastest aligned
    push -> receive (which also holds the frame's transfer time, and exists only for links
    that carried activations: a replay gave every other link the median, and a requester's
    routes then differed from live ones)."""
    best: dict[tuple[str, str], float] = {}
    for push, receive in pairs:
        key = (push.peer, receive.peer)
        delay = max(MIN_LATENCY_S, receive.t - push.t)
        best[key] = min(best.get(key, delay), delay)
    pinged: dict[tuple[str, str], float] = {}
    for e in rtts:
        rtt = e.event
        assert isinstance(rtt, Rtt)
        half = max(MIN_LATENCY_S, rtt.duration / 2.0)
        for key in ((e.peer, rtt.remote), (rtt.remote, e.peer)):
            pinged[key] = min(pinged.get(key, half), half)
    return {**best, **pinged}


def hidden_size(events: Iterable[Event]) -> int | None:
    """The hidden size from two pushes of different lengths: (bytes1 - bytes2) / (4 (n1 - n2))."""
    sizes: dict[int, int] = {}
    for e in events:
        push = e.event
        if isinstance(push, Push) and push.n_tokens and push.bytes:
            sizes.setdefault(push.n_tokens, push.bytes)
    if len(sizes) < 2:
        return None
    (n1, b1), (n2, b2) = sorted(sizes.items())[-1], sorted(sizes.items())[0]
    hidden, rest = divmod(b1 - b2, FLOAT32_BYTES * (n1 - n2))
    return hidden if hidden > 0 and rest == 0 else None


__all__ = ["from_trace", "find_databases", "compute_throughputs", "link_latencies", "hidden_size", "TraceTooThin"]
