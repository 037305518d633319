"""One end of an in-memory stream, and the model of the link under it.

The model of a link (one per ordered pair of peers, shared by all their streams):
a frame written at time ``now`` leaves when the link is free (frames queue
behind each other) and takes ``size / bandwidth`` seconds to send, then
``latency`` seconds to arrive::

    leaves = max(now, link.busy_until);  link.busy_until = leaves + size / bandwidth
    arrives = link.busy_until + latency

Nothing here is random: the same writes give the same arrival times. Writes do
not block (the bytes sit in the link, as in a socket buffer); the reader waits
until they arrive. Opening a stream costs one round trip (multistream-select on
an existing yamux connection); dialling a new connection
`memory_transport.DIAL_RTTS` more (TCP, Noise XX and the muxer's negotiation).
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import trio
from trio.lowlevel import ParkingLot

from tessera.peer.base.errors import StreamClosed


class StreamBook(Protocol):
    """The network's record of open streams (a `MemoryNetwork`): a closed stream is struck from it."""

    def _forget(self, stream: MemoryStream) -> None: ...


class StreamEndpoint(Protocol):
    """The transport a stream end belongs to (a `MemoryTransport`): its peer and its network."""

    peer_id: str

    @property
    def network(self) -> StreamBook: ...


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link: one-way latency in seconds, bandwidth in bytes/s."""

    latency: float = 0.001
    bandwidth: float = 125e6  # 1 Gbit/s

    def __post_init__(self) -> None:
        if not self.latency >= 0:
            raise ValueError(f"latency must be >= 0 seconds, got {self.latency!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")


LinkModel = Callable[[str, str], LinkSpec]


class Link:
    """A directed link's state: its spec and when it finishes sending what it holds."""

    __slots__ = ("spec", "busy_until", "bytes")

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.busy_until = 0.0
        self.bytes = 0


class Pipe:
    """One direction of one stream: chunks in flight, in arrival order."""

    __slots__ = ("chunks", "eof_at", "broken", "blackhole", "lot", "last_arrival")

    def __init__(self) -> None:
        self.chunks: deque[tuple[float, bytes]] = deque()
        self.eof_at: float | None = None  # when the writer's close reaches the reader
        self.broken = False  # reset: both ends raise StreamClosed
        self.blackhole = False  # the reader vanished: writes are lost
        self.lot = ParkingLot()
        self.last_arrival = 0.0

    def break_(self) -> None:
        self.broken = True
        self.chunks.clear()
        self.lot.unpark_all()


class MemoryStream:
    """One end of an in-memory stream (see the module docstring for its timing)."""

    __slots__ = ("local", "remote", "protocol", "_out", "_in", "_link", "_closed_write", "_other", "__weakref__")
    via = "memory"

    def __init__(self, local: StreamEndpoint, remote: str, protocol: str, out: Pipe, into: Pipe,
                 link: Link) -> None:
        self.local = local
        self.remote = remote
        self.protocol = protocol
        self._out = out
        self._in = into
        self._link = link
        self._closed_write = False
        self._other: weakref.ref[MemoryStream] | None = None  # the remote end (weak: no cycle)

    async def read(self, max_bytes: int) -> bytes:
        pipe = self._in
        while True:
            if pipe.broken:
                raise StreamClosed(f"stream from {self.remote} was reset")
            now = trio.current_time()
            if pipe.chunks:
                arrival, data = pipe.chunks[0]
                if arrival > now:
                    await trio.sleep_until(arrival)
                    continue
                if len(data) <= max_bytes:
                    pipe.chunks.popleft()
                    return data
                pipe.chunks[0] = (arrival, data[max_bytes:])
                return data[:max_bytes]
            if pipe.eof_at is not None:
                if pipe.eof_at > now:
                    await trio.sleep_until(pipe.eof_at)
                    continue
                return b""
            await pipe.lot.park()

    async def write(self, data: bytes) -> None:
        pipe = self._out
        if self._closed_write:
            raise StreamClosed(f"stream to {self.remote} is closed for writing")
        if pipe.broken:
            raise StreamClosed(f"stream to {self.remote} was reset")
        if pipe.blackhole:
            return  # the remote vanished silently: the bytes go nowhere, as on a dead wifi
        link = self._link
        now = trio.current_time()
        spec = link.spec
        link.busy_until = max(now, link.busy_until) + len(data) / spec.bandwidth
        link.bytes += len(data)
        arrival = max(link.busy_until + spec.latency, pipe.last_arrival)
        pipe.last_arrival = arrival
        pipe.chunks.append((arrival, bytes(data)))
        pipe.lot.unpark_all()

    async def close(self) -> None:
        """Half-close: the remote reads what was sent, then end of stream."""
        if self._closed_write or self._out.broken:
            return
        self._closed_write = True
        pipe = self._out
        pipe.eof_at = max(trio.current_time() + self._link.spec.latency, pipe.last_arrival)
        pipe.lot.unpark_all()
        other = self._other() if self._other is not None else None
        if other is not None and other._closed_write:
            self.local.network._forget(self)

    async def reset(self) -> None:
        self.abort()

    def abort(self) -> None:
        """Reset both directions now (both ends raise StreamClosed)."""
        self._out.break_()
        self._in.break_()
        self.local.network._forget(self)
