"""A peer killed mid-answer: the answer completes, token for token what an undisturbed run gives."""

from __future__ import annotations

import pytest

from peer.client import Swarm
from stages.generate import prompt_ids

from .swarm_helpers import local_swarm

pytestmark = pytest.mark.slow

PROMPT = "Write a short story about a robot who learns to paint."
TOKENS = 64
SPANS = [(0, 10), (10, 20), (20, 30), (0, 10), (10, 20), (20, 30)]  # every layer held twice


@pytest.fixture(scope="module")
def replicated(smol_dir):
    with local_swarm(SPANS) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def expected(local_engine, smol_tokenizer):
    ids = prompt_ids(smol_tokenizer, PROMPT, raw=False)
    out = local_engine.generate_ids(ids, max_new_tokens=TOKENS)
    assert len(out) == TOKENS, "the reference answer must run the whole length"
    return out


def peer_index(swarm, peer_id: str) -> int:
    return next(i for i, addr in enumerate(swarm.addrs) if addr.endswith(peer_id))


async def answer_with_kills(swarm_procs, kills: dict[int, int]) -> tuple[list[int], dict, list[int]]:
    """Generate; after token k, SIGKILL the peer at hop kills[k] of the route in use."""
    killed = []
    async with Swarm.join(swarm_procs.addrs[:1]) as swarm:
        await swarm.wait_for_route(30)
        ids = prompt_ids(swarm.tokenizer, PROMPT, raw=False)
        info: dict = {}
        tokens: list[int] = []
        gen = swarm.generate_ids(ids, max_new_tokens=TOKENS, info=info)
        async for token in gen:
            tokens.append(token)
            if len(tokens) in kills:
                # the live route: the generator's session is the requester's only one
                hops = [p for p in _current_route(swarm)]
                victim = peer_index(swarm_procs, hops[kills[len(tokens)]])
                swarm_procs.kill(victim)
                killed.append(victim)
    return tokens, info, killed


def _current_route(swarm: Swarm) -> list[str]:
    (session,) = swarm.active
    return [h.peer for h in session.current.hops]


def restart(swarm_procs, killed: list[int]) -> None:
    for i in killed:
        swarm_procs.start_peer(i, swarm_procs.addrs[:1] if i != 0 else swarm_procs.addrs[1:2])


@pytest.mark.parametrize("kills", [{20: 1}, {20: 0}, {20: 2}, {12: 1, 40: 0}],
                         ids=["middle", "first", "last", "two-kills"])
async def test_kill_mid_answer(replicated, expected, kills):
    tokens, info, killed = await answer_with_kills(replicated, kills)
    try:
        assert tokens == expected
        assert info["failovers"] == len(kills)
        assert len(killed) == len(kills)
    finally:
        restart(replicated, killed)
