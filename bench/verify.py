"""The cost of spot checks: decode speed with 1%, 5%, 10% of steps checked vs none, one run.

Four SmolLM2 peers on loopback ([0,15) and [15,30) twice each, so every span has
a checker); rounds alternate between the settings. Also prints the fingerprint's
size per token (what a checker sends instead of a 576-float row).

    .venv/bin/python bench/verify.py [--tokens 48] [--rounds 2]
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
from tessera.peer.request.ports import CheckPolicy
from tessera.protocol.fingerprint import fingerprint_bytes
from tessera.stages.decoding.generate import prompt_ids

SPANS = [(0, 15), (15, 30), (0, 15), (15, 30)]
RATES = [0.0, 0.01, 0.05, 0.10]
PROMPT = "Write a short story about a robot who learns to paint."


async def bench(peers: LocalSwarm, tokens: int, rounds: int) -> None:
    async with Swarm.join(peers.addrs[:1]) as swarm:
        await swarm.wait_for_route(60)
        ids = prompt_ids(swarm.tokenizer, PROMPT, raw=False)
        speeds: dict[float, list[float]] = {r: [] for r in RATES}
        moved = {r: 0 for r in RATES}
        made = {r: 0 for r in RATES}
        for r in range(rounds):
            for rate in RATES:
                info: dict = {}
                policy = CheckPolicy(rate=rate, seed=r, final_check=False) if rate else None
                started = time.perf_counter()
                out = [t async for t in swarm.generate_ids(ids, max_new_tokens=tokens, spot_check=policy, info=info)]
                speeds[rate].append(len(out) / (time.perf_counter() - started))
                moved[rate] += info.get("checks", {}).get("fingerprint_bytes", 0)
                made[rate] += len(out)
                print(f"round {r} rate {rate:.0%}: {speeds[rate][-1]:.2f} tok/s, "
                      f"{info.get('checks', {}).get('checks', 0)} checks")
    row = fingerprint_bytes(torch.randn(1, swarm.spec.hidden_size))
    print(f"fingerprint bytes per token: {len(row)} (a full row: {swarm.spec.hidden_size * 4} bytes)")
    base = statistics.median(speeds[0.0])
    for rate in RATES[1:]:
        print(f"check traffic at {rate:.0%}: {moved[rate] / max(made[rate], 1):.0f} fingerprint bytes per generated token")
    for rate in RATES[1:]:
        print(f"throughput with {rate:.0%} checked / unchecked: {statistics.median(speeds[rate]) / base:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    peers = LocalSwarm(len(SPANS), extra_args=[["--layers", f"{a}:{b}"] for a, b in SPANS])
    try:
        peers.start(together=True)
        trio.run(bench, peers, args.tokens, args.rounds)
    finally:
        peers.stop()


if __name__ == "__main__":
    main()
