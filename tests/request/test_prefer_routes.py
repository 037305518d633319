"""`--prefer` is honoured (issue 34, item 5): a chain enters a peer's span at any layer it holds and
may leave it before its end, so a non-preferred peer whose span starts earlier runs only the layers
no preferred peer holds. Pure routing on views, a property against brute force, and an answer
through real stage servers that uses such a hand-over, token for token."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.peer.plan.routing import Hop, route, route_cost
from tessera.peer.plan.view import PeerInfo, SwarmView
from tessera.peer.request.policy import RequesterPolicy
from tessera.stages.decoding.generate import LocalEngine

from ..plan.test_routing import all_chains
from .memory_swarm import PeerPlan, decisive_model, memory_swarm
from .test_requester_policy import A, B, C, D, REQ, peer


def test_a_non_preferred_peer_that_starts_earlier_runs_only_what_no_preferred_peer_holds():
    """What a user met: d (not preferred) [0, 20), b and c (preferred) [10, 20) and [20, 30).
    Before, a chain could only use the tail of d's span: d ran [0, 20) and b was never used."""
    view = SwarmView.of(30, [peer(D, 0, 20), peer(B, 10, 20), peer(C, 20, 30)])
    prefer = RequesterPolicy(prefer=frozenset({B, C}))
    chosen = route(prefer.apply(view), source=REQ)
    assert chosen.hops == (Hop(D, 0, 10), Hop(B, 10, 20), Hop(C, 20, 30))
    assert route(view, source=REQ).hops == (Hop(D, 0, 20), Hop(C, 20, 30))  # no preference: fewer hops win


def test_a_peer_is_never_used_twice_even_where_that_would_be_cheaper():
    """a (not preferred) holds everything, b (preferred) the middle: a -> b -> a would cost less,
    but a route opens one session per peer, so the chain is a alone."""
    view = SwarmView.of(30, [peer(A, 0, 30), peer(B, 10, 20)])
    chosen = route(RequesterPolicy(prefer=frozenset({B})).apply(view), source=REQ)
    assert chosen.peer_ids == (A,)
    view = SwarmView.of(30, [peer(A, 0, 30), peer(B, 10, 20), peer(C, 20, 30)])  # now c takes over after b
    chosen = route(RequesterPolicy(prefer=frozenset({B, C})).apply(view), source=REQ)
    assert chosen.hops == (Hop(A, 0, 10), Hop(B, 10, 20), Hop(C, 20, 30))


IDS = (A, B, C, D)


@st.composite
def preferring(draw):
    layers = draw(st.integers(2, 7))
    peers = []
    for pid in draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=4, unique=True)):
        start = draw(st.integers(0, layers - 1))
        # one speed for all: then a layer on a peer not preferred (1000 times the price) outweighs any
        # hops, and "fewest such layers" is what the cheapest chain means (with speeds that differ,
        # one slow non-preferred layer may cost more than two fast ones: the cost model decides)
        peers.append(PeerInfo(pid, "m", start, draw(st.integers(start + 1, layers)), 100.0))
    prefer = frozenset(draw(st.lists(st.sampled_from(IDS), max_size=3)))
    return SwarmView.of(layers, peers), RequesterPolicy(prefer=prefer)


def non_preferred_layers(hops, prefer) -> int:
    return sum(h.end - h.start for h in hops if h.peer_id not in prefer)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preferring())
def test_no_chain_of_distinct_peers_puts_fewer_layers_on_peers_not_preferred(case):
    view, policy = case
    priced = policy.apply(view)
    chosen = route(priced, source=REQ)
    chains = all_chains(view, 0, view.num_layers)
    assert chosen.ok == bool(chains)
    if not chains:
        return
    assert len(set(chosen.peer_ids)) == len(chosen.peer_ids)
    assert chosen.cost_ms == route_cost(priced, chosen.hops, source=REQ)
    if policy.prefer:
        assert non_preferred_layers(chosen.hops, policy.prefer) == min(non_preferred_layers(c, policy.prefer)
                                                                        for c in chains)
    assert route(priced, source=REQ) == chosen  # pure: the same view, the same route


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return decisive_model(tmp_path_factory.mktemp("prefer") / "m")


PROMPT = [5, 17, 42, 99, 7, 5, 17]
TOKENS = 16


async def test_an_answer_through_a_head_hand_over_is_exact(model, autojump_clock):
    """n (not preferred) loaded [0, 3) and runs only [0, 1); p (preferred) runs [1, 4)."""
    solo = LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, [PeerPlan("n", 0, 3, 4000.0), PeerPlan("p", 1, 4, 1000.0)])
        policy = RequesterPolicy(prefer=frozenset({world.ids["p"]}))
        info: dict = {}
        tokens = [t async for t in world.swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=info, policy=policy)]
        assert [(world.name(h["peer"]), h["start"], h["end"]) for h in info["route"]] == [("n", 0, 1), ("p", 1, 4)]
    assert tokens == solo


def test_the_cost_model_says_why_a_peer_not_preferred_was_chosen():
    from dataclasses import replace

    from tessera.peer.plan.routing import why_not_preferred
    from tessera.peer.plan.view import DRAINING

    prefer = RequesterPolicy(prefer=frozenset({B, C}))
    view = prefer.apply(SwarmView.of(30, [peer(D, 0, 20), peer(B, 10, 20), peer(C, 20, 30)]))
    chosen = route(view, source=REQ)
    (line,) = why_not_preferred(view, chosen, prefer=prefer.prefer, source=REQ)
    assert line == f"layers [0, 10) on {D[-8:]} (not preferred): no preferred peer takes sessions for [0, 10) " \
                   "(no preferred peer holds them)"
    draining = view.replace(replace(view.get(B), state=DRAINING))
    chosen = route(draining, source=REQ)
    assert chosen.hops == (Hop(D, 0, 20), Hop(C, 20, 30))
    (line,) = why_not_preferred(draining, chosen, prefer=prefer.prefer, source=REQ)
    assert "for [0, 20)" in line and f"{B[-8:]} draining" in line
    nested = RequesterPolicy(prefer=frozenset({B})).apply(SwarmView.of(30, [peer(A, 0, 30), peer(B, 10, 20)]))
    (line,) = why_not_preferred(nested, route(nested, source=REQ), prefer=frozenset({B}), source=REQ)
    assert "no preferred peer takes sessions for [0, 10), [20, 30)" in line
    assert why_not_preferred(view, route(view, source=REQ), prefer=frozenset(), source=REQ) == []


async def test_a_repair_never_gives_a_peer_of_the_session_a_second_piece(model, autojump_clock):
    """u runs [0, 1) of its [0, 3) and hands over to the faster f at f's first layer. f dies: the
    cheapest replacement for [1, 3) is u itself (no link to pay from itself), but u already runs
    this session ("session ... is already open here" failed answers in `tessera simulate`): the
    spare s takes it, and the answer is exact."""
    solo = LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)
    plans = [PeerPlan("u", 0, 3, 10.0), PeerPlan("f", 1, 3, 8000.0), PeerPlan("d", 3, 4, 4000.0),
             PeerPlan("s", 1, 3, 5.0)]  # u and s are slow: u's own [1, 3) would cost 200 ms, s's 400 ms
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, plans)
        info: dict = {}
        tokens = []
        async for token in world.swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=info):
            tokens.append(token)
            if len(tokens) == 6:
                world.network.crash(world.ids["f"])
        first, last = ([(world.name(h["peer"]), h["start"], h["end"]) for h in r] for r in (info["routes"][0], info["route"]))
    assert first == [("u", 0, 1), ("f", 1, 3), ("d", 3, 4)]
    assert last == [("u", 0, 1), ("s", 1, 3), ("d", 3, 4)]
    assert tokens == solo


async def test_a_second_answer_of_one_requester_goes_to_an_equivalent_peer(model, autojump_clock):
    """A requester counts its own open sessions per peer and routing prices each as a step queued
    there: with a running on the first answer, the second takes b (a little slower, idle), and the
    count is back to nothing when both are done. Both answers are exact. The speeds are low so
    that compute outweighs any RTT the requester has measured meanwhile (a at 100 ms a layer, b
    at 111: a with one session 800 ms a step, b 444 ms plus at most two default 100 ms links)."""
    solo = LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, [PeerPlan("a", 0, 4, 10.0), PeerPlan("b", 0, 4, 9.0)])
        first_info: dict = {}
        first = world.swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=first_info)
        tokens = [await first.__anext__()]  # the first answer's session is open on a
        assert dict(world.swarm.ctx.running) == {world.ids["a"]: 1}
        second_info: dict = {}
        second = [t async for t in world.swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=second_info)]
        tokens += [t async for t in first]
        assert [world.name(h["peer"]) for h in first_info["route"]] == ["a"]
        assert [world.name(h["peer"]) for h in second_info["route"]] == ["b"]
        assert dict(world.swarm.ctx.running) == {}
    assert tokens == solo and second == solo


async def test_a_peer_holding_as_many_of_a_requesters_sessions_as_it_admits_is_routed_past(model, autojump_clock):
    """A peer admits at most MAX_SESSIONS_PER_REQUESTER sessions of one requester (it refuses the
    next at once): a requester that holds that many on a routes past it, even where a is so much
    faster that one session fewer there would still be the cheapest chain; with every cover of a
    layer at the limit there is no route, which says why, and a wait that counts them as busy
    (the swarm is full for this requester: wait, do not fail)."""
    from tessera.protocol.admission import MAX_SESSIONS_PER_REQUESTER

    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, [PeerPlan("a", 0, 4, 4000.0), PeerPlan("b", 0, 4, 10.0)])
        a, b = world.ids["a"], world.ids["b"]
        for _ in range(MAX_SESSIONS_PER_REQUESTER - 1):
            world.swarm.ctx.hold(a)
        assert world.swarm.plan().peer_ids == (a,)  # 8 steps of a's still cost less than one of b's
        world.swarm.ctx.hold(a)
        assert world.swarm.plan().peer_ids == (b,)
        for _ in range(MAX_SESSIONS_PER_REQUESTER):
            world.swarm.ctx.hold(b)
        assert not world.swarm.plan().ok
        assert world.swarm.covered_but_busy()
        assert "of this requester's sessions, the most it admits" in world.swarm.route_wait.why_no_route()[1]
        world.swarm.ctx.drop(a)  # one of its sessions on a ended
        assert world.swarm.plan().peer_ids == (a,)
