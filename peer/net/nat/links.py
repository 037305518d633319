"""Ask a peer how it is connected to its neighbours: direct, punched or relayed.

A signed record carries each neighbour's RTT but not how the link runs, and only the
two ends of a link know that. `tessera swarm status` asks every peer it reaches on
LINKS_PROTOCOL and shows the answers next to the peer's advertised reachability; a
peer answers from `NatService.links` (peer/net/nat/reachability.py), i.e. its own
`Transport.connection_kind` for each connected peer. Nothing here is trusted for
routing: it is for people looking at a swarm.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import trio
from libp2p.peer.id import ID

from tessera.protocol.codec import message
from tessera.protocol.errors import WireError
from tessera.protocol.framing import DEFAULT_MAX_FRAME
from tessera.protocol.records import MAX_NEIGHBOURS, MAX_PEER_ID_SIZE
from tessera.protocol.schema import wire

from tessera.peer.base.protocols import LINKS_PROTOCOL
from tessera.peer.base.errors import PeerError
from tessera.peer.net.transport import DIRECT, PUNCHED, RELAYED, Channel, Stream, Transport

log = logging.getLogger(__name__)

LINKS_TIMEOUT = 5.0  # one small request and answer on an existing connection (as gossip's exchange)
REQUEST_FRAME_LIMIT = 64  # the question is an empty LinkReport: 16 bytes encoded
KINDS = (DIRECT, PUNCHED, RELAYED)


@message("link")
@dataclass(frozen=True)
class Link:
    """One connection of the answering peer.

    Attributes:
        peer_id: the neighbour's libp2p peer id.
        kind: "direct", "punched" or "relayed".
    """

    peer_id: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    kind: str = wire(max_len=16)


@message("links")
@dataclass(frozen=True)
class LinkReport:
    """A peer's connections; an empty report is the question.

    Attributes:
        links: one entry per connected peer (at most MAX_NEIGHBOURS).
    """

    links: tuple[Link, ...] = wire(max_items=MAX_NEIGHBOURS)


def serve_links(transport: Transport, links: Callable[[], dict[str, str]]) -> None:
    """Answer LINKS_PROTOCOL with `links()` (peer id -> kind)."""

    async def handle(stream: Stream) -> None:
        ticket = transport.intake.enter(stream)  # a stranger's stream for the whole exchange (peer/net/intake.py)
        if ticket is None:
            await stream.reset()
            return
        with ticket:
            channel = Channel(stream, max_frame=REQUEST_FRAME_LIMIT, on_frame=ticket.charge, max_send=DEFAULT_MAX_FRAME)
            try:
                with trio.fail_after(LINKS_TIMEOUT):
                    if not isinstance(await channel.receive(), LinkReport):
                        raise WireError("expected an (empty) LinkReport")
                    entries = sorted(links().items())[:MAX_NEIGHBOURS]
                    await channel.send(LinkReport(tuple(Link(ID.from_base58(p).to_bytes(), k) for p, k in entries)))
                await channel.close()
            except (trio.TooSlowError, PeerError, WireError) as bad:
                log.debug("links request from %s failed: %s", stream.remote, bad)
                await channel.reset()
        if ticket.evicted:
            await stream.reset()

    transport.set_handler(LINKS_PROTOCOL, handle)


async def ask_links(transport: Transport, peer_id: str) -> dict[str, str] | None:
    """`peer_id`'s connections (peer id -> kind), or None if it did not answer."""
    try:
        with trio.fail_after(LINKS_TIMEOUT):
            channel = Channel(await transport.open_stream(peer_id, LINKS_PROTOCOL))
            await channel.send(LinkReport(()))
            report = await channel.receive()
            await channel.close()
    except (trio.TooSlowError, PeerError, WireError) as error:
        log.debug("links from %s: %s", peer_id, error)
        return None
    if not isinstance(report, LinkReport):
        return None
    return {ID(link.peer_id).to_base58(): link.kind for link in report.links if link.kind in KINDS}
