"""peer/base/quick.py: the fast path takes no turn through the scheduler but is still a cancellation
point; the slow path waits as trio's own call does."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tessera.peer.base.quick import QuickLimiter, QuickLock, send_quick, wait_set


class Steps(trio.abc.Instrument):
    """Counts the task steps of one task (each time the scheduler resumes it)."""

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


async def _steps_of(call) -> int:
    """How many times the scheduler resumes the current task while `call()` runs."""
    steps = Steps()
    steps.task = trio.lowlevel.current_task()
    trio.lowlevel.add_instrument(steps)
    try:
        await call()
    finally:
        trio.lowlevel.remove_instrument(steps)
    return steps.count


def _free_lock_set_event_empty_channel() -> tuple[QuickLock, trio.Event, trio.MemorySendChannel[int],
                                                   trio.MemoryReceiveChannel[int]]:
    """What the fast paths find: a free lock, an event already set, a channel with room for one."""
    event = trio.Event()
    event.set()
    return QuickLock(), event, *trio.open_memory_channel[int](1)


async def test_a_free_lock_an_open_buffer_and_a_set_event_take_no_turn() -> None:
    lock, event, send, receive = _free_lock_set_event_empty_channel()

    async def hold() -> None:
        async with lock:
            assert lock.locked()

    assert await _steps_of(hold) == 0
    assert not lock.locked()
    assert await _steps_of(lambda: wait_set(event)) == 0
    assert await _steps_of(lambda: send_quick(send, 7)) == 0
    assert receive.receive_nowait() == 7
    # trio's own calls do take one (what these save)
    assert await _steps_of(event.wait) == 1
    assert await _steps_of(lambda: send.send(8)) == 1


async def test_each_waits_its_turn_when_it_must() -> None:
    lock, event = QuickLock(), trio.Event()
    send, receive = trio.open_memory_channel[int](1)
    order: list[str] = []

    async def second() -> None:
        async with lock:
            order.append("second has the lock")

    async def waiter() -> None:
        await wait_set(event)
        order.append("event seen")

    async def sender() -> None:
        await send_quick(send, 1)
        await send_quick(send, 2)  # the buffer holds one: waits for the receiver
        order.append("second value sent")

    async with trio.open_nursery() as nursery:
        async with lock:
            nursery.start_soon(second)
            nursery.start_soon(waiter)
            nursery.start_soon(sender)
            await trio.testing.wait_all_tasks_blocked()
            order.append("first releases")
        await trio.testing.wait_all_tasks_blocked()
        event.set()
        await trio.testing.wait_all_tasks_blocked()
        assert await receive.receive() == 1
        assert await receive.receive() == 2
    assert order == ["first releases", "second has the lock", "event seen", "second value sent"]


async def test_a_cancelled_task_raises_at_each_and_takes_nothing() -> None:
    lock, event, send, receive = _free_lock_set_event_empty_channel()

    async def take_lock() -> None:
        async with lock:
            pass

    for call in (take_lock, lambda: wait_set(event), lambda: send_quick(send, 1)):
        with trio.CancelScope() as scope:
            scope.cancel()
            await call()
            pytest.fail(f"{call} went on in a cancelled scope")
        assert scope.cancelled_caught
    assert not lock.locked()
    with pytest.raises(trio.WouldBlock):
        receive.receive_nowait()  # nothing was sent


async def test_a_lock_taken_on_the_fast_path_is_released_when_its_block_raises() -> None:
    # a frame send that fails (a broken stream) must not leave its channel's lock held: every
    # later send on it would wait forever
    lock = QuickLock()
    with pytest.raises(RuntimeError):
        async with lock:
            raise RuntimeError("the send failed")
    assert not lock.locked()
    with trio.fail_after(1):
        async with lock:
            assert lock.locked()


async def test_a_limiter_with_a_token_left_gives_it_at_once_and_one_without_waits_its_turn() -> None:
    limiter = QuickLimiter(trio.CapacityLimiter(1))
    first, second = object(), object()
    assert await _steps_of(lambda: limiter.acquire_on_behalf_of(first)) == 0
    assert limiter.limiter.borrowed_tokens == 1
    order: list[str] = []

    async def waits() -> None:
        await limiter.acquire_on_behalf_of(second)
        order.append("second has the token")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits)
        await trio.testing.wait_all_tasks_blocked()
        order.append("first releases")
        limiter.release_on_behalf_of(first)
    assert order == ["first releases", "second has the token"]
    limiter.release_on_behalf_of(second)
    with trio.CancelScope() as scope:
        scope.cancel()
        await limiter.acquire_on_behalf_of(first)
        pytest.fail("acquired in a cancelled scope")
    assert scope.cancelled_caught and limiter.limiter.borrowed_tokens == 0
    # trio's own limiter takes a turn with a token left (what this saves)
    assert await _steps_of(lambda: trio.CapacityLimiter(1).acquire_on_behalf_of(first)) == 1
