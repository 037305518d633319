"""Routing over a view that is briefly incomplete still answers exactly.

With bounded gossip a requester's view lags the swarm by up to B(N) (peer/net/gossip.py): a
peer that just joined is not in it yet, and one that just left still is. Real StageServers
on the memory transport (tests/request/memory_swarm.py); each answer equals the
single-process one token for token, whatever the view held when it was routed.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from tessera.stages.decoding.generate import LocalEngine

from tests.request.memory_swarm import PeerPlan, decisive_model, memory_swarm

PROMPT = [5, 17, 42, 99, 7, 5, 17]
TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return decisive_model(tmp_path_factory.mktemp("partial") / "m")


@pytest.fixture(scope="module")
def solo(model):
    return LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)


async def test_an_answer_is_exact_before_and_after_a_missing_record_arrives(model, solo):
    """The fastest peer's record has not reached the requester: it routes over the others;
    the record arrives mid-answer and the next answer takes the fast peer; both are exact."""
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, [PeerPlan("a", 0, 2, 500.0), PeerPlan("b", 2, 4, 500.0),
                                                  PeerPlan("fast", 0, 4, 5000.0)], held_back=("fast",))
        info: dict = {}
        tokens: list[int] = []
        async for token in world.swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=info):
            tokens.append(token)
            if len(tokens) == 3:
                world.advertise("fast")  # the record arrives while the answer runs
        assert tokens == solo
        assert [world.name(h["peer"]) for h in info["routes"][0]] == ["a", "b"]
        # a peer this requester never measured is priced at DEFAULT_RTT_MS a way, so two measured hops
        # may well be cheaper: once its round trip is known (a ping, as an open's pre-ping or a dial
        # gives it) the single fast hop wins; the cheapest chain, as what is tested is the view
        await world.swarm.pinger.ping(world.ids["fast"])
        world.swarm.spread = 0.0
        again: dict = {}
        assert await world.swarm.complete_ids(PROMPT, max_new_tokens=TOKENS, info=again) == solo
        assert [world.name(h["peer"]) for h in again["routes"][0]] == ["fast"]


async def test_an_answer_is_exact_when_the_view_still_holds_a_peer_that_is_gone(model, solo):
    """The fastest peer has died but its record is still in the view (its departure has not
    arrived): the route through it fails at once, the requester fails over, the answer is exact."""
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, [PeerPlan("a", 0, 2, 500.0), PeerPlan("b", 2, 4, 500.0),
                                                  PeerPlan("fast", 0, 4, 5000.0)])
        world.network.crash(world.ids["fast"])
        info: dict = {}
        assert await world.swarm.complete_ids(PROMPT, max_new_tokens=TOKENS, info=info) == solo
        assert [world.name(h["peer"]) for h in info["routes"][-1]] == ["a", "b"]
