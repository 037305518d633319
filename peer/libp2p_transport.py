"""The `Transport` over a real py-libp2p host: TCP, Noise only, yamux, optional private-swarm key.

py-libp2p's `new_host()` accepts plaintext connections unless told otherwise, so
we pass Noise as the only security transport: a plaintext-only host cannot
connect to us. A swarm key turns on libp2p's private-network protector (pnet): a
host with a different key cannot complete even the first handshake.

`ConnectionConfig(max_connections_per_peer=1)` matters for speed: py-libp2p 0.8.1
otherwise waits ~250 ms (a happy-eyeballs delay) on every connect; with it a
loopback connect takes ~6 ms (measured, see DEVELOPERS.md).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_pair
from libp2p.custom_types import TProtocol
from libp2p.host.basic_host import BasicHost
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from .errors import PeerUnreachable, StreamClosed
from .transport import DIRECT, RELAYED, Handler

# How long a dial may take before we call the peer unreachable. A loopback or LAN
# dial takes milliseconds; a relayed one a few hundred; 10 s is py-libp2p's own default.
DIAL_TIMEOUT = 10.0
# Stream opening = multistream-select negotiation on an existing connection (one RTT or two).
OPEN_STREAM_TIMEOUT = 10.0
READ_CHUNK = 1 << 16

# libp2p raises a family of exceptions for a dead stream or connection; all mean the same to us.
LIBP2P_IO_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError)
try:
    from libp2p.io.exceptions import IOException
    from libp2p.network.stream.exceptions import StreamError

    LIBP2P_IO_ERRORS += (IOException, StreamError)
except ImportError:  # pragma: no cover - layout of other py-libp2p versions
    pass


class Libp2pStream:
    """A py-libp2p stream behind our `Stream` interface (EOF -> b"", resets -> StreamClosed)."""

    def __init__(self, stream, remote: str) -> None:
        self._stream = stream
        self.remote = remote

    async def read(self, max_bytes: int) -> bytes:
        from libp2p.network.stream.exceptions import StreamEOF

        try:
            return await self._stream.read(max_bytes)
        except StreamEOF:
            return b""
        except LIBP2P_IO_ERRORS as error:
            raise StreamClosed(f"stream from {self.remote} failed: {type(error).__name__} {error}") from None

    async def write(self, data: bytes) -> None:
        try:
            await self._stream.write(data)
        except LIBP2P_IO_ERRORS as error:
            raise StreamClosed(f"stream to {self.remote} failed: {type(error).__name__} {error}") from None

    async def close(self) -> None:
        try:
            await self._stream.close()
        except LIBP2P_IO_ERRORS:
            pass  # already gone: closing is best effort by design

    async def reset(self) -> None:
        try:
            await self._stream.reset()
        except LIBP2P_IO_ERRORS:
            pass  # already gone


def swarm_key_hex(swarm_key: bytes | None) -> str | None:
    if swarm_key is None:
        return None
    if len(swarm_key) != 32:
        raise ValueError(f"a swarm key is 32 bytes, got {len(swarm_key)!r}")
    return swarm_key.hex()


def make_host(seed: bytes, *, swarm_key: bytes | None = None, noise_only: bool = True) -> BasicHost:
    """A py-libp2p host whose Ed25519 identity is `seed` (the same key as protocol.keys.Identity)."""
    key_pair = create_new_key_pair(seed)
    security = None
    if noise_only:
        security = {NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_x25519_pair().private_key)}
    return new_host(
        key_pair=key_pair,
        sec_opt=security,
        connection_config=ConnectionConfig(max_connections_per_peer=1),
        psk=swarm_key_hex(swarm_key),
    )


class Libp2pTransport:
    """`Transport` over one running py-libp2p host."""

    def __init__(self, host: BasicHost) -> None:
        self.host = host
        self.peer_id = host.get_id().to_base58()
        self.extra_addrs: list[str] = []  # e.g. relayed addresses added by peer/nat.py

    def addrs(self) -> list[str]:
        own = [str(a) for a in self.host.get_addrs()]
        return own + [a for a in self.extra_addrs if a not in own]

    def set_handler(self, protocol: str, handler: Handler) -> None:
        async def wrapped(stream) -> None:
            remote = stream.muxed_conn.peer_id.to_base58()
            await handler(Libp2pStream(stream, remote))

        self.host.set_stream_handler(TProtocol(protocol), wrapped)

    async def connect(self, addr: str) -> str:
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except (ValueError, multiaddr.exceptions.Error) as bad:
            raise PeerUnreachable(f"{addr!r} is not a /p2p/ multiaddr: {bad}") from None
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                await self.host.connect(info)
        except trio.TooSlowError:
            raise PeerUnreachable(f"dialling {addr} took over {DIAL_TIMEOUT} s") from None
        except Exception as error:  # py-libp2p raises many unrelated types for a failed dial
            raise PeerUnreachable(f"cannot dial {addr}: {type(error).__name__}: {error}") from None
        return info.peer_id.to_base58()

    async def open_stream(self, peer_id: str, protocol: str, *, addrs: Sequence[str] = ()) -> Libp2pStream:
        pid = ID.from_base58(peer_id)
        if addrs:
            self.host.get_peerstore().add_addrs(pid, [multiaddr.Multiaddr(a) for a in addrs], 3600)
        try:
            with trio.fail_after(OPEN_STREAM_TIMEOUT):
                stream = await self.host.new_stream(pid, [TProtocol(protocol)])
        except trio.TooSlowError:
            raise PeerUnreachable(f"opening {protocol} to {peer_id} took over {OPEN_STREAM_TIMEOUT} s") from None
        except Exception as error:  # dial, negotiation and protocol errors all mean "not reachable now"
            raise PeerUnreachable(f"cannot open {protocol} to {peer_id}: {type(error).__name__}: {error}") from None
        return Libp2pStream(stream, peer_id)

    def _connections(self, peer_id: str) -> list:
        network = self.host.get_network()
        conns = network.connections.get(ID.from_base58(peer_id))
        if conns is None:
            return []
        return conns if isinstance(conns, list) else [conns]

    def connected(self) -> list[str]:
        return sorted(pid.to_base58() for pid, conns in self.host.get_network().connections.items() if conns)

    def connection_kind(self, peer_id: str) -> str | None:
        conns = self._connections(peer_id)
        if not conns:
            return None
        return RELAYED if any(_is_relayed(c) for c in conns) else DIRECT

    async def disconnect(self, peer_id: str) -> None:
        try:
            await self.host.disconnect(ID.from_base58(peer_id))
        except LIBP2P_IO_ERRORS:
            pass  # already disconnected


def _is_relayed(conn) -> bool:
    try:
        addrs = conn.get_transport_addresses()
    except (AttributeError, NotImplementedError):
        return False
    return any("p2p-circuit" in str(a) for a in addrs)


@asynccontextmanager
async def open_libp2p_transport(
    seed: bytes,
    *,
    listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    swarm_key: bytes | None = None,
    noise_only: bool = True,
) -> AsyncIterator[Libp2pTransport]:
    """Run a host listening on `listen` for the duration of the block."""
    host = make_host(seed, swarm_key=swarm_key, noise_only=noise_only)
    async with host.run(listen_addrs=[multiaddr.Multiaddr(a) for a in listen]):
        yield Libp2pTransport(host)
