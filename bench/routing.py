"""Routing's cost at 1,000 peers: chains with head hand-overs (issue 34) against tail-only chains.

    .venv/bin/python bench/routing.py [--peers 1000] [--layers 60] [--neighbours 20] [--rounds 20]

Both searches run side by side on the same views (the random swarm of tests/plan/test_routing.py:
spans of a tenth to a third of the layers, 20 measured neighbours, 5 % draining), alternating,
so a loaded machine slows both alike. The last line is the ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plan"))

from test_routing import REQ, random_view  # noqa: E402  (the tests' view generator, not a copy)

from tessera.peer.plan.routing import route  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--neighbours", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    views = [random_view(args.peers, args.layers, args.neighbours, seed) for seed in range(3)]
    times: dict[bool, list[float]] = {True: [], False: []}
    cheaper = 0
    for i in range(args.rounds):
        view = views[i % len(views)]
        for heads in ((True, False) if i % 2 else (False, True)):
            started = time.perf_counter()
            chosen = route(view, source=REQ, head_handovers=heads)
            times[heads].append(time.perf_counter() - started)
            if heads and i < len(views):
                cheaper += chosen.cost_ms < route(view, source=REQ, head_handovers=False).cost_ms
    with_heads, tails = (statistics.median(times[h]) * 1000 for h in (True, False))
    print(f"{args.peers} peers, {args.layers} layers, {args.neighbours} measured neighbours each")
    print(f"route with head hand-overs: {with_heads:.1f} ms a call (median); tail-only: {tails:.1f} ms")
    print(f"views where a head hand-over found a cheaper chain: {cheaper}/{min(args.rounds, len(views))}")
    print(f"routing heads/tail-only time ratio: {with_heads / tails:.2f}")


if __name__ == "__main__":
    main()
