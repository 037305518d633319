"""The errors simulation and replay raise on purpose (PeerErrors, so the CLI prints one clean line)."""

from __future__ import annotations

from tessera.peer.base.errors import PeerError


class SimError(PeerError):
    """Base of every error peer/sim raises on purpose."""


class UnknownPolicy(SimError, ValueError):
    """A placement policy name that peer/sim/policies.py does not know."""


class BadScenario(SimError, ValueError):
    """A scenario or simulation option that cannot be run (a size, a rate, a mode)."""


class TraceTooThin(SimError, ValueError):
    """The trace lacks what a replay needs (no peer claimed a span)."""
