"""Recovery edge cases, deterministic: real StageServers and the real requester on the in-memory
transport under trio's MockClock (the multi-process kills stay in tests/request/test_failover.py).

Each answer must equal the single-process one token for token, whatever failed on the way.
The route is four single-layer hops; routing prefers the fastest peer of each layer, so the
first route is p0 -> p1 -> p2 -> p3 and the replacements come from the slower replicas.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.request.chain import TAP_WAIT
from tessera.stages.decoding.generate import LocalEngine
from tessera.store import events

from .memory_swarm import PeerPlan, crash_at_first_compute, decisive_model, memory_swarm

PROMPT = [5, 17, 42, 99, 7, 5, 17]
TOKENS = 24
KILL_AFTER = 8  # tokens out before the failure
LATE_TAPS = 100 * TAP_WAIT  # s, one way: the taps of a live peer that the requester gives up waiting for

PLANS = [
    PeerPlan("p0", 0, 1, 4000.0), PeerPlan("p1", 1, 2, 4000.0), PeerPlan("p2", 2, 3, 4000.0),
    PeerPlan("p3", 3, 4, 4000.0),
    PeerPlan("q1", 1, 2, 2000.0), PeerPlan("q2", 2, 3, 2000.0),  # the first replicas
    PeerPlan("r1", 1, 2, 250.0),  # a second replica of layer 1, slower by far: chosen only when q1 is out
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return decisive_model(tmp_path_factory.mktemp("recovery") / "m")


@pytest.fixture(scope="module")
def solo(model):
    return LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)


async def answer(world, on_token) -> tuple[list[int], dict]:
    """Generate through the memory swarm; `on_token(n)` runs after the n-th token."""
    info: dict = {}
    tokens: list[int] = []
    async for token in world.swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=info):
        tokens.append(token)
        on_token(len(tokens))
    return tokens, info


def route_names(world, info) -> list[str]:
    return [world.name(hop["peer"]) for hop in info["route"]]


def bans(world) -> dict[str, str]:
    """Who the requester banned, and the first reason given."""
    found: dict[str, str] = {}
    for event in world.tracer.of_kind(events.Ban):
        found.setdefault(world.name(event.event.remote), event.event.reason)
    return found


async def test_two_adjacent_peers_failing_at_once(model, solo, autojump_clock):
    """p1 and p2 die together: their span [1, 3) is re-routed as one region (over q1 -> q2)."""
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, PLANS)

        def kill(n: int) -> None:
            if n == KILL_AFTER:
                world.network.crash(world.ids["p1"])
                world.network.crash(world.ids["p2"])

        tokens, info = await answer(world, kill)
    assert tokens == solo
    assert info["failovers"] == 1
    assert route_names(world, info) == ["p0", "q1", "q2", "p3"]
    (failover,) = world.tracer.of_kind(events.Failover)  # one repair for both
    assert [world.name(p) for p in failover.event.replacements] == ["q1", "q2"]
    assert set(bans(world)) <= {"p1", "p2"}  # the one whose failure ended the step (the other is only replaced)


async def test_a_replacement_failing_during_repair(model, solo, autojump_clock):
    """p1 dies; its first replacement q1 dies while its cache is being rebuilt (the replay):
    q1 is banned and layer 1 goes to r1, in the same repair."""
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, PLANS)
        crash_at_first_compute(world, "q1")

        def kill(n: int) -> None:
            if n == KILL_AFTER:
                world.network.crash(world.ids["p1"])

        tokens, info = await answer(world, kill)
    assert tokens == solo
    assert info["failovers"] == 1
    assert route_names(world, info) == ["p0", "r1", "p2", "p3"]
    assert [world.name(p) for hop in info["routes"] for p in [hop[1]["peer"]]] == ["p1", "r1"]
    assert set(bans(world)) == {"p1", "q1"}


async def test_a_tap_timeout_takes_the_silent_upstream_out_too(model, solo, autojump_clock):
    """p1 keeps computing and pushing to p2, but its taps (copies of its output) stop reaching
    the requester; then p2 dies. The inputs of p2's span never arrive, so after TAP_WAIT p1 is
    treated as failed too and [1, 3) is rebuilt from p0's taps."""
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, PLANS)
        me = world.swarm.peer_id

        def fail(n: int) -> None:
            if n == KILL_AFTER - 3:  # from here on, p1's frames to the requester are late by minutes
                world.network.set_link(world.ids["p1"], me, LinkSpec(latency=LATE_TAPS), both_ways=False)
            if n == KILL_AFTER:
                world.network.crash(world.ids["p2"])

        tokens, info = await answer(world, fail)
    assert tokens == solo
    assert info["failovers"] == 1
    assert route_names(world, info) == ["p0", "q1", "q2", "p3"]
    reasons = bans(world)
    assert set(reasons) == {"p1", "p2"}
    assert reasons["p1"] == "its taps stopped arriving"
