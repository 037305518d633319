"""The errors of fetching weights from peers. Each says what failed and with which value."""

from __future__ import annotations

from tessera.peer.base.errors import PeerError


class WeightsError(PeerError):
    """Base of every error the weights protocol raises on purpose."""


class ManifestRejected(WeightsError):
    """A peer's manifest does not hash to the model id, or is malformed."""


class WeightsUnavailable(WeightsError):
    """No reachable, honest peer holds some chunk we need (named in the message)."""


class DiskFull(WeightsError):
    """The disk filled up while writing fetched weights; nothing half-written is used."""


class WeightsMismatch(WeightsError):
    """A tensor of the span being loaded differs from the model's manifest (named in the message):
    the peer refuses to serve it."""


class OverBudget(WeightsError):
    """Loading what was asked for would take more memory than the budget given (both named)."""
