"""Decoding over an emulated WAN: naive, async pipeline, speculation, both — in one run.

Four SmolLM2 peers on loopback, each delaying every frame it sends by 40–75 ms
(`--emulate-link`, user space: this kernel has no netem), the requester by
25 ms: the ring requester -> p1 -> p2 -> p3 -> p4 -> requester costs the sum.
A mix of prompts, some repetitive enough for n-gram drafts, some not.

    naive:      one prompt at a time, one token per ring round trip
    async:      all prompts at once (sessions interleave on every peer)
    speculate:  one at a time, n-gram drafts verified in one pass, no pipelining
    both:       all at once, drafts, blocks pipelined within each session

Prints tokens/s for each, the acceptance rate, the naive physical limit
(1 / ring round trip) and the ratio both/naive last.

    .venv/bin/python bench/wan.py [--tokens 48]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import trio

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.net.emulated import LinkEmulation
from tessera.peer.request.decode import Speculation
from tessera.stages.decoding.generate import prompt_ids
from tessera.stages.decoding.speculative import AdaptiveK, NgramDrafter

SPANS = [(0, 8), (8, 15), (15, 23), (23, 30)]
PEER_DELAYS_MS = [40, 60, 75, 50]
REQUESTER_DELAY_MS = 25
PROMPTS = [
    ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):", True),
    ("Repeat this sentence three times: the quick brown fox jumps over the lazy dog.", False),
    ("Write a haiku about the sea.", False),
    ("What are the three primary colours?", False),
]


async def run_mode(swarm: Swarm, tokens: int, *, concurrent: bool, speculate: bool, pipeline: bool) -> tuple[float, dict]:
    stats = {"proposed": 0, "accepted": 0, "tokens": 0}

    async def one(prompt: str, raw: bool) -> None:
        spec = Speculation(NgramDrafter(), k=AdaptiveK(4), pipeline=pipeline) if speculate else None
        ids = prompt_ids(swarm.tokenizer, prompt, raw=raw)
        async for _ in swarm.generate_ids(ids, max_new_tokens=tokens, speculation=spec):
            stats["tokens"] += 1
        if spec:
            stats["proposed"] += spec.proposed
            stats["accepted"] += spec.accepted

    started = time.perf_counter()
    if concurrent:
        async with trio.open_nursery() as nursery:
            for prompt, raw in PROMPTS:
                nursery.start_soon(one, prompt, raw)
    else:
        for prompt, raw in PROMPTS:
            await one(prompt, raw)
    return stats["tokens"] / (time.perf_counter() - started), stats


async def bench(peers: LocalSwarm, tokens: int) -> None:
    async with Swarm.join(peers.addrs[:1], emulate_link=LinkEmulation(delay=REQUESTER_DELAY_MS / 1000)) as swarm:
        await swarm.wait_for_route(60)
        await run_mode(swarm, 4, concurrent=False, speculate=False, pipeline=False)  # warm-up
        rates = {}
        accepted = proposed = 0
        for name, kw in [
            ("naive", dict(concurrent=False, speculate=False, pipeline=False)),
            ("async only", dict(concurrent=True, speculate=False, pipeline=False)),
            ("speculative only", dict(concurrent=False, speculate=True, pipeline=False)),
            ("both", dict(concurrent=True, speculate=True, pipeline=True)),
        ]:
            rates[name], stats = await run_mode(swarm, tokens, **kw)
            proposed += stats["proposed"]
            accepted += stats["accepted"]
            print(f"{name:>17}: {rates[name]:.2f} tok/s ({stats['tokens']} tokens)")
    ring = (REQUESTER_DELAY_MS + sum(PEER_DELAYS_MS)) / 1000
    print(f"draft acceptance rate: {accepted / max(proposed, 1):.2f} ({accepted}/{proposed})")
    print(f"naive physical limit (1 / ring round trip of {ring * 1000:.0f} ms): {1 / ring:.2f} tok/s")
    for name in ("async only", "speculative only"):
        print(f"{name}/naive: {rates[name] / rates['naive']:.2f}")
    print(f"both/naive: {rates['both'] / rates['naive']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    extra = [["--layers", f"{a}:{b}", "--emulate-link", f"delay={d}ms"] for (a, b), d in zip(SPANS, PEER_DELAYS_MS)]
    peers = LocalSwarm(len(SPANS), extra_args=extra)
    try:
        peers.start(together=True)
        trio.run(bench, peers, args.tokens)
    finally:
        peers.stop()


if __name__ == "__main__":
    main()
