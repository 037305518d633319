"""What the TUI draws, read from a live `PeerNode` as plain data — on the peer's trio side.

`read_snapshot(node)` runs in the peer's thread (called by `tessera.tui.bridge.PeerHandle`
between the peer's own tasks, so nothing changes under it) and returns a dict of
plain values — copies, never the node's own objects — that the UI thread may keep
and read at leisure. It extends `PeerNode.status()` with what the operator's screen
needs and `status()` does not say: the running sessions and who asked for them,
whether compute is paused, this peer's advertised reachability, and the names and
spans of the neighbours. Before the peer serves (it is still measuring or loading)
it says what is known so far.

Keys (always present): ``phase`` ("starting", "serving", "stopped"), ``at``
(monotonic seconds), the keys of `PeerNode.status()` (``peer_id``, ``name``,
``addrs``, ``model_id``, ``num_layers``, ``span``, ``state``, ``throughput``,
``memory_offered``, ``memory_used``, ``device``, ``vram`` (a CUDA card's ``free`` and ``total``
bytes, else None), ``quant`` (the span's quantization), ``uptime``, ``sessions`` — a count —,
``stats``, ``coverage`` and ``gaps`` (`PeerNode.coverage`: routing's definition, this peer
in its current state), ``serving`` (peers taking sessions, this one included if it does),
``neighbours``, ``held`` (layer ranges on disk), ``fetch`` (the
weights fetch under way: ``label``, ``done``, ``total``, ``rate``, ``eta_s``, ``peers``; else
None)), and ``model``, ``active`` (one
dict per running session: ``id``, ``requester``, ``span``, ``steps``, ``tokens``,
``idle_s``), ``paused``, ``accepting``, ``reachability``, ``swarm`` (``peers``,
``join``, ``private``), ``forced_layers``, ``max_sessions``, ``in_flight`` (the answers running
here and the grace leaving now would give them: ``sessions``, ``tokens_left``, ``grace``; see
peer/serve/leaving.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from tessera.peer.node.peer_node import PeerNode
from tessera.peer.node.config import capacity_in_layers
from tessera.peer.plan.placement import choose_span
from tessera.peer.serve.limits import ServerStats
from tessera.peer.plan.view import SERVING

ZERO_STATS = {f.name: 0 for f in dataclasses.fields(ServerStats)}


def read_snapshot(node: PeerNode) -> dict[str, Any]:
    """Everything the UI shows of `node`, as plain data (call on the peer's trio side)."""
    server = node.server
    base = node.status() if server is not None else _starting_status(node)
    view = node.keeper.snapshot()
    now = time.monotonic()
    me = base["peer_id"]
    own = view.get(me) if me else None
    nat = base.get("nat") or {}  # peer/net/nat/reachability.py's view of links: knows "punched" from "direct"
    link_kinds = nat.get("links") or {}
    active = [] if server is None else [
        {"id": s.short_id, "requester": s.requester, "span": [s.start, s.end], "steps": s.steps,
         "tokens": s.tokens, "idle_s": max(0.0, server.admission.clock() - s.last_active)}  # last_active's clock
        for s in sorted(server.sessions.values(), key=lambda s: s.session_id)
    ]
    requesters = {s["requester"] for s in active}
    neighbours = []
    for peer_id, link in sorted(base["neighbours"].items(), key=lambda item: (item[1]["rtt_ms"], item[0])):
        info = view.get(peer_id)
        neighbours.append({
            "peer_id": peer_id, "rtt_ms": link["rtt_ms"], "kind": link_kinds.get(peer_id) or link["kind"] or "gone",
            "name": info.name if info else "", "span": list(info.span) if info else None,
            # a neighbour without a record serves nothing: a requester of ours, or one we do not know
            "state": info.state if info else ("requester" if peer_id in requesters else "no record"),
        })
    others = [p for p in view.peers if p.peer_id != me]
    return {
        **base,
        "phase": "serving" if node.ready.is_set() else "starting",
        "at": now,
        "stats": {**ZERO_STATS, **base["stats"]},  # a copy: status() hands out the live counters
        "model": node.config.model if isinstance(node.config.model, str) else str(node.config.model),
        "neighbours": neighbours,
        "active": active,
        "paused": server is not None and not server.running.is_set(),
        "accepting": server is not None and server.accepting,
        "reachability": nat.get("reachability") or (own.reachability if own else "unknown"),
        "swarm": {"peers": len(others), "join": list(node.config.join), "private": node.config.swarm_key is not None},
        "forced_layers": node.config.layers is not None,
        "max_sessions": node.config.max_sessions,
        "in_flight": dataclasses.asdict(node.in_flight()),
    }


def stopped_snapshot(last: dict[str, Any] | None, node: PeerNode) -> dict[str, Any]:
    """The snapshot after the peer's loop ended: the last one seen, marked stopped.

    Not read afresh: the host and store are closed by then.
    """
    base = dict(last) if last is not None else {**_starting_status(node), "stats": dict(ZERO_STATS)}
    return {**base, "phase": "stopped", "state": node.state, "at": time.monotonic(), "active": [],
            "sessions": 0, "neighbours": [], "accepting": False, "paused": False,
            "in_flight": {"sessions": 0, "tokens_left": 0, "grace": 0.0}}


def preview_memory(node: PeerNode, gb: float) -> dict[str, Any]:
    """What `node.set_memory_offered(gb)` would claim, without doing it (call on the trio side).

    Returns ``{"span", "current", "moves", "capacity"}``: the span it would serve, the
    span it serves now, whether they differ (a move drops running sessions after a
    grace period), and how many layers `gb` holds. Raises ValueError for a `gb` that
    is not a positive finite number.
    """
    if not (isinstance(gb, (int, float)) and math.isfinite(gb) and gb > 0):
        raise ValueError(f"memory offered must be a positive number of GB, got {gb!r}")
    capacity = capacity_in_layers(node.spec, int(gb * (1 << 30)), node.itemsize, node.quant)
    current = tuple(node.span) if node.span else None
    if node.config.layers is not None or node.state != SERVING or node.transport is None:
        span = current  # set_memory_offered only re-advertises: a forced span never moves
    else:  # the same choice set_memory_offered makes
        me = node.transport.peer_id
        view = node.keeper.snapshot().without([me])
        span = choose_span(view, me=me, capacity_layers=capacity, throughput=node.throughput, held=node.held_layers())
    return {"span": list(span) if span else None, "current": list(current) if current else None,
            "moves": span != current, "capacity": capacity}


def _starting_status(node: PeerNode) -> dict[str, Any]:
    """`PeerNode.status()`'s keys before the peer serves (its server and pinger do not exist yet)."""
    transport = node.transport
    coverage = node.coverage()
    return {
        "peer_id": transport.peer_id if transport else None,
        "name": node.config.name,
        "addrs": [],
        "model_id": node.model_id,
        "num_layers": node.spec.num_layers,
        "span": list(node.span) if node.span else None,
        "state": node.state,
        "throughput": node.throughput,
        "memory_offered": node.memory_bytes,
        "memory_used": node.stage.weight_bytes if node.stage else 0,
        "device": node.compute.device_name,
        "vram": node.device_memory(),
        "quant": node.quant.tag,
        "uptime": time.time() - node.started,
        "sessions": 0,
        "stats": {},
        "coverage": list(coverage.replicas),
        "gaps": [list(gap) for gap in coverage.gaps],
        "serving": coverage.serving,
        "neighbours": {},
        "held": [list(span) for span in node.held_layers()],
        "fetch": node.fetching(),
    }
