"""The `Transport` in memory: many peers in one process, on trio's clock.

    network = MemoryNetwork(link=LinkSpec(latency=0.02, bandwidth=12.5e6))
    async with open_memory_transport(network, peer_id) as transport:
        StageServer(transport, identity, stage)      # the same peer code as over libp2p
        ...

Run under `trio.testing.MockClock(autojump_threshold=0)` and a thousand peers
cost no real time while they wait: simulated time jumps to the next event.

Links are modelled in peer/net/memory_stream.py (latency, bandwidth, queueing).

Failures, as the peer code meets them over libp2p:

- `MemoryNetwork.crash(peer)` — the process died but its machine did not: every
  stream of the peer resets (the remote reads/writes raise StreamClosed) and
  dials to it are refused after one round trip.
- `MemoryNetwork.crash(peer, silent=True)` — the machine vanished (power, wifi):
  its streams go quiet (writes vanish, reads wait forever, so only the peer
  code's own timeouts notice) and dials hang until the dial timeout.
- `MemoryNetwork.cut(a, b)` / `heal(a, b)` — the link between two peers breaks
  (both ends see a reset) and cannot be dialled until healed.

Every connection is direct (`connection_kind` says DIRECT): relays and hole
punching are libp2p's business, below this interface.
"""

from __future__ import annotations

import weakref
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

import trio

from tessera.peer.base.errors import PeerUnreachable
from tessera.peer.net.libp2p import DIAL_TIMEOUT, OPEN_STREAM_TIMEOUT
from tessera.peer.net.intake import Intake
from tessera.peer.net.memory_stream import Link, LinkModel, LinkSpec, MemoryStream, Pipe
from tessera.peer.net.transport import DIRECT, Handler, run_handler


# A new connection: TCP (1 RTT) + Noise XX (1.5 RTT) + muxer negotiation (~0.5 RTT).
DIAL_RTTS = 3.0
# A new stream on a live connection: multistream-select, one round trip.
OPEN_RTTS = 1.0


class MemoryTransport:
    """One peer's end of a `MemoryNetwork` (implements `tessera.peer.net.transport.Transport`)."""

    def __init__(self, network: "MemoryNetwork", peer_id: str, index: int) -> None:
        self.network = network
        self.peer_id = peer_id
        self.index = index
        self.handlers: dict[str, Handler] = {}
        self.conns: dict[str, None] = {}  # connected peer ids (an ordered set)
        self.nursery: trio.Nursery | None = None
        self.alive = False
        self.silent = False  # vanished without a trace (see MemoryNetwork.crash)
        self.intake = Intake()  # streams not admitted yet, every protocol (peer/net/intake.py)

    def addrs(self) -> list[str]:
        return [f"/memory/{self.index}/p2p/{self.peer_id}"]

    def set_handler(self, protocol: str, handler: Handler) -> None:
        self.handlers[protocol] = handler

    async def connect(self, addr: str) -> str:
        peer_id = addr.rsplit("/p2p/", 1)[-1] if "/p2p/" in addr else ""
        if not peer_id:
            raise PeerUnreachable(f"{addr!r} is not a /p2p/ multiaddr")
        await self._dial(peer_id)
        return peer_id

    async def _dial(self, peer_id: str) -> None:
        if peer_id in self.conns:
            return
        net = self.network
        remote = net.transports.get(peer_id)
        rtt = net.rtt(self.peer_id, peer_id)
        if remote is not None and remote.silent:
            await trio.sleep(DIAL_TIMEOUT)  # nobody answers: the dial times out
            raise PeerUnreachable(f"dialling {peer_id} took over {DIAL_TIMEOUT} s")
        await trio.sleep(DIAL_RTTS * rtt)
        if remote is None or not remote.alive or net.is_cut(self.peer_id, peer_id):
            raise PeerUnreachable(f"cannot dial {peer_id}: connection refused")
        if not self.alive:
            raise PeerUnreachable(f"{self.peer_id} is shutting down")
        self.conns[peer_id] = None
        remote.conns[self.peer_id] = None

    async def open_stream(self, peer_id: str, protocol: str, *, addrs: Sequence[str] = ()) -> MemoryStream:
        net = self.network
        if peer_id == self.peer_id:
            raise PeerUnreachable("a peer cannot open a stream to itself")
        await self._dial(peer_id)
        remote = net.transports.get(peer_id)
        if remote is not None and remote.silent:
            await trio.sleep(OPEN_STREAM_TIMEOUT)
            raise PeerUnreachable(f"opening {protocol} to {peer_id} took over {OPEN_STREAM_TIMEOUT} s")
        await trio.sleep(OPEN_RTTS * net.rtt(self.peer_id, peer_id))
        if remote is None or not remote.alive or peer_id not in self.conns:
            raise PeerUnreachable(f"cannot open {protocol} to {peer_id}: not connected")
        handler = remote.handlers.get(protocol)
        if handler is None or remote.nursery is None:
            raise PeerUnreachable(f"cannot open {protocol} to {peer_id}: protocol not supported")
        mine, theirs = net._stream_pair(self, remote, protocol)
        remote.nursery.start_soon(_run_handler, handler, theirs, name=f"{protocol} {peer_id[-6:]}")
        return mine

    def connected(self) -> list[str]:
        return sorted(self.conns)

    def connection_kind(self, peer_id: str) -> str | None:
        return DIRECT if peer_id in self.conns else None

    def stream_count(self, peer_id: str) -> int:
        return sum(1 for end in list(self.network.streams.get(self.peer_id, ()))
                   if end.local is self and end.remote == peer_id)

    async def disconnect(self, peer_id: str) -> None:
        self.network._disconnect(self.peer_id, peer_id)


async def _run_handler(handler: Handler, stream: MemoryStream) -> None:
    """A protocol handler, as every transport runs it (`run_handler`); a failure is counted."""
    if not await run_handler(handler, stream, protocol=stream.protocol):
        stream.local.network.handler_errors += 1


class MemoryNetwork:
    """Owns the in-memory peers, their links and their streams.

    `link` is either one `LinkSpec` for every directed link or a function
    ``(a, b) -> LinkSpec`` (asked once per pair); `set_link` overrides a pair.
    """

    def __init__(self, link: LinkSpec | LinkModel = LinkSpec()) -> None:
        self.link_model: LinkModel = (lambda a, b, spec=link: spec) if isinstance(link, LinkSpec) else link
        self.transports: dict[str, MemoryTransport] = {}
        self.links: dict[tuple[str, str], Link] = {}
        # peer id -> the open stream ends that touch it (both ends of each of its streams, so
        # that a crash finds them in one lookup). Weak: an end both sides dropped without
        # closing (a handler that just returns) is garbage, not a leak; a parked reader keeps
        # its end alive.
        self.streams: dict[str, weakref.WeakKeyDictionary[MemoryStream, None]] = {}
        self.cuts: set[tuple[str, str]] = set()
        self.handler_errors = 0
        self._next_index = 0

    # -- peers --------------------------------------------------------------------------

    def add(self, peer_id: str) -> MemoryTransport:
        """A transport for `peer_id` (not yet serving: see `open_memory_transport`)."""
        old = self.transports.get(peer_id)
        if old is not None and old.alive:
            raise ValueError(f"peer {peer_id} is already on this network")
        self._next_index += 1
        transport = MemoryTransport(self, peer_id, self._next_index)
        self.transports[peer_id] = transport
        self.streams[peer_id] = weakref.WeakKeyDictionary()
        return transport

    def crash(self, peer_id: str, *, silent: bool = False) -> None:
        """The peer is gone: its streams reset (or, `silent`, go quiet); nobody can dial it."""
        transport = self.transports.get(peer_id)
        if transport is None or not transport.alive:
            return
        transport.alive = False
        transport.silent = silent
        # Every stream end that touches the peer, at either end (an end its owner dropped
        # without closing still resets when the process dies, as a socket would).
        for stream in list(self.streams.get(peer_id, ())):
            if not silent:
                stream.abort()
            else:  # what others send it is lost; what it sent before it vanished still arrives
                into = stream._in if stream.local.peer_id == peer_id else stream._out
                into.blackhole = True
                into.chunks.clear()
        if not silent:
            for other in list(transport.conns):
                peer = self.transports.get(other)
                if peer is not None:
                    peer.conns.pop(peer_id, None)
            transport.conns.clear()

    # -- links ----------------------------------------------------------------------------

    def link(self, a: str, b: str) -> Link:
        key = (a, b)
        state = self.links.get(key)
        if state is None:
            state = self.links[key] = Link(self.link_model(a, b))
        return state

    def set_link(self, a: str, b: str, spec: LinkSpec, *, both_ways: bool = True) -> None:
        self.link(a, b).spec = spec
        if both_ways:
            self.link(b, a).spec = spec

    def rtt(self, a: str, b: str) -> float:
        return self.link(a, b).spec.latency + self.link(b, a).spec.latency

    def is_cut(self, a: str, b: str) -> bool:
        return (a, b) in self.cuts or (b, a) in self.cuts

    def cut(self, a: str, b: str) -> None:
        """Break the link a <-> b: streams between them reset, dials fail until `heal`."""
        self.cuts.add((a, b))
        self._disconnect(a, b)

    def heal(self, a: str, b: str) -> None:
        self.cuts.discard((a, b))
        self.cuts.discard((b, a))

    # -- streams ----------------------------------------------------------------------------

    def _stream_pair(self, opener: MemoryTransport, acceptor: MemoryTransport,
                     protocol: str) -> tuple[MemoryStream, MemoryStream]:
        there, back = Pipe(), Pipe()
        a, b = opener.peer_id, acceptor.peer_id
        mine = MemoryStream(opener, b, protocol, there, back, self.link(a, b))
        theirs = MemoryStream(acceptor, a, protocol, back, there, self.link(b, a))
        mine._other, theirs._other = weakref.ref(theirs), weakref.ref(mine)
        for end in (mine, theirs):
            self.streams[a][end] = None
            self.streams[b][end] = None
        return mine, theirs

    def _forget(self, stream: MemoryStream) -> None:
        other = stream._other() if stream._other is not None else None
        for peer in (stream.local.peer_id, stream.remote):
            ends = self.streams.get(peer)
            if ends is not None:
                ends.pop(stream, None)
                if other is not None:
                    ends.pop(other, None)

    def _disconnect(self, a: str, b: str) -> None:
        for x, y in ((a, b), (b, a)):
            transport = self.transports.get(x)
            if transport is not None:
                transport.conns.pop(y, None)
        for stream in [s for s in self.streams.get(a, ()) if s.remote in (a, b) and s.local.peer_id in (a, b)]:
            stream.abort()

    def bytes_sent(self) -> int:
        return sum(link.bytes for link in self.links.values())


@asynccontextmanager
async def open_memory_transport(network: MemoryNetwork, peer_id: str) -> AsyncIterator[MemoryTransport]:
    """Put `peer_id` on `network` for the duration of the block (handlers run in its nursery).

    Leaving the block resets the peer's streams (a process that exits closes its
    sockets), unless the network already crashed it.
    """
    transport = network.add(peer_id)
    try:
        async with trio.open_nursery() as nursery:
            transport.nursery = nursery
            transport.alive = True
            try:
                yield transport
            finally:
                network.crash(peer_id)
                nursery.cancel_scope.cancel()
    finally:
        transport.nursery = None


__all__ = ["LinkSpec", "MemoryNetwork", "MemoryStream", "MemoryTransport", "open_memory_transport",
           "DIAL_RTTS", "OPEN_RTTS"]
