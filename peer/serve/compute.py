"""How a step gets this peer's compute, and what its requester is told while it waits.

A stage runs one step, or one batch, at a time. A step that arrives takes one of three ways
to it (`StepCompute.run`):

- batched: steps of different sessions waiting together run as one stacked forward
  (peer/serve/batcher.py), taken in the fair queue's order when they do not all fit;
- alone, after its turn in the fair queue (peer/serve/load.py `ComputeQueue`: every requester
  identity with steps waiting gets an equal share of the compute's seconds);
- at once, when the compute is not taken in turns (a tensor-shard rank: its group's leader
  already ordered the steps, peer/serve/shard_server.py).

A step that must wait at least NOTICE_WAIT is told to its requester (`QueueNotice`), and so is
the moment it starts when it waited, so that the requester counts its deadline from the start
(peer/request/chain.py). Every step's measured time feeds the queue's speed, from which the
wait a peer reports is estimated.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Protocol

from tessera.protocol.messages import Forward, QueueNotice
from tessera.stages.engine.stage import Stage

from tessera.peer.serve.batcher import BatchBudget, StepBatcher
from tessera.peer.serve.load import NOTICE_WAIT, ComputeQueue
from tessera.peer.serve.session import ComputeContext, ServedSession, compute_batch

# A step's outcome: the frames to send, the seconds its compute took, and how many steps ran with it.
Outcome = tuple[list[object], float, int]


class ComputeHost(ComputeContext, Protocol):
    """What the compute needs of the server (a `StageServer` is one): a session's context, and how
    a step's compute is run (a worker thread; a simulation's cost model on trio's MockClock)."""

    run_compute: Callable[[Callable[[], object]], Awaitable[object]]


class StepCompute:
    """The ways a step of `server` gets the compute (module docstring). `notice` tells a session's
    requester where its step is (False: it could not be told); the compute itself runs through
    `server.run_compute` (a worker thread, or a simulation's cost model: read at each step, so
    that it may be swapped after the server is built)."""

    def __init__(self, server: ComputeHost, *, budget: BatchBudget, exclusive: bool,
                 notice: Callable[[ServedSession, QueueNotice], Awaitable[bool]]) -> None:
        self.server = server
        self.budget = budget
        self.exclusive = exclusive
        self.notice = notice
        # The steps waiting for the compute, served fairly among requesters; it says where a step
        # is and how long it will wait (peer/serve/load.py).
        self.queue = ComputeQueue()
        self.queued: dict[tuple[bytes, int], object] = {}  # a batched step's place in `queue`
        self.batcher = StepBatcher(self._run_batch, budget, order=self._batch_order, taken=self._batch_taken)

    @property
    def batching(self) -> bool:
        """Whether steps of different sessions run stacked: a budget over one row, and a stage
        that can (a tensor-shard rank or a simulated stage runs each step alone)."""
        return self.budget.max_rows > 1 and isinstance(self.server.stage, Stage)

    async def run(self, session: ServedSession, msg: Forward) -> Outcome:
        """Compute one step of `session`, by whichever way this peer takes (module docstring).
        Raises what the compute raises (WireError, StageError, BatchInterrupted)."""
        units = msg.n_tokens * (session.end - session.start)  # token-layers: what the queue prices
        if session.steps == 0:
            self.queue.first_step(units)
        if self.batching:
            return await self._batched(session, msg, units)
        if not self.exclusive:
            frames, seconds = await self.server.run_compute(lambda: session.compute(self.server, msg))
            return frames, seconds, 1
        told = False

        async def queued(ahead: int, wait: float) -> None:
            nonlocal told
            told = await self.notice(session, QueueNotice(session.session_id, msg.step, False, ahead, wait))

        async with self.queue.turn(session.requester, units, queued=queued) as turn:
            if told or self.queue.clock() - turn.entered >= NOTICE_WAIT:
                # it waited: its deadline counts from now (peer/request/chain.py)
                await self.notice(session, QueueNotice(session.session_id, msg.step, True))
            frames, seconds = await self.server.run_compute(lambda: session.compute(self.server, msg))
        self.queue.measured(units, seconds)
        return frames, seconds, 1

    def forget(self, session_id: bytes) -> None:
        """A session ended: its steps waiting for a batch are dropped."""
        self.batcher.forget(session_id)

    # -- batched ------------------------------------------------------------------------------

    async def _batched(self, session: ServedSession, msg: Forward, units: int) -> Outcome:
        """A step through the batcher, counted in the queue (a batch takes it in the queue's
        order); its requester is told when it must wait (its start is not told: the batch that
        takes it is formed by another task)."""
        key = (session.session_id, msg.step)
        waiter = self.queued[key] = self.queue.enter(session.requester, units)
        try:
            ahead, wait = self.queue.wait_for(session.requester, before=waiter)
            if wait >= NOTICE_WAIT:
                await self.notice(session, QueueNotice(session.session_id, msg.step, False, ahead, wait))
            return await self.batcher.submit(session.session_id, (session, msg), msg.n_tokens)
        finally:
            self.queued.pop(key, None)
            self.queue.finish(waiter) if waiter not in self.queue.waiting else self.queue.leave(waiter)

    def _batch_order(self, job: tuple[ServedSession, Forward]) -> tuple[float, int]:
        waiter = self.queued.get((job[0].session_id, job[1].step))
        return self.queue.key(waiter) if waiter is not None else (0.0, 0)

    def _batch_taken(self, job: tuple[ServedSession, Forward]) -> None:
        waiter = self.queued.get((job[0].session_id, job[1].step))
        if waiter is not None:
            self.queue.start(waiter)

    async def _run_batch(self, jobs: list[tuple[ServedSession, Forward]]) -> list[object]:
        """The batcher's compute: one stacked forward in a worker thread; per job (frames,
        seconds of the batch, batch size) or that job's own error. (One batch at a time: the
        batcher dispatches one.)"""
        outcomes, seconds = await self.server.run_compute(lambda: compute_batch(self.server, jobs))
        self.queue.measured(sum(job[1].n_tokens * (job[0].end - job[0].start) for job in jobs), seconds)
        return [o if isinstance(o, Exception) else (o, seconds, len(jobs)) for o in outcomes]


__all__ = ["StepCompute", "Outcome"]
