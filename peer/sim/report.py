"""What a simulation reports, and how it is written so that the same run gives the same bytes.

The report (JSON) holds:

- ``scenario``, ``settings``: what was run (policy, seed, timings, view mode, link model);
- ``summary``: requests completed/failed, latency and time-to-first-token percentiles,
  failovers, bans, placement moves, coverage (time with every layer served, gaps); each
  failed request's class (``failure_classes``: `classify_failure`), and why requesters
  avoided peers (``avoided``: bans by failure kind, and refusals, which are not bans:
  peer/base/backoff.py);
- ``requests``: per request — arrival, when its route opened, first token, end,
  latency, failovers, the routes it used (and, in a replay, the route taken live);
- ``coverage``: the swarm's ground truth as a step function — at every change of a
  peer's state or span: serving peers, uncovered layers, fewest replicas of a
  layer, and the bottleneck (tokens/s through the weakest layer);
- ``moves``: every placement move (time, peer, from, to, reason);
- ``peers``: per peer — joined, left (and how), spans held.

No wall-clock value goes in. Floats are rounded to `ROUND_DIGITS` decimals and
keys sorted (`dumps`), so the same scenario and seed give byte-identical files.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from tessera.peer.base.errors import NoRoute, PeerFailed, RouteLost
from tessera.peer.plan.view import SERVING

ROUND_DIGITS = 6
REPORT_VERSION = 1
# One point of the coverage step function: when, how many peers serve, how many layers
# nobody serves, the fewest servers of any layer, tokens/s through the weakest layer.
COVERAGE_COLUMNS = ("t", "serving_peers", "uncovered_layers", "min_replicas", "bottleneck")


@dataclass
class RequestOutcome:
    id: int
    requester: str
    arrival: float
    prompt_tokens: int
    new_tokens: int
    recorded_route: Any = None
    recorded: Any = None
    opened: float | None = None
    first_token: float | None = None
    done: float | None = None
    tokens: int = 0
    failovers: int = 0
    routes: list = field(default_factory=list)
    error: str | None = None
    failure: str | None = None  # the failure's class (classify_failure), when it failed
    avoided: dict[str, int] = field(default_factory=dict)  # peers avoided by this request, by Failure value

    def token_at(self, now: float) -> None:
        if self.tokens == 0:
            self.first_token = now
        self.tokens += 1
        self.done = now

    @property
    def completed(self) -> bool:
        return self.error is None and self.tokens == self.new_tokens

    def as_dict(self) -> dict[str, Any]:
        out = {
            "id": self.id, "requester": self.requester, "arrival": self.arrival,
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "tokens": self.tokens,
            "opened": self.opened, "first_token": self.first_token, "done": self.done,
            "latency": (self.done - self.arrival) if self.completed else None,
            "ttft": (self.first_token - self.arrival) if self.first_token is not None else None,
            "failovers": self.failovers, "routes": [[list(h) for h in r] for r in self.routes],
            "completed": self.completed, "error": self.error, "failure": self.failure,
            "avoided": dict(sorted(self.avoided.items())),
        }
        if self.recorded_route is not None:
            out["recorded_route"] = [list(h) for h in self.recorded_route]
            out["route_matches"] = bool(self.routes) and [list(h) for h in self.routes[0]] == out["recorded_route"]
        if self.recorded is not None:
            out["recorded"] = dict(self.recorded)
        return out


class Recorder:
    """Collects a run's observations; `report()` turns them into the report's dict."""

    def __init__(self, num_layers: int, clock) -> None:
        self.num_layers = num_layers
        self.clock = clock
        self.event_counts: dict[str, int] = {}
        self.requests: dict[int, RequestOutcome] = {}
        self.moves: list[dict[str, Any]] = []
        self.peer_log: dict[str, dict[str, Any]] = {}
        self.coverage: list[list[Any]] = []
        # Ground truth of who serves what, kept incrementally: a change costs its span, not the swarm.
        self._serving: dict[str, tuple[int, int, float]] = {}
        self._counts = [0] * num_layers
        self._caps = [0.0] * num_layers
        self._failed_at: dict[int, float] = {}  # request id -> when it failed (to hold it against coverage)
        self.closed = False

    # -- peers ----------------------------------------------------------------------------

    def peer_changed(self, peer) -> None:
        if self.closed:
            return  # the run is over: peers torn down now did not leave
        now = self.clock()
        entry = self.peer_log.setdefault(peer.label, {"joined": now, "left": None, "how": None, "spans": [],
                                                      "throughput": peer.throughput, "capacity": peer.capacity})
        if not peer.alive and entry["left"] is None:
            entry["left"], entry["how"] = now, peer.exit or "stopped"
        serving = peer.alive and peer.state == SERVING and peer.span is not None
        old = self._serving.get(peer.label)
        new = (peer.span[0], peer.span[1], peer.throughput / (peer.span[1] - peer.span[0])) if serving else None
        if old == new:
            return
        if old is not None:
            self._apply(old, -1)
            del self._serving[peer.label]
        if new is not None:
            self._apply(new, +1)
            self._serving[peer.label] = new
        self._sample(now)

    def claim(self, peer) -> None:
        if self.closed:
            return
        self.peer_log[peer.label]["spans"].append([self.clock(), peer.span[0], peer.span[1]])

    def move(self, peer, old, new, reason: str) -> None:
        if self.closed:
            return
        now = self.clock()
        self.moves.append({"t": now, "peer": peer.label, "from": list(old) if old else None, "to": list(new),
                           "reason": reason})
        self.peer_log[peer.label]["spans"].append([now, new[0], new[1]])

    def _apply(self, entry: tuple[int, int, float], sign: int) -> None:
        start, end, per_layer = entry
        for layer in range(start, end):
            self._counts[layer] += sign
            self._caps[layer] += sign * per_layer

    def _sample(self, now: float) -> None:
        uncovered = sum(1 for c in self._counts if c == 0)
        neck = 0.0 if uncovered else min(self._caps, default=0.0)
        point = [now, len(self._serving), uncovered, min(self._counts, default=0), max(neck, 0.0)]
        if self.coverage and self.coverage[-1][0] == now:
            self.coverage[-1] = point  # several changes at one instant: keep the last state
        else:
            self.coverage.append(point)

    # -- requests ---------------------------------------------------------------------------

    def request_started(self, request) -> RequestOutcome:
        outcome = RequestOutcome(request.id, request.requester, request.at, request.prompt_tokens,
                                 request.new_tokens, request.recorded_route, request.recorded)
        self.requests[request.id] = outcome
        return outcome

    def request_finished(self, outcome: RequestOutcome) -> None:
        if outcome.error is None and not outcome.completed:
            outcome.error = "cut off: the simulation ended first"
            outcome.failure = CUT_OFF
        if outcome.error is not None:
            self._failed_at[outcome.id] = self.clock()

    def uncovered(self, ranges: Iterable[tuple[int, int]]) -> list[int]:
        """The layers of `ranges` that no live peer serves now (the ground truth, not a view)."""
        return [layer for a, b in ranges for layer in range(max(a, 0), min(b, self.num_layers))
                if self._counts[layer] == 0]

    # -- the report ---------------------------------------------------------------------------

    def report(self, *, scenario: dict, settings: dict, end: float) -> dict[str, Any]:
        requests = [self.requests[i].as_dict() for i in sorted(self.requests)]
        done = [r for r in requests if r["completed"]]
        summary = {
            "requests": len(requests),
            "completed": len(done),
            "failed": len(requests) - len(done),
            # failures while every layer was served: capacity (busy peers), a requester's bans, a
            # repair that found no free replica — not coverage, which the coverage line reports
            "failed_while_covered": self._failed_while_covered(),
            "errors": _count(r["error"].split(":")[0] for r in requests if r["error"]),
            "latency_s": _stats(r["latency"] for r in done),
            "ttft_s": _stats(r["ttft"] for r in requests if r["ttft"] is not None),
            "failovers": sum(r["failovers"] for r in requests),
            "requests_with_failover": sum(1 for r in requests if r["failovers"]),
            "failure_classes": _count(r["failure"] or "unclassified" for r in requests if r["error"]),
            "avoided": _sum_counts(r["avoided"] for r in requests),
            "moves": len(self.moves),
            "events": dict(sorted(self.event_counts.items())),
            "coverage": self._coverage_summary(end),
            "simulated_seconds": end,
        }
        recorded = [r for r in requests if "recorded_route" in r]
        if recorded:
            summary["route_matches"] = sum(1 for r in recorded if r["route_matches"])
            summary["routes_compared"] = len(recorded)
        peers = self.peer_log
        return {
            "version": REPORT_VERSION,
            "scenario": scenario,
            "settings": settings,
            "summary": summary,
            "requests": requests,
            "coverage_columns": list(COVERAGE_COLUMNS),
            "coverage": self.coverage,
            "moves": self.moves,
            "peers": peers,
        }

    def _failed_while_covered(self) -> int:
        times = [point[0] for point in self.coverage]
        count = 0
        for at in self._failed_at.values():
            i = bisect_right(times, at) - 1
            count += i >= 0 and self.coverage[i][2] == 0
        return count

    def _coverage_summary(self, end: float) -> dict[str, Any]:
        """Time with every layer served, counted from the first moment the swarm was whole."""
        points = self.coverage
        first = next((p[0] for p in points if p[2] == 0), None)
        if first is None:
            return {"first_covered": None, "covered_fraction": 0.0, "gaps": [], "longest_gap_s": None,
                    "min_bottleneck": 0.0, "mean_bottleneck": 0.0}
        gaps, covered, weighted, lowest = [], 0.0, 0.0, math.inf
        gap_start = None
        for i, (t, _, uncovered, _, neck) in enumerate(points):
            if t < first:
                continue
            until = points[i + 1][0] if i + 1 < len(points) else end
            until = max(until, t)
            if uncovered:
                gap_start = t if gap_start is None else gap_start
            else:
                if gap_start is not None:
                    gaps.append([gap_start, t])
                    gap_start = None
                covered += until - t
                lowest = min(lowest, neck)
            weighted += neck * (until - t)
        if gap_start is not None:
            gaps.append([gap_start, end])
        span = max(end - first, 1e-12)
        return {
            "first_covered": first,
            "covered_fraction": covered / span,
            "gaps": gaps,
            "longest_gap_s": max((b - a for a, b in gaps), default=0.0),
            "min_bottleneck": lowest if lowest < math.inf else 0.0,
            "mean_bottleneck": weighted / span,
        }


def _sum_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for count in counts:
        for key, n in count.items():
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def _stats(values: Iterable[float]) -> dict[str, Any]:
    xs = sorted(values)
    if not xs:
        return {"n": 0}

    def rank(q: float) -> float:  # nearest rank
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99),
            "max": xs[-1]}


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def canonical(value: Any) -> Any:
    """Floats rounded (and -0.0 made 0.0; inf/nan as strings), tuples as lists, recursively."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        rounded = round(value, ROUND_DIGITS)
        return 0.0 if rounded == 0 else rounded
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def dumps(report: dict[str, Any]) -> bytes:
    """The report's bytes: canonical values, sorted keys, one trailing newline."""
    return (json.dumps(canonical(report), sort_keys=True, indent=1, allow_nan=False) + "\n").encode()


def format_summary(report: dict[str, Any]) -> str:
    """A few lines for a terminal."""
    s = report["summary"]
    lat, ttft, cov = s["latency_s"], s["ttft_s"], s["coverage"]

    def q(stats: dict, key: str) -> str:
        return f"{stats[key]:.3f}" if key in stats else "-"

    lines = [
        f"requests: {s['completed']}/{s['requests']} completed, {s['failed']} failed"
        + (f" ({', '.join(f'{k} {v}' for k, v in s['errors'].items())})" if s["errors"] else "")
        + (f"; {s['failed_while_covered']} of them while every layer was served (busy or banned peers, "
           "or no free replica for a repair: capacity, not coverage)" if s.get("failed_while_covered") else ""),
        f"latency s: p50 {q(lat, 'p50')}  p90 {q(lat, 'p90')}  p99 {q(lat, 'p99')}  max {q(lat, 'max')}",
        f"first token s: p50 {q(ttft, 'p50')}  p90 {q(ttft, 'p90')}",
        f"failovers: {s['failovers']} (in {s['requests_with_failover']} requests); "
        f"placement moves: {s['moves']}; bans: {s['events'].get('ban', 0)}",
        _avoided_line(s.get("avoided", {})),
        f"coverage: every layer served {cov['covered_fraction'] * 100:.1f}% of the time since "
        f"t={_num(cov['first_covered'])} s; {len(cov['gaps'])} gaps, longest {_num(cov['longest_gap_s'])} s; "
        f"mean bottleneck {cov['mean_bottleneck']:.1f} tokens/s",
        f"simulated: {s['simulated_seconds']:.1f} s",
    ]
    if s.get("failure_classes"):
        lines.insert(1, "failed requests by class: " + ", ".join(f"{k} {v}" for k, v in s["failure_classes"].items()))
    if "route_matches" in s:
        lines.append(f"routes as recorded: {s['route_matches']}/{s['routes_compared']}")
    return "\n".join(lines)


def _avoided_line(avoided: dict[str, int]) -> str:
    """'bans by failure: timed-out 237, dropped 21; refusals (busy, draining: skipped, not banned): 1648'"""
    bans = {k: v for k, v in avoided.items() if k != "refused"}
    text = ", ".join(f"{k} {v}" for k, v in sorted(bans.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"
    return f"bans by failure: {text}; refusals (skipped, not banned): {avoided.get('refused', 0)}"


# The classes of a failed request (`classify_failure`), for the report.
GAP = "gap"  # no route: no live peer served some layer it needed (a real hole in the swarm)
NO_REPLACEMENT = "no replacement"  # a peer of its route failed and no usable one took its layers in time
NO_USABLE_PEER = "no usable peer"  # could not open: the layers were served, by peers it could not use
TIMEOUT = "timeout"  # still running at the scenario's request timeout
CUT_OFF = "cut off"  # the simulation ended first
FAILURE_CLASSES = (GAP, NO_REPLACEMENT, NO_USABLE_PEER, TIMEOUT, CUT_OFF)


def classify_failure(error: BaseException, uncovered: Callable[[Iterable[tuple[int, int]]], list[int]]) -> str:
    """Why a request failed, judged against the swarm's ground truth when it gave up: a gap when
    some layer it lacked had no live peer at all (`uncovered`: the recorder's), else a failed
    peer with no replacement (mid-answer) or no usable peer (at the start) — layers that were
    served, by peers the requester could not use (banned, busy, unreachable)."""
    if isinstance(error, NoRoute) and uncovered(error.missing or [(0, 10**9)]):
        return GAP
    if isinstance(error, (RouteLost, PeerFailed)):
        return NO_REPLACEMENT
    if isinstance(error, NoRoute):
        return NO_USABLE_PEER
    return NO_REPLACEMENT


__all__ = ["Recorder", "RequestOutcome", "dumps", "canonical", "format_summary", "REPORT_VERSION",
           "classify_failure", "FAILURE_CLASSES"]
