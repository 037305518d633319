"""Blocking work (torch, tokenizers) in a worker thread, with nothing of it left behind there.

    logits = await in_worker(lambda: head.logits(hidden))

`trio.to_thread.run_sync` runs a call in one of trio's cached worker threads. Those are
daemon threads, and after handing the result over, a worker still holds the call and its
result in its own frame until that frame is cleared. If the caller has dropped them by
then (a requester's last token, printed, then exit), the last reference — a tensor's —
dies in the worker thread, and freeing a tensor releases and re-takes the GIL. During
interpreter shutdown re-taking the GIL ends the thread with pthread_exit, whose unwinding
through torch's C++ deallocator calls std::terminate: "terminate called without an active
exception" and exit status -6, after a correct answer (1 `tessera generate` in ~20 on
this machine; gdb: THPVariable_clear in "Trio thread 0").

`in_worker` passes the call through a box the worker empties before it starts and fills
with the outcome before it returns, so the worker's frames end holding nothing: the call,
its arguments and its result are freed by the caller, on the caller's thread.

The thread starts in the caller's task step: trio's default limiter (40 threads at once) is
taken through `QuickLimiter`, whose free token costs no turn through the scheduler (a
peer's every step crosses here, and a pass of trio's run loop on a core that waited costs
tens of microseconds). The caller is resumed once, when the outcome is back.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import outcome
import trio

from tessera.peer.base.quick import QuickLimiter

T = TypeVar("T")


async def in_worker(call: Callable[[], T]) -> T:
    """`call()` in a trio worker thread (trio.to_thread.run_sync); returns or raises what it does."""
    box: list = [call]
    del call  # the box holds the only reference this frame had

    def job() -> None:
        box.append(outcome.capture(box.pop()))  # the call leaves the box as the outcome enters it

    await trio.to_thread.run_sync(job, limiter=QuickLimiter())
    return box.pop().unwrap()


__all__ = ["in_worker"]
