"""How long a leaving peer waits for the answers it is computing: a grace sized to them.

A peer that stops (Ctrl-C, SIGTERM, `q` in the TUI) takes no new sessions and lets the
running ones finish before it closes (peer/node/peer_node.py `_leave`). A fixed grace
(it was 10 s) cut a 200-token answer of a lone peer at about 100 tokens: how long an answer
still needs depends on how many tokens it may still ask for and how fast it has been going.
So the grace is estimated from the sessions themselves:

    a session's time to finish = tokens it may still ask for x its seconds per step so far
    grace = the longest of them x GRACE_MARGIN + GRACE_FLOOR, at most the cap (--leave-grace)

- *tokens it may still ask for*: its reserved length (`SessionOpen.max_length`: the prompt,
  the answer's budget and a little slack for speculation) less the tokens computed so far.
  An answer that ends early (end of sequence, a stop string) ends the wait early: the drain
  returns as soon as no session is left (`StageServer.drain`), so the estimate only bounds it.
- *seconds per step so far*: the time since it was admitted over its steps (prefill and the
  requester's turn-around included: what a step has really cost). A session that has not
  stepped yet is given `fallback_pace` (the peer's measured compute for its span, with
  FALLBACK_FACTOR for the network and the requester).
- GRACE_MARGIN = 1.5: the pace of the last steps may be slower than the average (another
  requester's steps batched beside them, a busier machine); a third more time covers the usual
  wobble without keeping a stalled requester's peer for long.
- GRACE_FLOOR = 3 s: the last step's round trip and the session's close, whatever the pace.

A session still running when the grace ends is handed back (`StageServer.hand_over`): its
requester is told LEAVING and re-routes at once, without a strike against this peer.
Pure: `now` is given (trio's clock in a peer, its MockClock in a simulation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

GRACE_MARGIN = 1.5
GRACE_FLOOR = 3.0
FALLBACK_FACTOR = 4.0  # a step's compute alone, times this, for a session that has not stepped yet
# The cap when the operator sets none (PeerConfig.leave_grace): five minutes hold a 4,096-token
# answer at ~15 tokens/s. A person who will not wait presses Ctrl-C again (the answers are handed
# back at once); a service manager that will not wait sends SIGKILL (systemd: after 90 s).
MAX_LEAVE_GRACE = 300.0


class RunningSession(Protocol):
    """What the estimate reads of a served session (peer/serve/session.py `ServedSession`)."""

    capacity: int
    tokens: int
    steps: int
    opened_at: float


@dataclass(frozen=True)
class InFlight:
    """The answers a leaving peer is computing: how many, how many tokens they may still ask
    for (at most), and how long it will wait for them."""

    sessions: int
    tokens_left: int
    grace: float

    def describe(self) -> str:
        """'1 answer running here (at most 150 tokens to go)'."""
        answers = f"{self.sessions} answer{'s' if self.sessions != 1 else ''}"
        return f"{answers} running here (at most {self.tokens_left} tokens to go)"


def seconds_to_finish(session: RunningSession, now: float, fallback_pace: float) -> float:
    """How long `session` needs at its pace so far, if it asks for every token it reserved."""
    left = max(0, session.capacity - session.tokens)
    pace = (now - session.opened_at) / session.steps if session.steps > 0 else fallback_pace
    return left * max(pace, 0.0)


def in_flight(sessions: Iterable[RunningSession], now: float, *, fallback_pace: float, cap: float) -> InFlight:
    """The answers in flight and the grace they get (see the module docstring)."""
    running = list(sessions)
    if not running:
        return InFlight(0, 0, 0.0)
    longest = max(seconds_to_finish(s, now, fallback_pace) for s in running)
    tokens_left = max(max(0, s.capacity - s.tokens) for s in running)
    return InFlight(len(running), tokens_left, min(cap, longest * GRACE_MARGIN + GRACE_FLOOR))


__all__ = ["GRACE_MARGIN", "GRACE_FLOOR", "FALLBACK_FACTOR", "MAX_LEAVE_GRACE", "InFlight", "in_flight",
           "seconds_to_finish"]
