"""A membership-only peer process for tests: a real libp2p host, a signed record, the real gossip.

    python -m tests.swarm.gossip_member --index 3 --join /ip4/127.0.0.1/tcp/4001/p2p/12D3... --out state.jsonl

No model: the record claims layers it does not serve, and nothing asks it to. It prints
its address on stdout, then appends one JSON line to --out every --every seconds: its
connections (how many in all, how many its membership holds, the peers of the others), its
neighbours, how many records it holds and the hash of its set (peers holding the same set
have the same hash). The gossip periods come from the environment
as for a real peer (TESSERA_GOSSIP_INTERVAL, TESSERA_GOSSIP_OUTBOUND, ...).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import trio

from tessera.peer.net.gossip import Gossip, ViewKeeper
from tessera.peer.net.libp2p import open_libp2p_transport
from tessera.protocol.crypto import sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import PeerRecord

MODEL = "gossip-member-test"


async def main(args: argparse.Namespace) -> None:
    identity = Identity.from_seed(bytes([args.index % 256]) * 32)
    async with open_libp2p_transport(identity.seed, relay=False, dedicated=False) as transport:
        keeper = ViewKeeper(model_id=MODEL, num_layers=30, clock=time.time)
        now = time.time()
        start = (3 * args.index) % 30
        record = sign_record(identity, PeerRecord(
            peer_id=identity.peer_id, name=f"m{args.index}", model_id=MODEL, start=start, end=min(30, start + 6),
            shard_index=0, shard_count=1, throughput=100.0, free_memory=0, load=0.0, max_sessions=16,
            state="serving", reachability="public", addrs=tuple(transport.addrs()[:4]), neighbours=(),
            issued_at=now, expires_at=now + 3600.0, seq=int(now * 1000)))
        keeper.merge([record])
        gossip = Gossip(transport, keeper, own_record=lambda: record, rng=random.Random(args.index))
        print(transport.addrs()[0], flush=True)
        if args.join:
            keeper.remember(args.join)
            await gossip.exchange(await transport.connect(args.join))
            await gossip.settle_join()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gossip.run)
            with open(args.out, "a") as out:
                while True:
                    root = keeper.root
                    connected = set(transport.connected())
                    member = gossip.membership
                    # held: connections this peer's membership keeps (its neighbours, what it dialled
                    # and has not closed, asks and probes running); the rest another peer opened
                    # and is about to close (an ask we refused, a link it dropped)
                    held = connected & (member.outbound.keys() | member.inbound.keys() | member.opened.keys()
                                        | member.pending)
                    out.write(json.dumps({
                        "t": time.time(), "peer": transport.peer_id, "connections": len(connected),
                        "held": len(held), "others": sorted(connected - held),
                        "neighbours": len(member.neighbours()), "records": len(keeper.live()),
                        "hash": root.hash.hex() if root is not None else "", "bytes_sent": gossip.bytes_sent,
                    }) + "\n")
                    out.flush()
                    await trio.sleep(args.every)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--join", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--every", type=float, default=0.25)
    try:
        trio.run(main, parser.parse_args())
    except KeyboardInterrupt:
        sys.exit(0)
