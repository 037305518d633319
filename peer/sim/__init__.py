"""Simulation and replay: many peers in one process, on trio's MockClock, running the real peer code.

    from tessera.peer.sim import simulate, synthetic, dumps
    report = simulate(synthetic(peers=100, requests=1000, churn=0.05, seed=1), policy="default", seed=1)

- peer/net/memory.py: the in-memory `Transport` (latency, bandwidth, crashes);
- stage.py: a weightless `Stage`, the compute cost model, and `SimCompute` (the stage loader of a simulated peer);
- policies.py: swappable placement policies (default, random, petals, recorded);
- scenario.py: who joins, leaves and asks what, when (`synthetic`); replay.py reads one from traces;
- peer.py / requester.py: a simulated peer and requester: the real PeerNode and Swarm on simulated parts;
- world.py: what they share (network, view, timings); engine.py runs it; report.py writes the result;
- convergence.py: random event sequences over peers running the real gossip, and how soon their views agree;
- scale.py: membership at up to 10,000 peers (connections, gossip bytes per peer, convergence after a burst).
"""

from typing import Any

_EXPORTS = {
    "simulate": "engine", "synthetic": "scenario", "Scenario": "scenario", "PeerPlan": "scenario",
    "RequestPlan": "scenario", "from_trace": "replay", "dumps": "report", "format_summary": "report",
}


def __getattr__(name: str) -> Any:
    """Lazy exports: `tessera.peer.sim.policies` (used by the CLI's parser) must not pull in the engine."""
    if name in _EXPORTS:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
