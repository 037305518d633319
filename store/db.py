"""`PeerStore`: the one sqlite database a peer keeps in its data dir (``DATA_DIR/tessera.db``).

Writes return at once: each method validates its arguments (so a bad value raises here,
in the caller, as a typed error) and queues the write for the store's background writer
thread (store/writer.py), which commits batches every ``flush_interval`` seconds. Reads
use a second connection of their own and first `flush()`, so a read always sees the
writes made before it (read-your-writes) — a read therefore may wait for one small
commit; from trio, call reads through ``trio.to_thread.run_sync``.

The schema is in store/schema.py; the trace, which shares this database and writer, is in
store/trace.py. Times are unix seconds; spans are half-open ``(start, end)``.
"""

from __future__ import annotations

import math
import os
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from tessera.store import schema
from tessera.store.errors import BadRecord, ReadOnlyStore, StoreClosed
from tessera.store.events import Stamped, TraceEvent, stamped
from tessera.store.reputation import Reputation
from tessera.store.values import check_int, check_span, check_text, timestamp
from tessera.store.writer import DEFAULT_FLUSH_INTERVAL_S, FLUSH_TIMEOUT_S, BatchWriter, call_op

CLAIM_ACTIONS = ("claim", "release", "move")
HOUR_S = 3600

def hour_bucket(at: float) -> int:
    """Unix seconds of the start of the (UTC) hour holding `at`."""
    return int(at // HOUR_S) * HOUR_S


class PeerStore(Reputation):
    """One peer's database: identity, claims, ledger, misbehaviour reports, trace.

    `path` is created if missing (and migrated forward if old) unless ``readonly=True``,
    which opens an existing database for reading only (the TUI, ``tessera ledger``).
    """

    def __init__(
        self, path: Path | str, *, flush_interval: float = DEFAULT_FLUSH_INTERVAL_S, readonly: bool = False
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self._writer: BatchWriter | None = None
        if readonly:
            self._reader = schema.connect(self.path, readonly=True)
            try:
                schema.check_version(self._reader)
            except BaseException:
                self._reader.conn.close()
                raise
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = schema.connect(self.path)
            try:
                schema.migrate(db)
            except BaseException:
                db.conn.close()
                raise
            self._writer = BatchWriter(db, flush_interval=flush_interval)
            self._reader = schema.connect(self.path)
        self._read_lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()

    # --- plumbing ---------------------------------------------------------------------

    @property
    def writer(self) -> BatchWriter:
        """The background writer (raises `ReadOnlyStore` for a read-only store)."""
        if self._writer is None:
            raise ReadOnlyStore(f"{str(self.path)!r} was opened read-only")
        return self._writer

    def _submit(self, fn: Any, label: str) -> None:
        if self._closed:
            raise StoreClosed(f"{str(self.path)!r} is closed")
        self.writer.submit(call_op(fn, label))

    def _query(self, sql: str, params: tuple | dict = ()) -> list[dict]:
        """Run a read on the reader connection after flushing queued writes."""
        if self._closed:
            raise StoreClosed(f"{str(self.path)!r} is closed")
        if self._writer is not None:
            self._writer.flush()
        with self._read_lock:
            return list(self._reader.query(sql, params))

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Block until every write queued so far is committed."""
        if self._writer is not None and not self._closed:
            self._writer.flush(timeout)

    def close(self) -> None:
        """Write what is queued and close both connections. Idempotent; a no-op in a forked child."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            with self._read_lock:
                self._reader.conn.close()

    def __enter__(self) -> PeerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- identity ----------------------------------------------------------------------

    def record_identity(self, peer_id: str, *, at: float | None = None) -> None:
        """Remember this peer's public id (the first time it is seen)."""
        row = (check_text("peer_id", peer_id), timestamp(at))
        self._submit(
            lambda db: db.execute("INSERT OR IGNORE INTO identity (peer_id, created) VALUES (?, ?)", row),
            "identity",
        )

    def identity(self) -> str | None:
        """The most recently created public peer id, or None."""
        rows = self._query("SELECT peer_id FROM identity ORDER BY created DESC, rowid DESC LIMIT 1")
        return rows[0]["peer_id"] if rows else None

    # --- claims --------------------------------------------------------------------------

    def record_claim(
        self,
        model_id: str,
        span: tuple[int, int],
        *,
        action: str = "claim",
        shard: tuple[int, int] = (0, 1),
        reason: str = "",
        moved_from: tuple[int, int] | None = None,
        at: float | None = None,
    ) -> None:
        """Record a claim, release or move of `span` (for a move: the new span, and `moved_from`)."""
        if action not in CLAIM_ACTIONS:
            raise BadRecord(f"action must be one of {CLAIM_ACTIONS!r}, got {action!r}")
        start, end = check_span(span)
        index, count = check_int("shard index", shard[0]), check_int("shard count", shard[1], minimum=1)
        if index >= count:
            raise BadRecord(f"shard must be (index, count) with index < count, got {shard!r}")
        old = check_span(moved_from) if moved_from is not None else (None, None)
        row = {
            "time": timestamp(at),
            "model_id": check_text("model_id", model_id),
            "span_start": start,
            "span_end": end,
            "shard_index": index,
            "shard_count": count,
            "action": action,
            "reason": str(reason),
            "moved_from_start": old[0],
            "moved_from_end": old[1],
        }
        self._submit(lambda db: db["claims"].insert(row), "claim")

    def claims(self, *, limit: int | None = None) -> list[dict]:
        """The claims history, oldest first (the last `limit` entries if given)."""
        sql = "SELECT * FROM claims ORDER BY time, id"
        if limit is not None:
            newest = f"SELECT * FROM claims ORDER BY time DESC, id DESC LIMIT {int(limit)}"
            sql = f"SELECT * FROM ({newest}) ORDER BY time, id"
        return self._query(sql)

    # --- ledger --------------------------------------------------------------------------

    def add_ledger(
        self, requester: str, layer_tokens: int, *, steps: int = 1, bytes: int = 0, at: float | None = None
    ) -> None:
        """Add one contribution (layer_tokens = tokens x layers computed) to this hour's row."""
        at = timestamp(at)
        key = (check_text("requester", requester), hour_bucket(at))
        values = (
            check_int("layer_tokens", layer_tokens),
            check_int("steps", steps),
            check_int("bytes", bytes),
            at,
        )
        if self._closed:
            raise StoreClosed(f"{str(self.path)!r} is closed")
        self.writer.submit(("ledger", key, values))

    def ledger(self, *, requester: str | None = None) -> list[dict]:
        """The raw hourly rows, oldest first."""
        if requester is None:
            return self._query("SELECT * FROM ledger ORDER BY hour, requester")
        return self._query("SELECT * FROM ledger WHERE requester = ? ORDER BY hour", (requester,))

    def ledger_summary(self, now: float | None = None, *, day_start: float | None = None) -> dict:
        """What this peer contributed: ``{today, total, by_requester}``.

        ``today`` sums the hours that began at or after `day_start` (default: local midnight
        of `now`); ``total`` sums everything; ``by_requester`` maps each requester to its
        sums plus ``last`` (unix time of its latest contribution; the start of its hour for
        rows written before the ledger kept it), largest contribution first. Each sum is
        ``{"layer_tokens", "steps", "bytes"}``.
        """
        if day_start is None:
            day_start = (
                datetime.fromtimestamp(timestamp(now))
                .replace(hour=0, minute=0, second=0, microsecond=0)
                .timestamp()
            )
        sums = ", ".join(f"coalesce(sum({c}), 0) AS {c}" for c in ("layer_tokens", "steps", "bytes"))
        total = self._query(f"SELECT {sums} FROM ledger")[0]
        today = self._query(f"SELECT {sums} FROM ledger WHERE hour >= ?", (math.floor(day_start),))[0]
        rows = self._query(
            f"SELECT requester, {sums}, max(coalesce(last, hour)) AS last FROM ledger"
            " GROUP BY requester ORDER BY layer_tokens DESC, requester"
        )
        by_requester = {r.pop("requester"): r for r in rows}
        return {"today": today, "total": total, "by_requester": by_requester}

    # --- the trace (written by tessera.store.trace.TraceWriter) ---------------------------------

    def events(
        self,
        *,
        after_id: int = 0,
        kinds: tuple[type[TraceEvent], ...] | None = None,
        limit: int | None = None,
    ) -> list[Stamped]:
        """Trace events with row id > `after_id`, oldest first, of the event classes `kinds`
        (all, with rows no class fits as `Unknown`, when None). For a live tail."""
        where, params = "WHERE id > ?", [after_id]
        if kinds:
            where += " AND kind IN ({})".format(", ".join("?" * len(kinds)))
            params += [cls.kind for cls in kinds]
        tail = f"LIMIT {int(limit)}" if limit is not None else ""
        return [stamped(row) for row in self._query(f"SELECT * FROM trace {where} ORDER BY id {tail}", tuple(params))]

    def recent_events(self, *, kinds: tuple[type[TraceEvent], ...] | None = None, limit: int = 50) -> list[Stamped]:
        """The newest `limit` trace events of the classes `kinds` (all when None), oldest first: a
        status page's tail. Read backwards by id, so it costs the rows since the `limit`-th newest
        match, not the whole trace a long-lived peer keeps."""
        where, params = "", []
        if kinds:
            where = "WHERE kind IN ({})".format(", ".join("?" * len(kinds)))
            params = [cls.kind for cls in kinds]
        rows = self._query(f"SELECT * FROM trace {where} ORDER BY id DESC LIMIT {int(limit)}", tuple(params))
        return [stamped(row) for row in reversed(rows)]
