"""Running a simulation's trio loop so that the same seed gives the same run, on any machine.

    report = run_deterministic(_run, scenario, ..., seed=1)

Three things decide a simulation's course besides its own code:

- time: trio's MockClock (autojump at once), so simulated time costs no real time and
  never reads the wall clock;
- which of several tasks runnable at one instant goes first: trio's scheduler, which
  otherwise reverses each batch at random, is put in its deterministic mode (tasks sorted
  by creation, then shuffled by an RNG seeded from the seed) — the switch trio itself
  flips under Hypothesis (trio/_core/_run.py: `_ALLOW_DETERMINISTIC_SCHEDULING` and the
  module RNG `_r`);
- nothing from outside. A signal arriving while trio runs in the main thread writes to
  trio's wake-up socket; the system task that reads it joins the next batch of runnable
  tasks, and one more task in a batch shuffles the whole batch differently. On a CI
  runner signals came during a test (37 advertisements in one run, 38 in the next, same
  seed). So the loop runs in a thread of its own: Python delivers signals to the main
  thread only, and trio listens for them only when it runs there.

Ctrl-C still stops a simulation: the main thread, waiting, gets the KeyboardInterrupt,
cancels the run through its trio token, waits for it to unwind and re-raises.
"""

from __future__ import annotations

import threading
from typing import Any, Awaitable, Callable

import outcome
import trio
import trio.testing


def run_deterministic(main: Callable[..., Awaitable[Any]], *args: Any, seed: int, profiler: Any = None) -> Any:
    """`trio.run(main, *args)` on a MockClock, scheduled by `seed`, out of reach of signals.

    `profiler`: a cProfile.Profile to enable around the run, in the run's own thread (a
    profiler enabled by the caller sees only the caller's thread).
    Returns what `main` returns and raises what it raises. Raises RuntimeError if this trio
    version has no deterministic-scheduling switch.
    """
    try:
        from trio._core import _run
    except ImportError:  # pragma: no cover - trio moved its internals
        raise RuntimeError("this trio version has no trio._core._run; simulation needs trio 0.2x") from None
    if not hasattr(_run, "_ALLOW_DETERMINISTIC_SCHEDULING") or not hasattr(_run, "_r"):
        raise RuntimeError(f"trio {trio.__version__} has no deterministic-scheduling switch; pin trio <= 0.35")

    running: list = []  # (trio token, the run's cancel scope), once the loop runs
    started = threading.Event()  # the loop runs, or has ended
    result: list[outcome.Outcome] = []

    async def cancellable() -> Any:
        with trio.CancelScope() as scope:
            running.append((trio.lowlevel.current_trio_token(), scope))
            started.set()
            return await main(*args)

    def body() -> None:
        if profiler is not None:
            profiler.enable()
        try:
            result.append(outcome.capture(trio.run, cancellable, clock=trio.testing.MockClock(autojump_threshold=0)))
        finally:
            if profiler is not None:
                profiler.disable()
            started.set()

    old_flag, old_state = _run._ALLOW_DETERMINISTIC_SCHEDULING, _run._r.getstate()
    _run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    _run._r.seed(f"tessera-sim-scheduler:{seed}")
    thread = threading.Thread(target=body, name="tessera-simulation")
    try:
        thread.start()
        try:
            thread.join()
        except KeyboardInterrupt:  # Ctrl-C reaches this thread: stop the run, then say so
            started.wait()
            for token, scope in running:
                try:
                    token.run_sync_soon(scope.cancel)
                except trio.RunFinishedError:
                    pass
            thread.join()
            raise
    finally:
        _run._ALLOW_DETERMINISTIC_SCHEDULING = old_flag  # type: ignore[misc]
        _run._r.setstate(old_state)
    return result[0].unwrap()


__all__ = ["run_deterministic"]
