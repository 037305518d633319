"""The Swarm page's picture of a swarm, as plain data: a pure function of a view.

`swarm_report(view, ...)` is what `GET /web/api/swarm` answers and what the Swarm page
draws: per layer, how many replicas a route could use now; the gaps; every peer with
its span (or tensor-shard rank), state, device, memory, speed, load and how the observer
reaches it; the shard groups; and the peers that were seen and are gone.

Coverage is **routable** coverage, the truth `tessera swarm status` prints: a layer counts
a peer only while a requester could open a session there (serving, measured, not full;
`routing.unusable_reason`), a complete tensor-shard group once, an incomplete one not
at all. A draining, paused, loading, leaving or full peer is listed with the reason it
is not counted. It is `peer/plan/coverage.py`'s `swarm_coverage`, the one definition
`swarm status` and the TUI read too.

A worked example (L = 30): a serves [0, 10), b [10, 20), c [20, 30), all serving ->
coverage [1] * 30, no gaps, "routable: every layer is served (1 replica at the thinnest)".
c drains -> it stays in the peer list (``not_routable: "draining"``), coverage is
[1] * 20 + [0] * 10 and the headline is "no route: layers [20, 30) missing".
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

from tessera.peer.plan.coverage import swarm_coverage
from tessera.peer.plan.groups import group_report, replica_coverage
from tessera.peer.plan.routing import unusable_reason
from tessera.peer.plan.view import PeerInfo, SwarmView


def headline(counts: Sequence[int], gaps: Sequence[Sequence[int]]) -> str:
    """The one line above the picture: routable or not, and which layers are missing."""
    if not counts:
        return "no route: the model has no layers"
    if gaps:
        ranges = " and ".join(f"[{a}, {b})" for a, b in gaps)
        return f"no route: layers {ranges} missing"
    thinnest = min(counts)
    return f"routable: every layer is served ({thinnest} replica{'s' if thinnest != 1 else ''} at the thinnest)"


def finite(x: float) -> float | None:
    """JSON has no infinity: a record's `expires_at` may be inf (a simulated view)."""
    return x if math.isfinite(x) else None


def quant_of(model_id: str) -> str:
    """The quantization a model id is tagged with (stages/kernels/quant.py `model_tag`): "none", "int8", ..."""
    return model_id.split("+", 1)[1] if "+" in model_id else "none"


def peer_entry(p: PeerInfo, *, rtt_ms: float | None, link: str | None, weights: int) -> dict:
    """One peer as the Swarm page lists it (JSON-ready)."""
    layers = p.end - p.start
    return {
        "peer_id": p.peer_id, "name": p.name, "span": [p.start, p.end],
        "shard": [p.shard_index, p.shard_count], "group": p.shard_group,
        "state": str(p.state),
        "not_routable": unusable_reason(p),  # why a route would not use it now; None: it would
        "device": p.device, "dtype": p.dtype, "quant": quant_of(p.model_id),
        # memory: what it still offers (advertised), what its span's weights take (estimated from the
        # model's shapes, its dtype and quantization), and their sum: what it offered
        "free_memory": p.free_memory, "weights": weights, "offered": weights + p.free_memory,
        "device_free": p.device_free,
        "throughput": round(p.throughput, 2),  # tokens/s through one layer (measured)
        "token_ms": round(layers * 1000 / p.throughput, 2) if p.throughput > 0 and layers > 0 else None,
        "load": round(p.load, 3), "max_sessions": p.max_sessions,
        "reachability": str(p.reachability),  # how it says others reach it
        "link": link,  # the observer's own connection to it: direct, punched, relayed; None: not connected
        "rtt_ms": round(rtt_ms, 2) if rtt_ms is not None else None,  # the observer's measured RTT
        "neighbours": {k: round(v, 2) for k, v in sorted(p.rtt_ms.items())},  # its own RTTs
        "issued_at": p.issued_at, "expires_at": finite(p.expires_at),
        "addrs": list(p.addrs),
    }


def swarm_report(
    view: SwarmView,
    *,
    model: str,
    model_id: str,
    observer: str,
    role: str,
    now: float,
    rtt_ms: Mapping[str, float],
    link_of: Callable[[str], str | None],
    weights_of: Callable[[PeerInfo], int],
    gone: Sequence[dict] = (),
) -> dict:
    """The Swarm page's data (see the module docstring). `observer` is the requester or peer
    whose view this is, `rtt_ms` its measured RTTs, `link_of` its connection kind to a peer,
    `weights_of` a peer's estimated weight bytes, `gone` the peers seen before and gone now
    (`watch.SwarmWatch`)."""
    coverage = swarm_coverage(view)  # what `swarm status` and the TUI say (peer/plan/coverage.py)
    counts, gaps = list(coverage.replicas), [list(gap) for gap in coverage.gaps]
    return {
        "model": model, "model_id": model_id, "num_layers": view.num_layers,
        "observer": {"peer_id": observer, "role": role},
        "now": now,
        "coverage": counts,
        "gaps": gaps,
        "routable": bool(counts) and not gaps,
        "headline": headline(counts, gaps),
        "claimed": view.coverage(),  # every claim but a leaving peer's, counted or not
        "replicas": replica_coverage(view),  # complete replicas claimed, routable or not
        "groups": group_report(view),  # tensor-shard groups: span, size, who holds each rank
        "peers": [peer_entry(p, rtt_ms=rtt_ms.get(p.peer_id), link=link_of(p.peer_id), weights=weights_of(p))
                  for p in view.peers],
        "gone": list(gone),
        # a record lives this long after its peer's last word: how late a peer that died still counts
        "record_ttl_s": max((p.expires_at - p.issued_at for p in view.peers if math.isfinite(p.expires_at - p.issued_at)),
                            default=None),
    }
