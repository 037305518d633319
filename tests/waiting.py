"""Waiting on a condition in tests, never on a guessed duration.

`wait_until` polls a predicate from plain test code; `await_until` does the same
inside trio (on whatever clock the run uses, MockClock included). Both fail with
"timed out after T s waiting for WHAT" so that a hang names what did not happen.
"""

from __future__ import annotations

import time
from typing import Callable

import trio


def wait_until(predicate: Callable[[], object], timeout: float, what: str, *, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def await_until(predicate: Callable[[], object], timeout: float, what: str, *, interval: float = 0.1) -> None:
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(interval)
        return
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
