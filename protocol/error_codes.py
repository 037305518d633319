"""The error codes a stage server puts in `ErrorMsg.code`: what a requester can act on.

Part of the wire protocol, so that the server (peer/serve/) and the requester
(peer/request/) both name them from here.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """A code's value is what travels (a plain string on the wire: schema.Str.dump converts)."""

    BUSY = "busy"  # no room now (sessions or KV memory); ErrorMsg.retry_after says when to ask again
    DRAINING = "draining"  # this peer is leaving or draining
    TOO_LONG = "too-long"  # the context or KV memory asked for exceeds the limits
    BAD_SPAN = "bad-span"  # the layers asked for are not served here
    BAD_REQUEST = "bad-request"  # malformed or out-of-order message
    BAD_FRAME = "bad-frame"  # a frame failed to decrypt, decode or validate
    COMPUTE_FAILED = "compute-failed"  # the stage rejected the input (shape, NaN/Inf, context)
    NEXT_HOP_FAILED = "next-hop-failed"  # our push to the next peer failed
    # an idle session was dropped to make room for another requester (peer/serve/admission.py):
    # no fault of the peer's; reopen (here after retry_after, or elsewhere) and replay
    RECLAIMED = "reclaimed"
    # this peer is leaving the swarm (its operator stopped it): a session it refuses, or one it
    # hands back because it could not finish within its leave grace, belongs elsewhere now. No
    # fault of the peer's and no reason to wait for it: route around it at once, no strike.
    LEAVING = "leaving"
    # a step would wait in this peer's queue longer than the requester said it would take
    # (SessionOpen.max_wait: what it routed with); the refusal's load report says how long. No
    # fault and no reason to avoid the peer: the requester routes again, priced with what it said.
    QUEUE_LONGER = "queue-longer"


# The members under their short names, as the server and the requester use them.
BUSY = ErrorCode.BUSY
DRAINING = ErrorCode.DRAINING
TOO_LONG = ErrorCode.TOO_LONG
BAD_SPAN = ErrorCode.BAD_SPAN
BAD_REQUEST = ErrorCode.BAD_REQUEST
BAD_FRAME = ErrorCode.BAD_FRAME
COMPUTE_FAILED = ErrorCode.COMPUTE_FAILED
NEXT_HOP_FAILED = ErrorCode.NEXT_HOP_FAILED
RECLAIMED = ErrorCode.RECLAIMED
LEAVING = ErrorCode.LEAVING
QUEUE_LONGER = ErrorCode.QUEUE_LONGER
