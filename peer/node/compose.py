"""The composition root of a real peer: libp2p + sqlite + torch, wired into a `PeerNode`.

    node = build_peer(PeerConfig(model="smollm2-135m", join=[addr]))
    await node.run()

Everything a volunteer's peer stands on is chosen here, and only here (`tessera peer`,
the TUI and the benches build their peers with it): the data dir (identity key, sqlite
store, trace), the libp2p host (with --emulate-link's pacing), the model's weights
on this machine's device, the wall clock. The simulator gives the same `PeerNode`
other parts (peer/sim/peer.py).
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from tessera.protocol.keys import Identity
from tessera.store.db import PeerStore
from tessera.store.keyfile import load_or_create_key
from tessera.store.trace import TraceWriter

from tessera.peer.net.emulated import emulate
from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.net.libp2p import open_libp2p_transport
from tessera.peer.net.transport import Transport
from tessera.peer.node.config import PeerConfig
from tessera.peer.node.parts import NodeParts
from tessera.peer.node.peer_node import PeerNode
from tessera.peer.node.torch_compute import TorchCompute
from tessera.peer.weights.bootstrap import FolderWeights


@asynccontextmanager
async def open_host(config: PeerConfig, identity: Identity) -> AsyncIterator[Transport]:
    """The peer's libp2p host on --listen (private with --swarm-key), with dedicated connections for
    the hot streams (--dedicated-port, --no-dedicated), frames paced by --emulate-link."""
    async with open_libp2p_transport(
        identity.seed, listen=config.listen, swarm_key=config.swarm_key,
        dedicated=config.dedicated, dedicated_port=config.dedicated_port,
    ) as real_transport, emulate(real_transport, config.emulate_link) as transport:
        yield transport


def build_peer(config: PeerConfig, *, out: Callable[[str], None] | None = None) -> PeerNode:
    """A volunteer's peer for `config`. Raises ConfigError (e.g. a memory offer too small for
    one layer) before anything is created on disk."""
    compute = TorchCompute(config)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    identity = Identity.from_seed(load_or_create_key(config.data_dir / "identity.key"))
    store = PeerStore(config.data_dir / "tessera.db")
    parts = NodeParts(
        open_transport=lambda: open_host(config, identity),
        identity=identity,
        compute=compute,
        keeper=ViewKeeper(model_id=compute.model_id, num_layers=compute.spec.num_layers, clock=time.time),
        tracer=lambda peer_id: TraceWriter(store, peer=peer_id),
        store=store,
        clock=time.time,
        weights=FolderWeights(compute.folder, serve=config.serve_weights, upload_rate=config.weights_upload_rate,
                              check=compute.weight_check),
    )
    return PeerNode(config, parts, out=out)


__all__ = ["build_peer", "open_host"]
