"""Framing: round trips through both readers, and the size limit checked on the
header, before the body is read or allocated."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from tessera.protocol.errors import BadLengthPrefix, EndOfStream, FrameTooLarge, TruncatedFrame
from tessera.protocol.framing import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame, read_frame


class Reader:
    """read_exactly over a byte string, recording every request."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.requests = data, 0, []

    async def __call__(self, n: int) -> bytes:
        self.requests.append(n)
        chunk = self.data[self.pos : self.pos + n]
        self.pos += len(chunk)
        return chunk


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
