"""A scenario: who joins and leaves when, and who asks for what. Plain data, made up or read from a trace.

    scenario = synthetic(peers=100, requests=1000, churn=0.05, seed=1)
    scenario = from_trace(["peer0/tessera.db", "peer1/tessera.db", "requester.db"])   # peer/sim/replay.py

Times are simulated seconds from the start of the run. Peers are given by what
placement needs (throughput per layer, capacity in layers) and, for a replay,
by what they did (the span claimed, moves); requests by their shape (prompt
tokens, tokens generated) and which requester sends them.

Synthetic swarms (`synthetic`)
------------------------------
Peers join over a warm-up; speeds are log-normal (volunteer hardware spans
orders of magnitude), capacities uniform over a range of layers, each peer sits
in one of four regions with the link latencies below. Requests arrive as a
Poisson process after the warm-up, at `rate` per second — or by default at
`load` times what the swarm could carry if requests spread evenly over it.
Churn: ``churn`` is the fraction of the swarm that leaves per simulated minute,
each leaver replaced by a newcomer a little later; a leaver drains and leaves
(half of them), is killed (a quarter: connections reset) or vanishes (a
quarter: connections go silent).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from tessera.peer.sim.errors import BadScenario

LEAVE_MODES = ("graceful", "crash", "vanish")

# Regions and one-way latencies between them, in seconds: half of typical RTTs in public
# ping tables (WonderNetwork): London-NYC ~75 ms, NYC-SF ~70 ms, SF-Tokyo ~110 ms,
# London-Tokyo ~230 ms; within a region ~15 ms.
REGIONS = ("eu", "us-east", "us-west", "asia")
ONE_WAY_S = (
    (0.008, 0.038, 0.070, 0.115),
    (0.038, 0.008, 0.035, 0.090),
    (0.070, 0.035, 0.008, 0.055),
    (0.115, 0.090, 0.055, 0.008),
)
# Home uplinks: 25 Mbit/s, 100 Mbit/s, 1 Gbit/s, in bytes/s.
BANDWIDTHS = (3.125e6, 12.5e6, 125e6)


@dataclass(frozen=True)
class PeerPlan:
    """One simulated peer.

    label:          its name in reports (a replay: the recorded peer id).
    join_at:        when it starts.
    throughput:     tokens/s through one layer: what it advertises (placement and routing see it),
                    and how fast it computes unless `compute_throughput` says otherwise.
    capacity_layers: how many layers its memory holds.
    leave_at, leave_mode: when and how it goes (None: it stays to the end).
    span:           a forced span (replay's `recorded` policy); None: placement chooses.
    moves:          recorded moves ((at, (start, end)), ...), replayed under `recorded`.
    region, bandwidth: where it sits (index into REGIONS) and its link speed, bytes/s.
    load_seconds:   how long loading its first span takes (a replay measures it); None: per layer.
    disk:           layer ranges it has on disk at the start (``()``: an empty folder; it
                    downloads what it claims beyond them at `bandwidth`, peer/sim/disk.py);
                    None: the whole model.
    compute_throughput: tokens/s through one layer its steps take (None: `throughput`). A replay
                    gives the speed its recorded forward steps ran at: the advertised one is a
                    start-up measurement, which on a busy machine (peers starting beside it) can
                    be many times slower than what the peer then computed.
    """

    label: str
    join_at: float
    throughput: float
    capacity_layers: int
    leave_at: float | None = None
    leave_mode: str = "graceful"
    span: tuple[int, int] | None = None
    moves: tuple[tuple[float, tuple[int, int]], ...] = ()
    max_sessions: int = 16
    region: int = 0
    bandwidth: float = 125e6
    load_seconds: float | None = None  # a replay's measured load time (default: per layer, see Timings)
    disk: tuple[tuple[int, int], ...] | None = None
    compute_throughput: float | None = None

    def __post_init__(self) -> None:
        if self.leave_mode not in LEAVE_MODES:
            raise BadScenario(f"leave_mode must be one of {LEAVE_MODES!r}, got {self.leave_mode!r}")
        if not self.throughput > 0:
            raise BadScenario(f"peer {self.label}: throughput must be > 0, got {self.throughput!r}")
        if self.compute_throughput is not None and not self.compute_throughput > 0:
            raise BadScenario(f"peer {self.label}: compute_throughput must be > 0, got {self.compute_throughput!r}")
        if self.capacity_layers < 1:
            raise BadScenario(f"peer {self.label}: capacity_layers must be >= 1, got {self.capacity_layers!r}")
        if self.leave_at is not None and self.leave_at < self.join_at:
            raise BadScenario(f"peer {self.label}: leaves at {self.leave_at!r}, before it joins at {self.join_at!r}")


@dataclass(frozen=True)
class RequestPlan:
    """One generation: `prompt_tokens` prefilled, then `new_tokens` produced (one step each).

    recorded_route: in a replay, the route the live requester took ((peer label, start, end), ...).
    """

    id: int
    at: float
    requester: str
    prompt_tokens: int
    new_tokens: int
    recorded_route: tuple[tuple[str, int, int], ...] | None = None
    max_length: int | None = None  # the KV capacity asked for (default: prompt + new tokens)
    recorded: dict[str, Any] | None = None  # a replay's live figures: latency, ttft, failovers

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.new_tokens < 1:
            raise BadScenario(f"request {self.id}: prompt_tokens and new_tokens must be >= 1")


@dataclass(frozen=True)
class Scenario:
    source: str  # "synthetic" or "replay"
    num_layers: int
    hidden_size: int
    model_id: str | None
    peers: tuple[PeerPlan, ...]
    requests: tuple[RequestPlan, ...]
    requesters: tuple[str, ...]
    requester_regions: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    # A replay's measured one-way latencies per (label, label) link, and the latency of the rest;
    # None: links come from the peers' regions and bandwidths.
    link_latency: dict[tuple[str, str], float] | None = None
    default_latency: float = 0.0005
    # A replay's requesters, when each joined (its traced Join); the others join shortly before
    # their first request (peer/sim/engine.py REQUESTER_LEAD_S).
    requester_joins: dict[str, float] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "peers": len(self.peers), "requests": len(self.requests), "requesters": len(self.requesters),
                **self.meta}


def synthetic(
    *,
    peers: int,
    requests: int,
    churn: float = 0.0,
    seed: int = 0,
    num_layers: int = 30,
    hidden_size: int = 576,
    capacity: tuple[int, int] = (6, 15),
    prompt: tuple[int, int] = (8, 64),
    tokens: tuple[int, int] = (2, 12),
    throughput_median: float = 400.0,
    load: float = 0.5,
    rate: float | None = None,
    warmup: float | None = None,
    requesters: int | None = None,
    max_sessions: int = 16,
) -> Scenario:
    """A made-up swarm and workload (see the module docstring). Raises BadScenario on bad sizes."""
    if peers < 1 or requests < 0 or churn < 0 or not 0 < load:
        raise BadScenario(f"need peers >= 1, requests >= 0, churn >= 0, load > 0; got {peers}, {requests}, {churn}, {load}")
    if not 1 <= capacity[0] <= capacity[1]:
        raise BadScenario(f"capacity range {capacity!r} must be 1 <= low <= high")
    rng = random.Random(f"tessera-synthetic:{seed}")
    warmup = float(warmup if warmup is not None else min(60.0, 5.0 + 0.05 * peers))
    n_req = requesters if requesters is not None else max(1, min(64, requests // 20))

    def new_peer(i: int, at: float) -> PeerPlan:
        return PeerPlan(
            label=f"peer-{i:05d}", join_at=round(at, 6),
            throughput=round(throughput_median * math.exp(rng.gauss(0.0, 0.6)), 3),
            capacity_layers=rng.randint(*capacity), region=rng.randrange(len(REGIONS)),
            bandwidth=rng.choice(BANDWIDTHS), max_sessions=max_sessions,
        )

    plans = [new_peer(i, 0.0 if i == 0 else rng.uniform(0.0, warmup)) for i in range(peers)]
    # The request rate: `rate`, or `load` x what the swarm could carry if requests spread evenly.
    mean_tokens = (prompt[0] + prompt[1]) / 2 + (tokens[0] + tokens[1]) / 2
    layer_tokens_per_s = sum(p.throughput for p in plans)  # summed over every layer it runs
    if rate is None:
        rate = load * layer_tokens_per_s / num_layers / mean_tokens
    elif not rate > 0:
        raise BadScenario(f"rate must be > 0 requests/s, got {rate!r}")
    reqs = []
    t = warmup + 5.0
    names = [f"req-{i:03d}" for i in range(n_req)]
    for i in range(requests):
        t += rng.expovariate(rate)
        reqs.append(RequestPlan(i, round(t, 6), names[i % n_req], rng.randint(*prompt), rng.randint(*tokens)))
    end = t
    # Churn over [warmup, end): Poisson departures at churn x peers per minute, each replaced.
    if churn > 0 and end > warmup:
        alive = {p.label: k for k, p in enumerate(plans)}
        departures = churn * peers / 60.0
        t, next_id = warmup, peers
        while True:
            t += rng.expovariate(departures)
            if t >= end:
                break
            joined = sorted(label for label, k in alive.items() if plans[k].join_at < t)
            if not joined:
                continue
            label = rng.choice(joined)
            k = alive.pop(label)
            mode = rng.choices(LEAVE_MODES, weights=(2, 1, 1))[0]
            plans[k] = _with(plans[k], leave_at=round(t, 6), leave_mode=mode)
            newcomer = new_peer(next_id, t + rng.expovariate(1 / 10.0))
            alive[newcomer.label] = len(plans)
            plans.append(newcomer)
            next_id += 1
    regions = {name: rng.randrange(len(REGIONS)) for name in names}
    meta = {"churn_per_minute": churn, "load": load, "warmup_s": warmup, "seed": seed,
            "request_rate_per_s": round(rate, 6)}
    return Scenario("synthetic", num_layers, hidden_size, None, tuple(plans), tuple(reqs), tuple(names),
                    requester_regions=regions, meta=meta)


def _with(plan: PeerPlan, **changes: Any) -> PeerPlan:
    return replace(plan, **changes)


__all__ = ["PeerPlan", "RequestPlan", "Scenario", "synthetic", "REGIONS", "ONE_WAY_S", "BANDWIDTHS", "LEAVE_MODES"]
