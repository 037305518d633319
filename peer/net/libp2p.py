"""The `Transport` over a real py-libp2p host: TCP, Noise only, yamux, optional private-swarm key.

py-libp2p's `new_host()` accepts plaintext connections unless told otherwise, so
we pass Noise as the only security transport: a plaintext-only host cannot
connect to us. A swarm key turns on libp2p's private-network protector (pnet): a
host with a different key cannot complete even the first handshake.

`ConnectionConfig(max_connections_per_peer=1)` matters for speed: py-libp2p 0.8.1
otherwise waits ~250 ms (a happy-eyeballs delay) on every connect; with it a
loopback connect takes ~6 ms (measured, see DEVELOPERS.md).

Behind NAT (see `peer/net/nat/reachability.py` for the policy, `peer/net/nat/relay.py` for the services):
every host also runs circuit relay v2 (STOP; HOP once found public) and DCUtR.
`connect`/`open_stream` dial direct addresses and `<relay>/p2p-circuit/p2p/<peer>`
addresses in one race: direct ones first, each with a short timeout (an address
that cannot work — another network's private range — is dropped silently and would
otherwise hold the dial for py-libp2p's 10 s), relayed ones after a head start.
`connection_kind` tells DIRECT, PUNCHED (a direct connection a DCUtR hole punch
made) and RELAYED apart. A host may listen on 0.0.0.0; `addrs()` then lists the
interface addresses, and the NAT policy may replace them (`advertised`).

The hot streams (a session's, a link's) skip yamux where they can: `open_stream` gives
them a dedicated connection of their own (peer/net/dedicated/) when the libp2p
connection is direct and the peer takes them, else a libp2p stream; `set_handler`
serves a hot protocol on both. `open_libp2p_stream` always opens a yamux stream.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import AsyncIterator, Callable, Sequence

import multiaddr
import psutil
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_pair
from libp2p.custom_types import TProtocol
from libp2p.host.basic_host import BasicHost
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from tessera.peer.base.errors import PeerUnreachable, StreamClosed
from tessera.peer.base.protocols import DEDICATED_PROTOCOL
from tessera.peer.net.dedicated.service import DedicatedStreams
from tessera.peer.net.intake import Intake
from tessera.peer.net.nat.relay import RelayStack, is_circuit_addr, is_relayed, run_relay_stack
from tessera.peer.net.transport import DIRECT, PUNCHED, RELAYED, Handler, Stream, run_handler

# How long a dial may take before we call the peer unreachable. A loopback or LAN
# dial takes milliseconds; a relayed one a few hundred; 10 s is py-libp2p's own default.
DIAL_TIMEOUT = 10.0
# Stream opening = multistream-select negotiation on an existing connection (one RTT or two).
OPEN_STREAM_TIMEOUT = 10.0
# One direct dial when the peer has other addresses to try: a TCP handshake that has
# not completed after two SYN retransmissions (1 s, then 2 s on Linux) is going nowhere
# — typically a private address of another network, whose packets are dropped.
DIRECT_DIAL_TIMEOUT = 4.0
# Head start of direct dials over relayed ones (happy eyeballs, RFC 8305 uses 250 ms
# between families; a relay costs more than a family switch, so a little longer).
RELAY_HEAD_START = 0.5
PEERSTORE_TTL = 3600  # seconds py-libp2p keeps an address we learned
# py-libp2p's yamux grants the sender credit after EVERY read by default (a WINDOW_UPDATE
# frame: one Noise encryption and one socket send per frame received). go-yamux grants
# it when half the receive window has been consumed; with release-on-read off py-libp2p
# does the same. Flow control is unchanged (the window still bounds what is in flight);
# on a decode chain it halves the socket sends per step (bench/hop_profile.py: the
# requester's went from ~12.8 to ~5.6 a token). Read by py-libp2p at call time; an
# operator's own PY_YAMUX_RELEASE_ON_READ wins.
YAMUX_RELEASE_ON_READ = ("PY_YAMUX_RELEASE_ON_READ", "0")
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

    via = "libp2p"

    def __init__(self, stream, remote: str) -> None:
        self._stream = stream
        self.remote = remote

    @property
    def remote_addr(self) -> str | None:
        """The remote end's observed `/ip4/A/tcp/P`, or None over a relay (the relay's is not theirs)."""
        muxed = getattr(self._stream, "muxed_conn", None)
        if muxed is None or is_relayed(muxed):
            return None
        try:
            remote = muxed.get_remote_address()
        except (AttributeError, NotImplementedError):
            return None
        if not remote:
            return None
        host, port = remote
        family = "ip6" if ":" in host else "ip4"
        return f"/{family}/{host}/tcp/{port}"

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
    """A py-libp2p host whose Ed25519 identity is `seed` (the same key as tessera.protocol.keys.Identity)."""
    os.environ.setdefault(*YAMUX_RELEASE_ON_READ)
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
    """`Transport` over one running py-libp2p host (with its relay stack, if started), and
    dedicated connections for the hot streams where they work (peer/net/dedicated/)."""

    def __init__(self, host: BasicHost, relay: RelayStack | None = None, *, swarm_key: bytes | None = None,
                 dedicated: DedicatedStreams | None = None) -> None:
        self.host = host
        self.relay = relay
        self.swarm_key = swarm_key
        self.dedicated = dedicated
        self.intake = Intake()  # streams not admitted yet, every protocol (peer/net/intake.py)
        if dedicated is not None:
            self.set_handler(DEDICATED_PROTOCOL, dedicated.serve_endpoint)
        self.peer_id = host.get_id().to_base58()
        self.extra_addrs: list[str] = []  # e.g. relayed addresses added by peer/net/nat/reachability.py
        # Set by the NAT policy (peer/net/nat/reachability.py): which addresses others can use. None: where we listen.
        self.advertised: Callable[[], list[str]] | None = None

    def set_advertised(self, advertised: Callable[[], list[str]] | None) -> None:
        """Let `addrs()` return what `advertised()` says (a method, so wrappers forward it)."""
        self.advertised = advertised

    def listen_addrs(self) -> list[str]:
        """Where we listen, wildcards expanded to interface addresses (full multiaddrs)."""
        out: list[str] = []
        for addr in self.host.get_transport_addrs():
            text = str(addr)
            if text.startswith("/ip4/0.0.0.0/"):
                rest = text[len("/ip4/0.0.0.0"):]
                out += [f"/ip4/{ip}{rest}" for ip in interface_ipv4s()]
            elif not is_circuit_addr(text):
                out.append(text)
        suffix = f"/p2p/{self.peer_id}"
        return [a if a.endswith(suffix) else a + suffix for a in dict.fromkeys(out)]

    def addrs(self) -> list[str]:
        own = self.advertised() if self.advertised is not None else self.listen_addrs()
        return own + [a for a in self.extra_addrs if a not in own]

    def open_probe(self) -> AbstractAsyncContextManager["Libp2pTransport"]:
        """A throwaway host (fresh identity, same swarm key) to dial someone afresh (dial-back)."""
        return open_libp2p_transport(os.urandom(32), listen=("/ip4/127.0.0.1/tcp/0",), swarm_key=self.swarm_key,
                                     relay=False, dedicated=False)

    def set_handler(self, protocol: str, handler: Handler) -> None:
        async def guarded(stream: Stream) -> None:  # py-libp2p would let a handler's failure end the whole host
            await run_handler(handler, stream, protocol=protocol)

        async def wrapped(stream) -> None:
            await guarded(Libp2pStream(stream, stream.muxed_conn.peer_id.to_base58()))

        self.host.set_stream_handler(TProtocol(protocol), wrapped)
        if self.dedicated is not None:
            self.dedicated.set_handler(protocol, guarded)  # the hot protocols are served there too

    async def connect(self, addr: str) -> str:
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except (ValueError, multiaddr.exceptions.Error) as bad:
            raise PeerUnreachable(f"{addr!r} is not a /p2p/ multiaddr: {bad}") from None
        peer_id = info.peer_id.to_base58()
        await self.dial(peer_id, [addr])
        return peer_id

    async def dial(self, peer_id: str, addrs: Sequence[str]) -> None:
        """Connect to `peer_id` unless connected: direct addresses first, relayed ones after a head start.

        Raises PeerUnreachable when every address failed.
        """
        if self._connections(peer_id):
            return
        pid = ID.from_base58(peer_id)
        direct = [a for a in addrs if not is_circuit_addr(a)]
        circuits = [a for a in addrs if is_circuit_addr(a)] if self.relay is not None else []
        if not direct and not circuits:
            raise PeerUnreachable(f"no address to dial {peer_id} on (given {list(addrs)!r})")
        if direct:
            self.host.get_peerstore().add_addrs(pid, [multiaddr.Multiaddr(a) for a in direct], PEERSTORE_TTL)
        errors: list[str] = []
        direct_done = trio.Event()
        # Alone, a direct dial gets the whole DIAL_TIMEOUT; raced with a relay, a short one.
        direct_timeout = DIRECT_DIAL_TIMEOUT if circuits else DIAL_TIMEOUT

        async def attempt(addr: str, relayed: bool, cancel: trio.CancelScope) -> None:
            try:
                if relayed:
                    with trio.move_on_after(RELAY_HEAD_START):
                        await direct_done.wait()
                    await self.relay.dial(addr)
                else:
                    with trio.fail_after(direct_timeout):
                        await self.host.get_network().dial_addr(multiaddr.Multiaddr(addr), pid)
            except trio.TooSlowError:
                # A peer on another swarm key fails the handshake silently, so this reads the same
                errors.append(f"{addr}: no answer within {direct_timeout:g} s (down, or on a different swarm key)")
                return
            except Exception as error:  # py-libp2p raises many unrelated types for a failed dial
                errors.append(f"{addr}: {type(error).__name__}: {error}")
                return
            cancel.cancel()  # the first connection wins; the others are not needed

        async def direct_dials(cancel: trio.CancelScope) -> None:
            async with trio.open_nursery() as inner:
                for addr in direct:
                    inner.start_soon(attempt, addr, False, cancel)
            direct_done.set()

        with trio.move_on_after(DIAL_TIMEOUT + RELAY_HEAD_START) as deadline:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(direct_dials, nursery.cancel_scope)
                for addr in circuits:
                    nursery.start_soon(attempt, addr, True, nursery.cancel_scope)
        if self._connections(peer_id):
            return
        if deadline.cancelled_caught:
            errors.append(f"gave up after {DIAL_TIMEOUT + RELAY_HEAD_START} s")
        raise PeerUnreachable(f"cannot dial {peer_id}: " + "; ".join(errors or ["no usable address"]))

    async def open_stream(self, peer_id: str, protocol: str, *, addrs: Sequence[str] = ()) -> Stream:
        """A stream on a dedicated connection where one works (peer/net/dedicated/), else a libp2p stream."""
        await self._ensure_connected(peer_id, addrs)
        if self.dedicated is not None:
            stream = await self.dedicated.open(self, peer_id, protocol)
            if stream is not None:
                return stream
        return await self.open_libp2p_stream(peer_id, protocol)

    async def _ensure_connected(self, peer_id: str, addrs: Sequence[str]) -> None:
        if not self._connections(peer_id):
            known = list(addrs) or [str(a) for a in self._peerstore_addrs(ID.from_base58(peer_id))]
            await self.dial(peer_id, known)

    async def open_libp2p_stream(self, peer_id: str, protocol: str, *, addrs: Sequence[str] = ()) -> Libp2pStream:
        """A stream on the libp2p connection (muxed by yamux), dialling first if needed."""
        pid = ID.from_base58(peer_id)
        await self._ensure_connected(peer_id, addrs)
        try:
            with trio.fail_after(OPEN_STREAM_TIMEOUT):
                stream = await self.host.new_stream(pid, [TProtocol(protocol)])
        except trio.TooSlowError:
            raise PeerUnreachable(f"opening {protocol} to {peer_id} took over {OPEN_STREAM_TIMEOUT} s") from None
        except Exception as error:  # dial, negotiation and protocol errors all mean "not reachable now"
            raise PeerUnreachable(f"cannot open {protocol} to {peer_id}: {type(error).__name__}: {error}") from None
        return Libp2pStream(stream, peer_id)

    def _peerstore_addrs(self, pid: ID) -> list:
        try:
            return list(self.host.get_peerstore().addrs(pid))
        except Exception:  # PeerStoreError: nothing known about this peer
            return []

    def _connections(self, peer_id: str) -> list:
        network = self.host.get_network()
        conns = network.connections.get(ID.from_base58(peer_id))
        if not conns:
            return []
        conns = conns if isinstance(conns, list) else [conns]
        return [c for c in conns if not getattr(c, "is_closed", False)]

    def remote_host(self, peer_id: str) -> str | None:
        """The IP our direct (not relayed) libp2p connection to `peer_id` reaches it at."""
        for conn in self._connections(peer_id):
            if is_relayed(conn):
                continue
            try:
                remote = conn.muxed_conn.get_remote_address()
            except (AttributeError, NotImplementedError):
                continue
            if remote:
                return remote[0]
        return None

    def connected(self) -> list[str]:
        """Peers with an open connection. py-libp2p may keep a closed or reset connection in its
        map for a while; counting it as connected made gossip skip the re-dial (and fail every
        exchange) until both sides' records of each other expired — and then nobody re-dialled."""
        out = []
        for pid, conns in self.host.get_network().connections.items():
            conns = conns if isinstance(conns, list) else [conns]
            if any(not getattr(c, "is_closed", False) for c in conns):
                out.append(pid.to_base58())
        return sorted(out)

    def connection_kind(self, peer_id: str) -> str | None:
        conns = self._connections(peer_id)
        if not conns:
            return None
        direct = [c for c in conns if not is_relayed(c)]
        if not direct:
            return RELAYED
        if self.relay is not None and any(self.relay.puncher.made_by_punch(c, ID.from_base58(peer_id)) for c in direct):
            return PUNCHED
        return DIRECT

    def stream_count(self, peer_id: str) -> int:
        """Yamux streams on the peer's connections, and dedicated connections (one stream each)."""
        muxed = sum(len(c.get_streams()) for c in self._connections(peer_id) if hasattr(c, "get_streams"))
        return muxed + (self.dedicated.live(peer_id) if self.dedicated is not None else 0)

    async def disconnect(self, peer_id: str) -> None:
        try:
            await self.host.disconnect(ID.from_base58(peer_id))
        except LIBP2P_IO_ERRORS:
            pass  # already disconnected


def interface_ipv4s() -> list[str]:
    """This machine's IPv4 addresses, loopback last (what a 0.0.0.0 listener is reachable on)."""
    return _interface_ips(socket.AF_INET)


def interface_ipv6s() -> list[str]:
    """This machine's IPv6 addresses (no scope suffix), loopback last."""
    return _interface_ips(socket.AF_INET6)


def _interface_ips(family: int) -> list[str]:
    found = [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == family]
    return sorted(set(found), key=lambda ip: (ipaddress.ip_address(ip).is_loopback, ip))


@asynccontextmanager
async def open_libp2p_transport(
    seed: bytes,
    *,
    listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    swarm_key: bytes | None = None,
    noise_only: bool = True,
    relay: bool = True,
    dedicated: bool = True,
    dedicated_listen: bool = True,
    dedicated_port: int = 0,
) -> AsyncIterator[Libp2pTransport]:
    """Run a host listening on `listen` for the duration of the block, with its relay stack unless
    `relay=False`. Hot streams get dedicated connections (peer/net/dedicated/) unless
    `dedicated=False`; a host that serves them listens for those on `dedicated_port` (0: any free
    port) unless `dedicated_listen=False` (a requester dials, it serves nothing)."""
    host = make_host(seed, swarm_key=swarm_key, noise_only=noise_only)
    async with host.run(listen_addrs=[multiaddr.Multiaddr(a) for a in listen]), trio.open_nursery() as nursery:
        # py-libp2p's auto-connector dials every address in the peerstore until ~200
        # connections are open (hundreds of dials at once on a loaded machine); our
        # peers connect to the peers they need themselves (gossip, routes).
        await host.get_network().auto_connector.stop()
        streams = None
        if dedicated:
            streams = DedicatedStreams(KeyPair(host.get_private_key(), host.get_public_key()), swarm_key=swarm_key,
                                    nursery=nursery)
            if dedicated_listen:
                bind, hosts = dedicated_listen_host(listen)
                await streams.listen(bind, dedicated_port, hosts)
        try:
            if not relay:
                yield Libp2pTransport(host, swarm_key=swarm_key, dedicated=streams)
            else:
                async with run_relay_stack(host) as stack:
                    yield Libp2pTransport(host, stack, swarm_key=swarm_key, dedicated=streams)
        finally:
            nursery.cancel_scope.cancel()  # the dedicated listener and its connections end with the host


def dedicated_listen_host(listen: Sequence[str]) -> tuple[str, list[str]]:
    """Where the dedicated listener binds (the host of the first TCP listen address) and the
    addresses it is reachable at (every interface's, for a wildcard)."""
    for addr in listen:
        parts = addr.split("/")
        if len(parts) > 4 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
            host = parts[2]
            if host == "0.0.0.0":
                return host, interface_ipv4s()
            if host == "::":  # trio listens on IPv6 only there
                return host, interface_ipv6s()
            return host, [host]
    return "127.0.0.1", ["127.0.0.1"]
