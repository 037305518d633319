"""Churn, hangs, graceful leaves and re-claiming, with real peer processes on loopback."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import trio

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm, memory_for_layers
from tessera.peer.base.errors import NoRoute
from tessera.stages.decoding.generate import prompt_ids

from ..swarm_helpers import local_swarm

pytestmark = pytest.mark.slow

PROMPTS = [
    ("What is the capital of France?", False),
    ("Name three colours.", False),
    ("Write a haiku about the sea.", False),
    ("Once upon a time", True),
    ("The best way to learn", True),
]
CHURN_ANSWERS = 20
CHURN_TOKENS = 16
CHURN_DEADLINE = 420.0  # seconds: the test stops by itself


def references(local_engine, tokenizer, n: int) -> dict[str, list[int]]:
    return {p: local_engine.generate_ids(prompt_ids(tokenizer, p, raw=raw), max_new_tokens=n) for p, raw in PROMPTS}


async def test_churn_every_answer_completes_exactly(smol_dir, local_engine, smol_tokenizer):
    """5 peers, every layer held at least twice; a peer is killed or restarted every few
    seconds while 20 answers run (more if it takes more to see 3 kills); every answer completes and
    equals the reference."""
    expected = references(local_engine, smol_tokenizer, CHURN_TOKENS)
    spans = [(0, 15), (15, 30), (0, 30), (0, 15), (15, 30)]
    rng = random.Random(2024)
    answers: list[tuple[str, list[int]]] = []
    events: list[str] = []
    with local_swarm(spans) as peers, trio.fail_after(CHURN_DEADLINE):
        async with Swarm.join(peers.addrs[:1]) as swarm:
            await swarm.wait_for_route(30)

            async def churn() -> None:
                down: int | None = None
                while True:
                    await trio.sleep(rng.uniform(2.0, 4.0))
                    if down is None:
                        down = rng.randrange(1, len(spans))  # peer 0 is everyone's bootstrap
                        peers.kill(down)
                        events.append(f"kill {down}")
                    else:
                        await trio.to_thread.run_sync(peers.start_peer, down, peers.addrs[:1])
                        events.append(f"restart {down}")
                        down = None

            async with trio.open_nursery() as nursery:
                nursery.start_soon(churn)
                n = 0  # at least CHURN_ANSWERS answers, and as many more as it takes to see 3 kills
                while n < CHURN_ANSWERS or sum(e.startswith("kill") for e in events) < 3:
                    prompt, raw = PROMPTS[n % len(PROMPTS)]
                    n += 1
                    ids = prompt_ids(swarm.tokenizer, prompt, raw=raw)
                    tokens = [t async for t in swarm.generate_ids(ids, max_new_tokens=CHURN_TOKENS, route_wait=60)]
                    answers.append((prompt, tokens))
                nursery.cancel_scope.cancel()
    print(f"churn events: {events}")
    assert len(answers) >= CHURN_ANSWERS
    assert sum(e.startswith("kill") for e in events) >= 3, events
    for prompt, tokens in answers:
        assert tokens == expected[prompt], prompt


async def test_hung_peer_is_detected_by_the_step_deadline(smol_dir, local_engine, smol_tokenizer):
    """SIGSTOP keeps the TCP connection up: only the deadline (from advertised speed) can tell."""
    expected = references(local_engine, smol_tokenizer, 16)
    with local_swarm([(0, 10), (10, 30), (10, 30)]) as peers:
        async with Swarm.join(peers.addrs[:1]) as swarm:
            await swarm.wait_for_route(30)
            prompt, raw = PROMPTS[0]
            info: dict = {}
            tokens = []
            stopped = None
            async for token in swarm.generate_ids(prompt_ids(swarm.tokenizer, prompt, raw=raw), max_new_tokens=16, info=info):
                tokens.append(token)
                if len(tokens) == 4:
                    (session,) = swarm.active
                    victim = session.current.hops[1].peer
                    stopped = next(i for i, a in enumerate(peers.addrs) if a.endswith(victim))
                    os.kill(peers.procs[stopped].pid, signal.SIGSTOP)
            os.kill(peers.procs[stopped].pid, signal.SIGCONT)
    assert tokens == expected[prompt]
    assert info["failovers"] == 1


async def test_graceful_leave_lets_the_running_answer_finish(smol_dir, local_engine, smol_tokenizer):
    expected = references(local_engine, smol_tokenizer, 32)
    with local_swarm([(0, 15), (15, 30)]) as peers:
        async with Swarm.join(peers.addrs[:1]) as swarm:
            await swarm.wait_for_route(30)
            prompt, raw = PROMPTS[2]
            info: dict = {}
            tokens = []
            async for token in swarm.generate_ids(prompt_ids(swarm.tokenizer, prompt, raw=raw), max_new_tokens=32, info=info):
                tokens.append(token)
                if len(tokens) == 3:
                    peers.procs[1].send_signal(signal.SIGINT)  # Ctrl-C: drain, then leave
            assert tokens == expected[prompt]
            assert info["failovers"] == 0  # it drained: the session finished where it was
            peers.procs[1].wait(30)
            assert "left the swarm" in peers.log(1)
            # and now the swarm lacks layers [15, 30): a clear error naming them, after the wait
            with pytest.raises(NoRoute) as missing:
                async for _ in swarm.generate_ids(prompt_ids(swarm.tokenizer, prompt, raw=raw), max_new_tokens=4, route_wait=2.0):
                    pass
            assert "[15, 30)" in str(missing.value)


def test_layers_are_recovered_after_a_peer_leaves(smol_dir, tmp_path):
    """Placement without --layers: when a peer holding a span alone dies, a redundant peer
    moves to cover it (within a bounded time)."""
    import json
    import subprocess
    import sys

    memory = f"{memory_for_layers('smollm2-135m', 15):.4f}"
    peers = LocalSwarm(3, extra_args=[["--memory", memory, "--rebalance-interval", "2"]] * 3, base_dir=tmp_path)
    try:
        peers.start()
        spans = [next(l for l in peers.log(i).splitlines() if l.startswith("serving layers")) for i in range(3)]
        print(spans)
        lone = next(i for i in range(3) if sum(s == spans[i] for s in spans) == 1)
        peers.kill(lone)
        deadline = time.monotonic() + 90
        status = None
        while time.monotonic() < deadline:
            other = next(i for i in range(3) if i != lone)
            done = subprocess.run([sys.executable, "-m", "tessera.peer.cli.main", "swarm", "status", "--json", "--join", peers.addrs[other]],
                                  capture_output=True, text=True, timeout=60)
            status = json.loads(done.stdout) if done.returncode == 0 else None
            if status and not status["gaps"] and len(status["peers"]) == 2:
                break
            time.sleep(2)
        assert status is not None and not status["gaps"], status
        assert any("moved" in peers.log(i) for i in range(3) if i != lone)
    finally:
        peers.stop()
