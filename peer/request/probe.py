"""A cheap liveness check of a banned peer: one ping on the ping protocol every peer serves.

Used while a requester waits for a route and a peer it banned after a drop or a timeout
covers what is missing (peer/base/backoff.py: a ban does not outlast a comeback). A ping
is a stream and one round trip; it dials the peer's advertised addresses if the old
connection died with the old process (a restarted peer listens on a new port).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import trio

from tessera.protocol.errors import WireError
from tessera.protocol.records import Heartbeat

from tessera.peer.base.backoff import PROBE_TIMEOUT
from tessera.peer.base.errors import PeerError
from tessera.peer.base.protocols import PING_PROTOCOL
from tessera.peer.net.transport import Channel, Transport

_seq = itertools.count(1)


async def answers(transport: Transport, peer: str, *, addrs: Sequence[str] = (),
                  timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether `peer` echoes a heartbeat within `timeout` seconds."""
    seq = next(_seq)
    try:
        with trio.fail_after(timeout):
            channel = Channel(await transport.open_stream(peer, PING_PROTOCOL, addrs=addrs))
            await channel.send(Heartbeat(seq, 0.0))
            reply = await channel.receive()
            await channel.close()
    except (trio.TooSlowError, PeerError, WireError):
        return False
    return isinstance(reply, Heartbeat) and reply.seq == seq


__all__ = ["answers"]
