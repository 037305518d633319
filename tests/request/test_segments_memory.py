"""Routes with a tensor-shard group, in memory: the one repair loop and the spot checks over them.

A group's ranks compute with network collectives from their worker threads, so these run
on trio's real clock (the recovery cases of plain routes run under MockClock in
test_recovery_memory.py). Real StageServers and ShardServers on the memory transport; each
answer equals the single-process one token for token.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from tessera.peer.request.ports import CheckPolicy
from tessera.peer.request.verify import GROUP_UNCHECKED
from tessera.peer.serve.faults import perturber
from tessera.stages.decoding.generate import LocalEngine
from tessera.store import events

from .memory_swarm import PeerPlan, decisive_model, memory_swarm

PROMPT = [5, 17, 42, 99, 7, 5, 17]
TOKENS = 16
KILL_AFTER = 6  # tokens out before a rank dies
GROUP = [PeerPlan(f"g{i}", 2, 4, 3000.0, group="g", rank=i, ranks=2) for i in range(2)]  # layers [2, 4) in 2 ranks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return decisive_model(tmp_path_factory.mktemp("segments") / "m")


@pytest.fixture(scope="module")
def solo(model):
    return LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)


def route_names(world, route) -> list[str]:
    return [hop["peer"] if hop["peer"].startswith("group:") else world.name(hop["peer"]) for hop in route]


async def test_a_rank_dying_moves_the_group_span_whole(model, solo):
    """p0 [0, 2) -> group g [2, 4); rank g1 dies mid-answer. The group is one segment of the route;
    the repair loop re-routes its whole span (onto the plain replica s) and rebuilds it from the
    group's inputs, which the requester kept."""
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, [PeerPlan("p0", 0, 2, 4000.0), *GROUP, PeerPlan("s", 2, 4, 500.0)],
                                   held_back=("s",))  # routing would prefer s to the group's round trips
        info: dict = {}
        tokens: list[int] = []
        async for token in world.swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=info):
            tokens.append(token)
            if len(tokens) == KILL_AFTER:
                world.advertise("s")
                world.network.crash(world.ids["g1"])
    assert tokens == solo
    first, *_, last = info["routes"]
    assert route_names(world, first)[0] == "p0" and first[1]["peer"].startswith("group:")
    assert route_names(world, last) == ["p0", "s"]
    assert info["failovers"] == 1
    (failover,) = world.tracer.of_kind(events.Failover)
    assert [world.name(p) for p in failover.event.replacements] == ["s"]


async def test_spot_checks_on_a_route_with_a_group(model, solo):
    """p0 [0, 2) returns wrong activations; the route goes p0 -> group g [2, 4). The plain hop is
    checked as on any route (c0 and c1 serve [0, 2) too): p0 is convicted, [0, 2) fails over with
    a replay through the group (its cache was built from p0's wrong inputs), and the answer is
    the clean one. The group itself is not checked, and the summary says why."""
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, [
            PeerPlan("p0", 0, 2, 4000.0), PeerPlan("c0", 0, 2, 2000.0), PeerPlan("c1", 0, 2, 1000.0), *GROUP])
        world.servers["p0"].tamper = perturber(1.0, seed=3)  # every step
        info: dict = {}
        out = await world.swarm.complete_ids(PROMPT, max_new_tokens=TOKENS, info=info,
                                             spot_check=CheckPolicy(rate=1.0, seed=1))
    assert out == solo
    checks = info["checks"]
    assert any(v["guilty"] == world.ids["p0"] for v in checks["verdicts"]), checks
    assert not any(v["guilty"] in (world.ids["c0"], world.ids["c1"]) for v in checks["verdicts"])
    assert checks["unchecked"] == [{"span": [2, 4], "why": GROUP_UNCHECKED}]
    assert info["failovers"] == 1  # the conviction's repair, replayed on through the group
    first, last = info["routes"][0], info["route"]
    assert route_names(world, first)[0] == "p0" and first[1]["peer"].startswith("group:")
    assert route_names(world, last)[0] in ("c0", "c1") and last[1]["peer"].startswith("group:")
