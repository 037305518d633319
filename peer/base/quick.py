"""trio primitives that do not yield to the scheduler when they need not wait.

trio's `Lock.acquire`, `Event.wait`, `MemorySendChannel.send` and
`CapacityLimiter.acquire_on_behalf_of` each pass through the scheduler (a checkpoint) even
when the lock is free, the event set, the buffer has room or a token is left: the task is put back on the run queue and resumed in a later batch. That is a
deliberate default (every trio call is a place a task can be cancelled), and a costly
one on a peer's message path: a frame sent takes its channel's lock, a step takes the
compute lock and waits for the unpaused event, a received step goes through its
session's queue, and a step's compute takes a token of the thread limiter before its
worker thread starts (peer/base/threads.py). Counted in `bench/simulate.py` (a trio instrument): of ~133 task
steps an answer, ~31 were such checkpoints that waited for nothing.

Here each is still a cancellation point — a cancelled task raises Cancelled here, as in
trio's own call (`checkpoint_if_cancelled`: it yields only to raise) — and then takes the
fast path when it can, falling back to trio's own call (which waits) when it must. What
this gives up is the schedule point alone: other tasks get no turn here, only at the
caller's next real wait (each of these callers waits on a stream or a queue a moment later).
"""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

import trio

T = TypeVar("T")


class QuickLock:
    """A `trio.Lock` whose `async with` takes it at once when it is free.

    trio's lock is fair (a release hands it straight to the first waiter), so a free lock
    has nobody waiting for it: taking it without a turn through the scheduler skips no one.
    """

    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = trio.Lock()

    def locked(self) -> bool:
        return self.lock.locked()

    async def __aenter__(self) -> None:
        lock = self.lock
        if lock.locked():
            await lock.acquire()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
            lock.acquire_nowait()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.lock.release()


async def wait_set(event: trio.Event) -> None:
    """`await event.wait()`, without a turn through the scheduler when the event is already set."""
    if event.is_set():
        await trio.lowlevel.checkpoint_if_cancelled()
    else:
        await event.wait()


async def send_quick(channel: trio.MemorySendChannel[T], value: T) -> None:
    """`await channel.send(value)`, without a turn through the scheduler when the buffer has room."""
    await trio.lowlevel.checkpoint_if_cancelled()
    try:
        channel.send_nowait(value)
    except trio.WouldBlock:
        await channel.send(value)


class QuickLimiter:
    """A `trio.CapacityLimiter` (trio's default thread limiter, unless given) whose acquire takes a
    token at once when one is left: what `trio.to_thread.run_sync(limiter=...)` asks of a limiter.

    trio's limiter is fair (a release hands the token straight to the first waiter), so a token
    left over means nobody waits for one: taking it without a turn through the scheduler skips
    no one. The thread then starts in this task step, not the next.
    """

    __slots__ = ("limiter",)

    def __init__(self, limiter: trio.CapacityLimiter | None = None) -> None:
        self.limiter = limiter if limiter is not None else trio.to_thread.current_default_thread_limiter()

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        limiter = self.limiter
        if limiter.available_tokens > 0:
            await trio.lowlevel.checkpoint_if_cancelled()
            limiter.acquire_on_behalf_of_nowait(borrower)
        else:
            await limiter.acquire_on_behalf_of(borrower)

    def release_on_behalf_of(self, borrower: object) -> None:
        self.limiter.release_on_behalf_of(borrower)


__all__ = ["QuickLimiter", "QuickLock", "wait_set", "send_quick"]
