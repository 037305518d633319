"""Streams not admitted yet, at a real stage server (peer/net/intake.py in front of
peer/serve/server.py and the other protocols' handlers), over the in-memory transport under
trio's MockClock.

- issue 43's slow-loris: 9 identities keeping 16 session streams each open, a byte a second,
  never finishing their open: an honest requester still opens at once, and its answer is exact
  (before: the 128 places were full, its stream was reset unread, a `dropped` strike);
- a newcomer turned away for lack of room is told BUSY with a retry-after, a refusal and not a
  failure (before: reset unread);
- every protocol's first frame is bounded by its own limit, refused at its length prefix
  (before: 64 MiB on weights, ping and reports).
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import torch
import trio

from tessera.peer.base.errors import SessionRefused, StreamClosed
from tessera.peer.base.protocols import LINK_PROTOCOL, PING_PROTOCOL, REPORT_PROTOCOL, SESSION_PROTOCOL, WEIGHTS_PROTOCOL
from tessera.peer.net.intake import PER_IDENTITY, RETRY_AFTER, TOTAL
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.net.pinger import Pinger
from tessera.peer.net.transport import Channel
from tessera.peer.request.chain import RouteSession
from tessera.peer.request.reports import ReportBook
from tessera.peer.serve.limits import ServerLimits
from tessera.peer.serve.server import StageServer
from tessera.peer.weights.source import WeightSource
from tessera.protocol.admission import LINK_FRAME_LIMIT, OPEN_FRAME_LIMIT
from tessera.protocol.attest import REPORT_FRAME_LIMIT
from tessera.protocol.error_codes import BUSY
from tessera.protocol.keys import Identity
from tessera.protocol.records import HEARTBEAT_FRAME_LIMIT
from tessera.protocol.weights import REQUEST_FRAME_LIMIT
from tessera.stages.assembly.stage import load_stage
from tessera.stages.weights.registry import write_manifest

from ..waiting import await_until
from .test_admission import Requesters, inline, pid

ATTACKERS = 9  # issue 43: 9 identities x 16 streams filled the 128 places
STEPS = 5


def uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


async def slow_loris(network: MemoryNetwork, identity: Identity, server_id: str, streams: int, held: dict) -> None:
    """Open `streams` session streams and keep each trickling the body of a 9,000-byte open,
    a byte a second, opening another a second after the server ends one (its open timed out,
    it was turned away or lost its place): a persistent attacker."""
    async with open_memory_transport(network, pid(identity)) as transport, trio.open_nursery() as nursery:
        async def trickle(stream) -> None:
            try:
                await stream.write(uvarint(9000))
                for _ in range(9000):
                    await stream.write(b"\x00")
                    await trio.sleep(1.0)
            except StreamClosed:
                pass

        async def one() -> None:
            while True:
                stream = await transport.open_stream(server_id, SESSION_PROTOCOL)
                async with trio.open_nursery() as mine:
                    mine.start_soon(trickle, stream)
                    try:
                        while await stream.read(1 << 16):  # until the server ends it
                            pass
                    except StreamClosed:
                        pass
                    mine.cancel_scope.cancel()
                held["ended"] += 1
                await stream.reset()
                await trio.sleep(1.0)  # and again (at once would only cost this test time, not the peer room)

        for _ in range(streams):
            nursery.start_soon(one)


async def test_a_slow_loris_of_many_identities_does_not_lock_an_honest_requester_out(tiny_llama, autojump_clock):
    stage = load_stage(tiny_llama)
    spec = stage.spec
    network = MemoryNetwork(LinkSpec(latency=0.001, bandwidth=1e9))
    peer = Identity.from_seed(b"\x21" * 32)
    held = {"ended": 0}
    async with AsyncExitStack() as stack:
        tp = await stack.enter_async_context(open_memory_transport(network, pid(peer)))
        server = StageServer(tp, peer, stage, limits=ServerLimits(batch_rows=1))
        server.run_compute = inline
        async with trio.open_nursery() as nursery:
            for i in range(ATTACKERS):
                nursery.start_soon(slow_loris, network, Identity.from_seed(bytes([0x30 + i]) * 32), pid(peer),
                                   PER_IDENTITY, held)
            await trio.sleep(15.0)  # the attack in its steady state: every place taken (opens time out at 10 s)
            assert len(tp.intake.tickets) == TOTAL and held["ended"] > 0  # more than fit: some were turned away
            assert max(tp.intake.streams.values()) <= PER_IDENTITY

            people = Requesters(network, pid(peer), spec)
            inputs = torch.randn(STEPS + 3, spec.hidden_size, generator=torch.Generator().manual_seed(2))
            async with people.requester(Identity.from_seed(b"\x22" * 32)) as honest:
                session = RouteSession(honest, people.route, max_length=64)
                asked = trio.current_time()
                await session.open()  # raised PeerFailed (its stream reset unread) before
                waited = trio.current_time() - asked
                outputs = [await session.step(inputs[:4], 0)]
                for pos in range(4, 4 + STEPS - 1):
                    outputs.append(await session.step(inputs[pos : pos + 1], pos))
                await session.close()
            assert len(tp.intake.tickets) <= TOTAL  # the attackers are still there
            nursery.cancel_scope.cancel()
    assert waited < 1.0, waited
    solo = load_stage(tiny_llama)
    solo.open("ref", capacity=64)
    expected = torch.cat([solo.forward("ref", inputs[:4], 0)]
                         + [solo.forward("ref", inputs[pos : pos + 1], pos) for pos in range(4, 4 + STEPS - 1)])
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=0, atol=1e-5)


async def test_no_room_is_a_busy_refusal_not_a_reset(tiny_llama, autojump_clock):
    """An identity already holding its PER_IDENTITY places asks for one more: it is told BUSY
    with a retry-after (SessionRefused, which a requester never counts as a strike)."""
    stage = load_stage(tiny_llama)
    network = MemoryNetwork(LinkSpec(latency=0.001, bandwidth=1e9))
    peer, greedy = Identity.from_seed(b"\x23" * 32), Identity.from_seed(b"\x24" * 32)
    async with AsyncExitStack() as stack:
        tp = await stack.enter_async_context(open_memory_transport(network, pid(peer)))
        server = StageServer(tp, peer, stage)
        people = Requesters(network, pid(peer), stage.spec)
        async with people.requester(greedy) as ctx:
            silent = [await ctx.transport.open_stream(pid(peer), SESSION_PROTOCOL) for _ in range(PER_IDENTITY)]
            await await_until(lambda: tp.intake.streams.get(pid(greedy)) == PER_IDENTITY, 10, "the places taken")
            with pytest.raises(SessionRefused) as refused:
                await RouteSession(ctx, people.route, max_length=64).open()
            assert refused.value.code == BUSY and refused.value.retry_after == RETRY_AFTER
            assert server.stats.unadmitted_refused == 1
            for stream in silent:
                await stream.reset()
            await await_until(lambda: not tp.intake.tickets, 10, "the places freed")
            await RouteSession(ctx, people.route, max_length=64).open()  # and then it is admitted


@pytest.mark.parametrize("protocol, limit", [
    (SESSION_PROTOCOL, OPEN_FRAME_LIMIT), (LINK_PROTOCOL, LINK_FRAME_LIMIT), (PING_PROTOCOL, HEARTBEAT_FRAME_LIMIT),
    (REPORT_PROTOCOL, REPORT_FRAME_LIMIT), (WEIGHTS_PROTOCOL, REQUEST_FRAME_LIMIT),
])
async def test_every_protocols_first_frame_is_bounded_by_its_own_limit(tiny_llama, autojump_clock, protocol, limit):
    """A prefix announcing one byte more than the protocol's limit ends the stream before its
    body is read (the stream is reset); each limit is what that protocol's largest message
    needs (tests/protocol/test_frame_limits.py), far below the 64 MiB they all took before."""
    write_manifest(tiny_llama)
    stage = load_stage(tiny_llama)
    network = MemoryNetwork(LinkSpec(latency=0.001, bandwidth=1e9))
    peer, stranger = Identity.from_seed(b"\x25" * 32), Identity.from_seed(b"\x26" * 32)
    async with AsyncExitStack() as stack:
        tp = await stack.enter_async_context(open_memory_transport(network, pid(peer)))
        tr = await stack.enter_async_context(open_memory_transport(network, pid(stranger)))
        StageServer(tp, peer, stage)
        Pinger(tp)
        ReportBook(tp, model_id="m")
        WeightSource(tp, tiny_llama, name="tiny")
        stream = await tr.open_stream(pid(peer), protocol)
        await stream.write(uvarint(limit + 1) + b"\x00" * 1024)
        with pytest.raises(StreamClosed):
            await Channel(stream).receive()
        await await_until(lambda: not tp.intake.tickets, 10, "its place freed")
        assert tp.intake.bytes == 0 and limit < 1 << 20
