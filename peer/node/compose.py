"""The composition root of a real peer: libp2p + sqlite + torch, wired into a `PeerNode`.

    node = build_peer(PeerConfig(model="smollm2-135m", join=[addr]))
    await node.run()

Everything a volunteer's peer stands on is chosen here, and only here (`tessera peer`,
the TUI and the benches build their peers with it): the data dir (identity key, sqlite
store, trace; locked while the peer runs, peer/node/data_dir.py), the libp2p host (on
--listen, or every interface at port 4001 or a free one: peer/net/addresses.py; with
--emulate-link's pacing), the model's weights on this machine's device, the wall clock. The simulator gives the same `PeerNode`
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

from tessera.peer.net.addresses import default_listen
from tessera.peer.net.emulated import emulate
from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.net.libp2p import open_libp2p_transport
from tessera.peer.net.transport import Transport
from tessera.peer.node.config import PeerConfig
from tessera.peer.node.data_dir import DataDirLock
from tessera.peer.node.parts import NodeParts
from tessera.peer.node.peer_node import PeerNode
from tessera.peer.node.torch_compute import TorchCompute
from tessera.peer.weights.bootstrap import FolderWeights


@asynccontextmanager
async def open_host(config: PeerConfig, identity: Identity,
                    out: Callable[[str], None] = print) -> AsyncIterator[Transport]:
    """The peer's libp2p host on --listen (private with --swarm-key), with dedicated connections for
    the hot streams (--dedicated-port, --no-dedicated), frames paced by --emulate-link. Without
    --listen: every interface, port 4001 or (said on `out`) a free one."""
    listen, claim = config.listen, None
    if not listen:
        listen, note, claim = default_listen()
        if note:
            out(note)
    try:
        async with open_libp2p_transport(
            identity.seed, listen=listen, swarm_key=config.swarm_key,
            dedicated=config.dedicated, dedicated_port=config.dedicated_port,
        ) as real_transport, emulate(real_transport, config.emulate_link) as transport:
            yield transport
    finally:
        if claim is not None:
            claim.release()  # port 4001 is free for the next peer once this host has closed


def build_peer(config: PeerConfig, *, out: Callable[[str], None] | None = None) -> PeerNode:
    """A volunteer's peer for `config`. Raises ConfigError (e.g. a memory offer too small for
    one layer) before anything is created on disk, and DataDirInUse (a ConfigError) when
    another running peer holds the data dir — before its key or store is opened."""
    compute = TorchCompute(config, out=out)
    lock = DataDirLock.acquire(config.data_dir)  # held until the node stops (PeerNode.run)
    try:
        identity = Identity.from_seed(load_or_create_key(config.data_dir / "identity.key"))
        store = PeerStore(config.data_dir / "tessera.db")
    except BaseException:
        lock.release()
        raise
    node: PeerNode | None = None  # the node's own `out` says where the host listens (set below)
    parts = NodeParts(
        open_transport=lambda: open_host(config, identity, out=node.out),
        identity=identity,
        compute=compute,
        keeper=ViewKeeper(model_id=compute.model_id, num_layers=compute.spec.num_layers, clock=time.time),
        tracer=lambda peer_id: TraceWriter(store, peer=peer_id),
        store=store,
        clock=time.time,
        weights=FolderWeights(compute.folder, serve=config.serve_weights, upload_rate=config.weights_upload_rate,
                              check=compute.weight_check),
        data_dir_lock=lock,
    )
    node = PeerNode(config, parts, out=out)
    return node


__all__ = ["build_peer", "open_host"]
