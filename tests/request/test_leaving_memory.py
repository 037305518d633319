"""A peer that leaves tells its requesters so (issue 46): real StageServers and the real requester
on the in-memory transport under trio's MockClock.

A leaving peer refuses new sessions with LEAVING, and hands back (LEAVING) the ones it could not
finish within its grace: the requester re-routes at once, the answer stays the single-process one,
and the peer gets no strike (it did its job: it said it was going). Before, a peer past its grace
dropped its sessions silently; the requester's next step came back "bad-frame: step N on unknown
link", which counted as the peer breaking.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from types import SimpleNamespace

import pytest
import trio

from tessera.peer.base.backoff import Failure
from tessera.peer.serve.leaving import GRACE_FLOOR, GRACE_MARGIN, in_flight
from tessera.stages.decoding.generate import LocalEngine
from tessera.store import events

from .memory_swarm import PeerPlan, decisive_model, memory_swarm

PROMPT = [5, 17, 42, 99, 7, 5, 17]
TOKENS = 24
LEAVE_AFTER = 8  # tokens out before the peer leaves

PLANS = [PeerPlan("p", 0, 4, 4000.0), PeerPlan("q", 0, 4, 2000.0)]  # routing prefers p, the faster


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return decisive_model(tmp_path_factory.mktemp("leaving") / "m")


@pytest.fixture(scope="module")
def solo(model):
    return LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)


def names(world, kind) -> list[str]:
    return [world.name(e.event.remote) for e in world.tracer.of_kind(kind) if e.event.remote in world.ids.values()]


async def test_a_session_handed_back_by_a_leaving_peer_goes_elsewhere_at_once_without_a_strike(
        model, solo, autojump_clock):
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, PLANS)
        info: dict = {}
        tokens: list[int] = []
        async with trio.open_nursery() as nursery:
            async for token in world.swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=info):
                tokens.append(token)
                if len(tokens) == LEAVE_AFTER:
                    nursery.start_soon(world.servers["p"].hand_over, "this peer is leaving the swarm")
            left_at = trio.current_time()
        bans = world.swarm.bans
        p = world.ids["p"]
        assert tokens == solo
        assert [world.name(route[0]["peer"]) for route in info["routes"]] == ["p", "q"], info["routes"]
        assert bans.strikes(p) == 0 and bans.failure(p) is Failure.REFUSED  # skipped, not banned
        assert "p" not in names(world, events.Ban)
        errors = [e.event.reason for e in world.tracer.of_kind(events.Error)]
        assert any("leaving" in reason for reason in errors), errors
        assert left_at < 60.0  # no route wait: q took over at once (a MockClock figure, not a speed)


async def test_a_leaving_peer_refuses_new_sessions_as_leaving(model, solo, autojump_clock):
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, PLANS)
        world.servers["p"].leaving = True  # its record still says serving: the requester asks it first
        info: dict = {}
        tokens = [t async for t in world.swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=info)]
        p = world.ids["p"]
        assert tokens == solo
        assert [world.name(hop["peer"]) for hop in info["route"]] == ["q"]
        assert world.swarm.bans.strikes(p) == 0 and world.swarm.bans.failure(p) is Failure.REFUSED
        assert world.servers["p"].stats.refused == 1


def session(capacity: int, tokens: int, steps: int, opened_at: float) -> SimpleNamespace:
    return SimpleNamespace(capacity=capacity, tokens=tokens, steps=steps, opened_at=opened_at)


def test_the_leave_grace_is_sized_to_the_longest_answer_in_flight():
    now = 100.0
    # 50 tokens in 50 steps over 5 s: 0.1 s a step, 150 tokens to go -> 15 s at that pace
    long = session(capacity=200, tokens=50, steps=50, opened_at=95.0)
    short = session(capacity=40, tokens=30, steps=30, opened_at=97.0)  # 10 to go at 0.1 s
    running = in_flight([short, long], now, fallback_pace=1.0, cap=300.0)
    assert running.sessions == 2 and running.tokens_left == 150
    assert running.grace == pytest.approx(15.0 * GRACE_MARGIN + GRACE_FLOOR)
    assert in_flight([long], now, fallback_pace=1.0, cap=10.0).grace == 10.0  # the cap holds
    assert in_flight([], now, fallback_pace=1.0, cap=300.0).grace == 0.0  # nothing to wait for
    fresh = session(capacity=20, tokens=0, steps=0, opened_at=now)  # not stepped yet: the fallback pace
    assert in_flight([fresh], now, fallback_pace=0.5, cap=300.0).grace == pytest.approx(10.0 * GRACE_MARGIN + GRACE_FLOOR)
    assert "1 answer running here (at most 150 tokens to go)" == in_flight([long], now, fallback_pace=1.0, cap=1.0).describe()
