"""How many answers the gateway may run at once: what the swarm can hold of one requester.

Every answer is one swarm session, and each peer on its route holds one session slot
for it. A peer takes at most `max_sessions` sessions (it advertises the number) and
at most `ServerLimits.max_sessions_per_requester` of one requester's — and the gateway
is one requester. So the sessions the swarm can hold for the gateway at once are, for
the layer where that is least, the sum over the serving peers that cover it of
min(max_sessions, per-requester limit): a swarm of one peer with `--max-sessions 4`
holds 4; two replicas of [0, 15) (16 each) before one peer of [15, 30) (4) hold 4.

Running more than that only gets answers refused "busy" (and, before, a refusal
banned the peer and failed everyone's requests with 503 on a covered swarm); so the
gateway queues the rest (`Gateway.slot`) and follows this number as the view changes.
A tensor-shard group counts once (its rank 0), as a route uses it once.

    >>> from tessera.peer.plan.view import PeerInfo, SwarmView
    >>> peers = (PeerInfo("a", "m", 0, 15, 1.0, max_sessions=16), PeerInfo("b", "m", 0, 15, 1.0, max_sessions=16),
    ...          PeerInfo("c", "m", 15, 30, 1.0, max_sessions=4))
    >>> session_capacity(SwarmView(30, peers), per_requester=8)
    4
"""

from __future__ import annotations

from tessera.peer.plan.view import SwarmView


def session_capacity(view: SwarmView, *, per_requester: int) -> int:
    """Sessions of one requester the serving peers of `view` can hold at once (0: a layer
    has no serving peer)."""
    per_layer = [0] * view.num_layers
    for p in view.peers:
        if not p.routable or p.shard_index != 0:
            continue
        slots = min(p.max_sessions, per_requester)
        for layer in range(max(p.start, 0), min(p.end, view.num_layers)):
            per_layer[layer] += slots
    return min(per_layer, default=0)


def covered(view: SwarmView) -> bool:
    """Whether serving peers claim every layer (busy or not): a failure to route is then a
    matter of waiting, not of a missing layer."""
    return view.num_layers > 0 and session_capacity(view, per_requester=1) > 0
