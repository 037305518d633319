"""The one small interface between the peer logic and the network.

Everything in peer/ that moves bytes — the stage server, the requester, gossip,
pings — speaks to a `Transport`: open a stream to a peer on a protocol, serve a
protocol. `peer/libp2p_transport.py` implements it over real py-libp2p hosts;
`peer/net/memory.py` implements it in memory for simulation and replay
of many peers under trio's MockClock. Both run the same peer code.

On top of a raw byte `Stream`, `Channel` sends and receives whole protocol
messages: a length-prefixed frame (size checked before the body is read) holding
one CBOR message.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Awaitable, Callable, Protocol, Sequence

import logging

import trio

from tessera.protocol.codec import decode, encode
from tessera.protocol.errors import EndOfStream, WireError
from tessera.protocol.framing import DEFAULT_MAX_FRAME, encode_frame, read_buffered_frame
from tessera.protocol.messages import LinkHello

from tessera.peer.base.errors import PeerUnreachable, StreamClosed
from tessera.peer.base.quick import QuickLock
from tessera.peer.net.intake import Intake

log = logging.getLogger(__name__)


class LinkKind(StrEnum):
    """How this peer is connected to another, as shown by `swarm status` and the TUI."""

    DIRECT = "direct"
    PUNCHED = "punched"  # direct, after a DCUtR hole punch
    RELAYED = "relayed"


DIRECT = LinkKind.DIRECT
PUNCHED = LinkKind.PUNCHED
RELAYED = LinkKind.RELAYED


class Stream(Protocol):
    """A bidirectional byte stream to one remote peer."""

    remote: str  # the remote peer id
    via: str  # what carries it: "libp2p" (a yamux stream), "dedicated" (peer/net/dedicated/), "memory"

    async def read(self, max_bytes: int) -> bytes:
        """Up to max_bytes; b"" at end of stream. Raises StreamClosed on reset."""
        ...

    async def write(self, data: bytes) -> None:
        """Raises StreamClosed if the stream is gone."""
        ...

    async def close(self) -> None: ...

    async def reset(self) -> None: ...


Handler = Callable[[Stream], Awaitable[None]]


class Transport(Protocol):
    """What the peer logic needs from a network."""

    peer_id: str
    # what this peer holds for inbound streams not admitted yet, every protocol together
    # (peer/net/intake.py): each protocol's handler enters its streams there
    intake: Intake

    def addrs(self) -> list[str]:
        """Addresses others can dial this peer on (full multiaddrs with /p2p/<id>)."""
        ...

    def set_handler(self, protocol: str, handler: Handler) -> None: ...

    async def connect(self, addr: str) -> str:
        """Dial a multiaddr; return the remote peer id. Raises PeerUnreachable."""
        ...

    async def open_stream(self, peer_id: str, protocol: str, *, addrs: Sequence[str] = ()) -> Stream:
        """A new stream to `peer_id` (dialling `addrs` first if not connected). Raises PeerUnreachable."""
        ...

    def connected(self) -> list[str]:
        """Peer ids with a live connection."""
        ...

    def connection_kind(self, peer_id: str) -> str | None:
        """DIRECT, PUNCHED or RELAYED for a connected peer; None if not connected."""
        ...

    def stream_count(self, peer_id: str) -> int:
        """Streams open with `peer_id` now, either side's (0: its connection is idle, or there is none)."""
        ...

    async def disconnect(self, peer_id: str) -> None: ...


MEMO_MAX_BYTES = 512
MEMO_ENTRIES = 4096
# Small messages that recur byte for byte — a gossip digest of a view many peers share, an
# empty gossip turn — are encoded and decoded once (`Channel(memo=True)`): both are pure
# functions, and a decoded message is frozen, so one copy serves every receiver. A simulation
# of thousands of peers that agree sends the same digest thousands of times a period.
_ENCODED: dict[object, bytes] = {}
_DECODED: dict[bytes, object] = {}


def _remember(memo: dict, key: object, value: object) -> None:
    memo[key] = value
    if len(memo) > MEMO_ENTRIES:
        del memo[next(iter(memo))]  # the oldest


class Channel:
    """Whole messages over a stream: one frame, one CBOR message, limits checked first.

    Sends are serialised by a lock, so several tasks may share one channel; one
    task at a time should receive. `memo`: small messages are encoded and decoded once
    per process (see MEMO_MAX_BYTES).
    """

    def __init__(self, stream: Stream, *, max_frame: int = DEFAULT_MAX_FRAME, memo: bool = False,
                 on_frame: Callable[[int], None] | None = None, max_send: int | None = None) -> None:
        self.stream = stream
        self.memo = memo
        self.max_frame = max_frame
        # what it may send, when its answers are bigger than what it reads from a stranger (a
        # weights holder reads 1.5 KiB requests and answers chunks); None: max_frame, both ways
        self.max_send = max_send
        # told each frame's length before its body is read (an unadmitted stream's charge:
        # peer/net/intake.py `Ticket.charge`); None once the stream is admitted
        self.on_frame = on_frame
        self.remote = stream.remote
        self._send_lock = QuickLock()
        self._buffer = bytearray()
        self.bytes_in = 0
        self.bytes_out = 0

    async def send(self, msg: object) -> int:
        """Send one message; returns the bytes written. Raises StreamClosed."""
        payload = _ENCODED.get(msg) if self.memo else None
        if payload is None:
            payload = encode(msg)
            if self.memo and len(payload) <= MEMO_MAX_BYTES:
                _remember(_ENCODED, msg, payload)
        frame = encode_frame(payload, max_size=self.max_frame if self.max_send is None else self.max_send)
        async with self._send_lock:
            await self.stream.write(frame)
        self.bytes_out += len(frame)
        return len(frame)

    async def receive(self) -> object:
        """The next message. Raises StreamClosed at end of stream, WireError on a bad frame."""
        try:
            payload = await read_buffered_frame(self._buffer, self.stream.read, max_size=self.max_frame,
                                                on_length=self.on_frame)
        except EndOfStream:
            raise StreamClosed(f"stream from {self.remote} ended") from None
        self.bytes_in += len(payload)
        if self.memo and len(payload) <= MEMO_MAX_BYTES:
            key = bytes(payload)
            msg = _DECODED.get(key)
            if msg is None:
                msg = decode(key, max_size=self.max_frame)
                _remember(_DECODED, key, msg)
            return msg
        return decode(payload, max_size=self.max_frame)

    async def receive_or_none(self) -> object | None:
        """The next message, or None at a clean end of stream."""
        try:
            return await self.receive()
        except StreamClosed:
            return None

    def take_buffered(self) -> bytes:
        """Bytes read off the stream past the last message (handing the stream on to another reader)."""
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    async def close(self) -> None:
        await self.stream.close()

    async def reset(self) -> None:
        await self.stream.reset()


async def run_handler(handler: Handler, stream: Stream, *, protocol: str) -> bool:
    """Run a protocol handler as every transport runs it: a failure (a bug, whatever a remote
    sent) resets its own stream and ends there, never in the host. Returns False if it failed."""
    try:
        await handler(stream)
    except (trio.Cancelled, KeyboardInterrupt):
        raise
    except Exception:
        log.exception("the %s handler failed (remote %s)", protocol, stream.remote)
        await stream.reset()
        return False
    return True


async def open_channel(transport: Transport, peer_id: str, protocol: str, *, addrs: Sequence[str] = ()) -> Channel:
    return Channel(await transport.open_stream(peer_id, protocol, addrs=addrs))


async def receive_link_hello(channel: Channel) -> LinkHello:
    """The first frame of a link (previous peer -> this one, or rank -> rank). Raises WireError."""
    hello = await channel.receive()
    if not isinstance(hello, LinkHello):
        raise WireError(f"expected LinkHello, got {type(hello).__name__}")
    return hello


__all__ = [
    "LinkKind",
    "DIRECT",
    "PUNCHED",
    "RELAYED",
    "Stream",
    "Handler",
    "Transport",
    "Channel",
    "open_channel",
    "run_handler",
    "receive_link_hello",
]
