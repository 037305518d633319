"""The sole peer of a span is killed (kill -9) and restarted, or stopped (SIGSTOP) and resumed,
mid-answer: the requester waits for it (peer/base/backoff.py: a ban does not outlast a
comeback), rebuilds its session from the history as it would a replacement's, and the answer
completes exactly. Real peer processes on loopback; the middle span [10, 20) has no other peer.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio

from tessera.peer.request.client import Swarm
from tessera.stages.decoding.generate import prompt_ids

from ..swarm_helpers import local_swarm, reference_answer

pytestmark = pytest.mark.slow

PROMPT = "Write a short story about a robot who learns to paint."
TOKENS = 32
SPANS = [(0, 10), (10, 20), (20, 30)]
MIDDLE = 1
AWAY = 2.0  # seconds the killed peer stays down before it is started again
# The stopped peer stays stopped this long past the step's deadline (derived from the speeds
# the peers measured and advertise: chain.py step_timeout), so that the step surely times out.
# Both are well inside the route wait (peer/base/backoff.py ROUTE_WAIT, 30 s) that follows the failure.
STOPPED_PAST_DEADLINE = 6.0
AFTER = 4  # tokens out before the middle peer goes


@pytest.fixture(scope="module")
def peers(smol_dir):
    with local_swarm(SPANS) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def expected(local_engine, smol_tokenizer):
    return reference_answer(local_engine, smol_tokenizer, PROMPT, TOKENS)


async def answer(peers, disturb) -> tuple[list[int], dict]:
    """Generate through the swarm; after AFTER tokens, run `disturb(nursery, session)`."""
    async with Swarm.join(peers.addrs[:1], spot_check=None) as swarm:
        await swarm.wait_for_route(30)
        ids = prompt_ids(swarm.tokenizer, PROMPT, raw=False)
        info: dict = {}
        tokens: list[int] = []
        async with trio.open_nursery() as nursery:
            async for token in swarm.generate_ids(ids, max_new_tokens=TOKENS, info=info):
                tokens.append(token)
                if len(tokens) == AFTER:
                    (session,) = swarm.active
                    assert [h.peer for h in session.current.hops][MIDDLE] in peers.addrs[MIDDLE]
                    disturb(nursery, session)
        return tokens, info


def middle_peer_id(peers) -> str:
    return peers.addrs[MIDDLE].rsplit("/p2p/", 1)[1]


async def test_the_sole_peer_killed_and_restarted_resumes_the_answer(peers, expected):
    def kill_and_restart(nursery: trio.Nursery, session) -> None:
        peers.kill(MIDDLE)

        async def restart() -> None:
            await trio.sleep(AWAY)
            await trio.to_thread.run_sync(peers.start_peer, MIDDLE, peers.addrs[:1])

        nursery.start_soon(restart)

    tokens, info = await answer(peers, kill_and_restart)
    assert tokens == expected
    assert info["failovers"] == 1
    assert [h["peer"] for h in info["route"]][MIDDLE] == middle_peer_id(peers)  # the same peer (same identity)
    # its weights, checked at its first start, were vouched for by the cache (same data dir, files untouched)
    assert "weights checked against the manifest: 0 tensors hashed (0 MiB), 90 unchanged" in peers.log(MIDDLE)


async def test_the_sole_peer_stopped_and_resumed_resumes_the_answer(peers, expected):
    pid = peers.procs[MIDDLE].pid

    def stop_and_resume(nursery: trio.Nursery, session) -> None:
        stopped = session.current.step_timeout(1) + STOPPED_PAST_DEADLINE
        os.kill(pid, signal.SIGSTOP)

        async def resume() -> None:
            await trio.sleep(stopped)
            os.kill(pid, signal.SIGCONT)

        nursery.start_soon(resume)

    try:
        tokens, info = await answer(peers, stop_and_resume)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert tokens == expected
    assert info["failovers"] == 1
    assert [h["peer"] for h in info["route"]][MIDDLE] == middle_peer_id(peers)
