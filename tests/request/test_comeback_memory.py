"""A peer that is the only one serving its span dies and comes back: the answer waits for it.

Deterministic, on the in-memory transport under trio's MockClock, with real StageServers and
the real requester (the multi-process kill -9 and SIGSTOP versions are in
tests/swarm/test_comeback.py). The route is p0 [0, 1) -> p1 [1, 3) -> p2 [3, 4); nobody else
serves [1, 3). p1 is killed mid-answer and restarted (same identity, empty session table,
a fresh advertisement) a few seconds later. The requester banned it when it dropped, but
re-probes it while it waits for a route (peer/base/backoff.py), opens the span on it again
and rebuilds its cache from the history, as for any replacement: the answer equals the
single-process one token for token.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest
import trio

from tessera.peer.base.backoff import BAN_BASE, ROUTE_WAIT, Failure
from tessera.peer.base.errors import RouteLost
from tessera.peer.net.pinger import Pinger
from tessera.peer.net.memory import open_memory_transport
from tessera.peer.serve.server import StageServer
from tessera.protocol.crypto import sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import PeerRecord
from tessera.stages.decoding.generate import LocalEngine
from tessera.stages.assembly.stage import load_stage
from tessera.stages.weights import registry
from tessera.store import events

from .memory_swarm import RECORD_LIFETIME, PeerPlan, decisive_model, inline, memory_swarm

PROMPT = [5, 17, 42, 99, 7, 5, 17]
TOKENS = 24
KILL_AFTER = 8
PLANS = [PeerPlan("p0", 0, 1, 4000.0), PeerPlan("p1", 1, 3, 4000.0), PeerPlan("p2", 3, 4, 4000.0)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return decisive_model(tmp_path_factory.mktemp("comeback") / "m")


@pytest.fixture(scope="module")
def solo(model):
    return LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)


async def run_again(world, folder, name: str, plan: PeerPlan, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """`name` runs again (until cancelled): the same identity on a new transport, a new server (no
    sessions), a pinger (every real peer answers pings), and a new signed advertisement that
    reaches the requester."""
    identity = Identity.from_seed(bytes([PLANS.index(plan) + 1]) * 32)  # as memory_swarm made it
    async with open_memory_transport(world.network, world.ids[name]) as transport:
        server = StageServer(transport, identity, load_stage(folder, start=plan.start, end=plan.end))
        server.run_compute = inline
        Pinger(transport)
        now = time.time() + 1.0  # signed after the record it had when it died
        world.swarm.keeper.merge([sign_record(identity, PeerRecord(
            peer_id=identity.peer_id, name=name, model_id=registry.model_id(folder), start=plan.start, end=plan.end,
            shard_index=0, shard_count=1, throughput=plan.throughput, free_memory=0, load=0.0, max_sessions=64,
            state="serving", reachability="public", addrs=tuple(transport.addrs()), neighbours=(), issued_at=now,
            expires_at=now + RECORD_LIFETIME, seq=2,
        ))])
        world.servers[name] = server
        await trio.sleep_forever()


async def answer_with_a_comeback(world, model, down_for: float) -> tuple[list[int], dict]:
    """Kill p1 after KILL_AFTER tokens; it runs again `down_for` seconds later."""
    tokens: list[int] = []
    info: dict = {}

    async def come_back() -> None:
        await trio.sleep(down_for)
        await run_again(world, model, "p1", PLANS[1])

    failed: RouteLost | None = None
    async with trio.open_nursery() as peers:
        try:
            async for token in world.swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=info, spot_check=None):
                tokens.append(token)
                if len(tokens) == KILL_AFTER:
                    world.network.crash(world.ids["p1"])
                    peers.start_soon(come_back)
        except RouteLost as lost:
            failed = lost
        peers.cancel_scope.cancel()
    if failed is not None:
        raise failed
    return tokens, info


async def test_the_sole_peer_of_a_span_restarts_and_the_answer_completes_exactly(model, solo, autojump_clock):
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, PLANS)
        started = trio.current_time()
        tokens, info = await answer_with_a_comeback(world, model, down_for=5.0)
        waited = trio.current_time() - started
    assert tokens == solo
    assert info["failovers"] == 1
    assert [world.name(h["peer"]) for h in info["route"]] == ["p0", "p1", "p2"]  # the same peer, again
    (ban,) = [e.event for e in world.tracer.of_kind(events.Ban)]
    assert world.name(ban.remote) == "p1" and ban.failure == Failure.DROPPED.value and ban.seconds == BAN_BASE
    (parole,) = [e.event for e in world.tracer.of_kind(events.Parole)]
    assert world.name(parole.remote) == "p1"
    (failover,) = [e.event for e in world.tracer.of_kind(events.Failover)]
    assert [world.name(p) for p in failover.replacements] == ["p1"]
    assert waited < 5.0 + ROUTE_WAIT / 2  # used again within moments of its return, long before its ban ends


async def test_a_peer_that_stays_away_fails_the_answer_after_the_route_wait(model, autojump_clock):
    """The other side of the policy: no comeback within ROUTE_WAIT, a clear error naming the span."""
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, PLANS)
        with pytest.raises(RouteLost) as lost:
            await answer_with_a_comeback(world, model, down_for=ROUTE_WAIT + 10.0)
    assert "[1, 3)" in str(lost.value) and lost.value.missing == [(1, 3)]
