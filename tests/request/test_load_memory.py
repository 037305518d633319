"""A requester hears how busy peers are before it sends them an answer, on the memory transport
under MockClock (real StageServers; the requester is the real `Swarm`): the route chosen is
asked (a ping, whose echo carries the load: peer/serve/load.py) when the requester has not
heard from its peers lately, and chosen again with what they said."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from tessera.stages.decoding.generate import LocalEngine
from tessera.store import events

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
        world.servers["b"].queue.recent_wait = 30.0
        for _ in range(ANSWERS):
            assert await world.swarm.complete_ids(PROMPT, max_new_tokens=2, spot_check=None) == solo
        assert world.servers["a"].stats.sessions_opened == ANSWERS
        assert world.servers["b"].stats.sessions_opened == 0
        said = world.swarm.ctx.loads.reported()
        assert said[world.ids["b"]].wait_ms >= 29_000


async def test_a_refused_hop_is_replaced_in_place_and_the_peers_that_accepted_keep_their_sessions(
        model, autojump_clock):
    """b refuses the open (it is leaving: a refusal, as busy is) while a, its route neighbour,
    accepts: a keeps its session, and only b's span is routed again, onto c, before any step.
    Before, a's session was closed and a opened anew on a whole new route: two sessions on a
    for one answer (bench/load.py counted 764 such sessions in 6,844 with 50 requesters)."""
    half = LAYERS // 2
    plans = [PeerPlan("a", 0, half, 4000.0), PeerPlan("b", half, LAYERS, 4000.0), PeerPlan("c", half, LAYERS, 1000.0)]
    solo = LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=2)
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, plans)
        world.servers["b"].leaving = True  # its record still says serving: routing picks it, the faster
        info: dict = {}
        assert await world.swarm.complete_ids(PROMPT, max_new_tokens=2, spot_check=None, info=info) == solo
        assert world.servers["b"].stats.refused == 1
        assert world.servers["a"].stats.sessions_opened == 1  # kept, not opened again
        assert world.servers["c"].stats.sessions_opened == 1
        assert [world.name(hop["peer"]) for hop in info["route"]] == ["a", "c"]
        opened = [e.event for e in world.tracer.of_kind(events.SessionOpen) if e.event.route is not None]
        assert [[world.name(p) for p, _, _ in e.route] for e in opened] == [["a", "c"]]  # traced once, whole
