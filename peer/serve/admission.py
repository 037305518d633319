"""Who gets a session slot, and whose idle session gives one up: admission against exhaustion.

A peer has `max_sessions` slots and a KV budget. Identities cost a requester nothing
but a small proof of work (protocol/admission.py), so holding slots must cost
something too, or a few identities opening idle sessions lock everyone else out
(observed: three identities held every slot until a 300 s idle timeout). The rules:

1. **Memory follows use.** A session is charged the KV it has grown to (whole chunks
   of `stages.model.KV_CHUNK` positions), not its `max_length`: one chunk at
   admission, more as its steps reach them (`StageServer._grow`).
2. **Idle sessions give way under pressure.** A session that has stepped is *protected*
   until `STEP_GRACE` (a route wait, 30 s) after its last step (a Forward received, or one
   computed): its requester is using it, and a step of an answer waits in other peers'
   queues up and down the route for as long as they are busy; reclaiming it costs its
   requester a failover and a replay on another peer, which costs the swarm more than
   refusing the newcomer `busy` (it goes elsewhere at once, no strike). Shorter grants
   (`IDLE_GRACE`, or twice the longest gap between its steps so far) made a reclaim
   cascade at load: the simulator's 50 requesters at load 0.5 (20 peers, 200 answers)
   completed 133 of 200 with 23 sessions opened per answer, and 195 with 11 when a step
   bought a route wait. While a step of it is queued or running it is always protected.
   Until its first step, a
   session has a *grace of its own*: `IDLE_GRACE` from its open — or twice the
   longest sessions here lately waited for their first step, its requester's or anyone's, if
   longer (at most `GRACE_CAP`: a session at the end of a route gets its prompt only after the
   hops before it computed it, and a requester new to this peer, as most are when many
   requesters share a swarm, has no wait of its own here to go by) — for a requester with a
   proof of work that has a grace in hand
   (`GRACES_IN_HAND`: a new identity has one, an open spends one, each step of the
   requester's arriving here earns one; a session its requester closes before its first step,
   within its grace, gives the grace back, at most once per step arriving here). So cycling
   sessions (close and reopen) earns one identity no more protection than holding one, a new
   grace needs a step (real use) or a new identity with work, and an identity without work
   has no grace at all (its unstepped sessions give way to anyone who needs the room). When a requester needs a slot or memory that is not
   free, the unprotected sessions of *other* requesters are reclaimed, the one idle
   longest first; its requester is told `reclaimed` (and may reopen, here or
   elsewhere, and replay). A new session takes room only from an identity holding *more*
   sessions here than its own requester does (a fair share): two requesters with one
   session here each do not reclaim each other's in turn — at 50 requesters nearly every
   reclaimed session was unstepped, most under 2 s old (a replacement waiting for its
   replay, a downstream hop for its prompt), each reclaim a failover that reclaimed another
   (bench/load.py, 30 peers, load 0.8) — while a newcomer holding none still reclaims any
   idle identity's (the guarantee below); a growing session's memory may come from any. Nothing is reclaimed without pressure (a backstop reaper
   still drops sessions idle for `ServerLimits.idle_timeout`).
3. **Slots are shared fairly.** An open that finds no room waits here — up to
   `ADMIT_WAIT` when an idle session will become reclaimable meanwhile, else only
   `SHORT_WAIT` (a close on its way), so that a requester that could use another peer
   is not held — in a queue ordered by: identities with a proof of work first; then
   the requester holding the fewest sessions here; then the one admitted least
   recently (never admitted: first); then the one that first asked earliest (kept
   across its retries). Only the head of the queue may take a freed slot or reclaim
   one, so an honest newcomer is not overtaken by identities made after it asked.
   A requester at `max_sessions_per_requester` is refused at once.
4. **"Busy" says when.** An open still without room after its wait is refused
   `busy` with `retry_after`: when the first protected session's protection ends, or
   `IDLE_GRACE` if that is later (an answer may end and close a session any moment), plus a grace per `max_sessions`
   requesters ahead of it in the queue.

The guarantee. With every slot held by idle sessions of any number K of hostile
identities that never step them (each admitted at most a grace ago), an honest requester with a proof
of work that opens a session is admitted within a grace of asking: IDLE_GRACE (5 s), in one
open (ADMIT_WAIT, 6 s, outlasts it), at a peer whose sessions get their first step within
2.5 s; at a peer whose sessions lately waited longer for it (the end of a busy route), twice
that wait, at most GRACE_CAP — no more than one step buys any identity (STEP_GRACE), and
hostile identities can lengthen it only by stepping — provided no more than J other
identities with work, never admitted here, asked before it did; each of those can
take a slot ahead of it for one grace, so in general it is admitted within
grace x (1 + ceil(J / max_sessions)). Each such identity costs its maker a
proof of work and is spent once admitted (no second grace without a step). Identities
that step their sessions earn longer protection, STEP_GRACE after a step: they are
users (below), and one that stops stepping gives its slots back within STEP_GRACE. Hostile
sessions that *step* (one token every few seconds) are not idle: they are users,
and the queue's fairness (fewest sessions first) bounds them to their share of the
slots as they end; they are not preempted. Tested in tests/serve/test_admission.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import trio

from tessera.protocol.error_codes import BUSY

from tessera.peer.base.backoff import ROUTE_WAIT

# Seconds an admitted session may go without a step before another requester that needs its
# slot or memory may reclaim it. A requester's steps follow each other within a step's time
# (milliseconds to a second on a CPU); longer pauses come from a repair elsewhere in the chain
# (its wait for a route), and a session reclaimed then is reopened and replayed like any lost
# one. 5 s keeps an honest newcomer's wait short under a full-slot attack.
IDLE_GRACE = 5.0
# Before its first step, a session is protected for GAP_FACTOR times the recent wait for a first
# step here (its requester's, or any requester's: the peer's place in routes, first or deep, sets
# most of it) when that is longer than IDLE_GRACE: its prompt is expected within that wait, and
# twice that covers a slower round. With only its requester's own wait, a requester new to the
# peer had IDLE_GRACE, and at 50 requesters most are new to most peers: the sessions deep in
# their routes were reclaimed waiting for their prompt (bench/load.py, 20 peers, 200 answers,
# load 0.5: ~440 reclaims; p90 37.2 s, 47 failovers; with the peer's wait 31.4 s, 24). At most
# GRACE_CAP: an answer whose prompt takes longer than a route wait (peer/base/backoff.py
# ROUTE_WAIT) has given up on this route anyway, and no longer than a step buys (STEP_GRACE).
GAP_FACTOR = 2.0
GRACE_CAP = ROUTE_WAIT
# The recent wait for a first step is the longest measured, halved for every FIRST_WAIT_HALF_LIFE
# seconds since. Halved at each new first step instead, as it was, a busy peer (several opens a
# second) forgot a 10 s wait within a second: the next sessions deep in routes had IDLE_GRACE and
# were reclaimed waiting for their prompt (bench/load.py, 50 requesters at load 0.8, seed 1: 1,212
# sessions reclaimed before their first step, p90 50.8 s, 9.45 sessions an answer; halved every
# 10 s: 497, 42.7 s, 8.67). 10 s: a few turns of a busy peer's queue, a third of a route wait.
FIRST_WAIT_HALF_LIFE = 10.0
# A session that has stepped is protected this long after its last step (rule 2 above): as long
# as its requester waits for a route before it gives an answer up, since a step of a running
# answer may wait that long in other peers' queues; a requester that stops stepping gives the
# slot back within it.
STEP_GRACE = ROUTE_WAIT
# Seconds an open waits here for room before it is refused busy, when an idle session will become
# reclaimable meanwhile: longer than IDLE_GRACE, so that a newcomer at the head of the queue is
# admitted in the same open when the slots are held idle; within the server's bound on an open
# (peer/serve/limits.py ACCEPT_TIMEOUT, itself within the requester's). A refusal here sends its
# requester to route again, and the hops it had opened are closed unused; a longer wait turns more
# of them into an admission (bench/load.py, 50 requesters at load 0.8, seed 1: 6 s gave p90 41.5 s
# and 8.26 sessions an answer, 10 s 43.0 s and 7.50, 12 s 44.1 s and 7.36; at load 0.5, 6 s 23.4 s
# and 5.05, 10 s 22.7 s and 4.53; 2 requesters, who rarely meet a full peer, alike either way).
ADMIT_WAIT = 10.0
# Seconds it waits when every session is in use (a step in flight, or one within IDLE_HINT): enough
# for a close already on its way (a requester's answer just ended, its next one is asking), short
# enough that a requester that could go to another peer loses little by asking here first.
SHORT_WAIT = 0.5
# A session without a step for this long, and none in flight, counts as idle for the choice above.
IDLE_HINT = 0.5
# The least retry_after a refusal names: a requester does not come back sooner than this.
RETRY_MIN = 1.0
# Opens waiting at once. Each holds a stream whose first frame was read (at most
# OPEN_FRAME_LIMIT), so this bounds their memory; when it is full, a better-placed newcomer
# takes the place of the worst-placed waiter.
MAX_WAITING = 64
# Identities remembered (their grace, when they were admitted, since when they ask). Those
# with sessions or waiting are always kept; the least recently seen others are forgotten.
IDENTITY_MEMORY = 4096
# Graces a requester with a proof of work may hold in hand: each open that finds one gets a grace
# of its own (until its first step) and spends it; a new identity has one, and each step of the
# requester's that arrives here earns one more, up to this many. One requester runs several
# answers at once, and a route's sessions wait for their prompt behind the hops before them, so
# several of its sessions here are often unstepped at once: with one grace per step (none banked),
# every open after the first (another answer, a re-route after a refusal, a repair's replacement)
# had none and was reclaimable the instant it was admitted — the simulator's 50 requesters at
# load 0.5 (bench/load.py, 1,000 answers) lost ~40,000 sessions that way, most under 0.5 s old,
# one answer's replacements 148 times in a minute (each requester's repair reclaiming another's
# replacement before its replay). The guarantee holds: a session is protected at most its own
# grace after its admission unless it steps, and an identity that never steps has one grace.
# 8: a requester's own limit of sessions at one peer (peer/serve/limits.py).
GRACES_IN_HAND = 8
# Streams that have not been admitted yet (a session stream before its SessionAccept, a link
# stream before its session is found) are bounded with every other protocol's: peer/net/intake.py.


def _recent(wait: float, at: float, now: float) -> float:
    """A wait for a first step measured at `at`, as it counts at `now` (FIRST_WAIT_HALF_LIFE)."""
    return wait * 0.5 ** (max(0.0, now - at) / FIRST_WAIT_HALF_LIFE)


class Refused(Exception):
    """An open or a step refused with an ErrorMsg code (and, for busy, when to retry)."""

    def __init__(self, code: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


class Admitted(Protocol):
    """What admission reads of a served session (peer/serve/session.py `ServedSession`)."""

    requester: str
    kv_bytes: int
    last_active: float
    stepped: bool
    inflight: int
    closed: bool
    grace_until: float  # before its first step, it is protected until then (admission sets it)


class Host(Protocol):
    """What admission needs of the server it admits for."""

    sessions: dict

    def kv_in_use(self) -> int: ...

    def reclaim(self, session: Admitted) -> None:
        """Drop `session` now to make room (its requester is told `reclaimed`)."""
        ...


@dataclass
class Requester:
    """What a peer remembers of one requester identity."""

    peer_id: str
    sessions: int = 0  # open here now
    work: bool = False  # showed a valid proof of work
    last_admitted: float = -math.inf
    waiting_since: float | None = None  # first asked and not admitted since (kept across retries)
    graces: int = 1  # graces in hand (GRACES_IN_HAND): an open spends one, a step arriving here earns one
    returns: int = 0  # graces an unstepped close may give back (GRACES_IN_HAND): a step arriving here earns one
    left_over: float = 0.0  # seconds left of a grace given back without a return in hand (its next open's grace)
    first_wait: float = 0.0  # how long its sessions here lately waited for their first step
    first_wait_at: float = 0.0  # when that was measured (it halves every FIRST_WAIT_HALF_LIFE since)


@dataclass(eq=False)
class _Waiter:
    requester: Requester
    need: int  # KV bytes its admission charges
    bumped: bool = False  # pushed out of a full queue by a better-placed waiter


@dataclass(frozen=True)
class Limits:
    max_sessions: int
    max_sessions_per_requester: int
    kv_budget: int
    idle_grace: float = IDLE_GRACE
    admit_wait: float = ADMIT_WAIT


class Admission:
    """The waiting room and the reclaim policy of one stage server (see module docstring)."""

    def __init__(self, host: Host, limits: Limits, *, clock: Callable[[], float] = trio.current_time) -> None:
        self.host = host
        self.limits = limits
        self.clock = clock
        self.requesters: OrderedDict[str, Requester] = OrderedDict()
        self.waiting: list[_Waiter] = []
        self.reclaimed = 0  # sessions reclaimed under pressure
        self.first_wait = 0.0  # how long sessions here lately waited for their first step, any requester's (GAP_FACTOR)
        self.first_wait_at = 0.0  # when that was measured
        self._changed = trio.Event()

    # -- identities ---------------------------------------------------------------------

    def requester(self, peer_id: str) -> Requester:
        """The record of `peer_id` (made if new), now the most recently seen."""
        record = self.requesters.get(peer_id)
        if record is None:
            record = self.requesters[peer_id] = Requester(peer_id)
            self._forget_old()
        self.requesters.move_to_end(peer_id)
        return record

    def _forget_old(self) -> None:
        waiting = {w.requester.peer_id for w in self.waiting}
        excess = len(self.requesters) - IDENTITY_MEMORY
        for peer_id in [p for p, r in self.requesters.items() if not r.sessions and p not in waiting][:max(0, excess)]:
            del self.requesters[peer_id]

    # -- protection ---------------------------------------------------------------------

    def protected_until(self, session: Admitted) -> float:
        """When `session` stops being protected from reclaim (inf while a step of it is in flight)."""
        if session.inflight:
            return math.inf
        if session.stepped:
            return session.last_active + STEP_GRACE
        return session.grace_until

    def reclaimable(self, now: float, *, spare: Admitted | None = None, asker: str | None = None,
                    share: bool = False) -> list[Admitted]:
        """Sessions that may be reclaimed now, the one idle longest first (never `spare`, nor a
        session of `asker`: a requester's new session does not end one of its own, which may be
        an answer waiting for a repair elsewhere). With `share` (a new session's slot), only those
        of identities holding more sessions here than `asker` does (rule 2's fair share)."""
        held: dict[str, int] = {}
        if share:
            for s in self.host.sessions.values():
                if not s.closed:
                    held[s.requester] = held.get(s.requester, 0) + 1
        mine = held.get(asker, 0) if asker is not None else 0
        found = [s for s in self.host.sessions.values()
                 if s is not spare and s.requester != asker and not s.closed and self.protected_until(s) <= now
                 and (not share or held[s.requester] > mine)]
        return sorted(found, key=lambda s: s.last_active)

    def held(self, now: float) -> int:
        """Sessions a newcomer could not take the room of now: a step in flight, or protected by
        their idle grace. What a peer advertises as its load (peer/serve/load.py): a session
        held idle past its grace is room, since the open that needs it reclaims it, so idle
        sessions never make a peer look busy (four identities holding eight idle sessions each
        once made a peer advertise load 1.00 and routing passed it by, for good)."""
        return sum(1 for s in self.host.sessions.values() if not s.closed and self.protected_until(s) > now)

    def opened(self, session: Admitted) -> None:
        """`session` was admitted: count it, and give it a grace if its requester has one in hand."""
        record = self.requester(session.requester)
        now = self.clock()
        record.sessions += 1
        record.last_admitted = now
        record.waiting_since = None
        if record.graces > 0 and record.work:
            recent = max(_recent(record.first_wait, record.first_wait_at, now),
                         _recent(self.first_wait, self.first_wait_at, now))
            grace = max(self.limits.idle_grace, min(GAP_FACTOR * recent, GRACE_CAP))
            session.grace_until = now + grace
            record.graces -= 1
        elif record.left_over > 0 and record.work:
            session.grace_until = now + record.left_over
        record.left_over = 0.0
        session.last_active = now

    def stepped(self, session: Admitted) -> None:
        """A step of `session` arrived or ended: it is in use. Its first step's wait since the
        open is kept by its requester and by the peer (each the longest lately: what was kept
        halves every FIRST_WAIT_HALF_LIFE, so that it follows the queues as they are now)."""
        now = self.clock()
        record = self.requesters.get(session.requester)
        if session.inflight == 1 and not session.stepped and record is not None:  # its first step arrived
            waited = max(0.0, now - session.last_active)
            record.first_wait = max(waited, _recent(record.first_wait, record.first_wait_at, now))
            self.first_wait = max(waited, _recent(self.first_wait, self.first_wait_at, now))
            record.first_wait_at = self.first_wait_at = now
        session.last_active = now
        if not session.stepped:
            session.stepped = True
        if record is not None and session.inflight:  # a step arrived (not one that ended)
            record.graces = min(GRACES_IN_HAND, record.graces + 1)
            record.returns = min(GRACES_IN_HAND, record.returns + 1)

    def closed(self, session: Admitted) -> None:
        """`session` is gone. One its requester closed before its first step, while its grace
        held (it was not reclaimed), gives its grace back, if the requester holds a return: an
        open closed unused (a route re-chosen after an accept said a longer queue than priced,
        a repair's replacement abandoned) used no one's room for long, and without the return
        a requester that re-routes a few times had no grace left for the open it kept (its
        session reclaimed the instant it was admitted). Returns are earned like graces, one a
        step arriving here, so an identity that never steps gets none back: opening and
        closing at once holds no slot longer than one grace, as before."""
        record = self.requesters.get(session.requester)
        if record is not None and record.sessions > 0:
            record.sessions -= 1
        now = self.clock()
        if record is not None and not session.stepped and session.grace_until > now:
            if record.returns > 0:
                record.returns -= 1
                record.graces = min(GRACES_IN_HAND, record.graces + 1)
            else:
                record.left_over = max(record.left_over, session.grace_until - now)
        self._notify()

    # -- room -----------------------------------------------------------------------------

    def _fits(self, need: int, freed: Iterable[Admitted] = ()) -> bool:
        freed = list(freed)
        sessions = len(self.host.sessions) - len(freed)
        kv = self.host.kv_in_use() - sum(s.kv_bytes for s in freed)
        return sessions < self.limits.max_sessions and kv + need <= self.limits.kv_budget

    def make_room(self, need: int, *, now: float, slot: bool = True, spare: Admitted | None = None,
                  asker: str | None = None) -> bool:
        """Room for a new session (`slot`) or for `need` more bytes of KV (a growing session,
        `spare`, which is never reclaimed): free already, or made by reclaiming idle sessions,
        the one idle longest first. Returns False, reclaiming nothing, if even that is not enough."""
        def fits(freed: list[Admitted]) -> bool:
            if slot:
                return self._fits(need, freed)
            return self.host.kv_in_use() - sum(s.kv_bytes for s in freed) + need <= self.limits.kv_budget

        victims: list[Admitted] = []
        if fits(victims):
            return True
        for session in self.reclaimable(now, spare=spare, asker=asker, share=slot):
            victims.append(session)
            if fits(victims):
                for victim in victims:
                    self.reclaimed += 1
                    self.host.reclaim(victim)
                return True
        return False

    def idle_release(self, now: float, *, asker: str | None = None) -> float:
        """When the first *idle* session (no step in flight, none for IDLE_HINT) not of `asker`
        becomes reclaimable (inf: no such session is idle)."""
        idle = [self.protected_until(s) for s in self.host.sessions.values()
                if not s.closed and not s.inflight and s.requester != asker and now - s.last_active >= IDLE_HINT]
        return min(idle, default=math.inf)

    def next_release(self, now: float) -> float:
        """When the next protected session stops being protected (inf: none will, on its own)."""
        ends = [self.protected_until(s) for s in self.host.sessions.values() if not s.closed]
        later = [t for t in ends if t > now]
        return min(later, default=math.inf)

    def retry_after(self, record: Requester, now: float) -> float:
        """What a refusal tells `record`: when room may come, plus a grace per full round of
        requesters ahead of it."""
        release = self.next_release(now)
        # at most a grace: a session that stepped is protected a route wait (STEP_GRACE), but an
        # answer may end and close its session any moment, which no protection tells
        wait = min(self.limits.idle_grace, release - now)
        ahead = sum(1 for w in self.waiting if self._order(w.requester) < self._order(record))
        wait += (ahead // max(self.limits.max_sessions, 1)) * self.limits.idle_grace
        return round(max(RETRY_MIN, wait), 3)

    # -- the queue ------------------------------------------------------------------------

    def _order(self, record: Requester) -> tuple:
        since = record.waiting_since if record.waiting_since is not None else math.inf
        return (not record.work, record.sessions, record.last_admitted, since, record.peer_id)

    def _eligible(self, record: Requester) -> bool:
        return record.sessions < self.limits.max_sessions_per_requester

    def _head(self) -> _Waiter | None:
        eligible = [w for w in self.waiting if self._eligible(w.requester)]
        return min(eligible, key=lambda w: self._order(w.requester), default=None)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for_room(self, requester: str, need: int, *, work: bool) -> None:
        """Return when a new session of `requester` charging `need` KV bytes may be admitted
        (room was free, or was made by reclaiming idle sessions); the caller admits it before
        its next checkpoint. Raises Refused(BUSY, retry_after=...): at once for a requester at
        its own limit, after ADMIT_WAIT when an idle session becomes reclaimable within it,
        else after SHORT_WAIT."""
        record = self.requester(requester)
        record.work = record.work or work
        now = arrival = self.clock()
        if not self._eligible(record):
            raise self._busy(record, f"this requester has {record.sessions} sessions here, the limit is "
                                     f"{self.limits.max_sessions_per_requester}")
        if record.waiting_since is None:
            record.waiting_since = now
        waiter = _Waiter(record, need)
        if len(self.waiting) >= MAX_WAITING:
            worst = max([*self.waiting, waiter], key=lambda w: self._order(w.requester))
            if worst is waiter:
                raise self._busy(record, f"{len(self.waiting)} opens are waiting here already")
            worst.bumped = True
            self.waiting.remove(worst)
            self._notify()
        self.waiting.append(waiter)
        long = False  # whether an idle session will be reclaimable within ADMIT_WAIT
        try:
            while not waiter.bumped:
                now = self.clock()
                wake = math.inf
                if self._head() is waiter:
                    if self.make_room(need, now=now, asker=requester):
                        return
                    wake = self.next_release(now)
                long = long or self.idle_release(now, asker=requester) <= arrival + self.limits.admit_wait  # kept
                until = arrival + (self.limits.admit_wait if long else SHORT_WAIT)
                if now >= until:
                    break
                changed = self._changed
                with trio.move_on_at(min(wake, until, now + IDLE_HINT if not long else math.inf)):
                    await changed.wait()
        finally:
            if waiter in self.waiting:
                self.waiting.remove(waiter)
            self._notify()  # the next waiter may be the head now
        mine = record.sessions >= self.limits.max_sessions_per_requester
        why = (f"this requester has {record.sessions} sessions here, the limit is "
               f"{self.limits.max_sessions_per_requester}" if mine else
               f"{len(self.host.sessions)} sessions open (the limit is {self.limits.max_sessions}) and "
               f"no idle one to reclaim within {self.limits.admit_wait:g} s")
        raise self._busy(record, why)

    def _busy(self, record: Requester, why: str) -> Refused:
        return Refused(BUSY, why, retry_after=self.retry_after(record, self.clock()))


__all__ = ["Admission", "Limits", "Refused", "Requester", "IDLE_GRACE", "ADMIT_WAIT"]
