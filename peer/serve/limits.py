"""What a stage server promises and refuses: timeouts, limits, counters.

The error codes it answers with live in protocol/error_codes.py. Limits are checked
before anything is allocated; who is admitted when the peer is full is
peer/serve/admission.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.protocol.admission import MAX_SESSIONS_PER_REQUESTER

from tessera.peer.serve.admission import ADMIT_WAIT
from tessera.peer.serve.batcher import MAX_BATCH_ROWS, MAX_BATCH_WAIT


# A requester sends SessionOpen right after opening the stream; a peer dials its next
# hop before accepting. Both are a few RTTs; 10 s covers a relayed intercontinental link.
OPEN_TIMEOUT = 10.0
# An open's whole stay before it is answered: its frame, the wait for room (at most ADMIT_WAIT)
# and the dial of its next hop (what is left: at least NEXT_HOP_DIAL after a full wait, as a 10 s
# bound on the whole open left after the 6 s wait there was). Shorter than the requester's bound on
# an open (peer/request/chain.py OPEN_TIMEOUT, 15 s), so that a peer out of room says so before
# its requester gives it up as failed.
NEXT_HOP_DIAL = 4.0
ACCEPT_TIMEOUT = ADMIT_WAIT + NEXT_HOP_DIAL
# A link stream may arrive before the requester's SessionOpen reaches us (they race
# over different connections); wait this long for the session to be registered.
LINK_WAIT = 10.0
REAPER_INTERVAL = 5.0



@dataclass
class ServerLimits:
    """What one peer accepts. Defaults suit a small CPU peer."""

    max_sessions: int = 16
    max_sessions_per_requester: int = MAX_SESSIONS_PER_REQUESTER  # the swarm's rule (protocol/admission.py)
    max_length: int = 4096  # tokens per session (clamped to the model's context)
    kv_budget: int = 2 << 30  # bytes of KV cache across sessions (charged as they grow: peer/serve/admission.py)
    # seconds without a step before a session is dropped even when nobody needs its room (a
    # backstop for requesters that vanished; under pressure idle sessions give way after
    # admission.IDLE_GRACE)
    idle_timeout: float = 300.0
    batch_rows: int = MAX_BATCH_ROWS  # rows of one stacked forward of several sessions' steps; 1: no stacking
    batch_wait: float = MAX_BATCH_WAIT  # seconds a batch waits for the sessions of the last one


@dataclass
class ServerStats:
    steps: int = 0
    tokens: int = 0
    layer_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    sessions_opened: int = 0
    refused: int = 0
    errors: int = 0
    reclaimed: int = 0  # idle sessions dropped to make room (peer/serve/admission.py)
    unadmitted_refused: int = 0  # streams reset unread: too many not yet admitted
