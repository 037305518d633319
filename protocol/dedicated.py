"""Messages of dedicated connections: where a peer takes them, and which protocol one carries.

A peer's hot streams (sessions and links: one frame per decode step each) can skip
py-libp2p's stream muxer. The dialler opens a TCP connection of its own to the peer's
dedicated port, secures it with libp2p's Noise handshake (the same identities as the
libp2p connection: both ends know whom they talk to), and names the one protocol the
connection carries; from then on it is that protocol's stream (peer/net/dedicated/):

    dialler                                        peer
      | -- libp2p stream /tessera/dedicated/1.0.0 ->  |
      | <- DedicatedEndpoint(port, hosts) ----------  |   asked once per peer
      |                                            |
      | == TCP to host:port, [pnet], Noise XX ==   |   a new connection per stream
      | -- DedicatedOpen(protocol) ---------------->  |
      | <- DedicatedAccept(protocol) / ErrorMsg ----  |
      | ... the protocol's frames, as on a libp2p stream
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.protocol.codec import message
from tessera.protocol.schema import wire

MAX_HOSTS = 16
"""Interface addresses a peer lists (a machine with more names the first sixteen)."""

MAX_HOST_LEN = 64
"""An IPv4 or IPv6 address in text fits in 45 characters."""

MAX_PROTOCOL_LEN = 128
"""Protocol ids are short paths such as /tessera/session/1.0.0."""


@message("dedicated-endpoint")
@dataclass(frozen=True)
class DedicatedEndpoint:
    """Peer -> dialler: where this peer takes dedicated connections.

    Attributes:
        port: the TCP port of its dedicated listener.
        hosts: the addresses the listener is bound to (every interface address when it
            listens on all of them). A dialler uses the port only at the address its
            libp2p connection reaches the peer on, and only if that address is listed:
            an address not listed was translated by a NAT on the way, whose mapping
            covers the libp2p port and not this one.
    """

    port: int = wire(min=1, max=65535)
    hosts: tuple[str, ...] = wire(max_items=MAX_HOSTS, max_len=MAX_HOST_LEN)


@message("dedicated-open")
@dataclass(frozen=True)
class DedicatedOpen:
    """Dialler -> peer, the first frame after the handshake: the protocol this connection carries.

    Attributes:
        protocol: a protocol id the peer serves over dedicated connections.
    """

    protocol: str = wire(max_len=MAX_PROTOCOL_LEN)


@message("dedicated-accept")
@dataclass(frozen=True)
class DedicatedAccept:
    """Peer -> dialler: the connection now carries `protocol` (a refusal is an ErrorMsg).

    Attributes:
        protocol: the protocol accepted, repeated.
    """

    protocol: str = wire(max_len=MAX_PROTOCOL_LEN)
