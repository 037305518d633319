"""`PeerHandle`: the TUI's one door into a running peer.

Textual runs on asyncio in the main thread; the peer runs on trio. The handle runs
the peer's trio loop in a thread of its own (``trio.run`` in a thread) rather than
as a trio guest on Textual's loop: as a guest, every callback of the peer's network
I/O would share one thread with Textual's layout and painting, so a slow repaint
would delay a hop's activations; in its own thread the UI costs the peer no more
than the GIL it already shares with its torch worker threads. Neither loop ever
touches the other's objects; only these cross, each thread-safe:

- **snapshots** — a task on the trio side calls `read_snapshot(node)` every
  `SNAPSHOT_INTERVAL` seconds and puts the plain dict in a one-slot mailbox (a newer
  snapshot replaces one not read yet: the UI only ever wants the latest);
  `latest()` reads it without waiting for anything.
- **commands** — `drain()`, `pause()`, `resume()`, `set_memory_offered(gb)`,
  `preview_memory(gb)`, `leave()` hand a command to the trio side with
  ``TrioToken.run_sync_soon`` (which never blocks either side) and return a
  `concurrent.futures.Future` (``asyncio.wrap_future`` awaits it on Textual's loop).
  One trio task runs commands one at a time, in the order they were given.
- **lines** the peer prints (its ``out`` callback: "listening on ...", "left the
  swarm") go to a bounded deque instead of the terminal Textual is drawing on.

    handle = PeerHandle(node)
    handle.start()
    handle.wait_ready(120)
    handle.latest()             # -> dict (see tui/snapshot.py)
    handle.drain().result(10)   # or: await asyncio.wrap_future(handle.drain())
    handle.leave()              # the peer drains, says it leaves, and its thread ends
    handle.join(30)
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from tessera.peer.node.peer_node import PeerNode

from tessera.tui.snapshot import preview_memory, read_snapshot, stopped_snapshot

log = logging.getLogger(__name__)

# The UI redraws about twice a second; a fresher snapshot would not be seen, and each
# one costs the peer a walk over its view and sessions (microseconds, but on its loop).
SNAPSHOT_INTERVAL = 0.5
COMMAND_QUEUE = 16  # commands waiting on the trio side; a person presses keys slower than they run
KEPT_LINES = 500  # of the peer's printed lines


class PeerNotRunning(RuntimeError):
    """The peer's trio loop has not started yet or has already finished."""


class CommandQueueFull(RuntimeError):
    """More than COMMAND_QUEUE commands are waiting to run on the peer."""


class PeerHandle:
    """A `PeerNode` running in its own thread, seen and steered through thread-safe calls only."""

    def __init__(self, node: PeerNode, *, snapshot_interval: float = SNAPSHOT_INTERVAL) -> None:
        self.node = node
        self.snapshot_interval = snapshot_interval
        self.lines: collections.deque[tuple[float, str]] = collections.deque(maxlen=KEPT_LINES)  # (unix time, line)
        self._lines_total = 0
        self.started = threading.Event()  # the trio loop runs and takes commands
        self.ready = threading.Event()  # the peer serves its span
        self.finished = threading.Event()  # the peer's thread is done (left, failed or cancelled)
        self._settled = threading.Event()  # ready or finished: what wait_ready waits for
        self.error: BaseException | None = None  # why the peer stopped, if it failed
        self.snapshot_error: str | None = None  # why the last snapshot could not be read, if it failed
        self._lock = threading.Lock()
        self._latest: dict[str, Any] | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._commands: trio.MemorySendChannel | None = None
        self._cancel: trio.CancelScope | None = None
        self._pending: set[concurrent.futures.Future] = set()  # commands given and not done
        self._thread = threading.Thread(target=self._thread_main, name="tessera-peer", daemon=True)
        node.out = self._line

    @property
    def db_path(self) -> Path:
        """The peer's sqlite database (the UI opens it read-only for events and the ledger)."""
        return self.node.store.path

    # -- the UI's side ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Block until the peer serves (True) or stops or `timeout` passes (False)."""
        self._settled.wait(timeout)
        return self.ready.is_set()

    def latest(self) -> dict[str, Any] | None:
        """The newest snapshot (a plain dict; see tui/snapshot.py), or None before the first."""
        with self._lock:
            return self._latest

    def drain(self) -> concurrent.futures.Future:
        return self._submit(self.node.drain)

    def pause(self) -> concurrent.futures.Future:
        return self._submit(self.node.pause)

    def resume(self) -> concurrent.futures.Future:
        return self._submit(self.node.resume)

    def set_memory_offered(self, gb: float) -> concurrent.futures.Future:
        return self._submit(lambda: self.node.set_memory_offered(gb))

    def preview_memory(self, gb: float) -> concurrent.futures.Future:
        """The span the peer would serve if it offered `gb` (see snapshot.preview_memory)."""
        return self._submit(lambda: _sync(preview_memory, self.node, gb))

    def leave(self) -> None:
        """Stop gracefully: no new sessions, announce leaving, let running ones finish, end."""
        self._soon(self.node.stop)

    def force_stop(self) -> None:
        """Like a second Ctrl-C: running answers go back to their requesters now (they re-route),
        then the peer leaves."""
        self._soon(self.node.stop_now)

    def abort(self) -> None:
        """Stop the peer's loop without waiting for anything (it did not leave in time)."""
        self._soon(lambda: self._cancel.cancel() if self._cancel is not None else None)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the peer's thread to end; True if it did."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _soon(self, fn: Callable[[], object]) -> None:
        token = self._token
        if token is None or self.finished.is_set():
            raise PeerNotRunning("the peer is not running")
        try:
            token.run_sync_soon(fn)
        except trio.RunFinishedError:
            raise PeerNotRunning("the peer has stopped") from None

    def _submit(self, command: Callable[[], Awaitable[Any]]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

        def enqueue() -> None:  # runs on the trio side
            try:
                self._commands.send_nowait((command, future))
            except trio.WouldBlock:
                future.set_exception(CommandQueueFull(f"{COMMAND_QUEUE} commands are already waiting"))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                future.set_exception(PeerNotRunning("the peer is stopping"))

        try:
            self._soon(enqueue)
        except PeerNotRunning as stopped:
            future.set_exception(stopped)
        return future

    def _forget(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def lines_since(self, seen: int) -> tuple[list[tuple[float, str]], int]:
        """The peer's lines after the first `seen` it printed (as many as are kept), and the new count."""
        with self._lock:
            new = min(self._lines_total - seen, len(self.lines))
            return (list(self.lines)[len(self.lines) - new:] if new > 0 else []), self._lines_total

    def printed(self, text: str) -> bool:
        """Whether the peer has printed a line containing `text` (among the kept ones)."""
        with self._lock:
            return any(text in line for _, line in self.lines)

    def _line(self, line: str) -> None:
        with self._lock:
            self.lines.append((time.time(), line))
            self._lines_total += 1

    # -- the peer's side ---------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as error:  # noqa: BLE001 - kept for the UI and run_with_tui to report
            self.error = error
        finally:
            self.finished.set()
            self._settled.set()
            # A command queued as the loop ended never runs: answer it rather than leave
            # the UI waiting for ever.
            with self._lock:
                orphans, self._pending = self._pending, set()
            for future in orphans:
                if not future.done() and (future.running() or future.set_running_or_notify_cancel()):
                    future.set_exception(PeerNotRunning("the peer stopped before the command ran"))

    async def _main(self) -> None:
        send, receive = trio.open_memory_channel[tuple](COMMAND_QUEUE)
        self._commands = send
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self._cancel:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._publish_forever)
                nursery.start_soon(self._run_commands, receive)
                self.started.set()
                try:
                    await self.node.run()
                finally:
                    # The publisher goes first: at any checkpoint after the last word it read the
                    # live node again and wrote over it (a peer that left then showed "leaving"
                    # for good). No checkpoint from here on: a Cancelled raised in this finally
                    # would take the place of the error the peer stopped with.
                    nursery.cancel_scope.cancel()
                    with self._lock:  # the last word: stopped (the host and store are closed now)
                        self._latest = stopped_snapshot(self._latest, self.node)
                    send.close()

    def _publish(self) -> None:
        try:
            snapshot = read_snapshot(self.node)
        except Exception as error:  # noqa: BLE001 - a drawing bug must not take the volunteer's peer down
            log.exception("reading the peer's snapshot failed")
            self.snapshot_error = f"{type(error).__name__}: {error}"  # the UI shows it
            return
        with self._lock:
            self._latest = snapshot
        if self.node.ready.is_set():
            self.ready.set()
            self._settled.set()

    async def _publish_forever(self) -> None:
        while True:
            self._publish()
            await trio.sleep(self.snapshot_interval)

    async def _run_commands(self, receive: trio.MemoryReceiveChannel) -> None:
        async with receive:
            async for command, future in receive:
                if not future.set_running_or_notify_cancel():
                    continue  # the UI gave up on it before it ran
                try:
                    result = await command()
                except Exception as error:  # noqa: BLE001 - the UI shows it; the peer goes on serving
                    future.set_exception(error)
                except BaseException:  # cancelled: the peer is stopping under it
                    future.set_exception(PeerNotRunning("the peer stopped before the command finished"))
                    raise
                else:
                    future.set_result(result)
                self._publish()  # show the effect now, not at the next tick


async def _sync(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)
