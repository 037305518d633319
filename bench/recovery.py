"""Time from a peer's death to the next token, vs the normal time per token.

Six peers on loopback hold every layer twice ([0,10), [10,20), [20,30) each
twice). Each round generates greedily, SIGKILLs the middle peer of the route in
use after a few tokens, and measures the time from the kill to the next token
reaching the requester; the killed peer is restarted between rounds. The normal
time per token is the median gap between tokens with no kill in between.

    .venv/bin/python bench/recovery.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import trio

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm

SPANS = [(0, 10), (10, 20), (20, 30)] * 2
KILL_AFTER = 12
TOKENS = 40


async def one_round(peers: LocalSwarm, ids: list[int]) -> tuple[float, list[float], int]:
    async with Swarm.join(peers.addrs[:1]) as swarm:
        await swarm.wait_for_route(60)
        gaps: list[float] = []
        recovery = None
        killed_at = None
        victim = -1
        last = time.perf_counter()
        count = 0
        async for _ in swarm.generate_ids(ids, max_new_tokens=TOKENS):
            now = time.perf_counter()
            count += 1
            if killed_at is not None and recovery is None:
                recovery = now - killed_at
            elif count > 2:
                gaps.append(now - last)
            last = now
            if count == KILL_AFTER:
                (session,) = swarm.active
                middle = session.current.hops[1].peer
                victim = next(i for i, a in enumerate(peers.addrs) if a.endswith(middle))
                killed_at = time.perf_counter()
                peers.kill(victim)
                last = killed_at
        assert recovery is not None, "the answer ended before the kill"
        return recovery, gaps, victim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # it logs every refused dial
    peers = LocalSwarm(len(SPANS), extra_args=[["--layers", f"{a}:{b}"] for a, b in SPANS])
    recoveries, gaps = [], []
    try:
        peers.start(together=True)
        from tessera.stages.text.tokenizer import Tokenizer
        from tessera.stages.weights import registry

        ids = Tokenizer.from_folder(registry.resolve("smollm2-135m")).encode("The history of the city begins in the year")
        for r in range(args.rounds):
            recovery, round_gaps, victim = trio.run(one_round, peers, ids)
            recoveries.append(recovery)
            gaps += round_gaps
            print(f"round {r}: killed peer{victim}; next token {recovery:.3f} s after the kill")
            peers.start_peer(victim, peers.addrs[:1] if victim != 0 else peers.addrs[1:2])
    finally:
        peers.stop()
    normal = statistics.median(gaps)
    print(f"normal time per token: {normal:.3f} s (median of {len(gaps)} gaps)")
    print(f"death -> next token: {statistics.median(recoveries):.3f} s (median of {len(recoveries)} kills)")
    print(f"recovery/normal token time ratio: {statistics.median(recoveries) / normal:.1f}")


if __name__ == "__main__":
    main()
