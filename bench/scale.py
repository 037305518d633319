"""Membership at scale: connections, gossip bytes and convergence at 100, 1,000 and 10,000 peers.

    .venv/bin/python bench/scale.py                     # N = 100, 1,000 and 10,000, one after another
    .venv/bin/python bench/scale.py --sizes 100 1000 --seed 2

Every peer is the real PeerNode with its own view, gossip and membership, on the memory
transport under trio's MockClock (peer/sim/scale.py says how a run goes: the swarm
forms, settles, then a burst of 8 joins, 8 leaves and 8 moves). Each size runs in a
process of its own, one after another. The figures are simulated (connections, bytes
sent by each peer's gossip, gossip periods), so they do not move with the machine's
load; only `wall` does. The last lines print one line per size, in this form:

    scale N=10000: connections per peer max 31 mean 24.0; membership bytes per peer per minute max 2.1e+05 mean 1.4e+05; convergence 6.2 periods; wall 41 s

then the goals: connections max <= 64 at every N; bytes per peer per minute at the largest
N <= 3x that at the smallest; convergence <= 3 log2(N) periods.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.peer.net.membership import MAX_CONNECTIONS  # noqa: E402
from tessera.peer.sim.scale import ScaleResult, measure_scale  # noqa: E402

CONNECTIONS_GOAL = 64
BYTES_RATIO_GOAL = 3.0


def run_one(n: int, seed: int) -> ScaleResult:
    """One size in a fresh process (its memory and caches its own), as JSON back."""
    done = subprocess.run([sys.executable, __file__, "--one", str(n), "--seed", str(seed)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"N={n} failed:\n{done.stderr[-4000:]}")
    return ScaleResult(**json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10_000])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # run one size here, print JSON
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(dataclasses.asdict(measure_scale(args.one, seed=args.seed))))
        return
    results = []
    for n in args.sizes:
        result = run_one(n, args.seed)
        print(f"N={n}: {result.peers_measured} peers measured over {result.window_s:.0f} simulated s, neighbours "
              f"max {result.neighbours_max}, convergence bound B(N) {result.bound_periods:.1f} periods, "
              f"{result.simulated_s:.0f} simulated s", flush=True)
        results.append(result)
    for result in results:
        print(result.line())
    small, big = results[0], results[-1]
    worst = max(r.connections_max for r in results)
    print(f"goal connections max <= {CONNECTIONS_GOAL} at every N: {'met' if worst <= CONNECTIONS_GOAL else 'NOT met'} "
          f"(max {worst}; membership's own bound {MAX_CONNECTIONS})")
    mean_ratio = big.bytes_per_minute_mean / small.bytes_per_minute_mean
    max_ratio = big.bytes_per_minute_max / small.bytes_per_minute_max
    print(f"goal bytes per peer per minute at N={big.n} <= {BYTES_RATIO_GOAL:g}x N={small.n}: mean ratio "
          f"{mean_ratio:.2f} ({'met' if mean_ratio <= BYTES_RATIO_GOAL else 'NOT met'}), max ratio {max_ratio:.2f} "
          f"({'met' if max_ratio <= BYTES_RATIO_GOAL else 'NOT met'})")
    parts = []
    for r in results:
        goal = 3 * math.log2(r.n)
        ok = r.convergence_periods is not None and r.convergence_periods <= goal
        conv = f"{r.convergence_periods:.1f}" if r.convergence_periods is not None else "none"
        parts.append(f"N={r.n} {conv} <= {goal:.1f} {'met' if ok else 'NOT met'}")
    print("goal convergence <= 3 log2(N) periods: " + "; ".join(parts))


if __name__ == "__main__":
    main()
