"""The requester's policy: which peers may compute its answers.

A requester that trusts only some peers with its activations (they see every
hidden state of its prompt and answer) says so with a `RequesterPolicy`:

- ``deny``: never use these peers;
- ``allow``: if given, use only these peers (``deny`` still wins);
- ``prefer``: among the allowed peers, use these wherever they cover the layers,
  and the others only where no preferred peer does.

The policy is a pure function of a `SwarmView` snapshot, applied before routing
(`RequesterPolicy.apply`): peers it does not admit are dropped from the view, and
the compute of admitted peers that are not preferred is priced `PREFER_FACTOR`
times higher. `peer/plan/routing.py` is unchanged and the same snapshot and policy
give the same route, live, in a simulation and in a replay. A worked example
(L = 4, default RTT 100 ms)::

    peer  span    ms per layer
    a     [0, 4)  10
    b     [0, 2)  10
    c     [2, 4)  10

    no policy                 r -> a -> r                 100 + 40 + 100        = 240 ms
    prefer={b, c}             r -> b -> c -> r            100 + 20 + 100 + 20 + 100 = 340 ms
                              (a would now cost 100 + 40,000 + 100)
    allow={a, b}              r -> a -> r
    allow={b}                 no route: layers [2, 4) are covered by no allowed peer

Peer ids are full base58 libp2p ids (``12D3KooW...``), checked when the policy is
built: a prefix would resolve against a view that changes while a requester runs
(the same prefix could name another peer tomorrow), and a policy is about trust.
`read_peer_ids` reads ``@file`` arguments: one id per line, ``#`` comments.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

from tessera.protocol.errors import WireError
from tessera.protocol.keys import public_key_from_peer_id

from tessera.peer.base.errors import ConfigError
from tessera.peer.plan.view import SwarmView
from tessera.peer.base.ids import peer_id_bytes

__all__ = ["PREFER_FACTOR", "BadPeerId", "RequesterPolicy", "check_peer_id", "read_peer_ids", "explain_gaps"]

# How much more a layer on a peer that is not preferred costs than on a preferred one.
# A layer's compute is 1-100 ms on the peers we see (SmolLM2 on a laptop CPU to a 1B
# model), a hop's round trip 1-250 ms (routing.DEFAULT_RTT_MS); multiplied by 1000,
# one layer on a non-preferred peer outweighs any number of extra hops between
# preferred ones, so "prefer" means "wherever they can", not "a little cheaper".
PREFER_FACTOR = 1000.0


class BadPeerId(ConfigError):
    """A policy names something that is not a libp2p peer id."""


def check_peer_id(text: str, *, what: str = "peer id") -> str:
    """`text` if it is a full base58 Ed25519 libp2p peer id. Raises BadPeerId naming it."""
    if not isinstance(text, str) or not text.strip():
        raise BadPeerId(f"{what}: expected a peer id (12D3KooW...), got {text!r}")
    text = text.strip()
    try:
        public_key_from_peer_id(peer_id_bytes(text))
    except (ValueError, WireError):
        raise BadPeerId(f"{what}: {text!r} is not a full peer id (base58, 12D3KooW..., 52 characters)") from None
    return text


def read_peer_ids(arguments: Sequence[str], *, option: str) -> frozenset[str]:
    """Peer ids from command-line arguments: each an id, or ``@FILE`` (one id per line,
    blank lines and ``#`` comments ignored). Raises BadPeerId or ConfigError (unreadable file)."""
    ids: set[str] = set()
    for argument in arguments:
        if argument.startswith("@"):
            path = Path(argument[1:]).expanduser()
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as error:
                raise ConfigError(f"{option} {argument}: cannot read {str(path)!r}: {error}") from None
            for n, line in enumerate(lines, 1):
                line = line.split("#", 1)[0].strip()
                if line:
                    ids.add(check_peer_id(line, what=f"{option} {argument} line {n}"))
        else:
            ids.add(check_peer_id(argument, what=option))
    return frozenset(ids)


@dataclass(frozen=True)
class RequesterPolicy:
    """Which peers may compute a requester's answers (see module docstring).

    allow:  the only peers to use; None = every peer.
    deny:   peers never to use (wins over `allow` and `prefer`).
    prefer: peers to use wherever they cover the layers.
    """

    allow: frozenset[str] | None = None
    deny: frozenset[str] = frozenset()
    prefer: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name in ("allow", "deny", "prefer"):
            ids = getattr(self, name)
            if ids is None:
                continue
            if isinstance(ids, str):
                raise BadPeerId(f"policy {name}: expected a collection of peer ids, got the string {ids!r}")
            checked = frozenset(check_peer_id(i, what=f"policy {name}") for i in ids)
            object.__setattr__(self, name, checked)

    @property
    def restricts(self) -> bool:
        """Whether this policy changes anything."""
        return self.allow is not None or bool(self.deny) or bool(self.prefer)

    def admits(self, peer_id: str) -> bool:
        return peer_id not in self.deny and (self.allow is None or peer_id in self.allow)

    def denying(self, peer_id: str) -> "RequesterPolicy":
        """This policy with one more peer denied (what a revocation leaves behind)."""
        return replace(self, deny=self.deny | {peer_id})

    def narrowed(self, other: "RequesterPolicy | None") -> "RequesterPolicy":
        """Both policies at once: a request's policy can narrow the requester's, never widen it.
        Allow-lists intersect, deny- and prefer-lists add up."""
        if other is None:
            return self
        if self.allow is None or other.allow is None:
            allow = self.allow if other.allow is None else other.allow
        else:
            allow = self.allow & other.allow
        return RequesterPolicy(allow=allow, deny=self.deny | other.deny, prefer=self.prefer | other.prefer)

    def apply(self, view: SwarmView, *, keep: Iterable[str] = ()) -> SwarmView:
        """The view routing should see: peers not admitted dropped, non-preferred peers'
        compute priced `PREFER_FACTOR` times higher (when anything is preferred).
        Peers in `keep` (the requester itself, with its RTT measurements) stay as they are."""
        if not self.restricts:
            return view
        keep = frozenset(keep)
        peers = []
        for p in view.peers:
            if p.peer_id in keep:
                peers.append(p)
            elif self.admits(p.peer_id):
                slower = self.prefer and p.peer_id not in self.prefer and p.throughput > 0
                peers.append(replace(p, throughput=p.throughput / PREFER_FACTOR) if slower else p)
        return SwarmView(view.num_layers, tuple(peers))

    def summary(self) -> dict:
        return {"allow": sorted(self.allow) if self.allow is not None else None,
                "deny": sorted(self.deny), "prefer": sorted(self.prefer)}


def _ranges(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """Half-open ranges of the indices where `flags` is true."""
    out: list[tuple[int, int]] = []
    for i, flag in enumerate(flags):
        if flag and out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        elif flag:
            out.append((i, i + 1))
    return out


def explain_gaps(view: SwarmView, policy: RequesterPolicy) -> tuple[list[tuple[int, int]], str]:
    """Why no route exists, layer by layer: (every layer range no usable peer covers, a sentence).

    Tells "no peer at all covers [a, b)" (the swarm has a hole: wait, or start a peer)
    from "no allowed peer covers [a, b)" (peers exist, but the policy excludes them).
    """
    everyone = view.coverage()
    allowed = policy.apply(view).coverage() if policy.restricts else everyone
    nobody = _ranges([c == 0 for c in everyone])
    excluded = _ranges([a == 0 and c > 0 for a, c in zip(allowed, everyone)])
    parts = []
    if nobody:
        parts.append("no peer at all covers layers " + ", ".join(f"[{a}, {b})" for a, b in nobody))
    if excluded:
        parts.append("no allowed peer covers layers " + ", ".join(f"[{a}, {b})" for a, b in excluded)
                     + " (peers there are excluded by the requester's policy)")
    missing = sorted(nobody + excluded)
    return missing, "; ".join(parts)
