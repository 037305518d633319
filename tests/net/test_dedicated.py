"""Dedicated connections (peer/net/dedicated/): when they are used, when not, what a stranger's
connections cost the listener, and how a stream ends. The streams themselves also run the
transport conformance suite (test_transport_conformance.py)."""

from __future__ import annotations

import gc
import os
import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest
import trio
from hypothesis import HealthCheck, given, settings, strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from tessera.peer.base.errors import PeerUnreachable, StreamClosed
from tessera.peer.base.protocols import GOSSIP_PROTOCOL, LINK_PROTOCOL, SESSION_PROTOCOL
from tessera.peer.net.dedicated import service, stream as stream_module
from tessera.peer.net.dedicated.service import DedicatedLimits, DedicatedStreams
from tessera.peer.net.dedicated.stream import DedicatedStream
from tessera.peer.net.libp2p import Libp2pStream, Libp2pTransport, open_libp2p_transport
from tessera.peer.net.transport import DIRECT, PUNCHED, RELAYED, Channel, Stream
from tessera.protocol.codec import decode, encode
from tessera.protocol.dedicated import DedicatedAccept, DedicatedEndpoint
from tessera.protocol.errors import WireError
from tessera.protocol.framing import FrameDecoder, encode_frame

WAIT = 10.0
SWARM_KEY = bytes(range(32))


async def echo(stream: Stream) -> None:
    while data := await stream.read(1 << 16):
        await stream.write(data)
    await stream.close()


async def round_trip(stream: Stream, data: bytes = b"ping") -> bytes:
    await stream.write(data)
    got = b""
    while len(got) < len(data):
        got += await stream.read(1 << 16)
    return got


async def wait_for(condition, what: str) -> None:
    with trio.move_on_after(WAIT):
        while not condition():
            await trio.sleep(0.01)
        return
    raise AssertionError(f"timed out waiting for {what}")


def pair(**b_options):
    """A dialler `a` (it listens for none) and a listener `b`, not yet connected."""
    return open_libp2p_transport(os.urandom(32), dedicated_listen=False), open_libp2p_transport(os.urandom(32), **b_options)


@asynccontextmanager
async def hosts() -> AsyncIterator[tuple[Libp2pTransport, Libp2pTransport]]:
    """`pair()`, running, with `a` connected to `b` over libp2p."""
    one, two = pair()
    async with one as a, two as b:
        await a.connect(b.addrs()[0])
        yield a, b


def banned(transport: Libp2pTransport, peer_id: str) -> bool:
    return transport.dedicated.avoid.is_banned(peer_id, transport.dedicated.clock())


# -- when they are used ----------------------------------------------------------------


async def test_hot_streams_get_their_own_connection_and_the_rest_stay_on_libp2p() -> None:
    async with hosts() as (a, b):
        b.set_handler(SESSION_PROTOCOL, echo)
        b.set_handler(GOSSIP_PROTOCOL, echo)
        with trio.fail_after(WAIT):
            session = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            gossip = await a.open_stream(b.peer_id, GOSSIP_PROTOCOL)
            assert isinstance(session, DedicatedStream) and isinstance(gossip, Libp2pStream)
            assert await round_trip(session) == b"ping" and await round_trip(gossip) == b"ping"
            assert (a.dedicated.opened, b.dedicated.accepted) == (1, 1)
            assert a.dedicated.live(b.peer_id) == 1 and b.dedicated.live(a.peer_id) == 1
            await session.close()
            await wait_for(lambda: a.dedicated.live() == 0 and b.dedicated.live() == 0, "both sockets released")


@pytest.mark.parametrize("side", ["dialler off", "listener off"])
async def test_without_dedicated_connections_on_either_side_streams_are_libp2p(side: str) -> None:
    async with open_libp2p_transport(os.urandom(32), dedicated=side != "dialler off", dedicated_listen=False) as a, \
            open_libp2p_transport(os.urandom(32), dedicated=side != "listener off") as b:
        b.set_handler(SESSION_PROTOCOL, echo)
        await a.connect(b.addrs()[0])
        with trio.fail_after(WAIT):
            stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            assert isinstance(stream, Libp2pStream) and await round_trip(stream) == b"ping"
        if a.dedicated is not None:  # it asked, learned there is nothing, and blames nobody
            assert not banned(a, b.peer_id)
            assert a.dedicated.opened == 0


async def test_a_private_swarm_keeps_its_dedicated_connections_to_itself() -> None:
    async with open_libp2p_transport(os.urandom(32), swarm_key=SWARM_KEY, dedicated_listen=False) as a, \
            open_libp2p_transport(os.urandom(32), swarm_key=SWARM_KEY) as b, trio.open_nursery() as nursery:
        b.set_handler(SESSION_PROTOCOL, echo)
        await a.connect(b.addrs()[0])
        with trio.fail_after(WAIT):
            stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            assert isinstance(stream, DedicatedStream) and await round_trip(stream) == b"ping"
            # a host without the key that knows the endpoint gets no handshake at all
            stranger = dialler(nursery, swarm_key=None)
            assert await stranger.open(Side(b.dedicated.endpoint), b.peer_id, SESSION_PROTOCOL) is None
            assert stranger.avoid.is_banned(b.peer_id, stranger.clock()) and b.dedicated.accepted == 1
            assert await round_trip(stream, b"still served") == b"still served"
        nursery.cancel_scope.cancel()


async def test_a_peer_at_its_share_of_connections_sends_the_rest_to_libp2p_without_a_strike() -> None:
    async with hosts() as (a, b):
        b.dedicated.limits = DedicatedLimits(per_peer=2)
        b.set_handler(SESSION_PROTOCOL, echo)
        with trio.fail_after(WAIT):
            streams = [await a.open_stream(b.peer_id, SESSION_PROTOCOL) for _ in range(3)]
            assert [type(s) for s in streams] == [DedicatedStream, DedicatedStream, Libp2pStream]
            for s in streams:
                assert await round_trip(s) == b"ping"
        assert not banned(a, b.peer_id)


async def test_a_protocol_not_served_there_costs_no_strike_and_is_not_asked_again() -> None:
    async with hosts() as (a, b):
        b.set_handler(SESSION_PROTOCOL, echo)
        with trio.fail_after(WAIT):
            with pytest.raises(PeerUnreachable):
                await a.open_stream(b.peer_id, LINK_PROTOCOL)  # b serves no links anywhere
            with pytest.raises(PeerUnreachable):
                await a.open_stream(b.peer_id, LINK_PROTOCOL)
            assert not banned(a, b.peer_id)
            assert isinstance(await a.open_stream(b.peer_id, SESSION_PROTOCOL), DedicatedStream)
            await wait_for(lambda: b.dedicated.handshaking() == 0, "the refusal's connection to end")
        assert b.dedicated.accepted == 1  # the second link open was not even dialled


async def test_our_own_dial_limit_sends_streams_to_libp2p_and_bans_nobody() -> None:
    async with hosts() as (a, b):
        a.dedicated.limits = DedicatedLimits(dials=1)
        b.set_handler(SESSION_PROTOCOL, echo)
        with trio.fail_after(WAIT):
            first, second = [await a.open_stream(b.peer_id, SESSION_PROTOCOL) for _ in range(2)]
        assert (type(first), type(second)) == (DedicatedStream, Libp2pStream)
        assert not banned(a, b.peer_id)


# -- how a stream ends -------------------------------------------------------------------


async def test_a_stream_dropped_without_closing_gives_its_connection_back() -> None:
    async with hosts() as (a, b):
        b.set_handler(SESSION_PROTOCOL, echo)
        with trio.fail_after(WAIT):
            streams = [await a.open_stream(b.peer_id, SESSION_PROTOCOL) for _ in range(5)]
            for stream in streams:
                assert await round_trip(stream) == b"ping"
            assert a.dedicated.live() == 5
            del streams, stream  # as sessions whose opening timed out after their streams were open
            gc.collect()
            await wait_for(lambda: a.dedicated.live() == 0 and b.dedicated.live() == 0, "the sockets to be released")


async def test_a_closed_stream_still_reads_all_the_remote_sends_however_long(monkeypatch) -> None:
    monkeypatch.setattr(stream_module, "LINGER", 0.3)  # the drainer's patience: longer than this, it must not cut in
    async with hosts() as (a, b):

        async def ticks(stream: Stream) -> None:
            await stream.read(10)  # the request: then the answer, slowly, after the asker closed
            for i in range(10):
                await stream.write(b"tick %d;" % i)
                await trio.sleep(0.06)
            await stream.close()

        b.set_handler(SESSION_PROTOCOL, ticks)
        with trio.fail_after(WAIT):
            stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            await stream.write(b"go")
            await stream.close()
            got = b""
            while data := await stream.read(100):
                got += data
        assert got == b"".join(b"tick %d;" % i for i in range(10))
        await wait_for(lambda: a.dedicated.live() == 0, "the socket to be released")


async def test_a_closed_stream_nobody_reads_keeps_what_comes_for_a_later_read() -> None:
    async with hosts() as (a, b):

        async def late_answer(stream: Stream) -> None:
            await stream.read(10)
            await stream.write(b"answer")
            await stream.close()

        b.set_handler(SESSION_PROTOCOL, late_answer)
        with trio.fail_after(WAIT):
            stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            await stream.write(b"question")
            await stream.close()  # nobody reads: the drainer does, and keeps it
            await trio.sleep(0.2)
            assert await stream.read(100) == b"answer" and await stream.read(100) == b""
        await wait_for(lambda: a.dedicated.live() == 0, "the socket to be released")


async def test_a_closed_stream_whose_remote_never_closes_is_reset_after_the_linger(monkeypatch) -> None:
    monkeypatch.setattr(stream_module, "LINGER", 0.2)
    async with hosts() as (a, b):
        held = trio.Event()

        async def never_closes(stream: Stream) -> None:
            await stream.read(10)
            await held.wait()

        b.set_handler(SESSION_PROTOCOL, never_closes)
        with trio.fail_after(WAIT):
            stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            await stream.write(b"x")
            await stream.close()
            await wait_for(lambda: a.dedicated.live() == 0, "the drainer to give up")
            with pytest.raises(StreamClosed):
                await stream.read(10)  # a reset, not a clean end: what the remote meant to send is lost
        held.set()


async def test_a_write_cut_short_ends_the_stream() -> None:
    async with hosts() as (a, b):
        results: list[object] = []
        reading = trio.Event()

        async def receive_later(stream: Stream) -> None:
            await reading.wait()  # the writer's socket buffers fill meanwhile, and its write blocks
            try:
                while await stream.read(1 << 16):
                    pass
                results.append("end")
            except StreamClosed:
                results.append("reset")

        b.set_handler(SESSION_PROTOCOL, receive_later)
        with trio.fail_after(WAIT):
            stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            with trio.move_on_after(0.3) as waited:
                await stream.write(os.urandom(64 << 20))  # cancelled with part of it sent
            assert waited.cancelled_caught
            with pytest.raises(StreamClosed):
                await stream.write(b"after")  # the cipher moved on, a frame was cut: nothing after it could be read
            reading.set()
            await wait_for(lambda: results, "the remote to notice")
        assert results == ["reset"]


async def test_a_write_cancelled_before_it_began_leaves_the_stream_whole() -> None:
    async with hosts() as (a, b):
        b.set_handler(SESSION_PROTOCOL, echo)
        with trio.fail_after(WAIT):
            stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            with trio.CancelScope() as scope:
                scope.cancel()
                await stream.write(b"never")  # cancelled at its first checkpoint, before any byte
            assert await round_trip(stream) == b"ping"


async def test_a_frame_goes_out_without_waiting_its_turn_at_the_scheduler() -> None:
    """A hop's frame is written with no pass through trio's run loop before its bytes are on the
    socket (stream.py `SocketPipe`: py-libp2p's pipe took a lock of its own, a pass, and ours another):
    the write's only pass is trio's checkpoint after the send. Counted by an instrument that sees
    every pass of the loop; a private swarm's pnet pipe is py-libp2p's and is not counted here."""

    class Passes(trio.abc.Instrument):
        count = 0

        def before_io_wait(self, timeout: float) -> None:
            self.count += 1

    async with hosts() as (a, b):
        b.set_handler(SESSION_PROTOCOL, echo)
        with trio.fail_after(WAIT):
            stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            assert await round_trip(stream) == b"ping"
            passes = Passes()
            trio.lowlevel.add_instrument(passes)
            try:
                await stream.write(b"x" * 2400)  # a SmolLM2 decode step's hidden state, sealed
            finally:
                trio.lowlevel.remove_instrument(passes)
            assert passes.count <= 1
            got = b""
            while len(got) < 2400:
                got += await stream.read(1 << 16)
            assert got == b"x" * 2400


# -- what strangers cost the listener ----------------------------------------------------


async def test_stalled_handshakes_fill_no_more_than_their_slots_and_are_dropped(monkeypatch) -> None:
    monkeypatch.setattr(service, "HANDSHAKE_TIMEOUT", 0.5)
    one, two = pair()
    async with one as a, two as b:
        b.dedicated.limits = DedicatedLimits(handshakes=2)
        b.set_handler(SESSION_PROTOCOL, echo)
        port = b.dedicated.endpoint.port
        with trio.fail_after(WAIT):
            silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]  # the slots, taken
            await wait_for(lambda: b.dedicated.handshaking() == 2, "both handshakes to start")
            with trio.fail_after(0.3):  # refused at once, long before a handshake times out
                extra = await trio.open_tcp_stream("127.0.0.1", port)
                assert await extra.receive_some(100) == b""
            for stalled in silent:
                assert await stalled.receive_some(100) == b""  # dropped after HANDSHAKE_TIMEOUT, unanswered
            await wait_for(lambda: b.dedicated.handshaking() == 0, "the slots to be freed")
            await a.connect(b.addrs()[0])
            stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            assert isinstance(stream, DedicatedStream) and await round_trip(stream) == b"ping"


async def test_one_address_cannot_take_every_handshake_slot() -> None:
    one, two = pair()
    async with one as a, two as b:
        b.dedicated.limits = DedicatedLimits(handshakes=8, handshakes_per_address=2)
        port = b.dedicated.endpoint.port
        with trio.fail_after(WAIT):
            silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
            await wait_for(lambda: b.dedicated.handshaking() == 2, "both handshakes to start")
            third = await trio.open_tcp_stream("127.0.0.1", port)
            assert await third.receive_some(100) == b""
        for s in silent:
            await s.aclose()


async def test_a_stranger_cannot_make_the_listener_buffer_a_big_opening_frame() -> None:
    one, two = pair()
    async with one as a, two as b, trio.open_nursery() as nursery:
        b.set_handler(SESSION_PROTOCOL, echo)
        with trio.fail_after(WAIT):
            stream = await handshake_only(dialler(nursery, swarm_key=None), b)
            await stream.write(encode_frame(os.urandom(100))[:1] + b"\xff\xff\x3f")  # claims a 1 MiB frame
            assert await answers(stream) == []  # dropped at the length prefix: no answer at all
            await wait_for(lambda: b.dedicated.handshaking() == 0 and b.dedicated.live() == 0, "the listener to forget")
        nursery.cancel_scope.cancel()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blobs=st.lists(st.binary(min_size=1, max_size=3000), min_size=1, max_size=4), after_handshake=st.booleans())
def test_garbage_gets_no_stream_and_the_listener_serves_on(blobs: list[bytes], after_handshake: bool) -> None:
    # a blob that ends inside a length prefix holds its connection until the handshake times out
    handshake_timeout, service.HANDSHAKE_TIMEOUT = service.HANDSHAKE_TIMEOUT, 0.3

    async def scenario() -> None:
        one, two = pair()
        async with one as a, two as b, trio.open_nursery() as nursery:
            b.set_handler(SESSION_PROTOCOL, echo)
            with trio.fail_after(WAIT):
                for blob in blobs:
                    if after_handshake:  # a peer with a valid identity, then garbage for its DedicatedOpen
                        stream = await handshake_only(dialler(nursery, swarm_key=None), b)
                        await stream.write(blob)
                        assert not any(isinstance(m, DedicatedAccept) for m in await answers(stream))
                    else:  # a stranger's bytes where the Noise handshake should be
                        raw = await trio.open_tcp_stream("127.0.0.1", b.dedicated.endpoint.port)
                        await raw.send_all(blob)
                        received = b""
                        try:
                            while data := await raw.receive_some(100):
                                received += data
                        except trio.BrokenResourceError:
                            pass  # a reset: as good as a close here
                        await raw.aclose()
                        assert len(received) < 200  # at most Noise's first reply to what looked like a start
                await wait_for(lambda: b.dedicated.handshaking() == 0 and b.dedicated.live() == 0, "the listener to forget")
                assert b.dedicated.accepted == 0
                await a.connect(b.addrs()[0])
                stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
                assert isinstance(stream, DedicatedStream) and await round_trip(stream) == b"ping"
            nursery.cancel_scope.cancel()

    try:
        trio.run(scenario)
    finally:
        service.HANDSHAKE_TIMEOUT = handshake_timeout


# -- the dialler's decisions, against a stand-in for the libp2p side ------------------


class Side:
    """The libp2p side as `DedicatedStreams.open` sees it: a connection of `kind` reaching the
    peer at `host`, and the peer's answer to the endpoint question (None: it has none;
    "hang": it never answers)."""

    def __init__(self, endpoint, *, kind: str = DIRECT, host: str = "127.0.0.1") -> None:
        self.endpoint, self.kind, self.host = endpoint, kind, host
        self.asked = 0

    def connection_kind(self, peer_id: str) -> str | None:
        return self.kind

    def remote_host(self, peer_id: str) -> str | None:
        return self.host

    async def open_libp2p_stream(self, peer_id: str, protocol: str) -> Stream:
        self.asked += 1
        await trio.sleep(0.01)  # a round trip, so that concurrent askers overlap
        answer = self.endpoint

        class Answer:
            remote = peer_id
            via = "libp2p"

            async def read(self, n: int) -> bytes:
                nonlocal answer
                if answer == "hang":
                    await trio.sleep_forever()
                out, answer = (encode_frame(encode(answer)) if answer is not None else b""), None
                return out

            async def write(self, data: bytes) -> None: ...
            async def close(self) -> None: ...
            async def reset(self) -> None: ...

        return Answer()


def dialler(nursery: trio.Nursery, *, swarm_key: bytes | None = SWARM_KEY) -> DedicatedStreams:
    return DedicatedStreams(create_new_key_pair(os.urandom(32)), swarm_key=swarm_key, nursery=nursery)


async def handshake_only(streams: DedicatedStreams, b) -> DedicatedStream:
    """A Noise-secured connection to b's listener, before any DedicatedOpen."""
    socket_stream = await trio.open_tcp_stream("127.0.0.1", b.dedicated.endpoint.port)
    pipe = streams._pipe(socket_stream, initiator=True)
    secure = await streams._noise.secure_outbound(pipe, ID.from_base58(b.peer_id))
    return streams._stream(socket_stream, pipe, secure, b.peer_id, streams._dialled)


async def answers(stream: DedicatedStream) -> list[object]:
    """Every message the listener sends until it closes or resets the connection."""
    decoder, out = FrameDecoder(max_size=1 << 16), []
    try:
        while data := await stream.read(1 << 16):
            out += [decode(frame) for frame in decoder.feed(data)]
    except (StreamClosed, WireError):
        pass
    return out


@pytest.mark.parametrize("kind", [RELAYED, PUNCHED, None])
async def test_relayed_punched_or_absent_connections_are_never_bypassed(kind) -> None:
    async with trio.open_nursery() as nursery:
        side = Side(DedicatedEndpoint(port=9, hosts=("127.0.0.1",)), kind=kind)
        assert await dialler(nursery).open(side, "12D3KooWPeer", SESSION_PROTOCOL) is None
        assert side.asked == 0  # not even asked: the libp2p connection is the only way in
        nursery.cancel_scope.cancel()


async def test_an_address_a_nat_rewrote_is_not_dialled() -> None:
    async with trio.open_nursery() as nursery:
        streams = dialler(nursery)
        side = Side(DedicatedEndpoint(port=9, hosts=("10.0.0.7",)), host="192.0.2.1")
        assert await streams.open(side, "12D3KooWPeer", SESSION_PROTOCOL) is None
        assert side.asked == 1 and not streams.avoid.is_banned("12D3KooWPeer", streams.clock())
        assert await streams.open(side, "12D3KooWPeer", SESSION_PROTOCOL) is None
        assert side.asked == 1  # the answer is kept (ENDPOINT_TTL)
        nursery.cancel_scope.cancel()


async def test_concurrent_opens_ask_the_peer_once() -> None:
    async with trio.open_nursery() as nursery:
        streams = dialler(nursery)
        side = Side(DedicatedEndpoint(port=9, hosts=("10.0.0.7",)), host="192.0.2.1")
        async with trio.open_nursery() as opens:
            for _ in range(5):
                opens.start_soon(streams.open, side, "12D3KooWPeer", SESSION_PROTOCOL)
        assert side.asked == 1
        nursery.cancel_scope.cancel()


async def test_a_question_that_was_cut_short_is_asked_again(monkeypatch) -> None:
    monkeypatch.setattr(service, "ENDPOINT_TIMEOUT", 0.1)
    async with trio.open_nursery() as nursery:
        streams = dialler(nursery)
        side = Side("hang")
        assert await streams.open(side, "12D3KooWPeer", SESSION_PROTOCOL) is None  # timed out: not an answer
        with trio.move_on_after(0.02):
            await streams.open(side, "12D3KooWPeer", SESSION_PROTOCOL)  # the caller gives up: not an answer
        side.endpoint = DedicatedEndpoint(port=9, hosts=("10.0.0.7",))
        await streams.open(side, "12D3KooWPeer", SESSION_PROTOCOL)
        assert side.asked == 3
        assert not streams.avoid.is_banned("12D3KooWPeer", streams.clock())
        nursery.cancel_scope.cancel()


async def test_a_refused_dial_falls_back_and_the_peer_is_avoided_for_a_while() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    async with trio.open_nursery() as nursery:
        streams = dialler(nursery)
        side = Side(DedicatedEndpoint(port=closed, hosts=("127.0.0.1",)))
        assert await streams.open(side, "12D3KooWPeer", SESSION_PROTOCOL) is None
        assert streams.avoid.is_banned("12D3KooWPeer", streams.clock())
        assert await streams.open(side, "12D3KooWPeer", SESSION_PROTOCOL) is None
        assert side.asked == 1  # avoided: no second question, no second dial
        nursery.cancel_scope.cancel()


async def test_the_dialler_checks_whom_it_reached() -> None:
    async with open_libp2p_transport(os.urandom(32)) as b, trio.open_nursery() as nursery:
        b.set_handler(SESSION_PROTOCOL, echo)
        streams = dialler(nursery, swarm_key=None)
        meant = ID.from_pubkey(create_new_key_pair(os.urandom(32)).public_key).to_base58()  # we mean it; b answers
        with trio.fail_after(WAIT):
            assert await streams.open(Side(b.dedicated.endpoint), meant, SESSION_PROTOCOL) is None
        assert streams.avoid.is_banned(meant, streams.clock()) and b.dedicated.accepted == 0
        nursery.cancel_scope.cancel()


async def test_a_hot_stream_keeps_its_frames_whole_across_the_handover() -> None:
    """DedicatedOpen/DedicatedAccept and the protocol's first frames back to back: none lost."""
    async with hosts() as (a, b):

        async def first_frames(stream: Stream) -> None:
            channel = Channel(stream)
            await channel.send(DedicatedEndpoint(port=1, hosts=()))  # at once, before any read
            await channel.send(await channel.receive())
            await channel.close()

        b.set_handler(SESSION_PROTOCOL, first_frames)
        with trio.fail_after(WAIT):
            channel = Channel(await a.open_stream(b.peer_id, SESSION_PROTOCOL))
            assert await channel.receive() == DedicatedEndpoint(port=1, hosts=())
            await channel.send(DedicatedEndpoint(port=2, hosts=("x",)))
            assert await channel.receive() == DedicatedEndpoint(port=2, hosts=("x",))
