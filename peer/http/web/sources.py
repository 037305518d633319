"""Where the web view's facts come from: a gateway's requester, or a peer itself.

Both read the same kind of swarm view — the verified advertisements their node keeps
(`ViewKeeper.snapshot`) — and add what only they know:

- `GatewaySource` (`tessera serve`): its own RTTs and connections to each peer, the
  answers it is running through each, and the tokens its answers had through each
  (credited when an answer ends: `credit`). It has a chat endpoint.
- `NodeSource` (`tessera peer --web`): the peer's own truth — its sessions, its trace's
  recent events, tokens served, memory offered and used — and its view of the others.

Everything here runs on the trio loop of the node it reads; nothing blocks it but the
sqlite read of recent events, which goes to a worker thread (`in_worker`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.kernels.quant import Quant, QuantError, span_bytes
from tessera.store.db import PeerStore
from tessera.store.events import NOTABLE_KINDS, Stamped

from tessera.peer.base.threads import in_worker
from tessera.peer.plan.view import PeerInfo, SwarmView
from tessera.peer.http.web.report import quant_of

if TYPE_CHECKING:
    from tessera.peer.http.api import Gateway
    from tessera.peer.node.peer_node import PeerNode

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}  # bytes per weight element, by advertised dtype
# A page's recent events leave out the routine kinds (store/events.py ROUTINE_KINDS), as the TUI's log does.
RECENT_EVENTS = 50  # a peer's events a page shows


def weights_estimate(spec: ModelSpec, p: PeerInfo) -> int:
    """Bytes the weights of `p`'s span take, from the model's shapes, its dtype and quantization
    (a record says what a peer still offers, not what it uses), each layer at its own bytes (a
    sparse layer holds all its experts); a tensor-shard rank holds 1/n."""
    try:
        quant = Quant.parse(quant_of(p.model_id))
    except QuantError:
        return 0
    start, end = max(0, p.start), min(p.end, spec.num_layers)
    return span_bytes(spec, start, max(start, end), ITEMSIZE.get(p.dtype, 4), quant) // max(1, p.shard_count)


class GatewaySource:
    """The web view of `tessera serve` (see the module docstring)."""

    role = "gateway"
    chat = True

    def __init__(self, gateway: "Gateway") -> None:
        self.gateway = gateway
        self.swarm = gateway.swarm
        self.model = gateway.name
        self.model_id = self.swarm.model_id
        self.spec = self.swarm.spec
        self.tokens: dict[str, int] = {}  # peer id -> tokens of this gateway's answers through it

    @property
    def me(self) -> str:
        return self.swarm.peer_id

    def view(self) -> SwarmView:
        return self.swarm.keeper.snapshot()

    def rtt_ms(self) -> Mapping[str, float]:
        return self.swarm.pinger.rtt_ms

    def link_of(self, peer_id: str) -> str | None:
        return self.swarm.transport.connection_kind(peer_id)

    def token_counts(self, view: SwarmView) -> Mapping[str, int]:
        # every peer in view from 0, so that the first answer through one shows as a rate
        return {**{p.peer_id: 0 for p in view.peers}, **self.tokens}

    def credit(self, summary: dict) -> list[str]:
        """An answer ended: every position it computed (prompt and answer) went through each hop of
        its last route. Returns those peers."""
        positions = summary["prompt_tokens"] + summary["completion_tokens"]
        peers = sorted({hop["peer"] for hop in summary["route"]})
        for peer in peers:
            self.tokens[peer] = self.tokens.get(peer, 0) + positions
        return peers

    def forget(self, keep: set[str]) -> None:
        """Drop the counters of peers not in `keep` (gone for long)."""
        for peer in [p for p in self.tokens if p not in keep]:
            del self.tokens[peer]

    def sessions_of(self, peer_id: str) -> list[dict]:
        """This gateway's answers running through `peer_id` now."""
        return [
            {"id": f"{id(s) & 0xFFFFFF:06x}", "positions": s.confirmed, "failovers": s.failovers,
             "route": s.routes[-1].summary() if s.routes else []}
            for s in sorted(self.swarm.active, key=id) if s.uses(peer_id)
        ]

    def local_status(self) -> None:
        return None  # a gateway serves no layers

    async def recent_events(self) -> list[dict]:
        return []  # a gateway's own trace is not kept; the watch's changes say what it saw

    def close(self) -> None:
        pass


class NodeSource:
    """The web view of one peer, `tessera peer --web` (see the module docstring)."""

    role = "peer"
    chat = False

    def __init__(self, node: "PeerNode") -> None:
        self.node = node
        self.model = str(node.config.model)
        self.model_id = node.model_id
        self.spec = node.spec
        self._reader: PeerStore | None = None  # a read-only connection of its own (sqlite reads in workers)

    @property
    def me(self) -> str:
        return self.node.transport.peer_id if self.node.transport is not None else ""

    def view(self) -> SwarmView:
        return self.node.keeper.snapshot()

    def rtt_ms(self) -> Mapping[str, float]:
        return self.node.pinger.rtt_ms if self.node.pinger is not None else {}

    def link_of(self, peer_id: str) -> str | None:
        node = self.node
        if node.transport is None:
            return None
        if peer_id == self.me:
            return "self"
        nat = node.nat.links if node.nat is not None else {}  # knows "punched" from "direct"
        return nat.get(peer_id) or node.transport.connection_kind(peer_id)

    def token_counts(self, view: SwarmView) -> Mapping[str, int]:
        server = self.node.server
        return {self.me: server.stats.tokens} if server is not None and self.me else {}

    def sessions_of(self, peer_id: str) -> list[dict]:
        server = self.node.server
        if peer_id != self.me or server is None:
            return []
        now = server.admission.clock()  # the clock `last_active` is read on (trio's, not time.monotonic)
        return [
            {"id": s.short_id, "requester": s.requester, "span": [s.start, s.end], "steps": s.steps,
             "tokens": s.tokens, "idle_s": round(max(0.0, now - s.last_active), 1)}
            for s in sorted(server.sessions.values(), key=lambda s: s.session_id)
        ]

    def local_status(self) -> dict:
        """What this peer says of itself (the keys of `PeerNode.status()` a page shows)."""
        node = self.node
        server = node.server
        return {
            "peer_id": self.me, "name": node.config.name, "state": str(node.state),
            "span": list(node.span) if node.span else None,
            "shard": list(node.config.shard), "group": node.config.group,
            "memory_offered": node.memory_bytes, "memory_used": node.stage.weight_bytes if node.stage else 0,
            "device": node.compute.device_name, "quant": node.quant.tag,
            "throughput": round(node.throughput, 2), "uptime": round(node.clock() - node.started, 1),
            "sessions": len(server.sessions) if server else 0, "max_sessions": node.config.max_sessions,
            "stats": dict(vars(server.stats)) if server else {},
            "accepting": bool(server and server.accepting),
            "paused": bool(server is not None and not server.running.is_set()),
            "addrs": node.transport.addrs() if node.transport else [],
        }

    async def recent_events(self) -> list[dict]:
        store = self.node.store
        if store is None:
            return []
        if self._reader is None:
            path = store.path
            self._reader = await in_worker(lambda: PeerStore(path, readonly=True))
        reader = self._reader
        rows = await in_worker(lambda: reader.recent_events(kinds=NOTABLE_KINDS, limit=RECENT_EVENTS))
        return [event_dict(row) for row in rows]

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def event_dict(row: Stamped) -> dict:
    """A trace row as a page lists it: when, what kind, and its fields that are set."""
    event = row.event
    fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)} if dataclasses.is_dataclass(event) else {}
    fields = {k: v for k, v in fields.items() if v is not None}
    return {"id": row.id, "at": row.wall, "kind": event.kind, "fields": _plain(fields)}


def _plain(value):
    """JSON-ready: tuples as lists, bytes as hex."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
