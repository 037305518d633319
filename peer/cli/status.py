"""`tessera swarm status`: every peer of a swarm and the coverage of every layer."""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Sequence

import trio

from tessera.protocol.keys import Identity
from tessera.stages.weights import registry
from tessera.stages.families.catalog import spec_from_file
from tessera.stages.kernels.quant import base_model_id

from tessera.peer.base.errors import PeerError, PeerUnreachable
from tessera.peer.net.join import why_unreachable
from tessera.peer.net.other_model import other_model_reason, registered_models
from tessera.peer.net.gossip import Gossip, ViewKeeper
from tessera.peer.net.libp2p import open_libp2p_transport
from tessera.peer.net.nat.links import ask_links
from tessera.peer.plan.coverage import swarm_coverage
from tessera.peer.plan.groups import group_report, replica_coverage
from tessera.peer.plan.routing import unusable_reason

SETTLE = 1.5  # seconds to let a second gossip round bring in peers the first one named


async def gather_status(join: Sequence[str], *, model: str, swarm_key: bytes | None = None,
                        only: bool = False) -> dict:
    """Join briefly as an observer, collect the view, and return it as plain data.

    `only`: report exactly what the --join peers hold (no settling, no asking the peers they
    name): how to see whether one peer's view has split from the others'."""
    folder = registry.resolve(model)
    spec = spec_from_file(folder / "config.json")
    # every quantization of the model (each peer's model id says which it serves)
    keeper = ViewKeeper(model_id=registry.model_id(folder), num_layers=spec.num_layers, clock=time.time,
                        accept_mixed=True)
    identity = Identity.generate()
    async with open_libp2p_transport(identity.seed, swarm_key=swarm_key) as transport:
        gossip = Gossip(transport, keeper)
        failed: list[str] = []
        for addr in join:
            try:
                await gossip.exchange(await transport.connect(addr), whole_from_it=only)
            except PeerUnreachable:  # said as a peer's join says it (peer/net/join.py)
                failed.append(f"cannot join {addr}: {await why_unreachable(addr, swarm_key is not None)}")
            except PeerError as error:
                failed.append(f"cannot join {addr}: {error}")
        if len(failed) == len(join):
            raise PeerError("; ".join(failed))
        for line in failed:
            print(f"warning: {line}", file=sys.stderr)
        if not only:
            await trio.sleep(SETTLE)
        for info in ([] if only else keeper.snapshot().peers):
            if info.peer_id not in transport.connected() and info.addrs:
                with trio.move_on_after(2.0):
                    try:
                        await gossip.exchange(await transport.connect(info.addrs[0]))
                    except PeerError:
                        pass  # listed but unreachable from here; shown as such
        view = keeper.snapshot()
        kinds = {p.peer_id: transport.connection_kind(p.peer_id) for p in view.peers}
        links = {p.peer_id: await ask_links(transport, p.peer_id) for p in view.peers if kinds[p.peer_id]}
        links = {p: {q: k for q, k in (found or {}).items() if q != transport.peer_id} for p, found in links.items()}
    now = time.time()
    coverage = swarm_coverage(view)  # the TUI's and routing's definition (peer/plan/coverage.py)
    # peers heard of that serve another model (kept out of the view): which, and what --model to pass
    others = Counter(keeper.foreign_models.values())
    return {
        "model": folder.name,  # its registered name (or a folder's own name)
        "model_id": keeper.model_id,
        "other_models": [{"model_id": m, "peers": n, "registered_as": registered_models().get(base_model_id(m))}
                         for m, n in others.most_common()],
        "other_model": (other_model_reason(keeper.foreign_models.values(), keeper.model_id, folder.name)
                        if others and not view.peers else None),
        "num_layers": spec.num_layers,
        "peers": [
            {
                "peer_id": p.peer_id, "name": p.name, "span": [p.start, p.end],
                "shard": [p.shard_index, p.shard_count], "state": p.state,
                "free_memory": p.free_memory, "throughput": round(p.throughput, 2), "load": round(p.load, 3),
                "reachability": p.reachability, "connection": kinds.get(p.peer_id),
                "last_seen_s": round(max(0.0, now - p.issued_at), 1), "addrs": list(p.addrs),
                "neighbours": {k: round(v, 2) for k, v in p.rtt_ms.items()},
                "links": links.get(p.peer_id) or {},  # its own connections: peer id -> direct/punched/relayed
                # why a requester would not open a session here now (routing.unusable_reason); None: it would
                "not_routable": unusable_reason(p),
            }
            for p in view.peers
        ],
        # what routing can use: per layer, the peers that accept sessions (a complete shard group
        # once); a draining, paused, leaving, loading or full peer is listed, but not counted
        "coverage": list(coverage.replicas),
        "gaps": [list(gap) for gap in coverage.gaps],
        "claimed": list(coverage.claimed),  # every claim but a leaving peer's, as before
        "groups": group_report(view),  # tensor-shard groups: span, size, who holds each rank
        "replicas": replica_coverage(view),  # per layer: unsharded peers + complete groups
    }


def format_status(report: dict) -> str:
    n = len(report["peers"])
    named = f"{report['model']} ({report['model_id'][:16]}…)" if report.get("model") else f"{report['model_id'][:16]}…"
    lines = [f"model {named}  {report['num_layers']} layers  {n} peer{'' if n == 1 else 's'}", ""]
    if report.get("other_model"):  # nothing of ours to show: say what the swarm serves instead
        return "\n".join([lines[0], f"{report['other_model']}"])
    # reach: how the peer says others reach it (public / hole-punched / relayed / private, see
    # peer/net/nat/reachability.py); link: this observer's own connection to it (direct / punched / relayed).
    header = (f"{'peer':<14}{'name':<12}{'span':<10}{'state':<10}{'free':>9}{'tok/s·layer':>13}{'load':>6}  "
              f"{'reach':<13}{'link':<9}{'seen':>6}")
    lines.append(header)
    for p in report["peers"]:
        span = f"[{p['span'][0]},{p['span'][1]})"
        if p["shard"][1] > 1:
            span += f"#{p['shard'][0]}/{p['shard'][1]}"
        lines.append(
            f"{'…' + p['peer_id'][-12:]:<14}{p['name'][:11]:<12}{span:<10}{p['state']:<10}"
            f"{p['free_memory'] / 2**30:>8.1f}G{p['throughput']:>13.1f}{p['load']:>6.2f}  "
            f"{p['reachability']:<13}{p['connection'] or '-':<9}{p['last_seen_s']:>5.0f}s"
        )
    names = {p["peer_id"]: p["name"] or "…" + p["peer_id"][-8:] for p in report["peers"]}
    linked = [p for p in report["peers"] if p.get("links")]
    if linked:
        lines += ["", "links (as each peer sees its connections):"]
        for p in linked:
            others = ", ".join(f"{names.get(q, '…' + q[-8:])} {kind}" for q, kind in sorted(p["links"].items()))
            lines.append(f"  {names[p['peer_id']]}: {others}")
    lines += ["", "coverage (peers taking sessions, per layer):", "  " + " ".join(str(c) for c in report["coverage"])]
    aside = [p for p in report["peers"] if p.get("not_routable")]
    if aside:
        lines.append("not taking sessions (not counted): " + ", ".join(
            f"{names[p['peer_id']]} [{p['span'][0]},{p['span'][1]}) {p['not_routable']}" for p in aside))
    if report.get("groups"):
        lines += ["", "shard groups:"]
        for g in report["groups"]:
            ranks = ", ".join(names.get(r, "…" + r[-8:]) if r else f"rank {i} MISSING" for i, r in enumerate(g["ranks"]))
            state = "complete" if g["complete"] else "INCOMPLETE (cannot serve)"
            lines.append(f"  {g['group']} [{g['span'][0]},{g['span'][1]}) {g['count']} ranks, {state}: {ranks}")
        lines.append("replicas per layer (a complete group counts once):")
        lines.append("  " + " ".join(str(c) for c in report["replicas"]))
    gaps = report["gaps"]
    lines.append("gaps: " + (", ".join(f"[{a},{b}) UNCOVERED" for a, b in gaps) if gaps else "none — every layer is served"))
    return "\n".join(lines)
