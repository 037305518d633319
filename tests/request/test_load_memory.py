"""A requester hears how busy peers are before it sends them an answer, on the memory transport
under MockClock (real StageServers; the requester is the real `Swarm`): the route chosen is
asked (a ping, whose echo carries the load: peer/serve/load.py) when the requester has not
heard from its peers lately, and chosen again with what they said; a peer whose queue grew
since it last said refuses the open (queue-longer) and the route is chosen again."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from tessera.peer.request.client import REFRESH_INTERVAL
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
        # b's word is at most a refresh old (the requester pings its peers each REFRESH_INTERVAL),
        # its wait less that age (it drains: peer/request/loads.py)
        assert said[world.ids["b"]].wait_ms >= (30.0 - REFRESH_INTERVAL) * 1000


async def test_an_open_refused_for_a_longer_queue_goes_elsewhere_with_no_session_and_no_ban(model, autojump_clock):
    """b, the faster, said a moment ago that it was idle (a fresh word: no ask before the open),
    and its queue has grown since (many requesters heard the same). The open tells b the queue it
    was priced with; b refuses (queue-longer) before it holds anything, the requester prices what
    b said and routes again, to a: the answer is exact, b opened no session and is not avoided
    (a longer queue is news, not a fault)."""
    plans = [PeerPlan("a", 0, LAYERS, 1000.0), PeerPlan("b", 0, LAYERS, 4000.0)]
    solo = LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=2)
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, plans)
        swarm, b = world.swarm, world.ids["b"]
        for name in ("a", "b"):
            await swarm.pinger.ping(world.ids[name])
        assert b not in swarm.ctx.loads.reported() and not swarm.ctx.loads.stale([b])  # idle, and fresh
        world.servers["b"].compute.queue.recent_wait = 30.0
        assert await swarm.complete_ids(PROMPT, max_new_tokens=2, spot_check=None) == solo
        assert world.servers["b"].stats.sessions_opened == 0 and world.servers["b"].stats.refused == 1
        assert world.servers["a"].stats.sessions_opened == 1
        assert swarm.ctx.loads.reported()[b].wait_ms >= (30.0 - REFRESH_INTERVAL) * 1000 and not swarm.is_banned(b)


async def test_the_only_peer_with_a_longer_queue_than_priced_is_taken_once_its_queue_is_priced(model, autojump_clock):
    """A refusal for a longer queue is news, not a skip: with no other peer for the layers, the
    route chosen again is the same peer, priced with the queue it said, and that open is taken,
    queue and all (the answer waits in it rather than fail)."""
    solo = LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=2)
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, [PeerPlan("b", 0, LAYERS, 1000.0)])
        swarm, b = world.swarm, world.ids["b"]
        await swarm.pinger.ping(b)  # idle, and fresh: no ask before the open
        world.servers["b"].compute.queue.recent_wait = 30.0
        assert await swarm.complete_ids(PROMPT, max_new_tokens=2, spot_check=None) == solo
        assert world.servers["b"].stats.refused == 1 and world.servers["b"].stats.sessions_opened == 1
        assert not swarm.is_banned(b)
