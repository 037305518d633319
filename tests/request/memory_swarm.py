"""A requester and real StageServers on the in-memory transport, for recovery tests under MockClock.

The model is a tiny seeded one (stages/weights/synth.py) whose embedding and head are scaled up so
that greedy choices have wide margins: a replayed cache (one prefill-shaped step instead
of the original token-by-token steps) rounds differently in the last bits, and the answer
must not hinge on that. Compute runs inline (no worker threads): under trio's MockClock a
thread would let the clock jump past every deadline while it computes.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import trio
from libp2p.peer.id import ID
from safetensors.torch import load_file, save_file

from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.net.pinger import Pinger
from tessera.peer.request.client import Swarm
from tessera.peer.request.verify import DEFAULT_SPOT_CHECKS
from tessera.peer.serve.server import StageServer
from tessera.peer.serve.shard_server import ShardServer
from tessera.protocol.crypto import sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import PeerRecord
from tessera.stages.weights import registry
from tessera.stages.shards.sharded import ShardedStage
from tessera.stages.assembly.stage import load_stage
from tessera.stages.weights.synth import synth_spec, write_synth
from tessera.store.trace import MemoryTracer

LAYERS = 4
LATENCY = 0.005  # s, one way: a LAN; every wait is on the MockClock, so the figure only orders events
RECORD_LIFETIME = 3600.0  # s of wall time (the keeper's clock): longer than any test


def decisive_model(out: Path) -> Path:
    """A 4-layer model (hidden 64) with wide greedy margins (see module docstring)."""
    spec = synth_spec(hidden=64, layers=LAYERS, heads=4, kv_heads=2, intermediate=128, vocab=300)
    write_synth(spec, out, seed=7)
    state = load_file(str(out / "model.safetensors"))
    state["model.embed_tokens.weight"] *= 50.0
    state["lm_head.weight"] *= 25.0
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    registry.write_manifest(out)
    return out


@dataclass(frozen=True)
class PeerPlan:
    """A serving peer: its name, its span, and the throughput it advertises (routing prefers the
    fastest); with `ranks` > 1, rank `rank` of the tensor-shard group `group` over the span."""

    name: str
    start: int
    end: int
    throughput: float
    group: str = ""
    rank: int = 0
    ranks: int = 1


async def inline(fn):
    return fn()


def peer_id(identity: Identity) -> str:
    return ID(identity.peer_id).to_base58()


@dataclass
class MemorySwarm:
    network: MemoryNetwork
    swarm: Swarm
    ids: dict[str, str]  # name -> peer id
    servers: dict[str, StageServer]
    tracer: MemoryTracer
    records: dict[str, object]  # name -> its signed record

    def advertise(self, name: str) -> None:
        """The requester's view learns of `name` (held back at the start)."""
        self.swarm.keeper.merge([self.records[name]])

    def name(self, peer: str) -> str:
        return next(n for n, p in self.ids.items() if p == peer)


async def memory_swarm(stack: AsyncExitStack, folder: Path, plans: list[PeerPlan], *,
                       held_back: tuple[str, ...] = ()) -> MemorySwarm:
    """Every peer of `plans` on one in-memory network running the real StageServer, and a
    requester (`Swarm`) whose view holds their signed records (but those `held_back`)."""
    network = MemoryNetwork(LinkSpec(latency=LATENCY, bandwidth=1e9))
    model_id = registry.model_id(folder)
    records, ids, servers = {}, {}, {}
    for i, plan in enumerate(plans):
        identity = Identity.from_seed(bytes([i + 1]) * 32)
        pid = peer_id(identity)
        transport = await stack.enter_async_context(open_memory_transport(network, pid))
        if plan.ranks > 1:
            # a rank's compute joins network collectives from its worker thread (peer/serve/shard_links.py),
            # so it keeps its threads: a test with groups runs on the real clock
            stage = ShardedStage.load(folder, start=plan.start, end=plan.end, index=plan.rank, count=plan.ranks)
            server = ShardServer(transport, identity, stage, group=plan.group)
        else:
            server = StageServer(transport, identity, load_stage(folder, start=plan.start, end=plan.end))
            server.run_compute = inline
        Pinger(transport, load=server.load_report)  # a peer answers pings with its load, as a PeerNode does
        now = time.time()
        records[plan.name] = (sign_record(identity, PeerRecord(
            peer_id=identity.peer_id, name=plan.name, model_id=model_id, start=plan.start, end=plan.end,
            shard_index=plan.rank, shard_count=plan.ranks, shard_group=plan.group, throughput=plan.throughput, free_memory=0, load=0.0, max_sessions=64,
            state="serving", reachability="public", addrs=tuple(transport.addrs()), neighbours=(), issued_at=now,
            expires_at=now + RECORD_LIFETIME, seq=1,
        )))
        ids[plan.name], servers[plan.name] = pid, server
    me = Identity.generate()
    transport = await stack.enter_async_context(open_memory_transport(network, peer_id(me)))
    nursery = await stack.enter_async_context(trio.open_nursery())
    stack.callback(nursery.cancel_scope.cancel)  # runs first on exit: background closes may still wait
    tracer = MemoryTracer(peer="requester")
    # routes spread by a seeded draw (peer/plan/cost.py Spread), and the default spot checks drawn
    # from a seeded stream: the same in every run (an unseeded check, 1 step in 20, opened a shadow
    # session on another peer now and then, and a test counting the requester's sessions failed
    # about one run in eight)
    swarm = Swarm(transport, nursery, folder=folder, identity=me, tracer=tracer, route_seed=1,
                  spot_check=replace(DEFAULT_SPOT_CHECKS, seed=1))
    swarm.keeper.merge([record for name, record in records.items() if name not in held_back])

    async def embed(tokens):
        return swarm.head.embed(list(tokens))

    async def logits(hidden):
        return swarm.head.logits(hidden)

    swarm._embed, swarm._logits = embed, logits  # inline, as the servers compute
    return MemorySwarm(network, swarm, ids, servers, tracer, records)


def crash_at_first_compute(world: MemorySwarm, name: str) -> None:
    """`name` dies as it starts its first computation (for a replacement: the replay that
    rebuilds its cache), as a process killed mid-step would."""
    server = world.servers[name]

    async def compute(fn):
        world.network.crash(world.ids[name])
        return fn()

    server.run_compute = compute
