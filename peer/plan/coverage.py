"""Coverage: which layers a new session can get through now — the one definition.

`swarm status`, the operator's TUI (and the web view) say how many peers serve each
layer and where the gaps are; a requester's route either exists or not. They must never
disagree: a TUI that showed "gaps: none" for a swarm whose only peer of layers [0, 10)
was draining, while every requester failed, is what this module exists to prevent. So
all of them read `swarm_coverage`, a pure function of a view built on routing's own test
of a usable peer (`routing.unusable_reason`) and routing's notion of a replica (an
unsharded peer, or a complete tensor-shard group, counted once: `groups.replica_coverage`).

A peer reading its own coverage passes `own`: its current state as it knows it, which
wins over its record in the view (that record is re-advertised a moment later, or not
yet there at all; a peer that just pressed "leave" is not serving, whatever its last
record says). A worked example, L = 30::

    view: a [0, 10) serving, b [10, 30) serving; a's operator presses "d" (drain)
    swarm_coverage(view, own=a as draining)
        replicas  = 0 x 10, 1 x 20        gaps = ((0, 10),)
        claimed   = 1 x 30                serving = 1 of 2 peers
        aside     = (("a", "draining"),)
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.peer.plan.groups import replica_coverage
from tessera.peer.plan.routing import routable_view, unusable_reason
from tessera.peer.plan.view import PeerInfo, SwarmView


@dataclass(frozen=True)
class SwarmCoverage:
    """What a view covers, per layer (see the module docstring).

    replicas: per layer, the replicas a new session could use now (0 = a gap).
    gaps:     the layer ranges at 0 replicas, half-open, in order.
    claimed:  per layer, the peers claiming it in any state but leaving (placement's count).
    serving:  peers that take sessions now; `peers`: every peer of the view.
    aside:    (peer id, why) for each peer with a span that takes no sessions now, by peer id.
    """

    replicas: tuple[int, ...]
    gaps: tuple[tuple[int, int], ...]
    claimed: tuple[int, ...]
    serving: int
    peers: int
    aside: tuple[tuple[str, str], ...]

    @property
    def complete(self) -> bool:
        """Whether every layer has a usable replica (a route may still need an RTT's luck)."""
        return not self.gaps


def gaps_in(counts: tuple[int, ...] | list[int]) -> tuple[tuple[int, int], ...]:
    """The half-open ranges of layers whose count is 0."""
    out: list[tuple[int, int]] = []
    for layer, count in enumerate(counts):
        if count:
            continue
        if out and out[-1][1] == layer:
            out[-1] = (out[-1][0], layer + 1)
        else:
            out.append((layer, layer + 1))
    return tuple(out)


def swarm_coverage(view: SwarmView, *, own: PeerInfo | None = None) -> SwarmCoverage:
    """The coverage of `view`, with `own` (a peer's own current state) in place of its record."""
    if own is not None:
        view = view.replace(own)
    replicas = tuple(replica_coverage(routable_view(view)))
    reasons = [(p.peer_id, unusable_reason(p)) for p in view.peers]
    return SwarmCoverage(
        replicas=replicas,
        gaps=gaps_in(replicas),
        claimed=tuple(view.coverage()),
        serving=sum(1 for _, why in reasons if why is None),
        peers=len(view.peers),
        aside=tuple((pid, why) for (pid, why), p in zip(reasons, view.peers) if why is not None and p.end > p.start),
    )


__all__ = ["SwarmCoverage", "swarm_coverage", "gaps_in"]
