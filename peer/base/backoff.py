"""Who a requester avoids, for how long, and how long it waits for a route: one policy.

Why a peer failed decides how long it is avoided and whether it may come back sooner:

    failure     what the requester saw                            avoided for               comes back
    ---------   -----------------------------------------------   -----------------------   ------------------
    LIED        a spot check proved it returned wrong             GUILTY_BAN (24 h)         never (a proof)
                activations (peer/request/verify.py)
    BROKE       it answered, with an error or garbage (bad        BAN_BASE x 2^(k-1),       when the ban ends
                frame, failed compute, a wrong reply)             at most BAN_CAP
    DROPPED     its connection or stream reset; it could          BAN_BASE x 2^(k-1),       re-probed while no
                not be dialled (a killed process)                 at most BAN_CAP           route exists
    TIMED_OUT   no answer within a step's deadline (a hung        BAN_BASE x 2^(k-1),       re-probed while no
                or stopped process, a vanished machine)           at most BAN_CAP           route exists
    REFUSED     it declined a session (busy, draining,            its retry-after, else     when the skip ends
                leaving, no memory for it): not a failure;        REFUSED_SKIP; no strike
                or ended an open unanswered, the first time
                before it answers one again (unanswered_open),
                or a neighbour found its link reset, the first
                time before it serves a step (link_reset)
    DISPUTED    a spot check found it and another peer            BAN_BASE x 2^(k-1),       when the ban ends;
                disagreeing, and nothing could tell which was     at most BAN_CAP           never paroled as
                right (peer/request/dispute.py): both avoided                               the only cover

k counts the peer's strikes, kept from one answer to the next (however well it served in
between): a peer that keeps failing is avoided longer. A refusal is a peer doing its job.

One parole for the only cover. A peer avoided for anything but a lie, a dispute or a refusal that
covers layers no usable peer covers (the only cover of a span) is probed while a route is
awaited, no sooner than SOLE_PAROLE_AFTER after it failed, and paroled once in that wait if it
answers — whatever its ban says: without it the wait ends in failure for sure (a replacement
banned BROKE for BAN_BASE = ROUTE_WAIT failed an answer with "banned (broke) for 0 s more").
The caller (the requester's session: peer/request/repair.py) keeps which peers had their parole
in the current wait.

The numbers, and why:

- ROUTE_WAIT = 30 s: how long a request waits for some peer to cover its layers (at the
  start, and again after a failure) before it fails naming the layers. A restarted peer of
  a small model is serving again in 5-10 s (process start, measuring one layer, loading
  its span), then announces itself within an advertisement and a gossip round (3 s + 2 s):
  it fits, with room for a slower disk. Waiting longer holds a user on a swarm that lost
  a span for good.
- BAN_BASE = 30 s (doubling to BAN_CAP = 1 h): while another peer serves the span, a
  peer that just failed is avoided for at least a route wait, so that routes do not flap
  back onto it. Strikes double it; the cap lets a peer that was unlucky for a day serve
  again within the hour.
- A ban does NOT outlast a comeback: a DROPPED or TIMED_OUT peer covering layers that no
  usable peer covers is probed (a ping) every PROBE_INTERVAL while a route is awaited, and
  paroled — its ban lifted, its strikes kept — as soon as it answers AND has signed a new
  advertisement since it failed (so it is known to be back, and to serve what the new record
  says: a restarted peer still loading advertises LOADING and is not routed to yet). So a
  killed and restarted peer, or a stopped and resumed one, is used again within
  PROBE_INTERVAL of its return (PROBE_INTERVAL = 2 s: the requester's own gossip period),
  however long its ban. Before this policy the ban (30 s) and the route wait (30 s) were
  two unrelated constants of equal length: a peer that came back after 5 s was still
  banned when the wait gave up.
- PROBE_TIMEOUT = 2 s: a ping is a stream and one round trip (1 ms on loopback, under
  0.5 s across continents even when it must dial: 3 round trips); a peer that cannot
  answer in 2 s is not one to route a step through.
- REFUSED_SKIP = 5 s: a peer that refused without saying when to retry is skipped this
  long (other peers are tried meanwhile); a retry-after it gives is used instead, up to
  ROUTE_WAIT.
- BUSY_WAIT = 120 s: how long an open keeps waiting past the route wait while every layer
  it needs is covered by peers that are only busy (they refused it with a retry-after, or
  advertise every slot taken). A full swarm is a queue, not a failure: its peers are
  serving and each refusal says when to ask again, so giving up after one route wait (the
  time a restarted peer needs) lost answers that a few more seconds of queueing would have
  finished (`bench/load.py` at load 0.8: 443 of 1,000 answers of 2 requesters, all "no
  usable peer" at full coverage). Four route waits: longer than a peak's queue at a
  swarm loaded to 0.8, shorter than an API client's default timeout.
- SOLE_PAROLE_AFTER = REFUSED_SKIP: the only cover of a span is given a few seconds before
  its one parole (a busy or briefly broken peer may have recovered), and no more: the route
  wait runs meanwhile.

`Bans` holds them, keyed by peer id. Pure: every call takes `now` (whatever clock the owner
runs on: time.monotonic in a live requester, trio's MockClock in the simulator), so the same
object serves both and tests need no clock. The requester's `Swarm` owns one, so strikes
survive from one answer to the next. `Backoff` is the plain keyed doubling it is built on
(also used where a connection, not a peer's answers, is avoided: peer/net/dedicated/).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Iterable, Iterator


class Failure(StrEnum):
    """Why a peer is avoided (the table in the module docstring); the value is what traces carry."""

    LIED = "lied"
    BROKE = "broke"
    DROPPED = "dropped"
    TIMED_OUT = "timed-out"
    REFUSED = "refused"
    DISPUTED = "disputed"


ROUTE_WAIT = 30.0
BUSY_WAIT = 4 * ROUTE_WAIT
BAN_BASE = 30.0
BAN_CAP = 3600.0
GUILTY_BAN = 24 * 3600.0
PROBE_INTERVAL = 2.0
PROBE_TIMEOUT = 2.0
REFUSED_SKIP = 5.0
SOLE_PAROLE_AFTER = REFUSED_SKIP

# The failures after which a peer may come back before its ban ends (it was gone, not wrong).
COMEBACK = frozenset({Failure.DROPPED, Failure.TIMED_OUT})
# The failures after which the only cover of a span may have one parole in a route wait (not a
# dispute: paroling one side of an undecided dispute would go on, unverified, with that side).
SOLE_PAROLE = frozenset({Failure.BROKE, Failure.DROPPED, Failure.TIMED_OUT})


class Backoff:
    """Bans keyed by peer id: `until(key)` is when the ban on `key` ends (0.0: never banned).

    A failure of `key` bans it for `base` seconds, doubling with each further failure
    (strikes) up to `cap`. Strikes are kept; `cap` bounds the ban.
    """

    def __init__(self, base: float, cap: float) -> None:
        if not 0 < base <= cap:
            raise ValueError(f"back-off base must be > 0 and <= cap, got base={base!r} cap={cap!r}")
        self.base = base
        self.cap = cap
        self._strikes: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def register_failure(self, key: str, now: float, *, seconds: float | None = None) -> float:
        """Count a strike against `key` and ban it from `now` for `seconds`, or, when not
        given, for base * 2 ** (strikes - 1) capped at `cap`. Returns the ban's length."""
        strikes = self._strikes[key] = self._strikes.get(key, 0) + 1
        duration = seconds if seconds is not None else min(self.cap, self.base * 2 ** (strikes - 1))
        self._until[key] = max(self._until.get(key, 0.0), now + duration)
        return duration

    def ban_until(self, key: str, until: float) -> None:
        """Avoid `key` until at least `until` (no strike: a ban for what others proved)."""
        self._until[key] = max(self._until.get(key, 0.0), until)

    def lift(self, key: str, now: float) -> None:
        """End the ban on `key` now (its strikes stay)."""
        if self._until.get(key, 0.0) > now:
            self._until[key] = now

    def is_banned(self, key: str, now: float) -> bool:
        return self._until.get(key, 0.0) > now

    def until(self, key: str) -> float:
        return self._until.get(key, 0.0)

    def strikes(self, key: str) -> int:
        return self._strikes.get(key, 0)

    def banned(self, now: float) -> Iterator[str]:
        """The keys banned at `now`, in the order they were first banned."""
        return (key for key, until in self._until.items() if until > now)

    def next_end(self, now: float) -> float | None:
        """When the earliest ban running at `now` ends (None: none runs)."""
        return min((until for until in self._until.values() if until > now), default=None)

    def clear(self) -> None:
        """Forget every ban and strike."""
        self._strikes.clear()
        self._until.clear()


@dataclass(frozen=True)
class Avoided:
    """Why and since when a peer is avoided; `mark` is what proves a comeback (the issue time
    of the peer's advertisement when it failed: a newer one says it is back)."""

    failure: Failure
    since: float
    mark: float = 0.0


class Bans(Backoff):
    """The requester's bans and skips, by failure (see the module docstring).

    `register(peer, now, failure)` avoids a peer as its failure says; `comeback_candidates`
    lists those that may be probed now, and `parole` lifts a ban after a probe answered.
    Also answers `Backoff`'s questions (is_banned, banned, until, strikes).
    """

    def __init__(self, base: float = BAN_BASE, cap: float = BAN_CAP) -> None:
        super().__init__(base, cap)
        self.why: dict[str, Avoided] = {}
        self._probed: dict[str, float] = {}  # peer -> when it was last probed
        self._unanswered: set[str] = set()  # peers whose last open ended unanswered (unanswered_open)
        self._link_reset: set[str] = set()  # peers whose link a neighbour found reset, not served since (link_reset)

    def register(self, key: str, now: float, failure: Failure, *, seconds: float | None = None,
                 mark: float = 0.0) -> float:
        """Avoid `key` after `failure`; returns for how long. REFUSED: skipped for `seconds`
        (its retry-after, at most ROUTE_WAIT) or REFUSED_SKIP, with no strike; LIED: GUILTY_BAN;
        the others: the doubling ban (or `seconds`, when given)."""
        if failure is Failure.REFUSED:
            duration = min(seconds, ROUTE_WAIT) if seconds is not None and seconds > 0 else REFUSED_SKIP
            if not self.is_banned(key, now) or self.failure(key) is Failure.REFUSED:
                self.why[key] = Avoided(failure, now, mark)  # a skip never hides a ban's reason
            self.ban_until(key, now + duration)
            return duration
        if failure is Failure.LIED:
            seconds = GUILTY_BAN
        duration = self.register_failure(key, now, seconds=seconds)
        previous = self.why.get(key)
        if previous is None or previous.failure is not Failure.LIED:  # a proven liar stays one
            self.why[key] = Avoided(failure, now, mark)
        self._probed.pop(key, None)
        return duration

    def unanswered_open(self, key: str) -> Failure:
        """What an open that `key` ended unanswered (a reset before any reply) counts as: REFUSED the
        first time — a peer past what it can refuse politely resets newcomers for lack of room
        (peer/net/intake.py), and lack of room is never a strike — and DROPPED (a strike) when it
        happens again before `key` answers an open (`answered_open`). So a peer that resets every
        open is struck from its second; one that alternates gains only skips, as a peer that always
        refuses does: it holds no session, and costs a requester one round trip per open."""
        if key in self._unanswered:
            return Failure.DROPPED
        self._unanswered.add(key)
        return Failure.REFUSED

    def answered_open(self, key: str) -> None:
        """`key` answered an open (accepted or refused it): its next unanswered open is a skip again."""
        self._unanswered.discard(key)

    def link_reset(self, key: str) -> Failure:
        """What a neighbour's report that `key` reset the link between them (next-hop-failed) counts
        as: REFUSED the first time — the link waits among `key`'s unadmitted streams until its
        session takes it, and a peer out of room for them resets it unread (peer/net/intake.py) —
        and DROPPED when it happens again before a step of this requester's was served through
        `key` (`served`). So a peer that resets links buys each skip with a step it served; one
        that never serves is struck from its second."""
        if key in self._link_reset:
            return Failure.DROPPED
        self._link_reset.add(key)
        return Failure.REFUSED

    def served(self, key: str) -> None:
        """A step of this requester's went through `key`: its next link reset is a skip again."""
        self._link_reset.discard(key)

    def prove_guilty(self, key: str, now: float) -> None:
        """Avoid `key` for GUILTY_BAN on others' proof (a verified report), with no strike."""
        self.ban_until(key, now + GUILTY_BAN)
        self.why[key] = Avoided(Failure.LIED, now)

    def failure(self, key: str) -> Failure | None:
        """Why `key` was last avoided (None: never)."""
        avoided = self.why.get(key)
        return avoided.failure if avoided is not None else None

    def comeback_candidates(self, now: float, peers: Iterable[str]) -> list[str]:
        """Those of `peers` banned now after a DROPPED or TIMED_OUT failure, not probed in the
        last PROBE_INTERVAL (sorted, so that probes go out in a reproducible order)."""
        out = []
        for key in sorted(set(peers)):
            avoided = self.why.get(key)
            if (avoided is not None and avoided.failure in COMEBACK and self.is_banned(key, now)
                    and now - self._probed.get(key, -PROBE_INTERVAL) >= PROBE_INTERVAL):
                out.append(key)
        return out

    def probed(self, key: str, now: float) -> None:
        self._probed[key] = now

    def parole(self, key: str, now: float, *, sole: bool = False) -> bool:
        """Lift the ban on `key` (a DROPPED or TIMED_OUT peer that answered a probe; with `sole`,
        the only cover of a span, banned for any of SOLE_PAROLE); its strikes stay. False
        (nothing changes) for a peer banned for anything else."""
        avoided = self.why.get(key)
        if avoided is None or avoided.failure not in (SOLE_PAROLE if sole else COMEBACK):
            return False
        self.lift(key, now)
        return True

    def sole_parole_due(self, key: str, now: float) -> bool:
        """Whether `key`, if it is the only cover of a span, may have its parole now: banned for
        one of SOLE_PAROLE at least SOLE_PAROLE_AFTER ago, and not probed in the last PROBE_INTERVAL."""
        avoided = self.why.get(key)
        return (avoided is not None and avoided.failure in SOLE_PAROLE and self.is_banned(key, now)
                and now - avoided.since >= SOLE_PAROLE_AFTER
                and now - self._probed.get(key, -PROBE_INTERVAL) >= PROBE_INTERVAL)

    def sole_parole_at(self, key: str) -> float:
        """When `key`'s sole-cover parole becomes due (its failure + SOLE_PAROLE_AFTER)."""
        avoided = self.why.get(key)
        return avoided.since + SOLE_PAROLE_AFTER if avoided is not None else 0.0

    def clear(self) -> None:
        super().clear()
        self.why.clear()
        self._probed.clear()
        self._unanswered.clear()
        self._link_reset.clear()


__all__ = ["Failure", "Backoff", "Bans", "Avoided", "ROUTE_WAIT", "BAN_BASE", "BAN_CAP", "GUILTY_BAN",
           "PROBE_INTERVAL", "PROBE_TIMEOUT", "REFUSED_SKIP", "SOLE_PAROLE_AFTER", "COMEBACK",
           "SOLE_PAROLE"]
