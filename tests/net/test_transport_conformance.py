"""One conformance suite for every `Transport`: the same checks against each implementation.

As trio's `check_two_way_stream` does for its streams: what the peer code relies on —
bytes in order, a half-close, a reset, refusals, a failing handler, the remote's identity,
streams at once — is checked the same way on the in-memory network the simulator runs,
on real py-libp2p hosts (yamux streams), on dedicated connections (peer/net/dedicated/)
and on the emulated slow link, so that simulation and the network cannot drift apart.
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

import pytest
import trio

from tessera.peer.base.errors import PeerUnreachable, StreamClosed
from tessera.peer.base.protocols import GOSSIP_PROTOCOL, LINK_PROTOCOL, SESSION_PROTOCOL
from tessera.peer.net.dedicated.service import DEDICATED_PROTOCOLS
from tessera.peer.net.dedicated.stream import DedicatedStream
from tessera.peer.net.emulated import EmulatedTransport, LinkEmulation
from tessera.peer.net.libp2p import Libp2pStream, open_libp2p_transport
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.net.transport import Stream, Transport

WAIT = 10.0  # no check here takes more than milliseconds; a hang fails after this


@dataclass
class Pair:
    """Two connected transports: `a` opens streams on `protocol`, `b` serves it."""

    a: Transport
    b: Transport
    protocol: str
    stream_type: type | None  # what `a.open_stream` must return (None: the transport's own)


@asynccontextmanager
async def memory_pair() -> AsyncIterator[Pair]:
    network = MemoryNetwork()
    async with open_memory_transport(network, "peer-a") as a, open_memory_transport(network, "peer-b") as b:
        yield Pair(a, b, SESSION_PROTOCOL, None)


@asynccontextmanager
async def libp2p_pair(*, dedicated: bool, protocol: str) -> AsyncIterator[Pair]:
    async with open_libp2p_transport(os.urandom(32), dedicated=dedicated, dedicated_listen=False) as a, \
            open_libp2p_transport(os.urandom(32), dedicated=dedicated) as b:
        await a.connect(b.addrs()[0])
        yield Pair(a, b, protocol, DedicatedStream if dedicated and protocol in DEDICATED_PROTOCOLS else Libp2pStream)


@asynccontextmanager
async def emulated_pair() -> AsyncIterator[Pair]:
    async with memory_pair() as inner, trio.open_nursery() as nursery:
        a = EmulatedTransport(inner.a, LinkEmulation(delay=0.002, jitter=0.001, rate=50e6), nursery)
        b = EmulatedTransport(inner.b, LinkEmulation(delay=0.002), nursery)
        yield Pair(a, b, inner.protocol, None)
        nursery.cancel_scope.cancel()


PAIRS = {
    "memory": memory_pair,
    "libp2p-yamux": lambda: libp2p_pair(dedicated=False, protocol=SESSION_PROTOCOL),
    "libp2p-dedicated": lambda: libp2p_pair(dedicated=True, protocol=SESSION_PROTOCOL),
    "libp2p-dedicated-link": lambda: libp2p_pair(dedicated=True, protocol=LINK_PROTOCOL),
    # a protocol dedicated connections do not carry: the same host, on yamux
    "libp2p-dedicated-host-gossip": lambda: libp2p_pair(dedicated=True, protocol=GOSSIP_PROTOCOL),
    "emulated": emulated_pair,
}


@pytest.fixture(params=sorted(PAIRS))
def make_pair(request):
    return PAIRS[request.param]


async def read_until_eof(stream: Stream) -> bytes:
    out = bytearray()
    while chunk := await stream.read(1 << 16):
        out += chunk
    return bytes(out)


async def open_checked(pair: Pair) -> Stream:
    stream = await pair.a.open_stream(pair.b.peer_id, pair.protocol)
    if pair.stream_type is not None:
        assert isinstance(stream, pair.stream_type), f"{type(stream).__name__} is not a {pair.stream_type.__name__}"
    return stream


async def test_bytes_arrive_in_order_both_ways(make_pair) -> None:
    sizes = [1, 100, 2400, 70_000, 200_000]  # past one Noise message (64 KiB) and one read
    async with make_pair() as pair:

        async def echo(stream: Stream) -> None:
            await stream.write(await read_until_eof(stream))
            await stream.close()

        pair.b.set_handler(pair.protocol, echo)
        with trio.fail_after(WAIT):
            stream = await open_checked(pair)
            sent = b"".join(os.urandom(n) for n in sizes)
            for offset, n in zip([0, *[sum(sizes[:i + 1]) for i in range(len(sizes))]], sizes):
                await stream.write(sent[offset : offset + n])
            await stream.close()
            assert await read_until_eof(stream) == sent
            assert await stream.read(10) == b""  # and stays at its end


async def test_close_is_a_half_close(make_pair) -> None:
    async with make_pair() as pair:

        async def answer_after_eof(stream: Stream) -> None:
            request = await read_until_eof(stream)  # the opener closed its side...
            await stream.write(b"got " + request)  # ...and still reads what this side sends
            await stream.close()

        pair.b.set_handler(pair.protocol, answer_after_eof)
        with trio.fail_after(WAIT):
            stream = await open_checked(pair)
            await stream.write(b"question")
            await stream.close()
            with pytest.raises(StreamClosed):
                await stream.write(b"more")  # a closed side sends nothing more
            assert await read_until_eof(stream) == b"got question"


async def test_a_reset_ends_the_remote(make_pair) -> None:
    """A reset ends the remote's reads at once, and its writes fail. py-libp2p 0.8.1's yamux
    reports a reset that arrives before the read as the end of the stream (it forgets the
    stream on RST), so a reader may see b"" or StreamClosed; `Channel` makes both
    StreamClosed, which is all the peer code relies on. Everywhere else it is StreamClosed."""
    async with make_pair() as pair:
        outcome: list[str] = []
        done = trio.Event()

        async def read_until_reset(stream: Stream) -> None:
            try:
                while await stream.read(1024):
                    pass
                outcome.append("end")
            except StreamClosed:
                outcome.append("reset")
            try:
                for _ in range(50):  # a reset reaches the writer after a round trip at most
                    await stream.write(b"still there?")
                    await trio.sleep(0.01)
                outcome.append("writes go on")
            except StreamClosed:
                outcome.append("writes fail")
            done.set()

        pair.b.set_handler(pair.protocol, read_until_reset)
        with trio.fail_after(WAIT):
            stream = await open_checked(pair)
            await stream.write(b"hello")
            await trio.sleep(0.05)
            await stream.reset()
            await done.wait()
        yamux = isinstance(stream, Libp2pStream)
        assert outcome in ([["reset", "writes fail"], ["end", "writes fail"]] if yamux else [["reset", "writes fail"]])


async def test_a_protocol_nobody_serves_is_unreachable(make_pair) -> None:
    async with make_pair() as pair:
        with trio.fail_after(WAIT), pytest.raises(PeerUnreachable):
            await pair.a.open_stream(pair.b.peer_id, pair.protocol)  # no handler set on b


async def test_a_failing_handler_ends_only_its_stream(make_pair) -> None:
    async with make_pair() as pair:
        calls = 0

        async def flaky(stream: Stream) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                await stream.read(10)
                raise RuntimeError("a handler bug")
            await stream.write(b"fine")
            await stream.close()

        pair.b.set_handler(pair.protocol, flaky)
        with trio.fail_after(WAIT):
            first = await open_checked(pair)
            await first.write(b"x")
            try:
                leftover = await read_until_eof(first)
            except StreamClosed:
                leftover = b""
            assert leftover == b""
            second = await open_checked(pair)
            assert await read_until_eof(second) == b"fine"


async def test_each_end_knows_the_other_peer(make_pair) -> None:
    async with make_pair() as pair:
        seen: list[str] = []

        async def note(stream: Stream) -> None:
            seen.append(stream.remote)
            await stream.close()

        pair.b.set_handler(pair.protocol, note)
        with trio.fail_after(WAIT):
            stream = await open_checked(pair)
            assert await read_until_eof(stream) == b""
        assert stream.remote == pair.b.peer_id and seen == [pair.a.peer_id]


async def test_many_streams_at_once(make_pair) -> None:
    async with make_pair() as pair:

        async def echo(stream: Stream) -> None:
            await stream.write(await read_until_eof(stream))
            await stream.close()

        pair.b.set_handler(pair.protocol, echo)
        got: dict[int, bytes] = {}
        payloads = {i: os.urandom(500 + 97 * i) for i in range(16)}

        async def one(i: int) -> None:
            stream = await open_checked(pair)
            await stream.write(payloads[i])
            await stream.close()
            got[i] = await read_until_eof(stream)

        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                for i in payloads:
                    nursery.start_soon(one, i)
        assert got == payloads
