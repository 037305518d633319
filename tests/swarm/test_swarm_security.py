"""Who may join: Noise only, the private-swarm key, and signed advertisements."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

from tessera.peer.base.errors import PeerUnreachable
from tessera.peer.net.gossip import Gossip, ViewKeeper
from tessera.peer.net.libp2p import open_libp2p_transport
from tessera.peer.base.protocols import GOSSIP_PROTOCOL
from tessera.peer.net.transport import Channel
from tessera.protocol.codec import encode
from tessera.protocol.crypto import RECORD_CONTEXT, sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import GossipPush, PeerRecord, SignedRecord
from tessera.stages.weights import registry

from ..conftest import FRANCE
from ..swarm_helpers import local_swarm

pytestmark = pytest.mark.slow


async def test_a_plaintext_only_host_cannot_connect():
    key_pair = create_new_key_pair(os.urandom(32))
    plaintext = new_host(key_pair=key_pair, sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)})
    async with open_libp2p_transport(os.urandom(32)) as ours:
        async with plaintext.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            with pytest.raises(Exception):
                with trio.fail_after(15):
                    await plaintext.connect(info_from_p2p_addr(multiaddr.Multiaddr(ours.addrs()[0])))
            assert ours.connected() == []
            # and we refuse to dial it
            with pytest.raises(PeerUnreachable):
                await ours.connect(str(plaintext.get_addrs()[0]))


async def test_the_swarm_key_gates_joining():
    key, wrong = os.urandom(32), os.urandom(32)
    async with open_libp2p_transport(os.urandom(32), swarm_key=key) as member:
        async with open_libp2p_transport(os.urandom(32), swarm_key=key) as friend:
            assert await friend.connect(member.addrs()[0]) == member.peer_id
        async with open_libp2p_transport(os.urandom(32), swarm_key=wrong) as stranger:
            with pytest.raises(PeerUnreachable):
                await stranger.connect(member.addrs()[0])
        async with open_libp2p_transport(os.urandom(32)) as keyless:
            with pytest.raises(PeerUnreachable):
                await keyless.connect(member.addrs()[0])


def test_a_requester_without_the_swarm_key_gets_a_clear_error(smol_dir, tmp_path):
    key = os.urandom(32).hex()
    with local_swarm([(0, 30)], extra=["--swarm-key", key]) as peers:
        cmd = [sys.executable, "-m", "tessera.peer.cli.main", "generate", FRANCE, "--join", peers.addrs[0], "--json", "--threads", "1"]
        wrong = subprocess.run([*cmd, "--swarm-key", os.urandom(32).hex()], capture_output=True, text=True, timeout=120)
        # libp2p's own failure may come first, folded to one line; ours is the last and names the key
        last = wrong.stderr.strip().splitlines()[-1] if wrong.stderr.strip() else ""
        assert wrong.returncode != 0 and last.startswith("error: ") and "swarm key" in last, wrong.stderr
        assert "Traceback" not in wrong.stderr
        right = subprocess.run([*cmd, "--swarm-key", key], capture_output=True, text=True, timeout=120)
        assert right.returncode == 0, right.stderr
        assert '"The capital of France is Paris."' in right.stdout


def signed_by(identity: Identity, record: PeerRecord) -> SignedRecord:
    data = encode(record)
    return SignedRecord(record=data, public_key=identity.public_key, signature=identity.sign(RECORD_CONTEXT + data))


def forged_records(model_id: str) -> dict[str, SignedRecord]:
    now = time.time()
    honest, other = Identity.generate(), Identity.generate()

    def record(identity: Identity, **changes) -> PeerRecord:
        base = PeerRecord(
            peer_id=identity.peer_id, name="mallory", model_id=model_id, start=0, end=30, shard_index=0,
            shard_count=1, throughput=1e6, free_memory=0, load=0.0, max_sessions=16, state="serving",
            reachability="public", addrs=("/ip4/127.0.0.1/tcp/9/p2p/x",), neighbours=(), issued_at=now,
            expires_at=now + 60, seq=1,
        )
        return dataclasses.replace(base, **changes)

    good = sign_record(honest, record(honest))
    return {
        # claims another peer's id, signed with the forger's own key (sign_record refuses
        # to make such a thing, so it is put together by hand)
        "forged-id": signed_by(honest, record(honest, peer_id=other.peer_id)),
        # a valid record whose bytes were altered after signing
        "bad-signature": dataclasses.replace(good, record=good.record[:-1] + bytes([good.record[-1] ^ 1])),
        # correctly signed but already expired
        "expired": sign_record(other, record(other, issued_at=now - 120, expires_at=now - 60)),
    }


async def test_forged_advertisements_are_ignored(smol_dir):
    model_id = registry.model_id(smol_dir)
    with local_swarm([(0, 30)]) as peers:
        async with open_libp2p_transport(os.urandom(32)) as mallory:
            target = await mallory.connect(peers.addrs[0])
            # push the forgeries as a gossiping neighbour would
            channel = Channel(await mallory.open_stream(target, GOSSIP_PROTOCOL))
            await channel.send(GossipPush(tuple(forged_records(model_id).values())))
            while await channel.receive_or_none() is not None:
                pass
            # then ask, with an honest empty view, what the peer believes now
            observer = ViewKeeper(model_id=model_id, num_layers=30, clock=time.time)
            assert await Gossip(mallory, observer).exchange(target)
            names = {k.info.name for k in observer.known.values()}
            assert set(observer.known) == {target} and "mallory" not in names, names
