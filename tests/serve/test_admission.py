"""Admission against exhaustion (peer/serve/admission.py) on a real StageServer over the
in-memory transport, under trio's MockClock: hostile identities holding and cycling idle
sessions, KV charged as sessions grow, and busy refusals that say when (streams bounded before
they are admitted: tests/serve/test_intake.py); then the policy alone (Admission over a stand-in host), rule by rule."""

from __future__ import annotations

import math
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

import pytest
import torch
import trio
from libp2p.peer.id import ID

from tessera.peer.base.errors import PeerError, SessionRefused
from tessera.peer.base.protocols import SESSION_PROTOCOL
from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.request.chain import OPEN_TIMEOUT as REQUESTER_OPEN_TIMEOUT, RouteSession
from tessera.peer.request.chain_state import RequesterContext
from tessera.peer.serve.admission import (
    ADMIT_WAIT, FIRST_WAIT_HALF_LIFE, GRACE_CAP, GRACES_IN_HAND, IDLE_GRACE, RETRY_MIN, SHORT_WAIT, STEP_GRACE, Admission, Limits, Refused,
    _Waiter,
)
from tessera.peer.serve.limits import ACCEPT_TIMEOUT, ServerLimits
from tessera.peer.serve.server import StageServer
from tessera.protocol.error_codes import BUSY, RECLAIMED
from tessera.protocol.keys import Identity
from tessera.stages.assembly.stage import load_stage
from tessera.stages.layers.cache import KV_CHUNK

from functools import partial

from ..waiting import await_until

SLOTS = 4
HOSTILE = 8  # identities, each holding (or waiting for) one idle session at a time
STEPS = 6  # the honest answer: a prompt and five decode steps


def pid(identity: Identity) -> str:
    return ID(identity.peer_id).to_base58()


async def inline(fn):
    return fn()


class Requesters:
    """Requester identities on one memory network, each with its own transport (opened by the
    task that uses it: `requester`)."""

    def __init__(self, network: MemoryNetwork, server_id: str, spec) -> None:
        self.network = network
        self.route = Route((Hop(server_id, 0, spec.num_layers),), 0.0)
        self.spec = spec

    @asynccontextmanager
    async def requester(self, identity: Identity, *, work: bool = True) -> AsyncIterator[RequesterContext]:
        async with open_memory_transport(self.network, pid(identity)) as transport, trio.open_nursery() as nursery:
            keeper = ViewKeeper(model_id="m", num_layers=self.spec.num_layers, clock=trio.current_time)
            ctx = RequesterContext(transport=transport, identity=identity, keeper=keeper, nursery=nursery,
                                   num_layers=self.spec.num_layers, hidden_size=self.spec.hidden_size)
            if not work:
                ctx.work = b""  # shows no proof of work
            yield ctx
            nursery.cancel_scope.cancel()


async def hold_idle(people: Requesters, identity: Identity, stats: dict, *, work: bool = True) -> None:
    """A hostile identity: open a session and never step it; when it is reclaimed, open again
    at once (cycling); when refused, come back when told."""
    async with people.requester(identity, work=work) as ctx:
        while True:
            session = RouteSession(ctx, people.route, max_length=4096)
            try:
                await session.open()
            except SessionRefused as refused:
                stats["refused"] += 1
                assert refused.code == BUSY and refused.retry_after is not None and refused.retry_after >= 1.0
                await trio.sleep(refused.retry_after)
                continue
            stats["admitted"] += 1
            await await_until(lambda: any(h.failure for h in session.hops), 10_000, "a reclaim", interval=0.25)
            assert any(RECLAIMED in (h.failure or "") for h in session.hops), [h.failure for h in session.hops]
            stats["reclaimed"] += 1
            await session.close()


async def test_hostile_identities_holding_idle_sessions_do_not_lock_out_an_honest_requester(tiny_llama, autojump_clock):
    """The guarantee of peer/serve/admission.py: every slot held by idle sessions of hostile
    identities that reopen as soon as they lose one, and a stream of fresh identities (some
    with a proof of work) asking all the while; an honest requester's open is admitted
    within IDLE_GRACE of asking, in one open, and its answer is exact. (Before: refused
    busy until the 300 s idle timeout.)"""
    stage = load_stage(tiny_llama)
    spec = stage.spec
    network = MemoryNetwork(LinkSpec(latency=0.001, bandwidth=1e9))
    peer = Identity.from_seed(b"\x01" * 32)
    stats = {"admitted": 0, "refused": 0, "reclaimed": 0}
    async with AsyncExitStack() as transports:
        tp = await transports.enter_async_context(open_memory_transport(network, pid(peer)))
        server = StageServer(tp, peer, stage, limits=ServerLimits(max_sessions=SLOTS, max_sessions_per_requester=1,
                                                                  batch_rows=1))
        server.run_compute = inline
        async with trio.open_nursery() as nursery:
            people = Requesters(network, pid(peer), spec)
            for i in range(HOSTILE):
                nursery.start_soon(hold_idle, people, Identity.from_seed(bytes([100 + i]) * 32), stats)

            async def flood() -> None:  # a new identity every half second, one in four with work
                for i in range(10_000):
                    nursery.start_soon(partial(hold_idle, people, Identity.from_seed(i.to_bytes(4, "big") * 8), stats,
                                               work=i % 4 == 0))
                    await trio.sleep(0.5)

            nursery.start_soon(flood)
            await trio.sleep(30.0)  # the attack in its steady state: every slot held, queue full
            assert len(server.sessions) == SLOTS
            assert all(s.requester != pid(peer) for s in server.sessions.values())

            inputs = torch.randn(STEPS + 3, spec.hidden_size, generator=torch.Generator().manual_seed(1))
            answers, waits = [], []
            async with people.requester(Identity.from_seed(b"\x07" * 32)) as honest:
                for _ in range(2):  # two answers in a row: the second open is as quick
                    session = RouteSession(honest, people.route, max_length=64)
                    asked = trio.current_time()
                    await session.open()
                    waits.append(trio.current_time() - asked)
                    outputs = [await session.step(inputs[:4], 0)]
                    for pos in range(4, 4 + STEPS - 1):
                        outputs.append(await session.step(inputs[pos : pos + 1], pos))
                    await session.close()
                    answers.append(torch.cat(outputs))
            nursery.cancel_scope.cancel()
    assert max(waits) <= IDLE_GRACE + 0.5, waits
    solo = load_stage(tiny_llama)
    solo.open("ref", capacity=64)
    expected = torch.cat([solo.forward("ref", inputs[:4], 0)]
                         + [solo.forward("ref", inputs[pos : pos + 1], pos) for pos in range(4, 4 + STEPS - 1)])
    for answer in answers:
        torch.testing.assert_close(answer, expected, rtol=0, atol=1e-5)
    # the attack ran: hostile sessions were admitted and reclaimed again and again, refusals said when
    assert stats["reclaimed"] >= HOSTILE and stats["refused"] > 0 and server.stats.reclaimed >= HOSTILE


async def test_kv_is_charged_as_sessions_grow_and_idle_ones_give_way(tiny_llama, autojump_clock):
    """A session of max_length 4096 is charged one chunk, then what its steps reach; a step
    that needs memory held by an idle session reclaims it; with no idle session the step is
    refused busy with a retry_after, and its session is not charged."""
    stage = load_stage(tiny_llama)
    spec = stage.spec
    chunk = stage.session_bytes(KV_CHUNK)
    network = MemoryNetwork(LinkSpec(latency=0.001, bandwidth=1e9))
    peer = Identity.from_seed(b"\x02" * 32)
    async with AsyncExitStack() as transports:
        tp = await transports.enter_async_context(open_memory_transport(network, pid(peer)))
        server = StageServer(tp, peer, stage, limits=ServerLimits(max_sessions=8, batch_rows=1, kv_budget=3 * chunk))
        server.run_compute = inline
        people = Requesters(network, pid(peer), spec)
        async with AsyncExitStack() as requesters:
            ctx = [await requesters.enter_async_context(people.requester(Identity.from_seed(bytes([10 + i]) * 32)))
                   for i in range(2)]
            a, b = (RouteSession(x, people.route, max_length=4096) for x in ctx)
            await a.open()
            await b.open()
            assert server.kv_in_use() == 2 * chunk  # not 2 x 4096 positions
            await a.step(torch.randn(3, spec.hidden_size), 0)
            await trio.sleep(STEP_GRACE + 1)  # a goes idle
            await b.step(torch.randn(2 * KV_CHUNK + 10, spec.hidden_size), 0)  # b needs two more chunks: a's too
            assert server.kv_in_use() == 3 * chunk and list(server.sessions) == [b.session_id]
            assert server.stats.reclaimed == 1
            await await_until(lambda: any(RECLAIMED in (h.failure or "") for h in a.hops), 10, "a told")
            assert stage.sessions[b.session_id].cache.allocated == 3 * KV_CHUNK
            with pytest.raises(PeerError, match="busy"):  # a fourth chunk: nobody else to reclaim
                await b.step(torch.randn(KV_CHUNK, spec.hidden_size), 2 * KV_CHUNK + 10)
            assert server.kv_in_use() == 3 * chunk


async def test_a_full_peer_refuses_busy_with_a_retry_after(tiny_llama, autojump_clock):
    """Every slot held by a session that steps: an open waits only SHORT_WAIT (nothing idle will
    free), then is refused busy, told when to come back; nobody stepping is reclaimed."""
    stage = load_stage(tiny_llama)
    spec = stage.spec
    network = MemoryNetwork(LinkSpec(latency=0.001, bandwidth=1e9))
    peer = Identity.from_seed(b"\x03" * 32)
    async with AsyncExitStack() as transports:
        tp = await transports.enter_async_context(open_memory_transport(network, pid(peer)))
        server = StageServer(tp, peer, stage, limits=ServerLimits(max_sessions=1, batch_rows=1))
        server.run_compute = inline
        people = Requesters(network, pid(peer), spec)
        async with people.requester(Identity.from_seed(b"\x0d" * 32)) as first, \
                people.requester(Identity.from_seed(b"\x0e" * 32)) as second, trio.open_nursery() as nursery:
            busy = RouteSession(first, people.route, max_length=4096)
            await busy.open()

            async def keep_stepping() -> None:
                for pos in range(1000):
                    await busy.step(torch.randn(1, spec.hidden_size), pos)
                    await trio.sleep(0.1)

            nursery.start_soon(keep_stepping)
            late = RouteSession(second, people.route, max_length=64)
            asked = trio.current_time()
            with pytest.raises(SessionRefused) as refused:
                await late.open()
            assert refused.value.code == BUSY and 1.0 <= refused.value.retry_after <= IDLE_GRACE
            assert SHORT_WAIT <= trio.current_time() - asked < ADMIT_WAIT and server.stats.reclaimed == 0
            nursery.cancel_scope.cancel()


# -- the policy alone: Admission over a stand-in host, on a clock the test sets ----------------------


@dataclass(eq=False)
class Held:
    """A served session as admission reads it (peer/serve/admission.py `Admitted`)."""

    requester: str
    kv_bytes: int = 1
    last_active: float = 0.0
    stepped: bool = True
    inflight: int = 0
    closed: bool = False
    grace_until: float = -math.inf


class Host:
    """A stage server's sessions and their KV as admission reads them; `reclaim` drops one."""

    def __init__(self, *sessions: Held) -> None:
        self.sessions = {}
        self.reclaimed: list[Held] = []
        for session in sessions:
            self.add(session)

    def add(self, session: Held) -> Held:
        self.sessions[id(session)] = session  # a key per session; the order is insertion order
        return session

    def kv_in_use(self) -> int:
        return sum(s.kv_bytes for s in self.sessions.values())

    def reclaim(self, session: Held) -> None:
        self.reclaimed.append(session)
        self.sessions = {k: s for k, s in self.sessions.items() if s is not session}


def test_the_session_idle_longest_is_reclaimed_first_and_as_soon_as_its_grace_ends() -> None:
    """Stepped sessions are protected until exactly STEP_GRACE after their last step, and the one
    idle longest gives way first (not whichever the server lists first), one at a time."""
    old, recent = Held("a", last_active=0.0), Held("b", last_active=1.0)
    host = Host(recent, old)  # listed newest first
    admission = Admission(host, Limits(max_sessions=2, max_sessions_per_requester=1, kv_budget=100))
    assert not admission.make_room(1, now=STEP_GRACE - 0.001, asker="c") and host.reclaimed == []
    assert admission.make_room(1, now=STEP_GRACE, asker="c")  # old's grace ends at this instant
    assert host.reclaimed == [old]
    old, recent = Held("a", last_active=0.0), Held("b", last_active=1.0)
    host = Host(recent, old)
    admission = Admission(host, Limits(max_sessions=2, max_sessions_per_requester=1, kv_budget=100))
    assert admission.make_room(1, now=100.0, asker="c")  # both idle: only the older one goes
    assert host.reclaimed == [old] and list(host.sessions.values()) == [recent]


def test_a_session_with_a_step_in_flight_is_never_reclaimed() -> None:
    """A step that runs (or waits in the batch queue) longer than IDLE_GRACE is use, not idleness:
    its session must not be dropped under it."""
    running = Held("a", last_active=0.0, inflight=1)
    host = Host(running)
    admission = Admission(host, Limits(max_sessions=1, max_sessions_per_requester=1, kv_budget=100))
    assert not admission.make_room(1, now=1000.0, asker="b")
    assert host.reclaimed == [] and admission.protected_until(running) == math.inf


def test_a_session_in_use_is_protected_a_route_wait_after_each_step_whatever_its_pace() -> None:
    """A session whose steps come far apart (they wait in other peers' queues up and down its route)
    is in use: protected STEP_GRACE after its last step, so a newcomer is refused busy rather than
    reclaim it (a reclaim costs its requester a failover and a replay: with IDLE_GRACE, or twice
    its longest gap, the simulator's 50 requesters lost most answers to a reclaim cascade). A
    requester whose sessions here waited 9 s for their first step has that much longer a grace
    for its next one's (twice the peer's wait: a new requester's too, below)."""
    now = [0.0]
    host = Host()
    admission = Admission(host, Limits(max_sessions=1, max_sessions_per_requester=1, kv_budget=100),
                          clock=lambda: now[0])
    admission.requester("r").work = True
    slow = host.add(Held("r", stepped=False))
    admission.opened(slow)
    for t in (9.0, 10.0, 11.0):  # its first step 9 s after it opened, then two 1 s apart
        now[0] = t
        slow.inflight = 1
        admission.stepped(slow)
        slow.inflight = 0
        admission.stepped(slow)
    assert admission.protected_until(slow) == 11.0 + STEP_GRACE
    assert not admission.make_room(1, now=11.0 + STEP_GRACE - 0.5, asker="x") and host.reclaimed == []
    assert admission.make_room(1, now=11.0 + STEP_GRACE, asker="x") and host.reclaimed == [slow]
    assert admission.requesters["r"].first_wait == 9.0
    host = Host()
    admission.host = host
    admission.limits = Limits(max_sessions=4, max_sessions_per_requester=4, kv_budget=100)
    now[0] = 12.0  # its next answer's session, a second after its last step
    fresh = host.add(Held("r", stepped=False))
    admission.opened(fresh)  # it stepped since its last grace: a new one, of twice its first wait as it counts now
    later = 2 * 9.0 * 0.5 ** ((now[0] - 9.0) / FIRST_WAIT_HALF_LIFE)  # measured at 9 s, halving since
    assert admission.protected_until(fresh) == pytest.approx(now[0] + later) and later > IDLE_GRACE
    idle = host.add(Held("q", stepped=False))
    admission.requester("q").work = True
    admission.opened(idle)
    assert admission.protected_until(idle) == pytest.approx(now[0] + later)


def test_a_requester_new_to_a_peer_gets_a_grace_of_twice_the_peers_recent_wait_for_a_first_step() -> None:
    """A session deep in a route waits for its prompt behind the hops before it. A requester new to
    the peer (at 50 requesters, most are new to most peers) has no wait of its own here: with
    IDLE_GRACE its sessions were reclaimed waiting for their prompt (bench/load.py: p90 37.2 s and
    47 failovers on 20 peers, 31.4 s and 24 with the peer's wait). The grace follows the peer's
    recent wait — the longest lately, halving every FIRST_WAIT_HALF_LIFE, not at each new first step
    (a busy peer, several opens a second, forgot a long wait within a second) — at most GRACE_CAP;
    an identity without work still has none, and a peer whose sessions step at once comes back to
    IDLE_GRACE."""
    now = [0.0]
    host = Host()
    admission = Admission(host, Limits(max_sessions=8, max_sessions_per_requester=8, kv_budget=100),
                          clock=lambda: now[0])
    fresh = host.add(Held("new", stepped=False))
    admission.requester("new").work = True
    admission.opened(fresh)
    assert admission.protected_until(fresh) == IDLE_GRACE  # nothing waited here yet
    for requester, opened_at, first_step in (("a", 0.0, 12.0), ("b", 20.0, 40.0)):
        admission.requester(requester).work = True
        now[0] = opened_at
        deep = host.add(Held(requester, stepped=False))
        admission.opened(deep)
        now[0] = first_step
        deep.inflight = 1
        admission.stepped(deep)
    assert admission.first_wait == 20.0
    newcomer = host.add(Held("c", stepped=False))
    admission.requester("c").work = True
    admission.opened(newcomer)
    assert admission.protected_until(newcomer) == 40.0 + GRACE_CAP  # 2 x 20 s, at most GRACE_CAP
    for t in (40.1, 40.2, 40.3):  # a burst of sessions that step at once: the 20 s wait is not forgotten
        now[0] = t
        quick = host.add(Held("b", stepped=False))
        admission.opened(quick)
        quick.inflight = 1
        admission.stepped(quick)
    assert admission.first_wait == pytest.approx(20.0 * 0.5 ** (0.3 / FIRST_WAIT_HALF_LIFE))
    now[0] = 40.3 + FIRST_WAIT_HALF_LIFE
    worker = host.add(Held("d", stepped=False))
    admission.requester("d").work = True
    admission.opened(worker)  # a half-life after the burst the 20 s counts about half: a grace of ~2 x 10 s
    kept = 20.0 * 0.5 ** ((now[0] - 40.0) / FIRST_WAIT_HALF_LIFE)  # the 20 s measured at 40 s, halving since
    assert admission.protected_until(worker) == pytest.approx(now[0] + 2 * kept)
    now[0] += 3 * FIRST_WAIT_HALF_LIFE
    drained = host.add(Held("f", stepped=False))
    admission.requester("f").work = True
    admission.opened(drained)  # long since: 2.5 s, so IDLE_GRACE again
    assert admission.protected_until(drained) == pytest.approx(now[0] + IDLE_GRACE)
    idler = host.add(Held("e", stepped=False))  # no proof of work: no grace at all
    admission.opened(idler)
    assert admission.protected_until(idler) < now[0]


def test_each_open_of_a_requester_that_steps_here_gets_its_own_grace_and_one_that_never_steps_one() -> None:
    """A requester running several answers opens sessions here at different times, each waiting for
    its prompt behind the hops before it: every one that a step of the requester's here paid for
    keeps IDLE_GRACE from its own open (with one grace shared by the requester, the second open was
    reclaimable the instant its predecessor's grace ended: the simulator's 50 requesters lost
    ~40,000 sessions that way). An identity that never steps has one grace, however often it opens."""
    now = [0.0]
    host = Host()
    admission = Admission(host, Limits(max_sessions=16, max_sessions_per_requester=8, kv_budget=100),
                          clock=lambda: now[0])
    for who in ("honest", "idle"):
        admission.requester(who).work = True
    first = host.add(Held("honest", stepped=False))
    admission.opened(first)
    for t in (1.0, 2.0):  # two steps of it arrive here
        now[0] = t
        first.inflight = 1
        admission.stepped(first)
        first.inflight = 0
        admission.stepped(first)
    opens = {}
    for t in (3.0, 6.0):  # two more answers' sessions, opened 3 s apart, no step of theirs yet
        now[0] = t
        opens[t] = host.add(Held("honest", stepped=False))
        admission.opened(opens[t])
        assert admission.protected_until(opens[t]) == t + IDLE_GRACE
    later = admission.reclaimable(3.0 + IDLE_GRACE + 0.5, asker="x")
    assert opens[3.0] in later and opens[6.0] not in later  # only its own grace ended
    idle = [host.add(Held("idle", stepped=False, last_active=t)) for t in (0.0, 1.0, 2.0)]
    for session in idle:
        admission.opened(session)
    assert [admission.protected_until(s) for s in idle[1:]] == [-math.inf, -math.inf]
    assert admission.requesters["honest"].graces <= GRACES_IN_HAND


def test_a_session_closed_unused_within_its_grace_gives_the_grace_back_once_per_step() -> None:
    """A requester that opens a route and closes it before its first step (an accept said a longer
    queue than it was priced with; a repair's replacement abandoned) gets that open's grace back, so
    the open it keeps is protected too (without the return, a requester that re-routed a few times
    had no grace left: its kept session reclaimed the instant it was admitted). A return is earned
    like a grace, one a step arriving here: an identity that never steps gets nothing back however
    often it closes and reopens (what is left of its one grace goes to its next open: all its opens
    together are protected one grace), and a session reclaimed (its grace over) returns nothing."""
    now = [0.0]
    host = Host()
    admission = Admission(host, Limits(max_sessions=16, max_sessions_per_requester=8, kv_budget=100),
                          clock=lambda: now[0])
    for who in ("honest", "cycler"):
        admission.requester(who).work = True
    used = host.add(Held("honest", stepped=False))
    admission.opened(used)
    used.inflight = 1
    admission.stepped(used)  # one step arrives: one grace and one return earned
    used.inflight = 0
    admission.stepped(used)
    record = admission.requesters["honest"]
    assert record.graces == 1 and record.returns == 1
    for t in (1.0, 2.0):  # two opens closed unused in their grace: the first gives its grace back
        now[0] = t
        unused = host.add(Held("honest", stepped=False))
        admission.opened(unused)
        assert admission.protected_until(unused) == t + IDLE_GRACE
        del host.sessions[id(unused)]
        unused.closed = True
        admission.closed(unused)
        assert record.returns == 0 and record.graces == (1 if t == 1.0 else 0)
    kept = host.add(Held("honest", stepped=False))
    admission.opened(kept)  # no grace in hand after the second, no return: only what was left of its grace
    assert admission.protected_until(kept) == 2.0 + IDLE_GRACE and record.left_over == 0.0
    cycler = admission.requesters["cycler"]
    protected = 0.0
    for opened, closed, until in ((4.0, 5.0, 9.0), (6.0, 8.0, 10.0), (9.0, 9.5, 11.0)):  # never steps, closes
        now[0] = opened  # each open unused: what is left of its one grace goes to its next open, never more
        unused = host.add(Held("cycler", stepped=False))
        admission.opened(unused)
        assert admission.protected_until(unused) == until
        now[0] = closed
        protected += closed - opened
        del host.sessions[id(unused)]
        unused.closed = True
        admission.closed(unused)
        assert cycler.graces == 0
    assert protected <= IDLE_GRACE
    assert cycler.left_over == IDLE_GRACE - protected
    late = Held("honest", stepped=False, grace_until=now[0] - 0.1)  # its grace over: reclaimable, no return
    record.returns = 1
    host.add(late)
    record.sessions += 1
    del host.sessions[id(late)]
    admission.closed(late)
    assert record.returns == 1 and record.graces == 0


def test_an_open_may_fill_the_kv_budget_exactly_and_growth_reclaims_all_it_needs() -> None:
    """The budget is a bound that may be reached (an open charging the last bytes fits, nothing is
    reclaimed); a growing session that needs the KV of two idle sessions gets both reclaimed, not
    only the last one counted (which would leave the budget overdrawn)."""
    a, b = Held("a", kv_bytes=3, last_active=0.0), Held("b", kv_bytes=3, last_active=1.0)
    grower = Held("c", kv_bytes=4, last_active=100.0)
    host = Host(a, b, grower)
    admission = Admission(host, Limits(max_sessions=8, max_sessions_per_requester=8, kv_budget=12))
    assert admission.make_room(2, now=100.0, asker="d") and host.reclaimed == []  # 10 + 2 == 12
    assert admission.make_room(7, now=100.0, slot=False, spare=grower)  # 10 + 7: 5 bytes to free
    assert host.reclaimed == [a, b] and host.kv_in_use() + 7 <= 12
    assert admission.reclaimed == 2


def test_only_a_requester_with_a_proof_of_work_gets_a_grace_before_its_first_step() -> None:
    """Identities are cheap; without a proof of work an unstepped session has no grace at all and
    gives way to anyone who needs the room (module docstring, rule 2)."""
    host = Host()
    admission = Admission(host, Limits(max_sessions=4, max_sessions_per_requester=1, kv_budget=100),
                          clock=lambda: 10.0)
    sessions = {}
    for who, work in (("worked", True), ("free", False)):
        admission.requester(who).work = work
        sessions[who] = host.add(Held(who, stepped=False))
        admission.opened(sessions[who])
    assert admission.protected_until(sessions["worked"]) == 10.0 + IDLE_GRACE
    assert admission.protected_until(sessions["free"]) == -math.inf
    assert admission.reclaimable(10.0, asker="x") == [sessions["free"]]


def test_retry_after_is_never_under_retry_min_and_adds_a_grace_per_round_of_requesters_ahead() -> None:
    """A busy refusal says when room may come (the next protection's end), never sooner than
    RETRY_MIN, plus IDLE_GRACE per `max_sessions` better-placed requesters already waiting."""
    host = Host(Held("a", stepped=False, grace_until=IDLE_GRACE))  # protected until IDLE_GRACE
    admission = Admission(host, Limits(max_sessions=1, max_sessions_per_requester=1, kv_budget=100))
    late = admission.requester("late")  # no proof of work: everyone with one is ahead of it
    assert admission.retry_after(late, IDLE_GRACE - 0.2) == RETRY_MIN
    assert admission.retry_after(late, 2.0) == IDLE_GRACE - 2.0
    stepping = Admission(Host(Held("b", last_active=0.0)), admission.limits)  # protected STEP_GRACE
    assert stepping.retry_after(stepping.requester("late"), 1.0) == IDLE_GRACE  # yet an answer may end any moment
    for who in ("x", "y"):  # two requesters with work waiting, one slot: two rounds ahead
        record = admission.requester(who)
        record.work = True
        admission.waiting.append(_Waiter(record, 1))
    assert admission.retry_after(late, 2.0) == IDLE_GRACE - 2.0 + 2 * IDLE_GRACE


async def test_a_requester_at_its_session_limit_is_refused_at_once(autojump_clock) -> None:
    """Rule 3: at `max_sessions_per_requester` an open is refused busy without waiting, even with
    slots free."""
    host = Host()
    admission = Admission(host, Limits(max_sessions=4, max_sessions_per_requester=1, kv_budget=100))
    admission.opened(host.add(Held("a")))
    asked = trio.current_time()
    with pytest.raises(Refused) as refused:
        await admission.wait_for_room("a", 1, work=True)
    assert refused.value.code == BUSY and trio.current_time() == asked and len(host.sessions) == 1


async def test_an_open_waits_for_a_slot_that_idles_free_8_s_later_and_is_admitted(autojump_clock) -> None:
    """Every slot held, one by a session unstepped whose grace ends 8 s from now: an open that comes
    now waits for it (ADMIT_WAIT) and is admitted in the same open, reclaiming it, instead of being
    refused busy after a shorter wait (then its requester routes again and closes the hops it had
    opened for the route: bench/load.py's sessions an answer)."""
    host = Host()
    admission = Admission(host, Limits(max_sessions=2, max_sessions_per_requester=2, kv_budget=100))
    admission.opened(host.add(Held("stepping", inflight=1)))  # never reclaimable
    asked = trio.current_time()
    idle = host.add(Held("slow", stepped=False, last_active=asked, grace_until=asked + 8.0))
    admission.opened(idle)
    await admission.wait_for_room("newcomer", 1, work=True)
    assert host.reclaimed == [idle] and trio.current_time() - asked == pytest.approx(8.0, abs=0.5)


def test_a_full_peer_answers_an_open_before_its_requester_gives_up_on_it() -> None:
    """The bounds nest: the wait for room (ADMIT_WAIT) fits the server's bound on an open with time
    left to dial the next hop, and that fits the requester's bound on the open, so a peer out of
    room is heard as busy, never timed out (a strike: peer/base/backoff.py)."""
    assert IDLE_GRACE < ADMIT_WAIT < ACCEPT_TIMEOUT < REQUESTER_OPEN_TIMEOUT
    assert ACCEPT_TIMEOUT - ADMIT_WAIT >= 4.0  # left to dial the next hop, relayed, after a full wait


async def test_a_freed_slot_goes_to_the_waiter_holding_fewer_sessions_before_the_one_admitted_earlier(
        autojump_clock) -> None:
    """The queue's order: fewest sessions here first, and only then the one admitted least recently.
    `many` holds a session and was admitted before `few` (whose session has ended): `few` is first."""
    host = Host()
    admission = Admission(host, Limits(max_sessions=2, max_sessions_per_requester=2, kv_budget=100))
    admission.opened(host.add(Held("many", inflight=1)))  # stepping: never reclaimable
    await trio.sleep(1.0)
    few = host.add(Held("few"))
    admission.opened(few)
    host.sessions = {k: s for k, s in host.sessions.items() if s is not few}
    admission.closed(few)
    other = host.add(Held("other", inflight=1))
    admitted: list[str] = []

    async def ask(who: str) -> None:
        try:
            await admission.wait_for_room(who, 1, work=True)
        except Refused:
            return
        admission.opened(host.add(Held(who, inflight=1)))  # admitted before the next checkpoint
        admitted.append(who)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "many")
        await trio.sleep(0.01)
        nursery.start_soon(ask, "few")
        await trio.sleep(0.1)
        host.sessions = {k: s for k, s in host.sessions.items() if s is not other}
        admission.closed(other)  # one slot frees
    assert admitted == ["few"]


def test_a_new_session_reclaims_only_from_an_identity_holding_more_sessions_here_than_its_requester() -> None:
    """Fair share (rule 2): an open takes an idle session's room only from an identity holding more
    sessions here than its own requester does, so two requesters with one session each here do not
    take each other's (a replacement waiting for its replay, a downstream hop waiting for its
    prompt) in turn; a newcomer holding none still reclaims any idle identity's (the lock-out
    guarantee), and a growing session's KV may still take any idle session's memory."""
    a1 = Held("a", last_active=0.0, stepped=False)
    b1, b2 = Held("b", last_active=1.0, stepped=False), Held("b", last_active=2.0, stepped=False)
    mine = Held("c", last_active=3.0)
    host = Host(a1, b1, b2, mine)
    admission = Admission(host, Limits(max_sessions=4, max_sessions_per_requester=4, kv_budget=100))
    now = STEP_GRACE + 10.0  # every session is past its protection
    assert admission.make_room(1, now=now, asker="c")
    assert host.reclaimed == [b1]  # not a1, idle longer: "a" holds one session here, as "c" does
    host.add(Held("d", last_active=now))  # the freed slot is taken (in use: protected)
    assert admission.make_room(1, now=now, asker="c") is False  # "b" holds one now: none is c's to take
    host.reclaimed.clear()
    assert admission.make_room(1, now=now, asker="newcomer") and host.reclaimed == [a1]  # holding none
    growing = Host(Held("a", last_active=0.0, stepped=False), Held("c", last_active=3.0))
    grow = Admission(growing, Limits(max_sessions=2, max_sessions_per_requester=2, kv_budget=2))
    assert grow.make_room(1, now=now, slot=False, asker="c") and len(growing.reclaimed) == 1
