"""in_worker: a call runs in a worker thread, and nothing of it is freed there."""

from __future__ import annotations

import gc
import threading

import pytest
import trio

from tessera.peer.base import threads
from tessera.peer.base.threads import in_worker


class Probe:
    """Records on which thread it was freed."""

    freed_on: list[bool] = []

    def __del__(self) -> None:
        Probe.freed_on.append(threading.current_thread() is threading.main_thread())


async def test_the_call_runs_in_a_worker_and_returns_or_raises_there():
    assert await in_worker(lambda: threading.current_thread() is not threading.main_thread())
    assert await in_worker(lambda: 6 * 7) == 42

    def fails() -> None:
        raise ValueError("from the worker")

    with pytest.raises(ValueError, match="from the worker") as caught:
        await in_worker(fails)
    assert caught.traceback[-1].name == "fails"  # raised with the worker's traceback


async def test_a_worker_that_keeps_its_frames_keeps_nothing_of_the_call(monkeypatch):
    """trio's worker holds its job and the job's outcome until its frame clears, which can be
    after the caller has dropped them (then a tensor is freed in the worker, and at interpreter
    shutdown that aborts the process). Here a worker that never lets go of either: the call's
    argument and result are still freed by the caller, on the caller's thread."""
    kept: list[object] = []

    async def hoarding_run_sync(job, **_):
        def work() -> None:
            kept.append(job)
            kept.append(job())

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()  # a short job: blocking the loop for it is fine in a test
        await trio.lowlevel.checkpoint()

    monkeypatch.setattr(threads.trio.to_thread, "run_sync", hoarding_run_sync)
    Probe.freed_on.clear()
    gc.collect()
    argument = Probe()
    result = await in_worker(lambda: (argument, Probe())[1])
    assert isinstance(result, Probe)
    del argument, result
    assert Probe.freed_on == [True, True]  # both freed here, at once, while the worker still holds its job
    assert len(kept) == 2


async def test_the_worker_starts_in_the_callers_task_step_and_the_caller_resumes_once():
    """trio's limiter takes a turn through the scheduler before the thread starts, even with
    tokens left; `QuickLimiter` does not: the caller is resumed once, with the outcome."""
    steps = []
    task = trio.lowlevel.current_task()

    class Steps(trio.abc.Instrument):
        def before_task_step(self, stepped: trio.lowlevel.Task) -> None:
            if stepped is task:
                steps.append(stepped)

    instrument = Steps()
    trio.lowlevel.add_instrument(instrument)
    try:
        assert await in_worker(lambda: 6 * 7) == 42
        mine = len(steps)
        await trio.to_thread.run_sync(lambda: 6 * 7)
    finally:
        trio.lowlevel.remove_instrument(instrument)
    assert (mine, len(steps) - mine) == (1, 2)
