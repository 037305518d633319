"""Steps of different sessions that reach a peer together run as one batch.

A peer serving eight requesters would otherwise make eight passes over its weights
per token, one session at a time; a decode step reads every weight to multiply one
row. `StepBatcher` sits between the server's sessions and the compute: each
session's worker `submit`s its step and waits; whoever finds the compute free
collects what is queued (in arrival order, up to the row budget), runs them as ONE call of `run` (the server's: one stacked
forward in a worker thread, `Stage.forward_batch`), and hands every member its own
outcome — its output or its own error, so a bad step fails only its session.

When to dispatch (the budget, `BatchBudget`):

- Never wait for company that is not expected: a lone session, or one whose
  companions of the last batch are all here already, runs at once. Steps that
  arrive while a batch computes simply queue and form the next one; that alone
  keeps sessions that step at the same rate together.
- When members of the last batch are still missing (their requesters are
  sampling, or their bytes are on the wire), wait for them at most `max_wait`,
  then go with what is here. A late session costs the others at most that.
- At most `max_rows` rows a batch, taken in the order `order` gives (a stable sort of the
  queue: the server's is its fair queue's, by each requester's share of the compute,
  peer/serve/load.py, so one requester's many sessions cannot fill every batch while
  others wait). A decode is one row, a speculative block a few,
  a prompt many: steps join while their rows fit, and a prompt longer than the
  budget runs alone. Mixing short prefills with decodes costs the decoders
  nothing they would not pay anyway (the compute is serial: they would wait for
  that prefill), and the prefill shares their weight pass; a long prompt alone
  keeps a batch's time, and so every member's latency, bounded.

A batch belongs to all its members: once it runs it finishes (shielded), even if
the session that started it is cancelled meanwhile; its result is then dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generic, Hashable, Sequence, TypeVar

import trio

# Rows of one stacked forward. On a CPU a decode step is bound by reading the weights;
# stacked rows share that read until the matmuls turn compute-bound, at a few dozen
# rows (measured with SmolLM2-135M, one thread: 8 one-row decodes stacked ran 4.2x
# the tokens/s of one). 32 rows keep that gain and bound a batch's time to about
# that of a 32-token prefill; a longer prompt runs alone.
MAX_BATCH_ROWS = 32
# How long a batch waits for members of the previous batch that have not arrived yet.
# A one-row decode of a small model takes ~10-30 ms on a CPU; 2 ms (a loopback round
# trip plus a requester's sampling is well under that) lets stragglers catch up while
# costing a batch at most ~10% of its step time. Set it to 0 to never wait.
MAX_BATCH_WAIT = 0.002

Job = TypeVar("Job")
Outcome = TypeVar("Outcome")


class BatchInterrupted(Exception):
    """The batch a step was in failed as a whole (not because of that step)."""


@dataclass(frozen=True)
class BatchBudget:
    """How big a batch may grow (rows) and how long it may wait for expected company (seconds)."""

    max_rows: int = MAX_BATCH_ROWS
    max_wait: float = MAX_BATCH_WAIT

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows!r}")
        if not 0 <= self.max_wait <= 1:
            raise ValueError(f"max_wait must lie in [0, 1] seconds, got {self.max_wait!r}")


@dataclass(eq=False)
class _Slot(Generic[Job, Outcome]):
    key: Hashable
    job: Job
    rows: int
    outcome: Outcome | BaseException | None = None
    done: bool = False


@dataclass
class BatchStats:
    batches: int = 0
    steps: int = 0
    largest: int = 0


class StepBatcher(Generic[Job, Outcome]):
    """Collects steps of different sessions (by key) and runs them in batches through `run`.

    `run(jobs)` computes a batch and returns one outcome per job, in order: a value, or
    the exception that job raised (returned, not raised). If `run` itself raises, the task
    that dispatched the batch gets the error, and every member of the batch BatchInterrupted.
    """

    def __init__(
        self, run: Callable[[list[Job]], Awaitable[Sequence[Outcome | BaseException]]], budget: BatchBudget,
        *, order: Callable[[Job], Any] | None = None, taken: Callable[[Job], None] | None = None,
    ) -> None:
        """`order(job)`: the key the queue is sorted by (stably) before a batch is taken (None:
        arrival order); `taken(job)`: told of every job a batch takes, as it is taken."""
        self.run = run
        self.budget = budget
        self.order = order
        self.taken = taken
        self.pending: list[_Slot[Job, Outcome]] = []
        self.busy = False  # a batch is being collected or computed
        self.regulars: set[Hashable] = set()  # who was in the last batch: the company to expect
        self.stats = BatchStats()
        self._arrived = trio.Event()  # a step was queued
        self._finished = trio.Event()  # a batch ended (outcomes handed out, compute free)

    async def submit(self, key: Hashable, job: Job, rows: int) -> Outcome:
        """Run `job` (of `rows` rows, for the session `key`) in the next batch that takes it;
        return its outcome or raise its error. One step per key at a time."""
        slot: _Slot[Job, Outcome] = _Slot(key, job, rows)
        self.pending.append(slot)
        self._arrived.set()
        try:
            while not slot.done:
                if self.busy:
                    await self._finished.wait()
                else:
                    await self._dispatch()
        finally:
            if not slot.done and slot in self.pending:
                self.pending.remove(slot)  # cancelled before any batch took it
        if isinstance(slot.outcome, BaseException):
            raise slot.outcome
        return slot.outcome  # type: ignore[return-value]

    def forget(self, key: Hashable) -> None:
        """A session ended: stop expecting it."""
        self.regulars.discard(key)

    async def _dispatch(self) -> None:
        self.busy = True
        try:
            await self._wait_for_company()
            batch = self._take()
            with trio.CancelScope(shield=True):  # the batch is every member's, not only ours
                try:
                    outcomes = await self.run([slot.job for slot in batch])
                except Exception as bad:
                    for slot in batch:
                        slot.outcome, slot.done = BatchInterrupted(f"the batch failed: {bad!r}"), True
                    raise
            assert len(outcomes) == len(batch), f"run returned {len(outcomes)} outcomes for {len(batch)} jobs"
            for slot, outcome in zip(batch, outcomes):
                slot.outcome, slot.done = outcome, True
        finally:
            self.busy = False
            self._finished.set()
            self._finished = trio.Event()

    async def _wait_for_company(self) -> None:
        """Wait (at most max_wait) while members of the last batch are missing and rows are left."""
        if self.budget.max_wait <= 0 or not self._expecting():
            return  # a lone session, or its company all here: no deadline to set up
        with trio.move_on_after(self.budget.max_wait):
            while self._expecting():
                self._arrived = trio.Event()
                await self._arrived.wait()

    def _expecting(self) -> bool:
        if sum(slot.rows for slot in self.pending) >= self.budget.max_rows:
            return False
        return not self.regulars <= {slot.key for slot in self.pending}

    def _take(self) -> list[_Slot[Job, Outcome]]:
        """The queued steps in `order` (stable: arrival order among equals) while their rows fit
        (the first always: a step bigger than the budget runs alone). Whoever dispatches goes on
        until its own step ran."""
        queue = self.pending if self.order is None else sorted(self.pending, key=lambda slot: self.order(slot.job))
        batch, rows = [queue[0]], queue[0].rows
        for slot in queue[1:]:
            if rows + slot.rows <= self.budget.max_rows:
                batch.append(slot)
                rows += slot.rows
        taken = set(map(id, batch))
        self.pending = [slot for slot in self.pending if id(slot) not in taken]
        self.regulars = {slot.key for slot in batch}
        if self.taken is not None:
            for slot in batch:
                self.taken(slot.job)
        self.stats.batches += 1
        self.stats.steps += len(batch)
        self.stats.largest = max(self.stats.largest, len(batch))
        return batch
