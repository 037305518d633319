"""How fast the swarm view converges: random event sequences over 3-64 simulated peers.

    .venv/bin/python bench/convergence.py                  # 40 sequences, 3-64 peers
    .venv/bin/python bench/convergence.py --sequences 10 --max-peers 12 --seed 3

Each sequence starts N peers, then applies up to --events random events (join, leave,
crash, vanish, move, memory change, partition, heal), running the real gossip over the
memory transport under MockClock (peer/sim/convergence.py), and measures the time from
the last change until every pair of peers in touch held the same live record set, in
gossip periods. The last lines print the figures: sequences tried, peers, worst and
mean convergence time in gossip periods, the bound B(N) (peer/net/gossip.py) over the
sizes tried, the worst share of its own bound a sequence took, and how many broke it.
Simulated time: the figures do not depend on the machine's load (the wall time does).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.peer.sim.convergence import CONVERGENCE_TIMINGS, bound_periods, EVENT_KINDS, Event, run_sequence  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=40)
    parser.add_argument("--min-peers", type=int, default=3)
    parser.add_argument("--max-peers", type=int, default=64)
    parser.add_argument("--events", type=int, default=10, help="most events per sequence")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    worst, periods, peers, broken, margins = 0.0, [], [], [], []
    began = time.perf_counter()
    for i in range(args.sequences):
        n = rng.randint(args.min_peers, args.max_peers)
        events = [Event(rng.choice(EVENT_KINDS), rng.uniform(0, 3 * CONVERGENCE_TIMINGS.gossip_interval),
                        rng.randrange(1000), rng.randrange(1000)) for _ in range(rng.randint(1, args.events))]
        outcome = run_sequence(n, events, seed=rng.randrange(2**16))
        ok = (outcome.worst_periods is not None and outcome.worst_periods <= bound_periods(outcome.peers)
              and outcome.agreed_throughout and not outcome.stale)
        peers.append(outcome.peers)
        if outcome.worst_periods is not None:
            periods.append(outcome.worst_periods)
            worst = max(worst, outcome.worst_periods)
            margins.append(outcome.worst_periods / bound_periods(outcome.peers))
        if not ok:
            broken.append((n, events, outcome))
        print(f"{i + 1:3d}: {outcome.peers:2d} peers, {len(events):2d} events "
              f"({', '.join(e.kind for e in events)}): converged in "
              f"{outcome.worst_periods if outcome.worst_periods is not None else float('nan'):.2f} periods"
              f"{'' if ok else '  BROKE THE BOUND: ' + repr(outcome)}", flush=True)
    wall = time.perf_counter() - began
    print(f"sequences {args.sequences}, peers {min(peers)}-{max(peers)} (mean {statistics.mean(peers):.1f}), "
          f"events <= {args.events} each")
    print(f"convergence after the last change: worst {worst:.2f} gossip periods, mean "
          f"{statistics.mean(periods) if periods else float('nan'):.2f}; bound B(N) {bound_periods(min(peers)):.2f}"
          f"-{bound_periods(max(peers)):.2f}; worst share of the bound {max(margins, default=float('nan')):.2f}; "
          f"broke it: {len(broken)}")
    print(f"wall {wall:.0f} s (simulated time; the wall time moves with the machine's load)")


if __name__ == "__main__":
    main()
