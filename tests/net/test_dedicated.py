"""Dedicated connections (peer/net/dedicated.py): when they are used, when not, and what a
stranger's connections cost the listener. The streams themselves run the transport
conformance suite (test_transport_conformance.py)."""

from __future__ import annotations

import os
import socket

import pytest
import trio
from hypothesis import HealthCheck, given, settings, strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair

from tessera.peer.base.errors import PeerUnreachable
from tessera.peer.base.protocols import GOSSIP_PROTOCOL, SESSION_PROTOCOL
from tessera.peer.net import dedicated
from tessera.peer.net.dedicated import DedicatedLimits, DedicatedStream, DedicatedStreams
from tessera.peer.net.libp2p import Libp2pStream, open_libp2p_transport
from tessera.peer.net.transport import DIRECT, PUNCHED, RELAYED, Stream
from tessera.protocol.dedicated import DedicatedEndpoint

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


# -- against real hosts ---------------------------------------------------------------


async def test_hot_streams_get_their_own_connection_and_the_rest_stay_on_libp2p() -> None:
    async with open_libp2p_transport(os.urandom(32), dedicated_listen=False) as a, \
            open_libp2p_transport(os.urandom(32)) as b:
        b.set_handler(SESSION_PROTOCOL, echo)
        b.set_handler(GOSSIP_PROTOCOL, echo)
        await a.connect(b.addrs()[0])
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
            assert not a.dedicated.avoid.is_banned(b.peer_id, a.dedicated.clock())
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
            assert stranger.avoid.is_banned(b.peer_id, stranger.clock())
            assert await round_trip(stream, b"still served") == b"still served"
        nursery.cancel_scope.cancel()


async def test_a_peer_at_its_share_of_connections_sends_the_rest_to_libp2p() -> None:
    async with open_libp2p_transport(os.urandom(32), dedicated_listen=False) as a, \
            open_libp2p_transport(os.urandom(32)) as b:
        b.dedicated.limits = DedicatedLimits(per_peer=2)
        b.set_handler(SESSION_PROTOCOL, echo)
        await a.connect(b.addrs()[0])
        with trio.fail_after(WAIT):
            streams = [await a.open_stream(b.peer_id, SESSION_PROTOCOL) for _ in range(3)]
            assert [type(s) for s in streams] == [DedicatedStream, DedicatedStream, Libp2pStream]
            for s in streams:
                assert await round_trip(s) == b"ping"


async def test_a_protocol_not_served_there_does_not_count_against_the_peer() -> None:
    async with open_libp2p_transport(os.urandom(32), dedicated_listen=False) as a, \
            open_libp2p_transport(os.urandom(32)) as b:
        b.set_handler(SESSION_PROTOCOL, echo)
        await a.connect(b.addrs()[0])
        with trio.fail_after(WAIT):
            with pytest.raises(PeerUnreachable):
                await a.open_stream(b.peer_id, dedicated.LINK_PROTOCOL)  # b serves no links
            assert not a.dedicated.avoid.is_banned(b.peer_id, a.dedicated.clock())
            assert isinstance(await a.open_stream(b.peer_id, SESSION_PROTOCOL), DedicatedStream)


async def test_a_stalled_handshake_is_dropped_and_frees_its_slot(monkeypatch) -> None:
    monkeypatch.setattr(dedicated, "HANDSHAKE_TIMEOUT", 0.3)
    async with open_libp2p_transport(os.urandom(32), dedicated_listen=False) as a, \
            open_libp2p_transport(os.urandom(32)) as b:
        b.dedicated.limits = DedicatedLimits(handshakes=2)
        b.set_handler(SESSION_PROTOCOL, echo)
        port = b.dedicated.endpoint.port
        with trio.fail_after(WAIT):
            silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]  # the slots, taken
            await wait_for(lambda: b.dedicated._handshakes == 2, "both handshakes to start")
            for stream in silent:
                assert await stream.receive_some(100) == b""  # dropped after HANDSHAKE_TIMEOUT, unanswered
            await wait_for(lambda: b.dedicated._handshakes == 0, "the slots to be freed")
            await a.connect(b.addrs()[0])
            stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
            assert isinstance(stream, DedicatedStream) and await round_trip(stream) == b"ping"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blobs=st.lists(st.binary(min_size=1, max_size=3000), min_size=1, max_size=4), after_handshake=st.booleans())
def test_garbage_gets_a_closed_connection_and_the_listener_serves_on(blobs: list[bytes], after_handshake: bool) -> None:
    # a blob that ends inside a length prefix holds its connection until the handshake times out
    handshake_timeout, dedicated.HANDSHAKE_TIMEOUT = dedicated.HANDSHAKE_TIMEOUT, 0.3

    async def scenario() -> None:
        async with open_libp2p_transport(os.urandom(32), dedicated_listen=False) as a, \
                open_libp2p_transport(os.urandom(32)) as b, trio.open_nursery() as nursery:
            b.set_handler(SESSION_PROTOCOL, echo)
            with trio.fail_after(WAIT):
                for blob in blobs:
                    if after_handshake:  # a peer with a valid identity, then garbage for its DedicatedOpen
                        stream = await handshake_only(dialler(nursery, swarm_key=None), b)
                        await stream.write(blob)
                        with pytest.raises(Exception):
                            while await stream.read(100):  # at most an ErrorMsg, then the end
                                pass
                            raise ConnectionResetError("ended")
                    else:  # a stranger's bytes where the Noise handshake should be
                        raw = await trio.open_tcp_stream("127.0.0.1", b.dedicated.endpoint.port)
                        await raw.send_all(blob)
                        try:
                            while await raw.receive_some(100):
                                pass
                        except trio.BrokenResourceError:
                            pass  # a reset: as good as a close here
                        await raw.aclose()
                await wait_for(lambda: b.dedicated._handshakes == 0 and b.dedicated.live() == 0, "the listener to forget")
                await a.connect(b.addrs()[0])
                stream = await a.open_stream(b.peer_id, SESSION_PROTOCOL)
                assert isinstance(stream, DedicatedStream) and await round_trip(stream) == b"ping"
            nursery.cancel_scope.cancel()

    try:
        trio.run(scenario)
    finally:
        dedicated.HANDSHAKE_TIMEOUT = handshake_timeout


# -- the dialler's decisions, against a stand-in for the libp2p side ------------------


class Side:
    """The libp2p side as `DedicatedStreams.open` sees it: a connection of `kind` reaching the
    peer at `host`, and the peer's answer to the endpoint question."""

    def __init__(self, endpoint: DedicatedEndpoint | None, *, kind: str = DIRECT, host: str = "127.0.0.1") -> None:
        self.endpoint, self.kind, self.host = endpoint, kind, host
        self.asked = 0

    def connection_kind(self, peer_id: str) -> str | None:
        return self.kind

    def remote_host(self, peer_id: str) -> str | None:
        return self.host

    async def open_libp2p_stream(self, peer_id: str, protocol: str) -> Stream:
        self.asked += 1
        answer = self.endpoint

        class Answer:
            remote = peer_id

            async def read(self, n: int) -> bytes:
                nonlocal answer
                from tessera.protocol.codec import encode
                from tessera.protocol.framing import encode_frame

                out, answer = (encode_frame(encode(answer)) if answer is not None else b""), None
                return out

            async def write(self, data: bytes) -> None: ...
            async def close(self) -> None: ...
            async def reset(self) -> None: ...

        return Answer()


def dialler(nursery: trio.Nursery, *, swarm_key: bytes | None = SWARM_KEY) -> DedicatedStreams:
    pair = create_new_key_pair(os.urandom(32))
    return DedicatedStreams(pair, swarm_key=swarm_key, nursery=nursery)


async def handshake_only(streams: DedicatedStreams, b) -> DedicatedStream:
    """A Noise-secured connection to b's listener, before any DedicatedOpen."""
    from libp2p.peer.id import ID

    socket_stream = await trio.open_tcp_stream("127.0.0.1", b.dedicated.endpoint.port)
    pipe = streams._pipe(socket_stream, initiator=True)
    secure = await streams._noise.secure_outbound(pipe, ID.from_base58(b.peer_id))
    return streams._stream(socket_stream, pipe, secure, b.peer_id)


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
        impostor_of = create_new_key_pair(os.urandom(32))
        from libp2p.peer.id import ID

        meant = ID.from_pubkey(impostor_of.public_key).to_base58()  # we mean this peer; b answers
        with trio.fail_after(WAIT):
            assert await streams.open(Side(b.dedicated.endpoint), meant, SESSION_PROTOCOL) is None
        assert streams.avoid.is_banned(meant, streams.clock()) and b.dedicated.accepted == 0
        nursery.cancel_scope.cancel()
