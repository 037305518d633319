"""Dedicated connections: a session's or a link's stream on a TCP connection of its own.

Why. On py-libp2p 0.8.1 every frame of a stream crosses yamux in Python: a reader task
parses each header into a buffer and sets an event, and the stream's reader wakes after
it. That machinery costs more than the bytes. A 2.4 KB frame's round trip between two
processes (bench/streams.py, 2-core machine) takes 0.70 ms over a yamux stream, 0.21 ms
over Noise on a connection of its own and 0.14 ms over bare TCP; after 10 ms idle, as a
pipeline stage sits between its steps, 1.71, 0.72 and 0.46 ms. A decode step through three
peers crosses four such streams.

What. The protocols in `DEDICATED_PROTOCOLS` (one frame per decode step each) may run on a
connection of their own: TCP, the swarm key's pnet protector when the swarm has one, and
libp2p's own Noise XX handshake with the hosts' libp2p identities. It carries exactly one
stream, so there is no muxer: a message is Noise's transport framing (a 2-byte length and
the ChaCha20-Poly1305 ciphertext) read straight off the socket. The handlers are the ones
the libp2p host runs; a `DedicatedStream` is a `Stream` like any other.

When. Only where it works at once, so that a session never waits on an attempt:

- the libp2p connection to the peer is direct (not relayed, and not hole-punched: a
  punched hole covers the libp2p port, not this one);
- the peer told us (`DedicatedEndpoint`, asked once over libp2p and kept `ENDPOINT_TTL`)
  that it listens on the address our libp2p connection reaches it at. An address it does
  not list was rewritten by a NAT on the way, whose mapping is the libp2p port's.

Anything else — a peer without the protocol, a refused or timed-out dial, a failed
handshake, a refusal — falls back to a libp2p stream, and that peer's dedicated path is
avoided for a while (`Backoff`, doubling from `AVOID_BASE`).

Security. As a libp2p stream's: Noise XX authenticates both ends' peer ids (a dialler
checks it reached the peer it meant; the listener learns who dialled, as a stream handler
does from libp2p) and encrypts everything after the handshake; pnet keeps out a host
without the swarm key; activations are sealed per link on top, as always. An observer
of the network sees one TCP connection per stream instead of one per pair of peers, so
how many sessions and links a peer runs shows. A stranger's connections cost bounded
memory: handshakes in progress, connections in all and per remote peer, and the time a
handshake may take are limited (`DedicatedLimits`).

Closing. `close()` half-closes, as on yamux: the remote reads what was sent, then end of
stream, and may still send. The socket is released once the remote has closed too (or
after `LINGER`): closing it at once could answer the remote's last frames with a reset,
which loses what the remote had not read yet. `reset()` aborts the connection (an RST).
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_pair
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.security.pnet.protector import new_protected_conn
from libp2p.transport.tcp.tcp import TrioTCPStream

from tessera.protocol.dedicated import MAX_HOSTS, DedicatedAccept, DedicatedEndpoint, DedicatedOpen
from tessera.protocol.error_codes import BAD_REQUEST, BUSY
from tessera.protocol.errors import WireError
from tessera.protocol.messages import ErrorMsg

from tessera.peer.base.backoff import Backoff
from tessera.peer.base.errors import PeerError, StreamClosed
from tessera.peer.base.protocols import (
    DEDICATED_PROTOCOL, LINK_PROTOCOL, SESSION_PROTOCOL, SHARD_LINK_PROTOCOL, SHARD_SESSION_PROTOCOL,
)
from tessera.peer.net.transport import DIRECT, Channel, Handler, Stream

log = logging.getLogger(__name__)

# The streams that carry a frame per decode step; everything else stays on libp2p.
DEDICATED_PROTOCOLS = frozenset({SESSION_PROTOCOL, LINK_PROTOCOL, SHARD_SESSION_PROTOCOL, SHARD_LINK_PROTOCOL})

# TCP, Noise XX (1.5 round trips and two signatures) and DedicatedOpen/DedicatedAccept: a few
# milliseconds on a LAN, well under a second across continents. A firewall that drops the
# SYN would hold the dial for a second, then two (Linux's retransmits): by then a libp2p
# stream, which needs no new connection, is the better deal.
DIAL_TIMEOUT = 2.0
# The listener's side of the same, for a dialler on a slow link; a stranger who stalls is
# dropped after it.
HANDSHAKE_TIMEOUT = 5.0
# Asking a peer for its endpoint: one stream open and one message on a live connection.
ENDPOINT_TIMEOUT = 5.0
# How long an endpoint is believed: a peer that restarts on another port is dialled at the
# old one at most this long after (the failed dial falls back, and asks again next time).
ENDPOINT_TTL = 300.0
# A peer whose dedicated path failed is avoided for 30 s, doubling up to 10 min.
AVOID_BASE, AVOID_CAP = 30.0, 600.0
# After close(), how long the socket waits for the remote to close its side, and how much of
# what the remote sends meanwhile it keeps for a later read (more is answered with a reset).
LINGER = 10.0
DRAIN_LIMIT = 4 << 20
# Noise transport messages hold at most 65535 bytes, 16 of them the tag.
MAX_PLAINTEXT = 65535 - 16
_LENGTH = struct.Struct(">H")
# A reset: close with a zero linger time, so the kernel sends RST at once.
_ABORT = struct.pack("ii", 1, 0)


@dataclass(frozen=True)
class DedicatedLimits:
    """What a stranger's connections may cost a listener."""

    handshakes: int = 32  # handshakes in progress at once (each holds a socket and a task)
    connections: int = 1024  # dedicated connections at once, dialled and accepted
    per_peer: int = 128  # of those, with one remote peer (a requester with many sessions and taps)


class NotServed(PeerError):
    """The peer does not serve that protocol on dedicated connections."""


class Libp2pSide(Protocol):
    """What dedicated connections need of the libp2p transport they sit beside."""

    def connection_kind(self, peer_id: str) -> str | None: ...

    def remote_host(self, peer_id: str) -> str | None:
        """The IP our libp2p connection to `peer_id` reaches it at (None: none, or relayed)."""
        ...

    async def open_libp2p_stream(self, peer_id: str, protocol: str) -> Stream: ...


class _Pipe(Protocol):
    """The byte pipe under Noise: a py-libp2p raw connection, or its pnet-protected wrapper."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


class DedicatedStream:
    """One stream on its own Noise-secured TCP connection (a `Stream`).

    One task at a time reads, as on any stream; after `close()`, if nobody reads, a drainer
    in the host's nursery keeps reading (what it gets waits for a later `read`, up to
    `DRAIN_LIMIT`) until the remote closes too, then releases the socket.
    """

    via = "dedicated"

    def __init__(self, socket_stream: trio.SocketStream, pipe: _Pipe, cipher, remote: str,
                 nursery: trio.Nursery, on_release: Callable[[], None]) -> None:
        self.remote = remote
        self._socket = socket_stream
        self._pipe = pipe
        self._cipher = cipher  # the Noise session's cipher states (noiseprotocol's NoiseConnection)
        self._nursery = nursery
        self._on_release = on_release
        self._in = bytearray()  # received bytes not yet parsed into a message
        self._ready = bytearray()  # decrypted bytes not yet read
        self._write_lock = trio.Lock()
        self._reading = False  # a read (the owner's or the drainer's) is on the socket
        self._draining = False
        self._drained = trio.Event()  # set (and replaced) whenever the drainer got something or ended
        self._eof = False  # the remote closed its side
        self._closed = False  # we closed ours
        self._aborted = False  # reset (by us, or found broken)
        self._released = False

    @property
    def remote_addr(self) -> str | None:
        """The remote end's `/ip4/A/tcp/P`."""
        try:
            host, port = self._socket.socket.getpeername()[:2]
        except OSError:
            return None
        return f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{port}"

    async def read(self, max_bytes: int) -> bytes:
        """Up to max_bytes; b"" at end of stream. Raises StreamClosed on a reset."""
        while not self._ready:
            if self._aborted:
                raise StreamClosed(f"dedicated stream with {self.remote} was reset")
            if self._eof or self._released:
                return b""
            if self._draining:
                await self._drained.wait()  # the drainer holds the socket: take what it brings
                continue
            await self._receive()
        out = bytes(self._ready[:max_bytes])
        del self._ready[:max_bytes]
        return out

    async def _receive(self) -> None:
        """One message into `_ready`, or the end of the stream into `_eof`."""
        self._reading = True
        try:
            message = await self._next_message()
            if message is None:
                self._eof = True
            else:
                self._ready += message
        finally:
            self._reading = False
            if self._closed:
                self._after_close()  # this reader was the one a close left the socket to

    def unread(self, data: bytes | bytearray) -> None:
        """Give back bytes a reader took but did not use (the next read returns them first)."""
        self._ready[:0] = data

    async def _next_message(self) -> bytes | None:
        """The next Noise transport message, decrypted; None at a clean end of stream."""
        while True:
            if len(self._in) >= 2:
                (size,) = _LENGTH.unpack_from(self._in)
                if len(self._in) >= 2 + size:
                    ciphertext = bytes(self._in[2 : 2 + size])
                    del self._in[: 2 + size]
                    try:
                        return self._cipher.decrypt(ciphertext)
                    except Exception as bad:  # noiseprotocol raises its own and cryptography's types
                        self._abort()
                        raise StreamClosed(f"dedicated stream from {self.remote}: a message does not decrypt "
                                           f"({type(bad).__name__})") from None
            try:
                data = await self._pipe.read(65536)
            except Exception as error:  # a reset: py-libp2p wraps socket errors in its own types
                self._abort()
                raise StreamClosed(f"dedicated stream from {self.remote} failed: {type(error).__name__} {error}") from None
            if not data:
                if self._in:
                    self._abort()
                    raise StreamClosed(f"dedicated stream from {self.remote} ended inside a message")
                return None
            self._in += data

    async def write(self, data: bytes) -> None:
        """Raises StreamClosed if this end closed or the connection is gone."""
        async with self._write_lock:
            if self._closed or self._released or self._aborted:
                raise StreamClosed(f"dedicated stream to {self.remote} is {'reset' if self._aborted else 'closed'}")
            view = memoryview(data)
            parts = []
            for start in range(0, len(view), MAX_PLAINTEXT):
                ciphertext = self._cipher.encrypt(bytes(view[start : start + MAX_PLAINTEXT]))
                parts += (_LENGTH.pack(len(ciphertext)), ciphertext)
            try:
                await self._pipe.write(b"".join(parts))
            except Exception as error:  # as in read
                self._abort()
                raise StreamClosed(f"dedicated stream to {self.remote} failed: {type(error).__name__} {error}") from None

    async def close(self) -> None:
        """Half-close (see the module docstring); idempotent."""
        async with self._write_lock:
            if self._closed or self._released or self._aborted:
                return
            self._closed = True
            try:
                await self._socket.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # gone already: nothing to tell the remote
        self._after_close()

    def _after_close(self) -> None:
        """Once closed: release the socket when the remote has closed too, else drain until it
        does — unless a reader is on the socket, which comes back here when it is done."""
        if self._released or self._draining or self._reading:
            return
        if self._eof:
            self._nursery.start_soon(self._release)
        else:
            self._draining = True
            self._nursery.start_soon(self._drain)

    async def _drain(self) -> None:
        with trio.move_on_after(LINGER):
            try:
                while not self._eof and len(self._ready) <= DRAIN_LIMIT:
                    await self._receive()
                    self._wake_readers()
            except StreamClosed:
                pass  # reset or broken: the socket is being released
        if not self._eof and not self._aborted:
            self._abort_socket()  # the remote kept sending, or never closed: it gets a reset
        self._draining = False
        self._wake_readers()
        await self._release()

    def _wake_readers(self) -> None:
        self._drained.set()
        self._drained = trio.Event()

    async def reset(self) -> None:
        """Abort the connection now: the remote's reads and writes fail."""
        self._aborted = True
        if self._released:
            return
        self._abort_socket()
        await self._release()

    def _abort(self) -> None:
        """The connection is broken or misbehaved: reset it (from a sync context)."""
        self._aborted = True
        self._abort_socket()
        self._nursery.start_soon(self._release)

    def _abort_socket(self) -> None:
        try:
            self._socket.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT)
        except OSError:
            pass  # already closed under us

    async def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self._on_release()
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(self._socket)


class DedicatedStreams:
    """Dedicated connections of one host: its listener, its dials, the endpoints it learned."""

    def __init__(self, key_pair: KeyPair, *, swarm_key: bytes | None, nursery: trio.Nursery,
                 limits: DedicatedLimits = DedicatedLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.peer_id = ID.from_pubkey(key_pair.public_key)
        self._noise = NoiseTransport(key_pair, noise_privkey=create_x25519_pair().private_key)
        self._swarm_key = swarm_key.hex() if swarm_key is not None else None
        self._nursery = nursery
        self.limits = limits
        self.clock = clock
        self.handlers: dict[str, Handler] = {}
        self.endpoint: DedicatedEndpoint | None = None  # ours, once listening
        self.avoid = Backoff(AVOID_BASE, AVOID_CAP)
        self._endpoints: dict[str, tuple[float, DedicatedEndpoint | None]] = {}  # peer -> (learned at, theirs)
        self._asking: dict[str, trio.Event] = {}
        self._handshakes = 0
        self._open: dict[str, int] = {}  # remote peer -> live dedicated connections
        self.opened = 0  # dedicated streams dialled (for tests and benches)
        self.accepted = 0

    # -- serving ---------------------------------------------------------------------

    def set_handler(self, protocol: str, handler: Handler) -> None:
        if protocol in DEDICATED_PROTOCOLS:
            self.handlers[protocol] = handler

    async def listen(self, host: str, port: int, hosts: list[str]) -> DedicatedEndpoint:
        """Start the listener on host:port (0: any free port); `hosts`: the addresses it is
        reachable at (what `DedicatedEndpoint` lists). Returns our endpoint."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]
        self.endpoint = DedicatedEndpoint(port=bound, hosts=tuple(hosts[:MAX_HOSTS]))
        for listener in listeners:
            self._nursery.start_soon(self._accept, listener)
        return self.endpoint

    async def serve_endpoint(self, stream: Stream) -> None:
        """The DEDICATED_PROTOCOL handler (on libp2p): tell the asker where we take dedicated connections."""
        channel = Channel(stream)
        try:
            if self.endpoint is not None:
                await channel.send(self.endpoint)
            await channel.close()
        except PeerError:
            pass  # the asker left; nothing to tell

    async def _accept(self, listener: trio.SocketListener) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as error:  # out of descriptors or buffers: wait, as trio.serve_listeners does
                    log.warning("dedicated listener: accept failed (%s); pausing", error)
                    await trio.sleep(0.1)
                    continue
                if self._handshakes >= self.limits.handshakes or self._live() >= self.limits.connections:
                    await trio.aclose_forcefully(stream)  # over the limits: a stranger's flood costs nothing more
                    continue
                self._handshakes += 1  # counted here, so that a burst of accepts sees its own
                self._nursery.start_soon(self._serve_connection, stream)

    async def _serve_connection(self, socket_stream: trio.SocketStream) -> None:
        opened = None
        try:
            with trio.move_on_after(HANDSHAKE_TIMEOUT):
                opened = await self._handshake_inbound(socket_stream)
        finally:
            self._handshakes -= 1
        if opened is None:
            return
        stream, handler = opened
        try:
            await handler(stream)
        except (trio.Cancelled, KeyboardInterrupt):
            raise
        except Exception:  # a handler bug ends its stream, not the peer (as libp2p runs handlers)
            log.exception("a dedicated stream's handler failed (remote %s)", stream.remote)
            await stream.reset()
            return
        await stream.close()

    async def _handshake_inbound(self, socket_stream: trio.SocketStream) -> tuple[DedicatedStream, Handler] | None:
        """Secure an accepted connection and learn its protocol; None (the connection closed) if it
        is not one of ours: a stranger, garbage, a stall past HANDSHAKE_TIMEOUT, or a refusal."""
        stream = None
        try:
            pipe = self._pipe(socket_stream, initiator=False)
            secure = await self._noise.secure_inbound(pipe)
            remote = secure.get_remote_peer().to_base58()
            stream = self._stream(socket_stream, pipe, secure, remote)
            channel = Channel(stream)
            request = await channel.receive()
            if not isinstance(request, DedicatedOpen):
                raise WireError(f"expected DedicatedOpen, got {type(request).__name__}")
            handler = self.handlers.get(request.protocol)
            if handler is None:
                refusal = ErrorMsg(BAD_REQUEST, f"{request.protocol!r} is not served on dedicated connections")
            elif self._open.get(remote, 0) > self.limits.per_peer:
                refusal = ErrorMsg(BUSY, f"{self.limits.per_peer} dedicated connections from one peer at most")
            else:
                await channel.send(DedicatedAccept(request.protocol))
                stream.unread(channel.take_buffered())
                self.accepted += 1
                return stream, handler
            await channel.send(refusal)
            await stream.close()  # the dialler reads the refusal, then the end of the stream
            return None
        except BaseException as error:
            # garbage, a failed handshake (py-libp2p's Noise raises many types), a stall or a cancellation
            if stream is not None:
                await stream.reset()
            else:
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(socket_stream)
            if not isinstance(error, Exception):
                raise
            log.debug("dedicated connection refused: %s: %s", type(error).__name__, error)
            return None

    # -- dialling --------------------------------------------------------------------

    async def open(self, via: Libp2pSide, peer_id: str, protocol: str) -> DedicatedStream | None:
        """A dedicated stream to `peer_id` for `protocol`, or None where a libp2p stream must do
        (see the module docstring: when it works at once). Never raises for the peer's sake."""
        if protocol not in DEDICATED_PROTOCOLS or self.avoid.is_banned(peer_id, self.clock()):
            return None
        if via.connection_kind(peer_id) != DIRECT:
            return None  # relayed or punched: the libp2p connection is the only way in
        host = via.remote_host(peer_id)
        endpoint = await self._endpoint_of(via, peer_id)
        if host is None or endpoint is None or host not in endpoint.hosts:
            return None
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                stream = await self._dial(peer_id, host, endpoint.port, protocol)
        except NotServed:
            return None  # the peer takes other protocols here: nothing wrong with its path
        except (trio.TooSlowError, OSError, PeerError, WireError) as error:
            return self._avoid(peer_id, f"{type(error).__name__}: {error}")
        except Exception as error:  # py-libp2p's Noise raises many types for a failed handshake
            return self._avoid(peer_id, f"handshake: {type(error).__name__}: {error}")
        self.opened += 1
        return stream

    def _avoid(self, peer_id: str, why: str) -> None:
        seconds = self.avoid.register_failure(peer_id, self.clock())
        self._endpoints.pop(peer_id, None)  # ask again when the ban ends: it may have moved
        log.info("dedicated connection to %s failed (%s); using libp2p streams for %.0f s", peer_id, why, seconds)
        return None

    async def _endpoint_of(self, via: Libp2pSide, peer_id: str) -> DedicatedEndpoint | None:
        """The peer's endpoint, asked once per ENDPOINT_TTL (concurrent callers share one ask)."""
        while True:
            known = self._endpoints.get(peer_id)
            if known is not None and self.clock() - known[0] < ENDPOINT_TTL:
                return known[1]
            asking = self._asking.get(peer_id)
            if asking is None:
                break
            await asking.wait()
        self._asking[peer_id] = done = trio.Event()
        endpoint = None
        try:
            with trio.move_on_after(ENDPOINT_TIMEOUT):
                channel = Channel(await via.open_libp2p_stream(peer_id, DEDICATED_PROTOCOL))
                try:
                    reply = await channel.receive_or_none()
                finally:
                    await channel.close()
                endpoint = reply if isinstance(reply, DedicatedEndpoint) else None
        except (PeerError, WireError) as error:
            log.debug("%s has no dedicated endpoint: %s", peer_id, error)  # an older peer: libp2p streams
        finally:
            self._endpoints[peer_id] = (self.clock(), endpoint)
            del self._asking[peer_id]
            done.set()
        return endpoint

    async def _dial(self, peer_id: str, host: str, port: int, protocol: str) -> DedicatedStream:
        """Connect, secure (checking the remote is `peer_id`) and open `protocol`. Raises on any failure."""
        if self._live() >= self.limits.connections:
            raise PeerError(f"{self.limits.connections} dedicated connections open already")
        socket_stream = await trio.open_tcp_stream(host, port)
        try:
            pipe = self._pipe(socket_stream, initiator=True)
            secure = await self._noise.secure_outbound(pipe, ID.from_base58(peer_id))
            stream = self._stream(socket_stream, pipe, secure, peer_id)
        except BaseException:
            await trio.aclose_forcefully(socket_stream)
            raise
        try:
            channel = Channel(stream)
            await channel.send(DedicatedOpen(protocol))
            reply = await channel.receive()
            if isinstance(reply, ErrorMsg):
                raise (NotServed if reply.code == BAD_REQUEST else PeerError)(f"refused: {reply.code}: {reply.message}")
            if not isinstance(reply, DedicatedAccept) or reply.protocol != protocol:
                raise WireError(f"answered DedicatedOpen with {type(reply).__name__}")
            stream.unread(channel.take_buffered())  # bytes after the accept are the protocol's
        except BaseException:
            await stream.reset()
            raise
        return stream

    # -- both ------------------------------------------------------------------------

    def _pipe(self, socket_stream: trio.SocketStream, *, initiator: bool):
        socket_stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)  # trio's default; said, as frames are small
        raw = RawConnection(TrioTCPStream(socket_stream), initiator)
        return new_protected_conn(raw, self._swarm_key) if self._swarm_key is not None else raw

    def _stream(self, socket_stream: trio.SocketStream, pipe, secure, remote: str) -> DedicatedStream:
        # After the handshake the session's ciphers are all that Noise keeps; a message is read
        # and written here directly (the same framing as py-libp2p's, fewer layers per frame).
        cipher = secure.conn.noise_state
        self._open[remote] = self._open.get(remote, 0) + 1

        def released() -> None:
            self._open[remote] -= 1
            if not self._open[remote]:
                del self._open[remote]

        return DedicatedStream(socket_stream, pipe, cipher, remote, self._nursery, released)

    def _live(self) -> int:
        return sum(self._open.values())

    def live(self, peer_id: str | None = None) -> int:
        """Dedicated connections open now (with `peer_id`, or in all)."""
        return self._open.get(peer_id, 0) if peer_id is not None else self._live()

    def status(self) -> dict:
        """What the status API shows: where we listen, what was opened and taken, who is avoided."""
        return {
            "port": self.endpoint.port if self.endpoint is not None else None,
            "opened": self.opened, "accepted": self.accepted, "live": self._live(),
            "avoided": sorted(self.avoid.banned(self.clock())),
        }


__all__ = ["DEDICATED_PROTOCOLS", "DedicatedLimits", "DedicatedStream", "DedicatedStreams", "Libp2pSide", "NotServed"]
