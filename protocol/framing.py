"""Length-prefixed frames over a byte stream, with a hard size limit.

A frame is an unsigned LEB128 varint (the multiformats `uvarint` that libp2p uses
for its own length prefixes) holding the payload length, then the payload:

    frame = uvarint(len(payload)) || payload

The limit is checked while the prefix is still being read, so a frame that claims
10 GB is refused after its first five bytes, before anything is allocated for its
body. Prefixes must be minimal (no trailing 0x80 ... 0x00 padding) and at most ten
bytes long.

Three readers share one prefix parser: `read_frame` pulls from an async
`read_exactly` that the caller supplies (together with any timeout: this module has
no clock); `read_buffered_frame` does the same from a buffer that it refills from an
async `read` (what a `Channel` uses: a frame that arrived in one piece costs one read
and no coroutine per byte); and `FrameDecoder` is fed bytes as they come, for tests
and fuzzing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tessera.protocol.errors import BadLengthPrefix, EndOfStream, FrameTooLarge, TruncatedFrame, WireError

DEFAULT_MAX_FRAME = 64 * 1024 * 1024
"""64 MiB: a 2048-token prefill of hidden size 8192 in float32, with its header."""

MAX_PREFIX_BYTES = 10
"""A uvarint of up to 64 bits takes at most ten bytes."""

READ_CHUNK = 65536
"""The least `read_buffered_frame` asks its stream for at once (a frame usually arrives whole)."""


def encode_frame(payload: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_FRAME) -> bytes:
    """Prefix `payload` with its length.

    Raises:
        FrameTooLarge: the payload is longer than `max_size`.
    """
    n = len(payload)
    if n > max_size:
        raise FrameTooLarge(f"payload of {n!r} bytes exceeds max_size {max_size!r}")
    prefix = bytearray()
    while n >= 0x80:
        prefix.append(n & 0x7F | 0x80)
        n >>= 7
    prefix.append(n)
    return b"".join((prefix, payload))


def parse_prefix(buf: bytes | bytearray | memoryview, pos: int, *, max_size: int) -> tuple[int, int] | None:
    """Parse the length prefix that starts at `buf[pos]`.

    Returns (payload length, prefix length), or None if `buf` ends inside the prefix.

    Raises:
        FrameTooLarge: the length exceeds `max_size` (raised as soon as the bytes
            read so far prove it, even if the prefix is incomplete).
        BadLengthPrefix: the prefix is longer than ten bytes or not minimal.
    """
    length = 0
    for i in range(MAX_PREFIX_BYTES):
        if pos + i >= len(buf):
            return None
        byte = buf[pos + i]
        length |= (byte & 0x7F) << (7 * i)
        if length > max_size:
            raise FrameTooLarge(f"frame claims at least {length!r} bytes, max_size is {max_size!r}")
        if not byte & 0x80:
            if byte == 0 and i > 0:
                raise BadLengthPrefix(f"frame length prefix {bytes(buf[pos : pos + i + 1]).hex()!r} is not minimal")
            return length, i + 1
    raise BadLengthPrefix(f"frame length prefix {bytes(buf[pos : pos + MAX_PREFIX_BYTES]).hex()!r} is too long")


async def read_frame(
    read_exactly: Callable[[int], Awaitable[bytes]],
    *,
    max_size: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """Read one frame's payload from a stream.

    `read_exactly(n)` must return n bytes, or fewer only when the stream has ended.
    It is called with n = 1 for each prefix byte and once with the payload length
    (only after that length has been checked against `max_size`); wrap the call in
    the caller's own timeout.

    Raises:
        EndOfStream: the stream ended cleanly before the first byte of a frame.
        TruncatedFrame: the stream ended inside a frame.
        FrameTooLarge: the prefix claims more than `max_size` bytes.
        BadLengthPrefix: the prefix is overlong or not minimal.
    """
    prefix = bytearray()
    while True:
        byte = await read_exactly(1)
        if len(byte) != 1:
            if not prefix:
                raise EndOfStream("stream ended between frames")
            raise TruncatedFrame(f"stream ended inside the length prefix {bytes(prefix).hex()!r}")
        prefix += byte
        parsed = parse_prefix(prefix, 0, max_size=max_size)
        if parsed is not None:
            break
    length = parsed[0]
    if length == 0:
        return b""
    payload = await read_exactly(length)
    if len(payload) != length:
        raise TruncatedFrame(f"stream ended after {len(payload)!r} of a frame's {length!r} bytes")
    return payload


async def read_buffered_frame(
    buffer: bytearray,
    read: Callable[[int], Awaitable[bytes]],
    *,
    max_size: int = DEFAULT_MAX_FRAME,
    on_length: Callable[[int], None] | None = None,
) -> bytes:
    """Read one frame's payload, as `read_frame` does over a buffered `read_exactly`.

    `buffer` holds bytes received and not used yet; the frame's bytes are taken from
    its front, and it keeps what follows the frame. When it holds too little, `read(n)`
    (up to n bytes; b"" at the end of the stream) refills it: for the prefix with
    READ_CHUNK, for the payload with max(missing bytes, READ_CHUNK). Those are exactly
    the reads that `read_frame` over a buffering `read_exactly` makes, so a stream sees
    the same calls (and a caller the same waits); the checks, errors and the bytes they
    are raised at are read_frame's too. Wrap the call in the caller's own timeout.
    `on_length`, when given, is told the frame's length once its prefix is read and before
    its body is (a peer charges what it is about to buffer: peer/net/intake.py); whatever
    it raises ends the read.

    Raises:
        EndOfStream: the stream ended cleanly before the first byte of a frame.
        TruncatedFrame: the stream ended inside a frame.
        FrameTooLarge: the prefix claims more than `max_size` bytes.
        BadLengthPrefix: the prefix is overlong or not minimal.
    """
    while (parsed := parse_prefix(buffer, 0, max_size=max_size)) is None:
        chunk = await read(READ_CHUNK)
        if not chunk:
            if not buffer:
                raise EndOfStream("stream ended between frames")
            raise TruncatedFrame(f"stream ended inside the length prefix {bytes(buffer).hex()!r}")
        buffer += chunk
    length, start = parsed
    if on_length is not None:
        on_length(length)
    end = start + length
    while len(buffer) < end:
        chunk = await read(max(end - len(buffer), READ_CHUNK))
        if not chunk:
            got = len(buffer) - start
            del buffer[:]
            raise TruncatedFrame(f"stream ended after {got!r} of a frame's {length!r} bytes")
        buffer += chunk
    with memoryview(buffer) as view:  # one copy, not two
        payload = bytes(view[start:end])
    del buffer[:end]
    return payload


class FrameDecoder:
    """Split a byte stream that arrives in arbitrary pieces into frame payloads.

    It buffers at most one incomplete frame (bounded by `max_size` plus a prefix)
    beyond what one `feed` call hands it. After it raises, the stream is out of
    step and cannot be resynchronised, so every later `feed` raises the same error.
    """

    def __init__(self, *, max_size: int = DEFAULT_MAX_FRAME) -> None:
        self.max_size = max_size
        self._buffer = bytearray()
        self._failed: WireError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received that do not yet form a complete frame."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Add bytes; return the payloads of every frame they complete, in order.

        Raises:
            FrameTooLarge: a prefix claims more than `max_size` bytes.
            BadLengthPrefix: a prefix is overlong or not minimal.
        """
        if self._failed is not None:
            raise type(self._failed)(*self._failed.args)
        self._buffer += data
        frames = []
        pos = 0
        try:
            while (parsed := parse_prefix(self._buffer, pos, max_size=self.max_size)) is not None:
                length, prefix_len = parsed
                end = pos + prefix_len + length
                if end > len(self._buffer):
                    break
                with memoryview(self._buffer) as view:  # one copy, not two
                    frames.append(bytes(view[pos + prefix_len : end]))
                pos = end
        except WireError as exc:
            self._failed = exc
            raise
        finally:
            del self._buffer[:pos]
        return frames

    def close(self) -> None:
        """Declare the end of the stream.

        Raises:
            TruncatedFrame: bytes of an incomplete frame are still buffered.
        """
        if self._buffer:
            raise TruncatedFrame(f"stream ended with {len(self._buffer)!r} bytes of an incomplete frame")
