"""A busy peer (peer/serve/load.py, admission.py `held`): its compute queue is fair among
requester identities, it says where a step is in it (and a requester counts the step's deadline
from the start it says), and the load it reports travels with answers that flow anyway — a
session's accept, a refusal, a ping's echo — counting what a newcomer could not have, never
sessions held idle past their grace. Real StageServers over the in-memory transport, on trio's
MockClock; the queue alone first."""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import torch
import trio

from tessera.peer.base.errors import SessionRefused
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.net.pinger import Pinger
from tessera.peer.request.chain import RouteSession
from tessera.peer.serve.admission import STEP_GRACE
from tessera.peer.serve.limits import ServerLimits
from tessera.peer.serve.load import NOTICE_WAIT, ComputeQueue
from tessera.peer.serve.server import StageServer
from tessera.protocol.error_codes import BUSY, QUEUE_LONGER
from tessera.protocol.keys import Identity
from tessera.stages.assembly.stage import load_stage

from .test_admission import Requesters, inline, pid

# -- the queue alone ----------------------------------------------------------------------------


async def test_the_queue_serves_requesters_their_share_not_sessions_in_arrival_order(autojump_clock) -> None:
    """Requester A queues eight steps, then B one of the same size: B's step runs second, not ninth
    (each identity waiting gets its share, whatever number of sessions it holds)."""
    queue = ComputeQueue()
    order: list[str] = []

    async def step(requester: str, tag: str) -> None:
        async with queue.turn(requester, 10.0):
            order.append(tag)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(step, "A", f"A{i}")
            await trio.sleep(0.01)
        nursery.start_soon(step, "B", "B0")
    assert order == ["A0", "B0", *(f"A{i}" for i in range(1, 8))]  # A0 held the compute when B asked


async def test_the_queue_shares_compute_not_turns(autojump_clock) -> None:
    """A keeps four 60-unit prompts queued, B four 1-unit decode steps (four sessions here each, a
    step sent as the last one returns): while both wait they get half the compute each, so B's
    240 units are done in about twice their own time (in turns B would get one step per prompt of
    A's: done only after most of A's 40 prompts)."""
    queue = ComputeQueue()
    done: dict[str, float] = {}
    waited: list[float] = []

    async def sender(requester: str, units: float, steps: int) -> None:
        for _ in range(steps):
            queued_at = trio.current_time()
            async with queue.turn(requester, units):
                if requester == "B":
                    waited.append(trio.current_time() - queued_at)
                await trio.sleep(units * 0.01)
        done[requester] = trio.current_time()

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(sender, "A", 60.0, 10)  # 24 s of compute in all
            nursery.start_soon(sender, "B", 1.0, 60)  # 2.4 s
    assert done["B"] <= 2 * 2.4 + 0.6 + 0.1  # half the compute while both waited (+ one prompt it found running)
    assert done["A"] == pytest.approx(24.0 + 2.4)  # nothing idle: the compute never waited
    assert len(waited) == 240 and max(waited) <= 0.6 + 4 * 0.01 + 1e-9  # at most one prompt and B's own others


class StepLog:
    """Steps through `queue` that record the order they got the compute in, each holding it for
    `seconds(units)`; `started` is set when the first one does."""

    def __init__(self, queue: ComputeQueue, seconds) -> None:
        self.queue, self.seconds = queue, seconds
        self.order: list[str] = []
        self.started = trio.Event()

    async def step(self, requester: str, units: float, tag: str) -> None:
        async with self.queue.turn(requester, units):
            self.order.append(tag)
            self.started.set()
            await trio.sleep(self.seconds(units))


async def test_a_short_step_goes_before_a_long_one_of_another_requester_queued_earlier(autojump_clock) -> None:
    """A prompt of A (100 units) waits; B's decode step (1 unit) arriving after it goes first; C's
    prompt, as long, after A's (arrival breaks the tie); A's own next step stays behind A's prompt
    (a requester's order is kept) and, A having had its share, behind C's too."""
    steps = StepLog(ComputeQueue(), lambda units: 1.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(steps.step, "D", 10.0, "D0")  # holds the compute
        await steps.started.wait()
        for requester, units, tag in (("A", 100.0, "A-prompt"), ("A", 1.0, "A-decode"), ("B", 1.0, "B-decode"),
                                      ("C", 100.0, "C-prompt")):
            nursery.start_soon(steps.step, requester, units, tag)
            await trio.sleep(0.01)
    assert steps.order == ["D0", "B-decode", "A-prompt", "C-prompt", "A-decode"]


async def test_a_requester_is_not_charged_after_a_pause_for_what_it_ran_alone(autojump_clock) -> None:
    """A runs a long step while nobody else waits; the compute then idles. Later A and B each
    queue a step of the same size, A first: A goes first (every share is even again once the
    compute was idle), not after B as if A still owed its long step."""
    steps = StepLog(ComputeQueue(), lambda units: units * 0.01)
    await steps.step("A", 100.0, "A-alone")
    await trio.sleep(5.0)
    steps.started = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(steps.step, "D", 1.0, "D")  # holds the compute while A and B queue
        await steps.started.wait()
        nursery.start_soon(steps.step, "A", 10.0, "A")
        await trio.sleep(0.001)
        nursery.start_soon(steps.step, "B", 10.0, "B")
    assert steps.order == ["A-alone", "D", "A", "B"]


async def test_the_queue_says_how_long_a_step_will_wait(autojump_clock) -> None:
    """The wait is the work ahead at the measured speed: what runs now, then what of the others'
    steps comes before a newcomer's step of the size steps here have had (its fair share), or
    everything before a queued step; a step that must wait at least NOTICE_WAIT is told so before
    it waits (and never one that need not)."""
    queue = ComputeQueue()
    queue.measured(100.0, 1.0)  # 10 ms a token-layer
    told: list[tuple[str, int, float]] = []
    started = trio.Event()

    async def step(requester: str, units: float, tag: str) -> None:
        async def queued(ahead: int, wait: float) -> None:
            told.append((tag, ahead, wait))

        async with queue.turn(requester, units, queued=queued):
            started.set()
            await trio.sleep(units * 0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(step, "A", 300.0, "A0")  # 3 s
        await started.wait()
        nursery.start_soon(step, "A", 200.0, "A1")
        nursery.start_soon(step, "B", 50.0, "B0")
        await trio.sleep(0.5)
        # a newcomer's step of 100 units (the size measured): A0's rest, then B0 (finish tag 50);
        # A1 (tagged 300..500: A ran 300 already) comes after it
        ahead, wait = queue.wait_for("C")
        assert ahead == 2 and wait == pytest.approx(2.5 + 0.5)
        ahead, wait = queue.wait_for("C", 600.0)  # one of 600 would finish after A1: it waits for it
        assert ahead == 3 and wait == pytest.approx(2.5 + 2.0 + 0.5)
        ahead, wait = queue.wait_for("A")  # A's own next step waits for everything queued
        assert ahead == 3 and wait == pytest.approx(2.5 + 2.0 + 0.5)
        assert queue.expected_wait() == pytest.approx(3.0)
        assert queue.expected_wait(pending=2) == pytest.approx(3.0)  # no first step seen yet: no size to guess
        queue.first_step(100.0)
        assert queue.expected_wait(pending=2) == pytest.approx(3.0 + 2 * 1.0)
    said = {tag: (ahead, wait) for tag, ahead, wait in told}
    assert set(said) == {"A1", "B0"} and all(w >= NOTICE_WAIT for _, w in said.values())
    assert said["B0"] == (1, pytest.approx(3.0))  # behind A0 only: its fair place is before A1
    assert said["A1"][1] >= 3.0
    assert queue.recent_wait > 0  # steps did wait: a report says so after the queue has emptied
    assert queue.steps_waiting() == 0 and not queue.waiting


async def test_a_cancelled_waiter_leaves_and_the_next_gets_the_turn(autojump_clock) -> None:
    queue = ComputeQueue()
    order: list[str] = []

    async def step(tag: str) -> None:
        async with queue.turn(tag, 1.0):
            order.append(tag)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(step, "a")
        await trio.sleep(0.1)
        nursery.start_soon(step, "b")
        async with trio.open_nursery() as inner:
            inner.start_soon(step, "c")
            await trio.sleep(0.1)
            cancelled = trio.CancelScope()

            async def doomed() -> None:
                with cancelled:
                    await step("d")

            inner.start_soon(doomed)
            await trio.sleep(0.1)
            cancelled.cancel()
    assert "d" not in order and order[0] == "a" and set(order) == {"a", "b", "c"}
    assert queue.running is None and not queue.waiting


# -- a real server, a real requester ------------------------------------------------------------


def timed_compute(durations: list[float]):
    """A server's `run_compute` that computes at once and takes `durations` on trio's clock, one a
    step in the order the compute runs them (1 s each after those)."""

    async def modelled(fn):
        frames, _ = fn()
        seconds = durations.pop(0) if durations else 1.0
        await trio.sleep(seconds)
        return frames, seconds

    return modelled


async def test_load_travels_with_accepts_refusals_and_pings_and_idle_sessions_are_room(tiny_llama, autojump_clock):
    """An accept says the load (the session just admitted counts), a refusal for lack of room
    says how full (and when to come back), a ping's echo says it too; sessions held idle past
    their grace count as room in every report and in the record's load (four identities holding
    idle sessions once made a peer look busy to the very requester whose open would reclaim them)."""
    stage = load_stage(tiny_llama)
    network = MemoryNetwork(LinkSpec(latency=0.001, bandwidth=1e9))
    peer = Identity.from_seed(b"\x21" * 32)
    async with AsyncExitStack() as stack:
        tp = await stack.enter_async_context(open_memory_transport(network, pid(peer)))
        server = StageServer(tp, peer, stage, limits=ServerLimits(max_sessions=2, batch_rows=1))
        server.run_compute = inline
        Pinger(tp, load=server.load_report)  # what a serving node's pinger answers with
        people = Requesters(network, pid(peer), stage.spec)
        ctx = [await stack.enter_async_context(people.requester(Identity.from_seed(bytes([0x30 + i]) * 32)))
               for i in range(3)]
        first = RouteSession(ctx[0], people.route, max_length=64)
        await first.open()
        said = first.hops[0].accepted
        assert said is not None and (said.sessions, said.max_sessions) == (1, 2)
        assert ctx[0].loads.heard[pid(peer)][1] == said  # routing hears it (peer/request/loads.py)
        second = RouteSession(ctx[1], people.route, max_length=64)
        await second.open()
        assert server.load == 1.0

        async def keep_stepping(session: RouteSession) -> None:  # in use: nothing to reclaim
            for pos in range(40):
                await session.step(torch.randn(1, stage.spec.hidden_size), pos)
                await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_stepping, first)
            nursery.start_soon(keep_stepping, second)
            await trio.sleep(0.05)
            with pytest.raises(SessionRefused) as refused:
                await RouteSession(ctx[2], people.route, max_length=64).open()
        assert refused.value.code == BUSY and refused.value.retry_after is not None
        full = ctx[2].loads.heard[pid(peer)][1]
        assert (full.sessions, full.max_sessions) == (2, 2)
        heard = []
        pinger = Pinger(ctx[2].transport, on_load=lambda p, load: heard.append((p, load)))
        await pinger.ping(pid(peer))
        assert heard and heard[0][0] == pid(peer) and heard[0][1].sessions == 2
        await trio.sleep(STEP_GRACE + 1)  # neither session steps now: both idle past their grace
        assert len(server.sessions) == 2 and server.load == 0.0 and server.load_report().sessions == 0
        third = RouteSession(ctx[2], people.route, max_length=64)
        await third.open()  # the open reclaims one: they were room, as the report said
        assert server.stats.reclaimed == 1
        for session in (first, second, third):
            await session.close()


async def test_a_step_queued_behind_others_is_not_a_time_out(tiny_llama, autojump_clock):
    """A's long step holds the compute for 100 s; B's one-token step waits behind it, far past its
    own deadline (5 s + 10 x its estimate). The peer says where B's step is, and when it starts:
    B's deadline counts from the start, so B's answer comes, exactly, with no failure."""
    stage = load_stage(tiny_llama)
    spec = stage.spec
    network = MemoryNetwork(LinkSpec(latency=0.001, bandwidth=1e9))
    peer = Identity.from_seed(b"\x22" * 32)
    # A's first step, A's long one, B's: the compute runs them in this order
    modelled = timed_compute([1.0, 100.0, 1.0])

    async with AsyncExitStack() as stack:
        tp = await stack.enter_async_context(open_memory_transport(network, pid(peer)))
        server = StageServer(tp, peer, stage, limits=ServerLimits(max_sessions=4, batch_rows=1))
        server.run_compute = modelled
        people = Requesters(network, pid(peer), spec)
        a_ctx = await stack.enter_async_context(people.requester(Identity.from_seed(b"\x41" * 32)))
        b_ctx = await stack.enter_async_context(people.requester(Identity.from_seed(b"\x42" * 32)))
        a, b = RouteSession(a_ctx, people.route, max_length=256), RouteSession(b_ctx, people.route, max_length=256)
        await a.open()
        await b.open()
        inputs = torch.randn(65, spec.hidden_size, generator=torch.Generator().manual_seed(3))
        await a.step(inputs[:1], 0)  # the peer measures its speed
        assert b.step_timeout(1) < 100.0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.step, inputs[1:61], 1)
            await trio.sleep(0.5)
            began = trio.current_time()
            out = await b.step(inputs[61:62], 0)
            assert trio.current_time() - began > b.step_timeout(1)  # it waited longer than its own deadline
    solo = load_stage(tiny_llama)
    solo.open("ref", capacity=8)
    torch.testing.assert_close(out, solo.forward("ref", inputs[61:62], 0), rtol=0, atol=1e-5)
    assert b_ctx.loads.heard[pid(peer)][1].wait > 50  # and routing heard how long the queue was


@asynccontextmanager
async def a_long_queue(tiny_llama, *, max_sessions: int):
    """A peer whose compute one requester (A) holds for 100 s, in one of `max_sessions` slots:
    yields (the server, its peer id, the requesters, B's context, A's session) half a second into
    A's long step, and ends that step (and A's session) on exit."""
    stage = load_stage(tiny_llama)
    spec = stage.spec
    network = MemoryNetwork(LinkSpec(latency=0.001, bandwidth=1e9))
    peer = Identity.from_seed(b"\x23" * 32)
    async with AsyncExitStack() as stack:
        tp = await stack.enter_async_context(open_memory_transport(network, pid(peer)))
        server = StageServer(tp, peer, stage, limits=ServerLimits(max_sessions=max_sessions, batch_rows=1))
        server.run_compute = timed_compute([1.0, 100.0])
        people = Requesters(network, pid(peer), spec)
        a_ctx = await stack.enter_async_context(people.requester(Identity.from_seed(b"\x43" * 32)))
        b_ctx = await stack.enter_async_context(people.requester(Identity.from_seed(b"\x44" * 32)))
        a = RouteSession(a_ctx, people.route, max_length=256)
        await a.open()
        inputs = torch.randn(61, spec.hidden_size, generator=torch.Generator().manual_seed(4))
        await a.step(inputs[:1], 0)  # the peer measures its speed
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.step, inputs[1:61], 1)  # holds the compute for 100 s
            await trio.sleep(0.5)
            yield server, pid(peer), people, b_ctx, a
            nursery.cancel_scope.cancel()
        await a.close()


async def test_an_open_priced_with_a_shorter_queue_is_refused_before_the_peer_holds_anything(tiny_llama,
                                                                                             autojump_clock):
    """A requester routes with the wait a peer last said; when many route there at once the queue
    has grown by the time the open arrives. The open says the longest queue its route was priced
    for (`max_wait`): a peer whose step would wait longer refuses (QUEUE_LONGER, with its load, so
    routing prices the real queue) and opens nothing — no session, no next-hop dial, no slot taken
    from anyone; an open priced for that queue, or one that says nothing, is accepted."""
    async with a_long_queue(tiny_llama, max_sessions=4) as (server, peer, people, b_ctx, a):
        opened = server.stats.sessions_opened
        with pytest.raises(SessionRefused) as refused:
            await RouteSession(b_ctx, people.route, max_length=256).open(max_waits={peer: 5.0})
        assert refused.value.code == QUEUE_LONGER and "longer than the 5 s" in refused.value.message
        assert server.stats.sessions_opened == opened and len(server.sessions) == 1  # nothing held
        said = b_ctx.loads.heard[peer][1]
        assert said.wait > 30  # the refusal carried the queue (60 tokens at 1 s each): routing prices it now
        b = RouteSession(b_ctx, people.route, max_length=256)
        await b.open(max_waits={peer: said.wait + 5.0})  # priced with the queue: taken, queue and all
        assert len(server.sessions) == 2
        c = RouteSession(b_ctx, people.route, max_length=256)
        await c.open()  # an open that says nothing takes any queue
        for session in (b, c):
            await session.close()


async def test_an_open_priced_with_a_shorter_queue_is_refused_before_it_waits_for_room(tiny_llama, autojump_clock):
    """A full peer whose queue is also longer than the open was priced with refuses it at once
    (QUEUE_LONGER), not after waiting for a slot it would not take: the requester routes again
    with the queue priced. (Checked only after the wait, an open waited for room, then was
    refused busy or for its queue: at 50 requesters, load 0.5, the opens took 6.0 s on average
    before their answer began, 5.4 s with the queue asked first; bench/load.py, seed 1.)"""
    async with a_long_queue(tiny_llama, max_sessions=1) as (server, peer, people, b_ctx, a):
        began = trio.current_time()
        with pytest.raises(SessionRefused) as refused:
            await RouteSession(b_ctx, people.route, max_length=256).open(max_waits={peer: 5.0})
        assert refused.value.code == QUEUE_LONGER
        assert trio.current_time() - began < 0.1  # no wait for room (SHORT_WAIT, ADMIT_WAIT) first
        with pytest.raises(SessionRefused) as refused:
            await RouteSession(b_ctx, people.route, max_length=256).open()  # unpriced: no room
        assert refused.value.code == BUSY


async def test_the_compute_goes_idle_after_every_finish_tag_was_forgotten(autojump_clock) -> None:
    """Many requesters' empty steps (0 units: their finish tags at V) are forgotten as steps start
    (the trim in `start`); the last one finishing leaves the compute idle without a tag to read."""
    queue = ComputeQueue()
    waiters = [queue.enter(f"r{i}", 0.0) for i in range(300)]
    for waiter in waiters:
        queue.start(waiter)
    assert not queue._finish  # every tag forgotten
    for waiter in waiters:
        queue.finish(waiter)
    assert queue.steps_running == 0 and queue.virtual == 0.0
