"""The background writer: one thread per open store that owns its write connection.

Callers never wait for the disk. `submit()` appends an item to an in-memory queue under a
lock held for a few hundred nanoseconds; the thread wakes every ``flush_interval`` seconds
(or at once when `flush()`/`close()` asks, or when the queue passes `MAX_BATCH` items),
takes up to `MAX_BATCH` items and writes them in **one transaction**, trace rows in chunks
of `CHUNK_ROWS` through ``executemany``. With WAL and ``synchronous=NORMAL`` a committed
batch survives kill -9, so a crash loses at most the last interval of events.

An item is one of:

- ``("trace", row)`` — a tuple in `TRACE_INSERT` column order (built by store/trace.py);
- ``("ledger", (requester, hour), (layer_tokens, steps, bytes, at))`` — the counts summed per
  key within a batch, then upsert-accumulated, and the latest `at` kept (the row's ``last``),
  so a step on the hot path costs one queue append;
- ``("op", fn, label)`` — ``fn(db)`` runs inside the batch's transaction (rare writes:
  identity, claims, reports).

Failures: "database is locked/busy" is transient — the batch goes back to the front of the
queue and is retried after an interval, nothing is lost. Any other error means some item
is bad; the batch is retried one item per transaction and the items that still fail are
dropped and logged (counted in `failed`). When more than `MAX_PENDING` trace rows wait
(the disk has been stuck for a long time), new trace rows are dropped and counted in
`dropped` rather than letting memory grow without bound; other items are always kept.
"""

from __future__ import annotations

import atexit
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

from sqlite_utils import Database

from tessera.store.errors import FlushTimeout, StoreClosed
from tessera.store.schema import transaction

log = logging.getLogger("tessera.store")

# Items per transaction. Bounds the time one commit holds the write lock (≈ tens of ms on
# a laptop disk) and the memory of one batch; a bigger backlog is written batch after batch.
MAX_BATCH = 5000
# Rows per executemany call inside a batch.
CHUNK_ROWS = 500
# Trace rows allowed to wait in memory while the disk is stuck (~100 MB at ~200 B a row).
MAX_PENDING = 500_000
# Default wait between batches: the most a crash loses, and the latency until a reader sees
# an event. A quarter second keeps the loss well inside the one-second promise.
DEFAULT_FLUSH_INTERVAL_S = 0.25
# How long flush() and close() wait for the queue to reach the disk before FlushTimeout.
FLUSH_TIMEOUT_S = 30.0

TRACE_COLUMNS = (
    "mono_ns",
    "wall",
    "peer",
    "kind",
    "session",
    "step",
    "span_start",
    "span_end",
    "bytes",
    "duration",
    "remote",
    "detail",
)
TRACE_INSERT = "INSERT INTO trace ({}) VALUES ({})".format(
    ", ".join(TRACE_COLUMNS), ", ".join("?" * len(TRACE_COLUMNS))
)
LEDGER_UPSERT = (
    "INSERT INTO ledger (requester, hour, layer_tokens, steps, bytes, last) VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (requester, hour) DO UPDATE SET"
    " layer_tokens = layer_tokens + excluded.layer_tokens,"
    " steps = steps + excluded.steps, bytes = bytes + excluded.bytes,"
    " last = max(coalesce(last, excluded.last), excluded.last)"
)

Item = tuple[Any, ...]

_live: "weakref.WeakSet[BatchWriter]" = weakref.WeakSet()


def _is_transient(error: BaseException) -> bool:
    """True for errors that mean "try again later": another connection holds the lock."""
    if not isinstance(error, sqlite3.OperationalError):
        return False
    text = str(error).lower()
    return "locked" in text or "busy" in text


def apply_items(db: Database, items: list[Item]) -> None:
    """Write `items` into the transaction open on `db` (ops in order, then ledger, then trace)."""
    rows: list[tuple] = []
    ledger: dict[tuple[str, int], list[int]] = {}
    for item in items:
        tag = item[0]
        if tag == "trace":
            rows.append(item[1])
        elif tag == "ledger":
            total = ledger.setdefault(item[1], [0, 0, 0, 0.0])
            layer_tokens, steps, nbytes, at = item[2]
            total[0] += layer_tokens
            total[1] += steps
            total[2] += nbytes
            total[3] = max(total[3], at)
        else:
            item[1](db)
    if ledger:
        db.conn.executemany(LEDGER_UPSERT, [(*key, *sums) for key, sums in ledger.items()])
    for start in range(0, len(rows), CHUNK_ROWS):
        db.conn.executemany(TRACE_INSERT, rows[start : start + CHUNK_ROWS])


class BatchWriter:
    """Owns `db` (a write connection) and writes what is submitted, off the caller's thread."""

    def __init__(
        self,
        db: Database,
        *,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL_S,
        name: str = "tessera-store-writer",
    ) -> None:
        if not flush_interval > 0:
            raise ValueError(f"flush_interval must be > 0, got {flush_interval!r}")
        self.db = db
        self._pid = os.getpid()  # a forked child must never touch this connection
        self.flush_interval = float(flush_interval)
        self.batches = 0  # transactions committed
        self.written = 0  # items committed
        self.failed = 0  # items dropped because writing them raised a non-transient error
        self.dropped = 0  # trace rows refused because MAX_PENDING were already waiting
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[Item] = deque()
        self._pending_rows = 0
        self._submitted = 0  # sequence number of the last accepted item
        self._done = 0  # sequence number of the last item written or given up on
        self._urgent = False
        self._closing = False
        self._abandon = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def submit(self, item: Item) -> None:
        """Queue one item; never touches the disk. Raises `StoreClosed` after `close()`."""
        with self._cond:
            if self._closing:
                raise StoreClosed("the store's writer is closed; nothing more can be written")
            if item[0] == "trace":
                if self._pending_rows >= MAX_PENDING:
                    self.dropped += 1
                    return
                self._pending_rows += 1
            self._queue.append(item)
            self._submitted += 1
            if len(self._queue) >= MAX_BATCH:
                self._cond.notify_all()

    def pending(self) -> int:
        """Items accepted but not yet written."""
        with self._cond:
            return self._submitted - self._done

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Block until everything submitted before this call is on disk (or given up on)."""
        if threading.current_thread() is self._thread:
            return  # an op asked for a read: its own batch is not written yet; nothing to wait for
        with self._cond:
            target = self._submitted
            self._urgent = True
            self._cond.notify_all()
            ok = self._cond.wait_for(lambda: self._done >= target or not self._thread.is_alive(), timeout)
            if not ok or self._done < target:
                raise FlushTimeout(
                    f"{target - self._done!r} queued writes did not reach the disk in {timeout!r} s"
                )

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Write what is queued, stop the thread and close the connection. Idempotent.

        In a forked child this does nothing: the thread did not survive the fork, and closing
        the inherited connection could checkpoint the parent's WAL under its feet.
        """
        if os.getpid() != self._pid:
            return
        with self._cond:
            if self._closing and not self._thread.is_alive():
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._abandon = True
                left = self._submitted - self._done
                self._cond.notify_all()
            raise FlushTimeout(f"closing the store gave up on {left!r} queued writes after {timeout!r} s")
        self.db.conn.close()
        _live.discard(self)

    # --- the thread -----------------------------------------------------------------

    def _take(self) -> list[Item] | None:
        """Wait for work; return the next batch, or None when closed and drained."""
        with self._cond:
            deadline = time.monotonic() + self.flush_interval
            while not (self._closing or self._urgent or len(self._queue) >= MAX_BATCH):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if self._abandon or (self._closing and not self._queue):
                return None
            if not self._queue:
                self._urgent = False
                return []
            if len(self._queue) <= MAX_BATCH:
                batch = list(self._queue)  # the common case: take everything, in C
                self._queue.clear()
            else:
                batch = [self._queue.popleft() for _ in range(MAX_BATCH)]
            if not self._queue:
                self._urgent = False
            return batch

    def _finish(self, batch: list[Item], *, written: int) -> None:
        with self._cond:
            self._done += len(batch)
            self._pending_rows -= sum(1 for item in batch if item[0] == "trace")
            self.written += written
            self.failed += len(batch) - written
            self._cond.notify_all()

    def _requeue(self, batch: list[Item]) -> None:
        with self._cond:
            self._queue.extendleft(reversed(batch))

    def _write(self, batch: list[Item]) -> None:
        try:
            with transaction(self.db):
                apply_items(self.db, batch)
        except Exception as error:  # sorted below: transient -> retry, else isolate bad items
            if _is_transient(error):
                log.warning("store writer: %s; retrying %d items", error, len(batch))
                self._requeue(batch)
                with self._cond:
                    self._cond.wait(self.flush_interval)
                return
            self._write_one_by_one(batch, error)
            return
        self.batches += 1
        self._finish(batch, written=len(batch))

    def _write_one_by_one(self, batch: list[Item], first: Exception) -> None:
        log.warning("store writer: batch of %d failed (%r); writing items one by one", len(batch), first)
        written = 0
        for item in batch:
            try:
                with transaction(self.db):
                    apply_items(self.db, [item])
                written += 1
            except Exception as error:  # a bad item is dropped, loudly; the others still land
                log.error("store writer: dropped %s item: %r", item[2] if item[0] == "op" else item[0], error)
        self.batches += 1
        self._finish(batch, written=written)

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                break
            if batch:
                self._write(batch)
        with self._cond:
            self._cond.notify_all()


@atexit.register
def _close_live_writers() -> None:
    """At interpreter exit, write what open stores still hold (daemon threads die after this)."""
    for writer in list(_live):
        try:
            writer.close(timeout=5.0)
        except FlushTimeout as error:
            log.error("store writer at exit: %s", error)


def call_op(fn: Callable[[Database], None], label: str) -> Item:
    """Build an ``("op", fn, label)`` item."""
    return ("op", fn, label)
