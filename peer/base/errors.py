"""The errors peer/ raises on purpose. Each says what failed and with which value."""

from __future__ import annotations

from tessera.peer.base.backoff import Failure


class PeerError(Exception):
    """Base of every error peer/ raises on purpose."""


class StreamClosed(PeerError):
    """The remote end closed or reset the stream."""


class PeerUnreachable(PeerError):
    """A peer could not be dialled or a stream to it could not be opened."""


class NoRoute(PeerError):
    """No chain of serving peers covers the layers a request needs."""

    def __init__(self, message: str, missing: list[tuple[int, int]] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []


class RouteLost(NoRoute):
    """A running session lost a peer and no other peer could take its layers (`missing`)."""


class DisputeUndecided(RouteLost):
    """Two peers disagreed on a span's activations, the requester could not tell which was right
    (no third holder, and it could not recompute the span itself), and no other peer serves the
    span: the answer stops rather than go on with either (peer/request/dispute.py)."""


class SessionRefused(PeerError):
    """A peer answered a session request with an error message (code says why; for "busy",
    `retry_after` says in how many seconds it expects room, when it says)."""

    def __init__(self, peer: str, code: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(f"peer {peer} refused: {code}: {message}")
        self.peer = peer
        self.code = code
        self.message = message
        self.retry_after = retry_after


class PeerFailed(PeerError):
    """A peer of a running session stopped answering, reset its stream or sent garbage.

    `failure` says which (peer/base/backoff.py: it decides how long the peer is avoided,
    and whether it may come back sooner)."""

    def __init__(self, peer: str, reason: str, failure: Failure = Failure.DROPPED) -> None:
        super().__init__(f"peer {peer} failed: {reason}")
        self.peer = peer
        self.reason = reason
        self.failure = failure


class OpenUnanswered(PeerFailed):
    """A peer ended the stream of a session open before answering it (a reset, no ErrorMsg).

    Ambiguous on its own: a peer whose unadmitted streams are full past what it can refuse
    politely resets newcomers unread (peer/net/intake.py), which is lack of room, not a fault;
    a crashed or misbehaving peer resets them too. The requester's `Bans.unanswered_open`
    decides (a skip the first time, a strike when it repeats before the peer answers an open)."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(peer, reason, Failure.DROPPED)


class ModelMismatch(PeerError):
    """The swarm serves a different model (config or weights) than the local files."""


class ConfigError(PeerError):
    """A peer or requester option is invalid."""


class UnknownPeer(PeerError):
    """A peer id that names no peer this requester knows (e.g. revoking it)."""
