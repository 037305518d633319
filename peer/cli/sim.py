"""`tessera replay`, `tessera simulate`: re-run a recorded swarm, or a made-up one, in simulation.

Both run the real peer code (placement, routing, advertisements, the stage
server, failover) over the in-memory transport on a simulated clock, and print
a summary; `--report` writes the full JSON report, byte-identical for the same
input and seed, so two policies can be compared with `diff` or a script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# peer/sim/policies.py's POLICIES (names) and VIEW_MODES, repeated so that `--help` imports
# no torch (peer/cli/options.py); tests/cli/test_cli_help.py checks that they agree.
POLICY_NAMES = ("default", "petals", "random", "recorded")
VIEW_MODES = ("shared", "gossip")

REPLAY_EXAMPLES = """examples:
  tessera replay ~/.local/share/tessera/                       # every *.db under a folder
  tessera replay peer0.db peer1.db requester.db --report live.json
  tessera replay peer*.db requester.db --policy default --report what-if.json --seed 1
"""

SIMULATE_EXAMPLES = """examples:
  tessera simulate --peers 100 --requests 1000 --churn 0.05 --seed 1
  tessera simulate --peers 1000 --requests 10000 --churn 0.02 --seed 1 --policy petals --report petals.json
"""


def _common(p: argparse.ArgumentParser, *, default_policy: str) -> None:
    p.add_argument("--policy", default=default_policy, choices=POLICY_NAMES,
                   help=f"placement policy (default {default_policy})")
    p.add_argument("--seed", type=int, default=0, help="identities, jitter and scheduling (default 0)")
    p.add_argument("--until", type=float, default=None, metavar="T",
                   help="stop at simulated second T (default: when every request has finished)")
    p.add_argument("--report", type=Path, default=None, metavar="OUT.json", help="write the full report here")
    p.add_argument("--view", choices=VIEW_MODES, default=None,
                   help="real gossip, or one shared view (default: gossip for a replay of <= 16 peers)")
    p.add_argument("--trace", type=Path, default=None, metavar="OUT.db",
                   help="also record every simulated node's events (for `tessera trace export`)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="re-run a recorded swarm (peer and requester traces) in simulation",
        description="Reads the joins, claims, moves, leaves and requests of recorded traces and re-runs them "
        "with the real peer code on a simulated clock. --policy swaps placement (recorded: the spans as "
        "claimed live).",
        epilog=REPLAY_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("traces", nargs="+", type=Path, metavar="TRACE", help="peer databases, or folders holding them")
    _common(p, default_policy="recorded")
    p.add_argument("--latency-ms", type=float, default=None,
                   help="one-way latency of every link (default: measured from the trace)")
    p.set_defaults(handler=run_replay)

    p = sub.add_parser(
        "simulate", help="simulate a synthetic swarm: N peers, M requests, churn",
        description="Peers join over a warm-up (log-normal speeds, capacities in layers, four regions), "
        "requests arrive as a Poisson process at --load (default half) of what the peers' summed speeds "
        "could carry, from one requester per 20 requests, and CHURN of the swarm is "
        "replaced per simulated minute (half drain and leave, a quarter are killed, a quarter vanish).",
        epilog=SIMULATE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--peers", type=int, required=True, metavar="N", help="peers that join the simulated swarm")
    p.add_argument("--requests", type=int, required=True, metavar="M", help="requests to answer through it")
    p.add_argument("--churn", type=float, default=0.0, metavar="RATE",
                   help="fraction of the swarm replaced per simulated minute (default 0)")
    p.add_argument("--layers", type=int, default=30, help="model layers (default 30)")
    p.add_argument("--max-sessions", type=int, default=16, help="sessions each peer accepts (default 16)")
    p.add_argument("--load", type=float, default=0.5, help="request rate as a fraction of capacity (default 0.5)")
    p.add_argument("--requesters", type=int, default=None, help="requesters (default: one per 20 requests, <= 64)")
    _common(p, default_policy="default")
    p.set_defaults(handler=run_simulate)


def _finish(report: dict, out: Path | None) -> int:
    from tessera.peer.sim.report import dumps, format_summary

    print(format_summary(report))
    if out is not None:
        out.write_bytes(dumps(report))
        print(f"report: {out}")
    if report["settings"]["handler_errors"]:
        print(f"warning: {report['settings']['handler_errors']} protocol handlers failed (see the log)", file=sys.stderr)
    return 0


def run_replay(args: argparse.Namespace) -> int:
    from tessera.peer.net.memory_stream import LinkSpec
    from tessera.peer.sim.engine import simulate
    from tessera.peer.sim.replay import from_trace

    scenario = from_trace(args.traces, until=args.until)
    link = LinkSpec(latency=args.latency_ms / 1000.0, bandwidth=125e6) if args.latency_ms is not None else None
    print(f"replaying {len(scenario.peers)} peers and {len(scenario.requests)} requests "
          f"from {len(scenario.meta['databases'])} databases, policy {args.policy}, seed {args.seed}")
    report = simulate(scenario, policy=args.policy, seed=args.seed, view=args.view, link=link,
                      until=args.until, trace_path=args.trace)
    return _finish(report, args.report)


def run_simulate(args: argparse.Namespace) -> int:
    from tessera.peer.sim.engine import simulate
    from tessera.peer.sim.scenario import synthetic

    scenario = synthetic(peers=args.peers, requests=args.requests, churn=args.churn, seed=args.seed,
                         num_layers=args.layers, max_sessions=args.max_sessions, load=args.load,
                         requesters=args.requesters)
    print(f"simulating {args.peers} peers, {args.requests} requests, churn {args.churn:g}/min, "
          f"policy {args.policy}, seed {args.seed}")
    report = simulate(scenario, policy=args.policy, seed=args.seed, view=args.view, until=args.until,
                      trace_path=args.trace)
    return _finish(report, args.report)
