"""The in-memory transport: timing model, failures, and the real peer code running over it."""

from __future__ import annotations

import pytest
import torch
import trio
from libp2p.peer.id import ID

from tessera.peer.base.errors import PeerFailed, PeerUnreachable, StreamClosed
from tessera.peer.net.gossip import Gossip, ViewKeeper
from tessera.peer.net.libp2p import DIAL_TIMEOUT
from tessera.peer.net.memory import DIAL_RTTS, OPEN_RTTS, MemoryNetwork, open_memory_transport
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.request.chain_state import RequesterContext
from tessera.peer.request.chain import RouteSession
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.serve.server import StageServer
from tessera.peer.sim.stage import SimStage, cost_model, sim_spec
from tessera.protocol.crypto import sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import PeerRecord
from tessera.store.events import Forward
from tessera.store.trace import MemoryTracer

LATENCY = 0.05
RTT = 2 * LATENCY
PROTO = "/test/echo/1.0.0"


def ident(i: int) -> Identity:
    return Identity.from_seed(bytes([i + 1]) * 32)


def pid(identity: Identity) -> str:
    return ID(identity.peer_id).to_base58()


class Inbox:
    """A handler that records (arrival time, bytes) of everything read."""

    def __init__(self) -> None:
        self.got: list[tuple[float, bytes]] = []
        self.ended = trio.Event()
        self.error: Exception | None = None

    async def __call__(self, stream) -> None:
        try:
            while chunk := await stream.read(1 << 20):
                self.got.append((trio.current_time(), chunk))
        except StreamClosed as error:
            self.error = error
        self.ended.set()


async def test_frame_arrives_after_latency_plus_size_over_bandwidth(autojump_clock):
    network = MemoryNetwork(LinkSpec(latency=LATENCY, bandwidth=1000.0))
    inbox = Inbox()
    async with open_memory_transport(network, "A") as a, open_memory_transport(network, "B") as b:
        b.set_handler(PROTO, inbox)
        began = trio.current_time()
        stream = await a.open_stream("B", PROTO)
        # a first stream dials (TCP + Noise + muxer) and negotiates the protocol
        assert trio.current_time() - began == pytest.approx((DIAL_RTTS + OPEN_RTTS) * RTT)
        sent = trio.current_time()
        await stream.write(b"x" * 500)
        await stream.write(b"y" * 500)  # queues behind the first on the same link
        await stream.close()
        await inbox.ended.wait()
        assert [round(t - sent, 9) for t, _ in inbox.got] == [round(0.5 + LATENCY, 9), round(1.0 + LATENCY, 9)]
        assert b"".join(c for _, c in inbox.got) == b"x" * 500 + b"y" * 500
        began = trio.current_time()
        await a.open_stream("B", PROTO)  # connected already: negotiation only
        assert trio.current_time() - began == pytest.approx(OPEN_RTTS * RTT)
        assert a.connection_kind("B") == "direct" and b.connected() == ["A"]


async def test_a_crash_resets_streams_and_refuses_dials(autojump_clock):
    network = MemoryNetwork(LinkSpec(latency=LATENCY))
    inbox = Inbox()
    async with open_memory_transport(network, "A") as a:
        async with open_memory_transport(network, "B") as b:
            b.set_handler(PROTO, inbox)
            stream = await a.open_stream("B", PROTO)
            await stream.write(b"hello")
            await trio.sleep(1)
            network.crash("A")  # the process died: its sockets reset
            await inbox.ended.wait()
            assert isinstance(inbox.error, StreamClosed) and inbox.got[0][1] == b"hello"
            with pytest.raises(StreamClosed):
                await stream.write(b"more")
            began = trio.current_time()
            with pytest.raises(PeerUnreachable, match="refused"):
                await b.connect("/memory/1/p2p/A")
            assert trio.current_time() - began == pytest.approx(DIAL_RTTS * RTT)
            assert b.connected() == []


async def test_a_vanished_peer_is_noticed_only_by_timeouts(autojump_clock):
    network = MemoryNetwork(LinkSpec(latency=LATENCY))
    got = []

    async def echo(stream) -> None:
        while chunk := await stream.read(100):
            got.append(chunk)
            await stream.write(chunk)

    async with open_memory_transport(network, "A") as a, open_memory_transport(network, "B") as b:
        b.set_handler(PROTO, echo)
        stream = await a.open_stream("B", PROTO)
        await stream.write(b"ping")
        assert await stream.read(100) == b"ping"
        network.crash("B", silent=True)  # power cut: no reset ever arrives
        await stream.write(b"lost")  # the write "succeeds" and goes nowhere
        with trio.move_on_after(60) as waited:
            await stream.read(100)
        assert waited.cancelled_caught and got == [b"ping"]
        began = trio.current_time()
        with pytest.raises(PeerUnreachable):
            await a.open_stream("B", PROTO)
        assert trio.current_time() - began >= DIAL_TIMEOUT - 1e-9


async def test_a_cut_link_resets_and_heals(autojump_clock):
    network = MemoryNetwork(LinkSpec(latency=LATENCY))
    inbox = Inbox()
    async with open_memory_transport(network, "A") as a, open_memory_transport(network, "B") as b:
        b.set_handler(PROTO, inbox)
        await a.open_stream("B", PROTO)
        network.cut("A", "B")
        await inbox.ended.wait()
        assert isinstance(inbox.error, StreamClosed)
        with pytest.raises(PeerUnreachable):
            await a.open_stream("B", PROTO)
        network.heal("A", "B")
        await a.open_stream("B", PROTO)


async def test_unknown_protocol_and_unknown_peer_are_unreachable(autojump_clock):
    network = MemoryNetwork()
    async with open_memory_transport(network, "A") as a, open_memory_transport(network, "B"):
        with pytest.raises(PeerUnreachable, match="not supported"):
            await a.open_stream("B", "/nobody/speaks/this")
        with pytest.raises(PeerUnreachable):
            await a.open_stream("C", PROTO)
        with pytest.raises(PeerUnreachable, match="/p2p/"):
            await a.connect("/ip4/127.0.0.1/tcp/1")


async def test_a_failing_handler_is_counted_not_fatal(autojump_clock):
    network = MemoryNetwork()

    async def broken(stream) -> None:
        raise RuntimeError("bug in a handler")

    async with open_memory_transport(network, "A") as a, open_memory_transport(network, "B") as b:
        b.set_handler(PROTO, broken)
        stream = await a.open_stream("B", PROTO)
        with pytest.raises(StreamClosed):
            await stream.read(10)
        assert network.handler_errors == 1


# -- the real peer code over the memory transport ------------------------------------------------

SPANS = [(0, 10), (10, 20), (20, 30)]
THROUGHPUT = [100.0, 50.0, 200.0]  # tokens/s through one layer


async def test_a_route_session_runs_through_three_stage_servers(autojump_clock):
    """RouteSession -> three StageServers (SimStage + cost model): the real open/step/close
    code, timed exactly as latency + compute (n_tokens x layers / throughput) per hop."""
    spec = sim_spec(30, 64)
    network = MemoryNetwork(LinkSpec(latency=LATENCY, bandwidth=1e12))
    peers = [ident(i) for i in range(3)]
    requester = ident(9)
    tracers = [MemoryTracer(peer=pid(p)) for p in peers]
    async with open_memory_transport(network, pid(peers[0])) as t0, \
            open_memory_transport(network, pid(peers[1])) as t1, \
            open_memory_transport(network, pid(peers[2])) as t2, \
            open_memory_transport(network, pid(requester)) as tr:
        for t, identity, span, speed, tracer in zip((t0, t1, t2), peers, SPANS, THROUGHPUT, tracers):
            server = StageServer(t, identity, SimStage(spec, *span), tracer=tracer)
            server.run_compute = cost_model(lambda s=server: s.stage, speed)
        keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        async with trio.open_nursery() as nursery:
            ctx = RequesterContext(transport=tr, identity=requester, keeper=keeper, nursery=nursery,
                                   num_layers=30, hidden_size=64)
            route = Route(tuple(Hop(pid(p), a, b) for p, (a, b) in zip(peers, SPANS)), 0.0)
            session = RouteSession(ctx, route, max_length=32)
            await session.open()
            hidden = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)
            began = trio.current_time()
            out = await session.step(hidden, 0)
            took = trio.current_time() - began
            assert torch.equal(out, hidden)  # a SimStage computes nothing: the chain is the identity
            compute = sum(8 * 10 / s for s in THROUGHPUT)
            assert took == pytest.approx(compute + 4 * LATENCY)  # r -> p0 -> p1 -> p2 -> r
            out = await session.step(hidden[:1], 8)
            assert torch.equal(out, hidden[:1])
            await session.close()
            nursery.cancel_scope.cancel()
    for tracer, speed in zip(tracers, THROUGHPUT):
        forwards = tracer.of_kind(Forward)
        assert [f.event.duration for f in forwards] == pytest.approx([8 * 10 / speed, 10 / speed])


async def test_a_dead_peer_fails_the_step_with_its_name(autojump_clock):
    spec = sim_spec(30, 64)
    network = MemoryNetwork(LinkSpec(latency=LATENCY))
    peers, requester = [ident(i) for i in range(3)], ident(9)
    async with open_memory_transport(network, pid(peers[0])) as t0, \
            open_memory_transport(network, pid(peers[1])) as t1, \
            open_memory_transport(network, pid(peers[2])) as t2, \
            open_memory_transport(network, pid(requester)) as tr:
        for t, identity, span in zip((t0, t1, t2), peers, SPANS):
            server = StageServer(t, identity, SimStage(spec, *span))
            server.run_compute = cost_model(lambda s=server: s.stage, 100.0)
        async with trio.open_nursery() as nursery:
            keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
            ctx = RequesterContext(transport=tr, identity=requester, keeper=keeper, nursery=nursery,
                                   num_layers=30, hidden_size=64)
            session = RouteSession(ctx, Route(tuple(Hop(pid(p), a, b) for p, (a, b) in zip(peers, SPANS)), 0.0),
                                   max_length=16)
            await session.open()
            network.crash(pid(peers[1]))
            with pytest.raises(PeerFailed) as failed:
                await session.step(torch.ones(2, 64), 0)
            assert failed.value.peer == pid(peers[1])
            await session.close()
            nursery.cancel_scope.cancel()


async def test_gossip_spreads_signed_records_over_the_memory_transport(autojump_clock):
    network = MemoryNetwork(LinkSpec(latency=LATENCY))
    ids = [ident(i) for i in range(3)]
    keepers = [ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time) for _ in ids]

    def record(i: int):
        now = trio.current_time()
        return sign_record(ids[i], PeerRecord(
            peer_id=ids[i].peer_id, name=f"p{i}", model_id="m", start=10 * i, end=10 * i + 10, shard_index=0,
            shard_count=1, throughput=100.0, free_memory=0, load=0.0, max_sessions=16, state="serving",
            reachability="public", addrs=(), neighbours=(), issued_at=now, expires_at=now + 15, seq=1))

    async with open_memory_transport(network, pid(ids[0])) as t0, \
            open_memory_transport(network, pid(ids[1])) as t1, \
            open_memory_transport(network, pid(ids[2])) as t2:
        own = [record(i) for i in range(3)]
        gossips = [Gossip(t, k, own_record=lambda r=r: r) for t, k, r in zip((t0, t1, t2), keepers, own)]
        await t1.connect(t0.addrs()[0])
        await t2.connect(t0.addrs()[0])
        assert await gossips[1].exchange(pid(ids[0]))  # 1 <-> 0
        assert await gossips[2].exchange(pid(ids[0]))  # 2 <-> 0 (0 passes on 1's record)
        assert await gossips[1].exchange(pid(ids[0]))
        spans = [(0, 10), (10, 20), (20, 30)]
        for i, keeper in enumerate(keepers):  # each learnt (and verified) the other two
            known = {p.span for p in keeper.snapshot().peers}
            assert {s for j, s in enumerate(spans) if j != i} <= known, i
            assert keeper.rejected == 0
