"""How fast the simulator runs a big swarm: 1,000 peers, 10,000 requests, with churn.

    .venv/bin/python bench/simulate.py                     # the full size
    .venv/bin/python bench/simulate.py --peers 200 --requests 2000 --profile
    .venv/bin/python bench/simulate.py --report a.json; .venv/bin/python bench/simulate.py --report b.json; cmp a.json b.json

Every simulated peer runs the real peer code (placement, advertisement records
signed and verified, the stage server, route sessions, failover) over the
in-memory transport on trio's MockClock; compute is the cost model. What is
measured is the simulator's own wall time, so the figure moves with the
machine's load: the last lines print simulated seconds, wall seconds, simulated
requests per wall second (the goal: the full size in <= 30 s), and the CPU seconds
this process used (what a loaded, shared machine inflates least).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.peer.sim.engine import simulate  # noqa: E402
from tessera.peer.sim.report import dumps, format_summary  # noqa: E402
from tessera.peer.sim.scenario import synthetic  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--churn", type=float, default=0.02, help="fraction of the swarm replaced per minute")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policy", default="default")
    parser.add_argument("--max-sessions", type=int, default=64, help="a GPU volunteer's session slots")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per simulated second")
    parser.add_argument("--requesters", type=int, default=8)
    parser.add_argument("--profile", action="store_true", help="print the 30 costliest functions")
    parser.add_argument("--report", type=Path, help="write the report's bytes here (two runs of one seed: identical)")
    args = parser.parse_args()

    # Requests are short (a chat turn's first tokens), so that the run exercises opening,
    # routing and failover at scale rather than decoding one long answer.
    scenario = synthetic(peers=args.peers, requests=args.requests, churn=args.churn, seed=args.seed,
                         max_sessions=args.max_sessions, prompt=(8, 32), tokens=(1, 4), rate=args.rate,
                         requesters=args.requesters)
    profiler = cProfile.Profile(time.process_time) if args.profile else None  # CPU time: a loaded machine skews wall time
    started, cpu_started = time.perf_counter(), time.process_time()
    report = simulate(scenario, policy=args.policy, seed=args.seed, profiler=profiler)  # the run has its own thread
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    print(format_summary(report))
    if args.report is not None:
        args.report.write_bytes(dumps(report))
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    s = report["summary"]
    left = sum(1 for p in scenario.peers if p.leave_at is not None)
    print(f"{args.peers} peers (+{len(scenario.peers) - args.peers} joining under churn, {left} leaving), "
          f"{args.requests} requests, policy {args.policy}, seed {args.seed}")
    print(f"simulated seconds: {s['simulated_seconds']:.1f}")
    print(f"wall seconds: {wall:.1f}")
    print(f"simulated requests per wall second: {args.requests / wall:.1f}")
    print(f"cpu seconds: {cpu:.1f} ({args.requests / cpu:.1f} simulated requests per cpu second)")


if __name__ == "__main__":
    main()
