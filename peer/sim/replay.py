"""Reading a scenario back out of recorded traces (one or more peer/requester databases).

    scenario = from_trace(["peer0/tessera.db", "peer1/tessera.db", "requester.db"])
    report = simulate(scenario, policy="recorded", seed=0)

The databases are merged and clock-aligned (store/timeline.py); time 0 of the
replay is the first recorded event. What is taken from them, per event kind:

- ``join`` (peer): when the peer started; its ``detail.model`` is the model id.
- ``claim`` (peer): the span claimed, ``detail.throughput`` (tokens/s per layer) and
  ``detail.capacity`` (layers its memory holds) — what placement needs. The time from
  the claim to its first ``advertise`` as serving is how long its load took.
- ``move`` (peer): span changes, re-applied at their times by the ``recorded`` policy.
- ``leave`` (peer): a graceful leave. A peer that falls silent for longer than
  `SILENT_GONE_S` before the trace ends, without a leave, is replayed as killed.
- ``session_open`` with ``detail.route`` (requester): a request, at the earliest
  event of its session anywhere; the route it took live.
- ``result`` (requester): the prompt length is the first result's ``n_tokens``
  (at ``start_pos`` 0); the number of tokens is one more than the last decoded
  position minus the prompt (a failover's replay step re-covers positions
  already counted). A ``request`` event with ``detail.prompt_tokens`` /
  ``detail.max_new_tokens`` for the session, if present, wins.
- ``push``/``receive`` pairs: each link's one-way latency (the fastest message
  on it, clocks aligned) and, from pushes carrying ``n_tokens``, the hidden size.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

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
        if e.session is not None:
            by_session[e.session].append(e)
    end = max((e.t for e in events), default=0.0)
    model_id = next((e.detail.get("model") for e in events if e.kind == "join" and e.detail.get("model")), None)

    peers = []
    for label, evs in by_peer.items():
        claims = [e for e in evs if e.kind == "claim" and e.span_start is not None]
        if not claims:
            continue  # a requester, or a peer that never claimed
        claim = claims[0]
        join = next((e.t for e in evs if e.kind == "join"), evs[0].t)
        leave = next((e.t for e in evs if e.kind == "leave"), None)
        mode = "graceful"
        if leave is None and end - evs[-1].t > SILENT_GONE_S:
            leave, mode = evs[-1].t, "crash"
        moves = tuple((e.t, (e.span_start, e.span_end)) for e in evs if e.kind == "move" and e.span_start is not None)
        throughput = float(claim.detail.get("throughput") or 0.0)
        span = (claim.span_start, claim.span_end)
        capacity = int(claim.detail.get("capacity") or (span[1] - span[0]))
        serving = next((e.t for e in evs if e.kind == "advertise" and e.t >= claim.t
                        and e.detail.get("state") == "serving"), None)
        peers.append(PeerPlan(label=label, join_at=join, throughput=throughput if throughput > 0 else 1.0,
                              capacity_layers=max(1, capacity), leave_at=leave, leave_mode=mode, span=span,
                              moves=moves, load_seconds=None if serving is None else serving - claim.t))
    if not peers:
        raise TraceTooThin(f"no peer claimed a span in {[str(p) for p in dbs]}; nothing to replay")

    requests, requesters = [], []
    opens = [e for e in events if e.kind == "session_open" and "route" in e.detail]
    arrival_of = {s: min(x.t for x in evs) for s, evs in by_session.items()}
    for e in sorted(opens, key=lambda e: (arrival_of[e.session], e.peer, e.session or "")):
        session = by_session[e.session]
        mine = [x for x in session if x.peer == e.peer]
        if any(x.kind == "session_open" and "route" in x.detail and x.t < e.t for x in mine):
            continue  # a second open of the same session (a re-route) is not a new request
        results = [x for x in mine if x.kind == "result"]
        asked = next((x.detail for x in mine if x.kind == "request" and "prompt_tokens" in x.detail), {})
        prompt = asked.get("prompt_tokens") or next(
            (x.detail.get("n_tokens") for x in results if x.detail.get("start_pos") == 0), None)
        if not prompt:
            continue  # no step ever came back: nothing says how long the prompt was
        last = max(x.detail.get("start_pos", 0) + x.detail.get("n_tokens", 0) for x in results)
        tokens = asked.get("max_new_tokens") or max(1, 1 + last - prompt)
        if e.peer not in requesters:
            requesters.append(e.peer)
        route = tuple((str(p), int(a), int(b)) for p, a, b in e.detail["route"])
        arrival = arrival_of[e.session]
        closed = next((x.t for x in mine if x.kind == "session_close"), None)
        recorded = {"latency": None if closed is None else closed - arrival,
                    "ttft": min(x.t for x in results) - arrival,
                    "failovers": sum(1 for x in mine if x.kind == "failover")}
        requests.append(RequestPlan(len(requests), arrival, e.peer, int(prompt), int(tokens),
                                    recorded_route=route, max_length=e.detail.get("max_length"), recorded=recorded))

    num_layers = max([p.span[1] for p in peers] + [h[2] for r in requests for h in r.recorded_route or ()])
    latencies = link_latencies(timeline.pairs)
    hidden = hidden_size(events)
    meta = {"databases": [str(p) for p in dbs], "trace_end_s": end, "clock_offsets_s": dict(
        sorted((str(timeline.paths[i]), off) for i, off in timeline.offsets.items())),
        "hidden_size_inferred": hidden is not None, "until": until}
    return Scenario(
        "replay", num_layers, hidden or DEFAULT_HIDDEN, model_id, tuple(sorted(peers, key=lambda p: p.join_at)),
        tuple(requests), tuple(requesters), meta=meta,
        link_latency=latencies,
        default_latency=statistics.median(latencies.values()) if latencies else DEFAULT_LATENCY_S,
    )


def link_latencies(pairs: Iterable[tuple[Event, Event]]) -> dict[tuple[str, str], float]:
    """One-way latency per directed link: its fastest aligned push -> receive."""
    best: dict[tuple[str, str], float] = {}
    for push, receive in pairs:
        key = (push.peer, receive.peer)
        delay = max(MIN_LATENCY_S, receive.t - push.t)
        best[key] = min(best.get(key, delay), delay)
    return best


def hidden_size(events: Iterable[Event]) -> int | None:
    """The hidden size from two pushes of different lengths: (bytes1 - bytes2) / (4 (n1 - n2))."""
    sizes: dict[int, int] = {}
    for e in events:
        n = e.detail.get("n_tokens") if e.kind == "push" else None
        if isinstance(n, int) and n > 0 and e.bytes:
            sizes.setdefault(n, e.bytes)
    if len(sizes) < 2:
        return None
    (n1, b1), (n2, b2) = sorted(sizes.items())[-1], sorted(sizes.items())[0]
    hidden, rest = divmod(b1 - b2, FLOAT32_BYTES * (n1 - n2))
    return hidden if hidden > 0 and rest == 0 else None


__all__ = ["from_trace", "find_databases", "link_latencies", "hidden_size", "TraceTooThin"]
