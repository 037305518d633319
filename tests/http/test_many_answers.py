"""Sixteen chat completions at once through `tessera serve` in front of four real peer
processes — two replicas of each half of SmolLM2 — sent with the official OpenAI client.

Every answer is what `tessera generate --local` gives, and the answers spread over the
replicas: each carries between 25% and 75% of its span's sessions (the gateway is one
requester: its running answers, the load peers report and the seeded spread of routing all
weigh in; without them every answer took the one cheapest chain). Spot checks are off here so
that every session a peer counts is a route's (a check opens a shadow session on the other
replica, which would count too).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import openai
import pytest

from tessera.peer.cli.demo import LocalSwarm
from tessera.stages.decoding.generate import prompt_ids
from tessera.store.db import PeerStore
from tessera.store.events import SessionOpen

from ..swarm_helpers import local_swarm
from ..waiting import wait_until
from .test_http import HTTP_TIMEOUT, KEY, MODEL, gateway_process

pytestmark = pytest.mark.slow

TOKENS = 6
PROMPTS = [f"Name one thing about the number {n}." for n in range(16)]
SPANS = [(0, 15), (0, 15), (15, 30), (15, 30)]
TRACE_WAIT = 20.0  # a peer's trace is flushed every 0.25 s; generous for a busy machine


@pytest.fixture(scope="module")
def peers(smol_dir) -> Iterator[LocalSwarm]:
    with local_swarm(SPANS) as swarm:
        yield swarm


def sessions_at(peers: LocalSwarm, i: int) -> int:
    with PeerStore(peers.base_dir / f"peer{i}" / "tessera.db", readonly=True) as store:
        return len({e.event.session for e in store.events(kinds=(SessionOpen,))})


def test_sixteen_answers_at_once_are_exact_and_spread_over_the_replicas(peers, local_engine):
    tokenizer = local_engine.tokenizer
    want = [tokenizer.decode(local_engine.generate_ids(prompt_ids(tokenizer, p, raw=False), max_new_tokens=TOKENS))
            for p in PROMPTS]
    with gateway_process(peers.addrs[0], peers.base_dir / "serve.log", "--api-key", KEY, "--spot-check", "0",
                         "--max-concurrent", str(len(PROMPTS))) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT)

        def ask(prompt: str) -> str:
            answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                    temperature=0, max_tokens=TOKENS)
            return answer.choices[0].message.content

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all sixteen at once
            got = list(pool.map(ask, PROMPTS))
    assert got == want
    wait_until(lambda: sum(sessions_at(peers, i) for i in range(len(SPANS))) >= 2 * len(PROMPTS),
                     TRACE_WAIT, "every peer's sessions traced")
    counts = [sessions_at(peers, i) for i in range(len(SPANS))]
    print(f"sessions per peer (spans {SPANS}): {counts}")
    for first, second in ((0, 1), (2, 3)):
        both = counts[first] + counts[second]
        assert both >= len(PROMPTS)
        for i in (first, second):
            assert 0.25 <= counts[i] / both <= 0.75, counts
