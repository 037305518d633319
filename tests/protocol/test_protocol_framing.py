"""Framing: round trips through both readers, and the size limit checked on the
header, before the body is read or allocated."""

from __future__ import annotations

from collections import deque

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from tessera.protocol.errors import BadLengthPrefix, EndOfStream, FrameTooLarge, TruncatedFrame
from tessera.protocol.errors import WireError
from tessera.protocol.framing import (
    DEFAULT_MAX_FRAME, READ_CHUNK, FrameDecoder, encode_frame, read_buffered_frame, read_frame,
)


class Reader:
    """read_exactly over a byte string, recording every request."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.requests = data, 0, []

    async def __call__(self, n: int) -> bytes:
        self.requests.append(n)
        chunk = self.data[self.pos : self.pos + n]
        self.pos += len(chunk)
        return chunk


class Chunks:
    """A stream's read(max_bytes) over the pieces it received (as a memory stream hands out
    its writes), recording every request."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces, self.requests = deque(p for p in pieces if p), []

    async def read(self, n: int) -> bytes:
        self.requests.append(n)
        if not self.pieces:
            return b""
        piece = self.pieces[0]
        if len(piece) <= n:
            return self.pieces.popleft()
        self.pieces[0] = piece[n:]
        return piece[:n]


async def _all_frames(read_one) -> tuple[list[bytes], str]:
    """Frames until the reader raises; the error as 'Type: message'."""
    got = []
    while True:
        try:
            got.append(await read_one())
        except WireError as end:
            return got, f"{type(end).__name__}: {end}"


def _old_and_buffered(pieces: list[bytes], max_size: int) -> tuple[tuple, tuple]:
    """The same stream read by read_frame over a buffering read_exactly (what Channel did
    before) and by read_buffered_frame: (frames, final error, the reads asked of the stream)."""
    old, new = Chunks(pieces), Chunks(pieces)
    old_buffer, new_buffer = bytearray(), bytearray()

    async def read_exactly(n: int) -> bytes:
        while len(old_buffer) < n:
            chunk = await old.read(max(n - len(old_buffer), READ_CHUNK))
            if not chunk:
                break
            old_buffer.extend(chunk)
        out = bytes(old_buffer[:n])
        del old_buffer[:n]
        return out

    async def both() -> tuple[tuple, tuple]:
        a = await _all_frames(lambda: read_frame(read_exactly, max_size=max_size))
        b = await _all_frames(lambda: read_buffered_frame(new_buffer, new.read, max_size=max_size))
        return (*a, old.requests), (*b, new.requests)

    return trio.run(both)


@given(payloads=st.lists(st.binary(max_size=300), max_size=6), tail=st.binary(max_size=12),
       cuts=st.lists(st.integers(0, 2000), max_size=8), max_size=st.sampled_from([100, 300, DEFAULT_MAX_FRAME]))
def test_buffered_reader_reads_as_read_frame_does(payloads: list[bytes], tail: bytes, cuts: list[int],
                                                  max_size: int) -> None:
    """Any split, any garbage after the frames, any limit: the same frames, the same error
    at the same byte, and the same reads asked of the stream (so the same waits)."""
    stream = b"".join(encode_frame(p) for p in payloads) + tail
    points = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    old, new = _old_and_buffered([stream[a:b] for a, b in zip(points, points[1:])], max_size)
    assert new == old
    assert new[0][: len(payloads)] == payloads[: len(new[0])]  # the tail may hold frames too


def test_buffered_reader_asks_for_a_big_frame_in_at_most_two_reads() -> None:
    big = bytes(range(256)) * 800  # 200 KB: more than one READ_CHUNK
    frames = encode_frame(big) + encode_frame(b"next")
    old, new = _old_and_buffered([frames[:70_000], frames[70_000:]], DEFAULT_MAX_FRAME)
    assert new == old
    assert new[0] == [big, b"next"] and new[1].startswith("EndOfStream")
    assert new[2][:2] == [READ_CHUNK, len(big) + 3 - READ_CHUNK]


@given(payloads=st.lists(st.binary(max_size=300), max_size=6), cuts=st.lists(st.integers(0, 2000), max_size=8))
def test_frame_decoder_reassembles_any_split(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    decoder = FrameDecoder()
    got = []
    points = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    for start, end in zip(points, points[1:]):
        got += decoder.feed(stream[start:end])
    decoder.close()
    assert got == payloads
    assert decoder.buffered == 0


async def test_read_frame_round_trips_over_a_trio_stream() -> None:
    send, receive = trio.testing.memory_stream_pair()
    payloads = [b"", b"x", bytes(range(256)) * 40, b"last"]
    buffer = bytearray()

    async def read_exactly(n: int) -> bytes:
        while len(buffer) < n:
            chunk = await receive.receive_some(4096)
            if not chunk:
                break
            buffer.extend(chunk)
        out = bytes(buffer[:n])
        del buffer[:n]
        return out

    async with trio.open_nursery() as nursery:

        async def writer() -> None:
            for p in payloads:
                await send.send_all(encode_frame(p))
            await send.aclose()

        nursery.start_soon(writer)
        got = [await read_frame(read_exactly) for _ in payloads]
        with pytest.raises(EndOfStream):
            await read_frame(read_exactly)
    assert got == payloads


@pytest.mark.parametrize("claim", [10 * 10**9, DEFAULT_MAX_FRAME + 1, 2**64 - 1])
async def test_a_huge_claim_is_refused_after_reading_only_the_header(claim: int) -> None:
    prefix = bytearray()
    n = claim
    while n >= 0x80:
        prefix.append(n & 0x7F | 0x80)
        n >>= 7
    prefix.append(n)
    reader = Reader(bytes(prefix) + b"body bytes that must never be read")
    with pytest.raises(FrameTooLarge, match="frame claims at least"):
        await read_frame(reader)
    assert reader.requests == [1] * len(reader.requests)  # only single header bytes were asked for
    assert reader.pos <= len(prefix)
    with pytest.raises(FrameTooLarge):
        FrameDecoder().feed(prefix)


async def test_ten_gigabytes_is_refused_within_five_header_bytes() -> None:
    reader = Reader(bytes.fromhex("80c8afa025") + b"...")  # uvarint(10_000_000_000)
    with pytest.raises(FrameTooLarge):
        await read_frame(reader)
    assert reader.pos <= 5


async def test_truncation_and_clean_end_are_told_apart() -> None:
    with pytest.raises(EndOfStream, match="between frames"):
        await read_frame(Reader(b""))
    with pytest.raises(TruncatedFrame, match="inside the length prefix '80'"):
        await read_frame(Reader(b"\x80"))
    with pytest.raises(TruncatedFrame, match="after 3 of a frame's 5 bytes"):
        await read_frame(Reader(b"\x05abc"))
    decoder = FrameDecoder()
    assert decoder.feed(b"\x05abc") == []
    with pytest.raises(TruncatedFrame, match="4 bytes of an incomplete frame"):
        decoder.close()


@pytest.mark.parametrize(
    ("prefix", "needle"),
    [(b"\x80\x00", "'8000' is not minimal"), (b"\x81\x80\x00", "not minimal"), (b"\x80" * 10 + b"\x00", "too long")],
)
async def test_bad_prefixes(prefix: bytes, needle: str) -> None:
    with pytest.raises(BadLengthPrefix, match=needle):
        await read_frame(Reader(prefix + b"xx"), max_size=2**70)
    with pytest.raises(BadLengthPrefix, match=needle):
        FrameDecoder(max_size=2**70).feed(prefix)


def test_limits_on_both_sides_and_a_failed_decoder_stays_failed() -> None:
    with pytest.raises(FrameTooLarge, match="payload of 11 bytes exceeds max_size 10"):
        encode_frame(b"x" * 11, max_size=10)
    decoder = FrameDecoder(max_size=10)
    assert decoder.feed(encode_frame(b"x" * 10)) == [b"x" * 10]
    with pytest.raises(FrameTooLarge):
        decoder.feed(b"\x0b")
    with pytest.raises(FrameTooLarge):
        decoder.feed(encode_frame(b"ok"))


def test_uvarint_prefix_matches_the_multiformats_encoding() -> None:
    assert encode_frame(b"")[:1] == b"\x00"
    assert encode_frame(b"a" * 300)[:2] == b"\xac\x02"
