"""What a hop costs: round trips between peers and compute time under load.

The prices that routing (`peer/plan/routing.py`) and tensor-shard groups
(`peer/plan/groups.py`) both use, so that neither imports the other for them.
"""

from __future__ import annotations

import math
from typing import Mapping

from tessera.peer.plan.view import PeerInfo

# Assumed round trip between two nodes that have not measured each other. Public
# ping surveys (e.g. WonderNetwork, RIPE Atlas) put same-continent pairs at 20-60 ms
# and intercontinental ones at 100-250 ms; volunteers are anywhere, so an unmeasured
# link is assumed to be a typical long one — measured fast links then win, and a
# measured slow link is not beaten by optimism about an unknown one.
DEFAULT_RTT_MS = 100.0

# Extra compute time per unit of load: a peer at load ρ (fraction of its session
# slots in use) is charged compute * (1 + LOAD_PENALTY * ρ). It interleaves our
# step with the other sessions' steps. Decode is memory-bound, so a step's time grows
# slowly with batch size; we estimate a full batch at about twice a lone step (an
# upper-end guess, until the stage server measures the curve) — hence 1.0: a full
# peer looks twice as slow. Besides the latency it models, it spreads requesters
# over equivalent peers instead of piling them onto the fastest.
LOAD_PENALTY = 1.0

# Each session this requester already runs on a peer is charged one more step of that
# peer's compute: a step of ours waits behind it (on a peer that computes one step at a
# time, exactly; one that stacks steps waits less). A peer re-signs its advertised load only
# when it crosses "full" (peer/net/gossip.py `material`), so without this every answer a
# requester starts on one view takes the same cheapest chain and queues there. What a
# requester knows for certain, at no cost on the network, is its own sessions. Measured with
# bench/simulate.py (1,000 peers, 10,000 answers, churn): refused opens 8,821 -> 54,
# failovers 691 -> 35, failed answers 62 -> 0, p99 latency 58 -> 13 s.
OWN_SESSION_PENALTY = 1.0

# A peer whose slots are all in use (load >= 1) would refuse a new session, so routes
# avoid it; the requester tries again when its advertised load drops.
FULL_LOAD = 1.0


def rtt_ms(peers: Mapping[str, PeerInfo], a: str, b: str, default_rtt_ms: float = DEFAULT_RTT_MS) -> float:
    """Round trip a <-> b: measured by a, by b (mean if both), else the default."""
    if a == b:
        return 0.0
    pa, pb = peers.get(a), peers.get(b)
    x = pa.rtt_ms.get(b) if pa is not None else None
    y = pb.rtt_ms.get(a) if pb is not None else None
    if x is None:
        return default_rtt_ms if y is None else y
    return x if y is None else (x + y) / 2.0


def hop_compute_ms(peer: PeerInfo, num_layers: int, load_penalty: float = LOAD_PENALTY) -> float:
    """Compute time for ``num_layers`` layers on ``peer``, with the load penalty."""
    if peer.throughput <= 0:
        return math.inf
    return num_layers * ms_per_layer(peer, load_penalty)


def ms_per_layer(peer: PeerInfo, load_penalty: float, own_sessions: int = 0) -> float:
    """One layer of a step on `peer`: its compute, with the load penalty and
    OWN_SESSION_PENALTY for each of `own_sessions` (the requester's sessions already on it)."""
    return 1000.0 / peer.throughput * (1.0 + load_penalty * max(peer.load, 0.0) + OWN_SESSION_PENALTY * own_sessions)
