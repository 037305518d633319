"""Who computes next at a busy peer, how long a step will wait, and the load a peer reports.

Steps of many sessions wait for one compute (a stage runs one step, or one batch, at a
time). This module holds that queue and answers the questions a requester asks of it.

Fair among requesters, in compute. Served in arrival order, a requester holding eight sessions
here gets eight turns for every turn of a requester holding one, and one that opened every slot it
could starves the rest. Served in turns (one step of each identity in its turn, as this queue did
before), a requester sending 60-token prompts gets sixty times the compute of one sending
one-token decode steps, and each decode step of an answer waits behind a prompt of every other
requester waiting: with 50 requesters at a shared peer that is most of the latency of an answer.
So the queue shares the compute itself, by start-time fair queueing (Goyal, Vin and Cheng,
SIGCOMM 1996): a step of `units` token-layers arriving is tagged start = max(V, its requester's
last finish tag), finish = start + units, where the virtual time V is the start tag of the step
that started last (when the compute goes idle, the largest finish tag run: every share is even
again); the waiting step with the smallest finish tag gets the compute
(`ComputeQueue.key`; arrival order breaks ties). So every identity with steps waiting gets an
equal share of the compute seconds, whatever number of sessions it holds and whatever the size of
its steps (identities cost a proof of work: peer/serve/admission.py); a requester idle for a while
is not owed what it did not use (its tags start at V); among requesters, a short step (a decode
step, one token) goes before a long one queued earlier (a prompt) when its share allows. One
requester's own steps keep their arrival order. Measured with bench/load.py (100 peers, 1,000
answers, seed 1, no churn; p90, sessions an answer): 50 requesters at load 0.5 30.0 s, 5.69 in
turns and 23.8 s, 4.61 by compute; 2 requesters 19.3 s, 4.94 and 18.5 s, 4.85. A batch
(peer/serve/batcher.py) takes its steps in the same order when they do not all fit.

Where a step is in the queue. A step that must wait at least NOTICE_WAIT is told to its
requester (`QueueNotice`: steps ahead, seconds), and so is the moment it starts (when the
queue grants its turn — also when a step waited that long without a notice, the queue having
looked shorter; a batched step is told only its wait), so that a requester counts a
step's deadline from its start: queueing behind other requesters is not this peer failing
(peer/request/chain.py `RouteSession.wait`).

The wait. A step's compute costs its token-layers (tokens x layers of the span) at the speed
this peer measured on its last steps (`seconds_per_unit`, a moving average; before any step,
none: a wait of 0 is said). A step arriving now waits for what is running to end, then for the
steps whose finish tags are below the one it would be given: of every other requester waiting, as
much as its own step's size (its fair share), and all its own requester's steps queued before it.
A report prices a step of the size steps here have had lately (`typical_units`). What a peer
reports (`expected_wait`) is the larger of that and how long its recent steps did wait
(`recent_wait`, a moving average of each step's time from arrival to start): a peer whose
sessions step in turn is busy even at the instant its queue happens to be empty; plus the
first steps of the sessions it admitted that have not sent one yet (`expected_wait(pending=...)`:
each a prompt of the size first steps here have had, `first_units`): a burst of opens is work
on its way even before its prompts arrive, and a requester asking in that moment must hear of it.

What a peer reports (`LoadReport`, in an answer to a ping, a session open or a refusal):
the sessions a newcomer could not take the room of (admission.py `Admission.held`: an idle
session past its grace is room, not load), the slots, the opens waiting, the steps waiting
and the wait of a step arriving now. A record carries `load` = held / slots, re-signed when it
crosses a band (peer/net/gossip.py `material`).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import trio

# A step that will wait less than this is not told it is queued: a requester's step deadline
# has a floor of 5 s (peer/request/chain.py STEP_TIMEOUT_FLOOR), so waits under a second at
# each of a route's few hops cannot make it fire, and a notice on every step of a busy peer's
# sessions would double the frames it sends.
NOTICE_WAIT = 1.0
# Weight of a new step's measured speed in the moving average: a peer's speed moves with its
# batch size and its machine's other load, and the last few steps say the most about the next.
SPEED_SMOOTHING = 0.2


@dataclass(eq=False)
class _Waiter:
    requester: str
    units: float  # token-layers of compute
    arrival: int
    entered: float  # when it was queued
    start_tag: float = 0.0  # virtual time its requester's share reaches it (fair queueing)
    finish_tag: float = 0.0  # start_tag + units: the queue serves the smallest first
    granted: trio.Event = field(default_factory=trio.Event)


class ComputeQueue:
    """The steps waiting for this peer's compute, served fairly among requesters (module docstring)."""

    def __init__(self, *, clock: Callable[[], float] = trio.current_time) -> None:
        self.clock = clock
        self.waiting: list[_Waiter] = []
        self.running: _Waiter | None = None  # holding the compute (the exclusive path)
        self.running_since = 0.0
        self.running_units = 0.0  # of every step computing now (a batch's too)
        self.steps_running = 0
        self.seconds_per_unit: float | None = None
        self.recent_wait = 0.0  # seconds its steps waited to start, a moving average
        self.first_units: float | None = None  # token-layers of a session's first step (its prompt), a moving average
        self.typical_units = 0.0  # token-layers of a step (or batch) here, a moving average
        self._arrivals = 0
        self.virtual = 0.0  # the start tag of the step that started last (or, idle, the largest finish tag run)
        self._finish: dict[str, float] = {}  # requester -> the finish tag of its last step queued

    # -- the order --------------------------------------------------------------------------

    @staticmethod
    def key(waiter: _Waiter) -> tuple[float, int]:
        """Where `waiter` sorts among the waiting (a batch takes its steps in this order too)."""
        return waiter.finish_tag, waiter.arrival

    def ordered(self) -> list[_Waiter]:
        """The waiting steps in the order they will get the compute."""
        return sorted(self.waiting, key=self.key)

    def tags(self, requester: str | None, units: float) -> tuple[float, float]:
        """(start, finish) tags a step of `requester` of `units` would be given now."""
        start = max(self.virtual, self._finish.get(requester, 0.0)) if requester is not None else self.virtual
        return start, start + units

    def next_arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals

    # -- the wait ---------------------------------------------------------------------------

    def measured(self, units: float, seconds: float) -> None:
        """A step (or batch) of `units` token-layers took `seconds`: update the speed."""
        if units <= 0 or not seconds >= 0:
            return
        sample = seconds / units
        typical = self.typical_units
        self.typical_units = units if not typical else (1 - SPEED_SMOOTHING) * typical + SPEED_SMOOTHING * units
        old = self.seconds_per_unit
        self.seconds_per_unit = sample if old is None else (1 - SPEED_SMOOTHING) * old + SPEED_SMOOTHING * sample

    def _remaining_running(self, now: float) -> float:
        if self.seconds_per_unit is None or self.steps_running == 0:
            return 0.0
        return max(0.0, self.running_units * self.seconds_per_unit - (now - self.running_since))

    def wait_for(self, requester: str | None, units: float | None = None, *,
                 before: _Waiter | None = None) -> tuple[int, float]:
        """(steps ahead, seconds) a step of `requester` waits: for what runs now, then for the
        steps served before it — those whose finish tag is below the one a step of `units` (None:
        a typical step here) would get now, or (`before`: a step already queued) those ahead of it."""
        now = self.clock()
        order = self.ordered()
        if before is not None:
            ahead = order[: order.index(before)] if before in order else order
        else:
            _, finish = self.tags(requester, self.typical_units if units is None else units)
            ahead = [w for w in order if w.finish_tag <= finish]
        speed = self.seconds_per_unit or 0.0
        return len(ahead) + self.steps_running, self._remaining_running(now) + speed * sum(w.units for w in ahead)

    def first_step(self, units: float) -> None:
        """A session's first step (its prompt) was `units` token-layers."""
        old = self.first_units
        self.first_units = units if old is None else (1 - SPEED_SMOOTHING) * old + SPEED_SMOOTHING * units

    def expected_wait(self, *, pending: int = 0) -> float:
        """What a step of a requester with nothing queued here can expect to wait now (what a
        load report says): the queue as it stands plus the first steps of `pending` sessions
        admitted that have sent none yet, or the queue as it has recently been, whichever is longer."""
        coming = pending * (self.first_units or 0.0) * (self.seconds_per_unit or 0.0)
        return max(self.wait_for(None)[1] + coming, self.recent_wait)

    def steps_waiting(self) -> int:
        return len(self.waiting) + self.steps_running

    # -- a turn -----------------------------------------------------------------------------

    def enter(self, requester: str, units: float) -> _Waiter:
        """Queue a step (`turn` does it; the batching path calls it to be counted)."""
        start, finish = self.tags(requester, units)
        waiter = _Waiter(requester, units, self.next_arrival(), self.clock(), start, finish)
        self._finish[requester] = finish
        self.waiting.append(waiter)
        return waiter

    def start(self, waiter: _Waiter) -> None:
        """`waiter`'s compute starts now (alone, or in a batch)."""
        if waiter in self.waiting:
            self.waiting.remove(waiter)
        now = self.clock()
        self.recent_wait = (1 - SPEED_SMOOTHING) * self.recent_wait + SPEED_SMOOTHING * max(0.0, now - waiter.entered)
        if self.steps_running == 0:
            self.running_since = self.clock()
            self.running_units = 0.0
        self.steps_running += 1
        self.running_units += waiter.units
        self.virtual = max(self.virtual, waiter.start_tag)
        if len(self._finish) > 4 * max(len(self.waiting), 64):
            # a requester whose last finish tag V has passed is tagged from V anyway: forget it
            self._finish = {r: f for r, f in self._finish.items() if f > self.virtual}

    def finish(self, waiter: _Waiter) -> None:
        self.steps_running = max(0, self.steps_running - 1)
        if self.steps_running == 0:
            self.running_units = 0.0
            if not self.waiting:
                # the compute goes idle: every share is even again (a requester is not charged,
                # after a pause, for what it ran while nobody else was waiting). Each requester's
                # last finish tag is now that of a step that ran, so V moves to the largest of them
                # and none is owed anything more.
                self.virtual = max([self.virtual, *self._finish.values()])  # none left: V stands
                self._finish.clear()

    def leave(self, waiter: _Waiter) -> None:
        """A queued step that never started (cancelled)."""
        if waiter in self.waiting:
            self.waiting.remove(waiter)
            if self._finish.get(waiter.requester) == waiter.finish_tag:  # its requester's last: not charged
                self._finish[waiter.requester] = waiter.start_tag

    def _grant_next(self) -> None:
        if self.running is None and self.waiting:
            head = self.ordered()[0]
            self.running = head
            head.granted.set()

    @asynccontextmanager
    async def turn(self, requester: str, units: float, *,
                   queued: Callable[[int, float], Awaitable[None]] | None = None) -> AsyncIterator[_Waiter]:
        """Hold the compute for one step of `requester` (`units` token-layers), when the fair
        order says; `queued(ahead, wait)` is called first if it must wait at least NOTICE_WAIT."""
        waiter = self.enter(requester, units)
        if self.running is None and self.ordered()[0] is waiter:
            self.running = waiter
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            try:
                if queued is not None:
                    ahead, wait = self.wait_for(requester, before=waiter)
                    if wait >= NOTICE_WAIT:
                        await queued(ahead, wait)
                await waiter.granted.wait()
            except BaseException:
                self.leave(waiter)
                if self.running is waiter:  # granted as it was cancelled: pass the turn on
                    self.running = None
                    self._grant_next()
                raise
        self.start(waiter)
        try:
            yield waiter
        finally:
            self.finish(waiter)
            self.running = None
            self._grant_next()


__all__ = ["ComputeQueue", "NOTICE_WAIT"]
