"""A host's dedicated connections: its listener, its dials, and when to use them (see the
package docstring for why, when, and what they guarantee)."""

from __future__ import annotations

import logging
import socket
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
from tessera.peer.base.errors import PeerError
from tessera.peer.base.protocols import (
    DEDICATED_PROTOCOL, LINK_PROTOCOL, SESSION_PROTOCOL, SHARD_LINK_PROTOCOL, SHARD_SESSION_PROTOCOL,
)
from tessera.peer.net.dedicated.stream import DedicatedStream, Pipe, SocketPipe
from tessera.peer.net.transport import DIRECT, Channel, Handler, Stream

log = logging.getLogger(__name__)

# The streams that carry a frame per decode step; everything else stays on libp2p.
DEDICATED_PROTOCOLS = frozenset({SESSION_PROTOCOL, LINK_PROTOCOL, SHARD_SESSION_PROTOCOL, SHARD_LINK_PROTOCOL})

# TCP, Noise XX (1.5 round trips and two signatures) and DedicatedOpen/DedicatedAccept: a few
# milliseconds on a LAN, well under a second across continents. A firewall that drops the
# SYN would hold the dial for a second, then two (Linux's retransmits): by then a libp2p
# stream, which needs no new connection, is the better deal.
DIAL_TIMEOUT = 2.0
# Asking a peer for its endpoint: one stream open and one message on a live, direct
# connection, so a round trip or two; together with a dial, the most a failing attempt
# can add to opening a session (once: the peer is avoided or its answer kept after it).
ENDPOINT_TIMEOUT = 2.0
# The listener's side of a dial, for a dialler on a slow link; a stranger who stalls is
# dropped after it.
HANDSHAKE_TIMEOUT = 5.0
# The frames before the protocol is named (DedicatedOpen, DedicatedAccept, a refusal) are
# a few dozen bytes; a stranger's claim of more is refused before it is buffered.
HANDSHAKE_FRAME = 1024
# What a refused dialler may still send while it reads the refusal.
REFUSAL_DRAIN = 4096
# How long an answer about a peer's endpoint is kept: a peer that restarts on another port
# is dialled at the old one at most this long after (the failed dial falls back, and the
# next attempt asks again). A peer that did not answer the question is asked again sooner.
ENDPOINT_TTL = 300.0
UNANSWERED_TTL = 30.0
# A peer whose dedicated path failed is avoided for 30 s, doubling up to 10 min.
AVOID_BASE, AVOID_CAP = 30.0, 600.0
# Our handshakes with one peer at once: a burst of opens (many sessions starting together)
# queues here, a few milliseconds each, instead of overrunning the listener's slots for our
# address (DedicatedLimits.handshakes_per_address), which would look like a failed path.
DIALS_PER_PEER = 4


@dataclass(frozen=True)
class DedicatedLimits:
    """What connections may cost a host: strangers' (accepted) and its own (dialled) apart."""

    handshakes: int = 64  # accepted connections not yet past DedicatedOpen (each a socket and a task)
    handshakes_per_address: int = 16  # of those, from one source address (a NAT, a machine of several peers)
    connections: int = 1024  # accepted connections at once
    per_peer: int = 128  # of those, from one remote peer (a requester with many sessions)
    dials: int = 1024  # connections this host dialled, at once


class NotServed(PeerError):
    """The peer does not serve that protocol on dedicated connections."""


class Busy(PeerError):
    """The peer holds as many of our dedicated connections as it takes."""


class Libp2pSide(Protocol):
    """What dedicated connections need of the libp2p transport they sit beside."""

    def connection_kind(self, peer_id: str) -> str | None: ...

    def remote_host(self, peer_id: str) -> str | None:
        """The IP our libp2p connection to `peer_id` reaches it at (None: none, or relayed)."""
        ...

    async def open_libp2p_stream(self, peer_id: str, protocol: str) -> Stream: ...


class DedicatedStreams:
    """Dedicated connections of one host: its listener, its dials, the endpoints it learned."""

    def __init__(self, key_pair: KeyPair, *, swarm_key: bytes | None, nursery: trio.Nursery,
                 limits: DedicatedLimits = DedicatedLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self._noise = NoiseTransport(key_pair, noise_privkey=create_x25519_pair().private_key)
        self._swarm_key = swarm_key.hex() if swarm_key is not None else None
        self._nursery = nursery
        self.limits = limits
        self.clock = clock
        self.handlers: dict[str, Handler] = {}
        self.endpoint: DedicatedEndpoint | None = None  # ours, once listening
        self.avoid = Backoff(AVOID_BASE, AVOID_CAP)
        self._endpoints: dict[str, tuple[float, DedicatedEndpoint | None]] = {}  # peer -> (kept until, theirs)
        self._not_served: dict[tuple[str, str], float] = {}  # (peer, protocol) -> refused until
        self._asking: dict[str, trio.Event] = {}
        self._dialling: dict[str, trio.Semaphore] = {}  # peer -> our handshakes with it (DIALS_PER_PEER)
        self._handshakes: dict[str, int] = {}  # source address -> accepted connections in their handshake
        self._accepted: dict[str, int] = {}  # remote peer -> accepted connections past it
        self._dialled: dict[str, int] = {}  # remote peer -> connections we dialled
        self.opened = 0  # dedicated streams dialled (for tests, benches and the status API)
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
        channel = Channel(stream, max_frame=HANDSHAKE_FRAME)
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
                address = _source(stream)
                handshaking = self.handshaking()
                if (handshaking >= self.limits.handshakes
                        or self._handshakes.get(address, 0) >= self.limits.handshakes_per_address
                        or handshaking + _total(self._accepted) >= self.limits.connections):
                    await trio.aclose_forcefully(stream)  # over the limits: a stranger's flood costs nothing more
                    continue
                _count(self._handshakes, address, +1)  # counted here, so that a burst of accepts sees its own
                self._nursery.start_soon(self._serve_connection, stream, address)

    async def _serve_connection(self, socket_stream: trio.SocketStream, address: str) -> None:
        opened = None
        try:
            with trio.move_on_after(HANDSHAKE_TIMEOUT):
                opened = await self._handshake_inbound(socket_stream)
        finally:
            _count(self._handshakes, address, -1)
        if opened is None:
            return
        stream, handler = opened
        try:
            # the stream is the handler's now (it outlives a handler that returns); a handler's
            # failure is its own (Libp2pTransport.set_handler gives us `run_handler`-guarded ones)
            await handler(stream)
        except BaseException:  # cancelled: the host is closing
            with trio.CancelScope(shield=True):
                await stream.reset()
            raise

    async def _handshake_inbound(self, socket_stream: trio.SocketStream) -> tuple[DedicatedStream, Handler] | None:
        """Secure an accepted connection and learn its protocol; None (the connection closed) if it
        is not one of ours: a stranger, garbage, a stall past HANDSHAKE_TIMEOUT, or a refusal."""
        stream = None
        try:
            pipe = self._pipe(socket_stream, initiator=False)
            secure = await self._noise.secure_inbound(pipe)
            remote = secure.get_remote_peer().to_base58()
            stream = self._stream(socket_stream, pipe, secure, remote, self._accepted)
            channel = Channel(stream, max_frame=HANDSHAKE_FRAME)
            request = await channel.receive()
            if not isinstance(request, DedicatedOpen):
                raise WireError(f"expected DedicatedOpen, got {type(request).__name__}")
            handler = self.handlers.get(request.protocol)
            if handler is None:
                refusal = ErrorMsg(BAD_REQUEST, f"{request.protocol!r} is not served on dedicated connections")
            elif self._accepted.get(remote, 0) > self.limits.per_peer:
                refusal = ErrorMsg(BUSY, f"{self.limits.per_peer} dedicated connections from one peer at most")
            else:
                await channel.send(DedicatedAccept(request.protocol))
                stream.unread(channel.take_buffered())
                self.accepted += 1
                return stream, handler
            await channel.send(refusal)
            await stream.finish(REFUSAL_DRAIN)  # the dialler reads the refusal, then both ends close
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
        (see the package docstring: when it works at once). Never raises for the peer's sake."""
        now = self.clock()
        if (protocol not in DEDICATED_PROTOCOLS or self.avoid.is_banned(peer_id, now)
                or self._not_served.get((peer_id, protocol), 0.0) > now):
            return None
        if via.connection_kind(peer_id) != DIRECT:
            return None  # relayed or punched: the libp2p connection is the only way in
        if _total(self._dialled) >= self.limits.dials:
            return None  # our own limit: nothing wrong with the peer
        host = via.remote_host(peer_id)
        if host is None:
            return None
        endpoint = await self._endpoint_of(via, peer_id)
        if endpoint is None or host not in endpoint.hosts:
            return None
        turn = self._dialling.setdefault(peer_id, trio.Semaphore(DIALS_PER_PEER))
        try:
            async with turn:  # the wait for a turn is not the dial's: the deadline starts after it
                if self.avoid.is_banned(peer_id, self.clock()):
                    return None  # an earlier dial in the queue failed meanwhile
                with trio.fail_after(DIAL_TIMEOUT):
                    stream = await self._dial(peer_id, host, endpoint.port, protocol)
        except NotServed:
            self._not_served[peer_id, protocol] = self.clock() + ENDPOINT_TTL
            return None  # the peer takes other protocols there: nothing wrong with its path
        except Busy:
            return None  # it holds enough of ours: this one goes on libp2p, no strike
        except (trio.TooSlowError, OSError, PeerError, WireError) as error:
            return self._avoid(peer_id, f"{type(error).__name__}: {error}")
        except Exception as error:  # py-libp2p's Noise raises many types for a failed handshake
            return self._avoid(peer_id, f"handshake: {type(error).__name__}: {error}")
        finally:
            if turn.value == DIALS_PER_PEER and not turn.statistics().tasks_waiting:
                self._dialling.pop(peer_id, None)  # nobody dials it now: keep no state for it
        self.opened += 1
        return stream

    def _avoid(self, peer_id: str, why: str) -> None:
        seconds = self.avoid.register_failure(peer_id, self.clock())
        self._endpoints.pop(peer_id, None)  # ask again when the ban ends: it may have moved
        log.info("dedicated connection to %s failed (%s); using libp2p streams for %.0f s", peer_id, why, seconds)
        return None

    async def _endpoint_of(self, via: Libp2pSide, peer_id: str) -> DedicatedEndpoint | None:
        """The peer's endpoint: its answer is kept ENDPOINT_TTL (UNANSWERED_TTL when it could not
        answer; nothing when the asking timed out or was cancelled); concurrent callers share one ask."""
        while True:
            known = self._endpoints.get(peer_id)
            if known is not None and self.clock() < known[0]:
                return known[1]
            asking = self._asking.get(peer_id)
            if asking is None:
                break
            await asking.wait()
        self._asking[peer_id] = done = trio.Event()
        endpoint, keep = None, 0.0
        try:
            with trio.move_on_after(ENDPOINT_TIMEOUT):
                channel = Channel(await via.open_libp2p_stream(peer_id, DEDICATED_PROTOCOL), max_frame=HANDSHAKE_FRAME)
                try:
                    reply = await channel.receive_or_none()
                finally:
                    await channel.close()
                endpoint, keep = (reply if isinstance(reply, DedicatedEndpoint) else None), ENDPOINT_TTL
        except (PeerError, WireError) as error:
            log.debug("%s has no dedicated endpoint: %s", peer_id, error)  # an older peer: libp2p streams
            keep = UNANSWERED_TTL
        finally:
            if keep:
                self._endpoints[peer_id] = (self.clock() + keep, endpoint)
            del self._asking[peer_id]
            done.set()
        return endpoint

    async def _dial(self, peer_id: str, host: str, port: int, protocol: str) -> DedicatedStream:
        """Connect, secure (checking the remote is `peer_id`) and open `protocol`. Raises on any failure."""
        socket_stream = await trio.open_tcp_stream(host, port)
        try:
            pipe = self._pipe(socket_stream, initiator=True)
            secure = await self._noise.secure_outbound(pipe, ID.from_base58(peer_id))
            stream = self._stream(socket_stream, pipe, secure, peer_id, self._dialled)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(socket_stream)
            raise
        try:
            channel = Channel(stream, max_frame=HANDSHAKE_FRAME)
            await channel.send(DedicatedOpen(protocol))
            reply = await channel.receive()
            if isinstance(reply, ErrorMsg):
                refused = {BAD_REQUEST: NotServed, BUSY: Busy}.get(reply.code, PeerError)
                raise refused(f"refused: {reply.code}: {reply.message}")
            if not isinstance(reply, DedicatedAccept) or reply.protocol != protocol:
                raise WireError(f"answered DedicatedOpen with {type(reply).__name__}")
            stream.unread(channel.take_buffered())  # bytes after the accept are the protocol's
        except BaseException:
            await stream.reset()
            raise
        return stream

    # -- both ------------------------------------------------------------------------

    def _pipe(self, socket_stream: trio.SocketStream, *, initiator: bool) -> Pipe:
        socket_stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)  # trio's default; said, as frames are small
        raw = RawConnection(TrioTCPStream(socket_stream), initiator)
        return new_protected_conn(raw, self._swarm_key) if self._swarm_key is not None else raw

    def _stream(self, socket_stream: trio.SocketStream, pipe: Pipe, secure, remote: str,
                counts: dict[str, int]) -> DedicatedStream:
        """The stream over a secured connection, counted in `counts` (accepted or dialled) until released."""
        # After the handshake the session's ciphers are all that Noise keeps (py-libp2p's
        # SecureSession holds them as conn.noise_state); messages are framed in stream.py, on
        # the socket itself unless pnet protects it (stream.py `SocketPipe` says why).
        _count(counts, remote, +1)
        after = pipe if self._swarm_key is not None else SocketPipe(socket_stream)
        return DedicatedStream(socket_stream, after, secure.conn.noise_state, remote, self._nursery,
                               lambda: _count(counts, remote, -1))

    def live(self, peer_id: str | None = None) -> int:
        """Dedicated connections open now, accepted and dialled (with `peer_id`, or in all)."""
        if peer_id is not None:
            return self._accepted.get(peer_id, 0) + self._dialled.get(peer_id, 0)
        return _total(self._accepted) + _total(self._dialled)

    def handshaking(self) -> int:
        """Accepted connections still in their handshake."""
        return _total(self._handshakes)

    def status(self) -> dict:
        """What the status API shows: where we listen, what was opened and taken, who is avoided."""
        return {
            "port": self.endpoint.port if self.endpoint is not None else None,
            "opened": self.opened, "accepted": self.accepted, "live": self.live(),
            "avoided": sorted(self.avoid.banned(self.clock())),
        }


def _count(counts: dict[str, int], key: str, delta: int) -> None:
    counts[key] = counts.get(key, 0) + delta
    if counts[key] <= 0:
        del counts[key]


def _total(counts: dict[str, int]) -> int:
    return sum(counts.values())


def _source(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except OSError:
        return ""


__all__ = ["DEDICATED_PROTOCOLS", "Busy", "DedicatedLimits", "DedicatedStreams", "Libp2pSide", "NotServed"]
