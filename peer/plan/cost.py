"""What a hop costs: round trips between peers, compute time under load, and the queue a peer reports.

The prices that routing (`peer/plan/routing.py`) and tensor-shard groups
(`peer/plan/groups.py`) both use, so that neither imports the other for them; and the
seeded spread (`Spread`) routing applies among chains of nearly the same price.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
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

# A record's load travels in bands. Full (>= FULL_LOAD) or not is re-signed at once (routing
# skips a full peer: peer/net/gossip.py `material`); below it, a peer re-signs when its load
# crosses one of LOAD_BANDS, at most once per `load_resign_interval` since it last signed, so
# that the swarm re-signs for load at most LOAD_RESIGNS_PER_S records a second in all, whatever
# its size: each such record costs every peer about one copy (~700 bytes), so that is at most
# ~7 KB/s a peer, beside membership's own bounded traffic (docs/pages/how-it-works.md). Between
# records, requesters hear load in answers (peer/request/loads.py).
LOAD_BANDS = (0.5, 0.75)
LOAD_RESIGNS_PER_S = 10.0


def load_band(load: float) -> int:
    """Which of the bands below FULL_LOAD `load` is in (0: under LOAD_BANDS[0])."""
    return sum(1 for edge in LOAD_BANDS if load >= edge)


def load_resign_interval(peers: int) -> float:
    """The least time between a peer's re-signings for a change of load band, in a swarm of
    `peers` (N / LOAD_RESIGNS_PER_S: 10 s at 100 peers, 100 s at 1,000)."""
    return max(peers, 1) / LOAD_RESIGNS_PER_S


@dataclass(frozen=True)
class Reported:
    """What a peer last said of its load to this requester (a ping's echo, a session's accept or
    a refusal: peer/serve/load.py), as of now: `load`, the share of its slots a newcomer could
    not have; `wait_ms`, what a step arriving now would wait before it starts (what it said,
    less the time since: a queue drains)."""

    load: float = 0.0
    wait_ms: float = 0.0


def ms_per_layer(peer: PeerInfo, load_penalty: float, own_sessions: int = 0,
                 reported: Reported | None = None) -> float:
    """One layer of a step on `peer`: its compute, with the load penalty (its advertised load, or
    the load it reported since if higher) and OWN_SESSION_PENALTY for each of `own_sessions` (the
    requester's sessions already on it); plus the wait it reported, spread over its span's layers
    (a hop that runs its whole span pays the whole wait once)."""
    load = max(peer.load, reported.load) if reported is not None else peer.load
    per_layer = 1000.0 / peer.throughput * (1.0 + load_penalty * max(load, 0.0) + OWN_SESSION_PENALTY * own_sessions)
    if reported is not None and reported.wait_ms > 0:
        per_layer += reported.wait_ms / max(peer.end - peer.start, 1)
    return per_layer


def spare(peer: PeerInfo, own_sessions: int = 0, reported: Reported | None = None) -> float:
    """The share of `peer`'s session slots free for this requester as far as it knows (at least
    SPARE_FLOOR): its advertised or reported load, whichever is higher, and its own sessions there."""
    load = max(peer.load, reported.load) if reported is not None else peer.load
    load += own_sessions / max(peer.max_sessions, 1)
    return max(SPARE_FLOOR, 1.0 - load)


# Spread. Among chains whose price is close, a requester chooses at random, each peer weighted
# by its spare capacity, from a seeded stream (`Spread.salt`: a replay that draws the same salts
# re-takes the same routes). How: every candidate's price per layer is multiplied by
# 1 + SPREAD_WIDTH * E / spare, E drawn from Exp(1) for (salt, peer), and the cheapest chain at
# those prices is taken. For peers of one price this is an exponential race: the smallest of
# E_i / w_i falls to peer i with probability w_i / sum(w) — a choice weighted by spare capacity
# (what power-of-d choices approximates with d draws). Chains cheaper by more than a few times
# SPREAD_WIDTH keep winning. Why it does not herd when every requester runs it: each draws its
# own salts, so requesters that see the same view and loads send their answers to the peers of
# near-equal chains in proportion to each one's free room, instead of all to the one cheapest;
# and what they add shows at once in what peers report (their queue, their load), which raises
# those peers' prices for the next choice.
# 0.6: volunteer peers' speeds differ by a factor of several (log-normal: a simulated swarm's
# sigma is 0.6, so the middle half spans 2.2x), and what decides which chains are "near-equal"
# is how much a requester's picture of their queues can be off. Measured on the simulator (100
# peers, 300 requests from 50 requesters at load 0.5, seed 1; latency p50 / p90): 0.25 gave
# 16.5 / 26.6 s, 0.6 15.2 / 24.3 s, 1.2 16.3 / 24.6 s (too wide pays speed for nothing).
SPREAD_WIDTH = 0.6
# The spare capacity a full peer is weighed with: not 0 (its price would be infinite, and a full
# peer is routed around as busy already, routing.unusable_reason).
SPARE_FLOOR = 0.05


@dataclass(frozen=True)
class Spread:
    """The seeded randomness of one routing decision: `salt` (64 bits a requester draws from its
    seeded stream for each open or re-route) and the width of the spread."""

    salt: int
    width: float = SPREAD_WIDTH

    def factor(self, peer_id: str, spare_share: float) -> float:
        """What `peer_id`'s price is multiplied by under this draw (see SPREAD_WIDTH)."""
        u = (_mix(self.salt ^ _peer_key(peer_id)) + 0.5) / 2.0 ** 64  # uniform in (0, 1)
        return 1.0 + self.width * -math.log(u) / spare_share

    def again(self, attempt: int) -> Spread:
        """The draw for the `attempt`-th route chosen under this one (0: itself): a re-route after a
        bounce must not meet the same near-equal peers' factors again, yet a replay that re-routes
        as often draws alike (a pure function of the salt and the count, not of the stream)."""
        return self if attempt == 0 else Spread(_mix(self.salt + attempt), self.width)


_MASK64 = (1 << 64) - 1
_peer_keys: dict[str, int] = {}


def _peer_key(peer_id: str) -> int:
    """64 bits of a peer id's hash (the same in every process: not Python's salted hash)."""
    key = _peer_keys.get(peer_id)
    if key is None:
        if len(_peer_keys) >= 1 << 16:
            _peer_keys.clear()
        key = _peer_keys[peer_id] = int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=8).digest(), "big")
    return key


def _mix(x: int) -> int:
    """splitmix64's finaliser: 64 well-mixed bits from 64 (a salt and a peer's key together)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


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
