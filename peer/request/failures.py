"""What kind of failure (peer/base/backoff.py `Failure`) a refusal, an error code or an exception is.

The kind decides how long the requester avoids the peer and whether it may come back
before its ban ends, so each is named where it is seen:

- a refusal of a session (`ErrorMsg` in answer to an open): busy, a longer queue than priced,
  draining, leaving, no room
  for the context, a span it no longer serves — the peer is doing its job: REFUSED (skipped
  for its retry-after, no strike); a malformed exchange: BROKE;
- an error a peer reports mid-session: its compute or our frame failed: BROKE (a
  "next hop failed" report blames the next peer, which dropped: DROPPED; a session it
  reclaimed after it sat idle, one it handed back because it is leaving the swarm, no room
  for the session's growth, or declined as above: REFUSED: the session goes elsewhere at
  once, and the peer gets no strike);
- an exception while talking to it: a reset or closed stream, a failed dial: DROPPED; a
  deadline that ran out: TIMED_OUT; bytes that do not decode: BROKE. Except an open's stream
  ended before any answer (OpenUnanswered: a peer out of room for unadmitted streams resets
  them unread, peer/net/intake.py): REFUSED the first time, DROPPED when it repeats before the
  peer answers an open (peer/base/backoff.py `Bans.unanswered_open`).
"""

from __future__ import annotations

import trio

from tessera.protocol.error_codes import (BAD_SPAN, BUSY, DRAINING, LEAVING, NEXT_HOP_FAILED, QUEUE_LONGER, RECLAIMED,
                                         TOO_LONG)
from tessera.protocol.errors import WireError

from tessera.peer.base.backoff import Failure

# Codes with which a live, honest peer declines a session it cannot take now (LEAVING: it is
# leaving the swarm, and says so when refusing a session or handing back a running one;
# QUEUE_LONGER: its queue is longer than the open said it was priced for — the open routes again
# at once, peer/request/repair.py, and nothing else should ever hear it).
DECLINED = frozenset({BUSY, DRAINING, LEAVING, TOO_LONG, BAD_SPAN, QUEUE_LONGER})
# RECLAIMED (a session a peer took back under memory pressure after it sat idle) comes from
# an honest, live peer: the session is opened again — there or elsewhere — as after a refusal.


def refusal_failure(code: str) -> Failure:
    """The kind of a session refused with `code`."""
    if code in DECLINED:
        return Failure.REFUSED
    if code == NEXT_HOP_FAILED:
        return Failure.DROPPED  # of the peer after the one that refused (chain.blame)
    return Failure.BROKE


def reported_failure(code: str | None) -> Failure:
    """The kind of an error a peer reported mid-session (None: the stream itself failed)."""
    if code is None or code == NEXT_HOP_FAILED:
        return Failure.DROPPED
    if code == RECLAIMED or code in DECLINED:
        return Failure.REFUSED
    return Failure.BROKE


def error_failure(error: BaseException) -> Failure:
    """The kind of an exception raised while talking to a peer."""
    if isinstance(error, trio.TooSlowError):
        return Failure.TIMED_OUT
    if isinstance(error, WireError):
        return Failure.BROKE
    return Failure.DROPPED  # PeerUnreachable, StreamClosed: the peer or the link is gone


__all__ = ["DECLINED", "refusal_failure", "reported_failure", "error_failure"]
