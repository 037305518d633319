"""A requester hears how busy peers are before it sends them an answer, on the memory transport
under MockClock (real StageServers; the requester is the real `Swarm`): the route chosen is
asked (a ping, whose echo carries the load: peer/serve/load.py) when the requester has not
heard from its peers lately, and chosen again with what they said."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from tessera.stages.decoding.generate import LocalEngine

from .memory_swarm import LAYERS, PeerPlan, decisive_model, memory_swarm

PROMPT = [5, 17, 42, 99, 7, 5, 17]
PLANS = [PeerPlan("a", 0, LAYERS, 1000.0), PeerPlan("b", 0, LAYERS, 1000.0)]  # equal: the spread splits them
ANSWERS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return decisive_model(tmp_path_factory.mktemp("loads") / "m")


async def test_an_open_asks_peers_it_has_not_heard_from_and_avoids_a_long_queue(model, autojump_clock):
    """b is deep in other requesters' work (its steps have waited 30 s lately): every answer goes
    to a, and b never has a session opened on it (without asking, the spread sent about half to
    b, where the accept then said the queue and the open went elsewhere: a session for nothing)."""
    solo = LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=2)
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, PLANS)
        world.servers["b"].compute.queue.recent_wait = 30.0
        for _ in range(ANSWERS):
            assert await world.swarm.complete_ids(PROMPT, max_new_tokens=2, spot_check=None) == solo
        assert world.servers["a"].stats.sessions_opened == ANSWERS
        assert world.servers["b"].stats.sessions_opened == 0
        said = world.swarm.ctx.loads.reported()
        assert said[world.ids["b"]].wait_ms >= 29_000
