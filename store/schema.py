"""Opening a peer database, its one transaction context manager, and its forward migrations.

Every write in store/ goes through `transaction()`: ``BEGIN IMMEDIATE`` takes the write
lock up front (so a second writer waits in SQLite's busy handler instead of failing half
way through with ``SQLITE_BUSY``), ``COMMIT`` on success, ``ROLLBACK`` on any exception.

The schema has a version. `MIGRATIONS` is a list of functions; migration *n* (1-based)
takes a database at version *n - 1* to version *n*. To change the schema, append one
function — never edit a released one, since databases in the field already ran it::

    def _migration_2(db: Database) -> None:
        db.execute("ALTER TABLE claims ADD COLUMN note TEXT")

    MIGRATIONS.append(_migration_2)

`migrate()` runs the missing ones in a single immediate transaction, so two processes
opening the same fresh database cannot both migrate it, and a crash leaves it at the old
version rather than half way.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path
from typing import Callable, Iterator

from sqlite_utils import Database

from tessera.store.errors import SchemaMismatch, SchemaTooNew

# How long a connection waits for another writer's lock before SQLite reports "database is
# locked". Our own writes are small batches that commit in milliseconds; five seconds covers
# a checkpoint or a slow disk, and the background writer retries after that anyway.
BUSY_TIMEOUT_S = 5.0

# A peer's database holds its ledger (which requester asked for how many tokens, hour by hour)
# and the trace of every session it served: the owner's to read, like its key (store/keyfile.py).
DB_FILE_MODE = 0o600
WAL_FILES = ("-wal", "-shm")  # SQLite's companions of a database in WAL mode


def connect(path: Path, *, readonly: bool = False) -> Database:
    """Open `path` through sqlite-utils with our pragmas; the connection may cross threads.

    Transactions are explicit (``isolation_level=None``): nothing begins behind our back,
    and `transaction()` is the only place that begins or commits. Callers must not use one
    connection from two threads at once (store/ guards each with a lock or a thread).
    """
    if readonly:
        target, uri = Path(path).resolve().as_uri() + "?mode=ro", True
    else:
        target, uri = str(path), False
        make_private(Path(path))
    conn = sqlite3.connect(
        target, uri=uri, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
    )
    db = Database(conn, execute_plugins=False)
    if not readonly:
        db.enable_wal()
    # NORMAL in WAL mode: a commit is durable against a process crash (kill -9) as soon as
    # it returns; only a power cut can lose the last transactions. FULL would fsync per batch.
    db.execute("PRAGMA synchronous=NORMAL")
    return db


def make_private(path: Path) -> None:
    """Create `path` 0600 before SQLite does (it gives the -wal and -shm files the database's
    own mode), and set an older database made 0644, and its companions, to 0600."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, DB_FILE_MODE)
    try:
        os.fchmod(fd, DB_FILE_MODE)  # the umask can only remove bits; an existing file keeps its mode
    finally:
        os.close(fd)
    for suffix in WAL_FILES:
        try:
            os.chmod(f"{path}{suffix}", DB_FILE_MODE)
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def transaction(db: Database) -> Iterator[Database]:
    """The one way store/ writes: an immediate transaction, committed or rolled back whole."""
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        if db.conn.in_transaction:
            db.conn.execute("ROLLBACK")
        raise
    else:
        db.conn.execute("COMMIT")


def _migration_1(db: Database) -> None:
    """The initial schema. Times are unix seconds (REAL); spans are half-open [start, end).

    Three of its tables are no longer written: ``settings`` (nothing read or set them),
    ``sessions`` (the trace's session_open/session_close events hold the same facts) and
    ``bans`` (bans live in the swarm client's back-off object, peer/base/backoff.py). They
    stay, empty, so that databases written before and after are the same version 1.
    """
    statements = [
        # The peer's public id(s); the private key stays in its own 0600 file (keyfile.py).
        """CREATE TABLE identity (
            peer_id TEXT PRIMARY KEY,
            created REAL NOT NULL)""",
        # Operator and peer settings; value is JSON text.
        """CREATE TABLE settings (
            key TEXT PRIMARY KEY,
            value TEXT NOT NULL,
            updated REAL NOT NULL)""",
        # Claims history: every claim, release and move of a span (or a tensor shard of one).
        """CREATE TABLE claims (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            model_id TEXT NOT NULL,
            span_start INTEGER NOT NULL,
            span_end INTEGER NOT NULL,
            shard_index INTEGER NOT NULL DEFAULT 0,
            shard_count INTEGER NOT NULL DEFAULT 1,
            action TEXT NOT NULL CHECK (action IN ('claim', 'release', 'move')),
            reason TEXT NOT NULL DEFAULT '',
            moved_from_start INTEGER,
            moved_from_end INTEGER)""",
        # Sessions served; steps and tokens are written when the session closes.
        """CREATE TABLE sessions (
            session TEXT PRIMARY KEY,
            requester TEXT,
            model_id TEXT,
            span_start INTEGER,
            span_end INTEGER,
            opened REAL,
            closed REAL,
            steps INTEGER NOT NULL DEFAULT 0,
            tokens INTEGER NOT NULL DEFAULT 0,
            close_reason TEXT)""",
        "CREATE INDEX sessions_opened ON sessions (opened)",
        # Contribution ledger: what this peer computed for each requester, per hour.
        # hour = unix seconds of the start of the hour; rows are upsert-accumulated.
        """CREATE TABLE ledger (
            requester TEXT NOT NULL,
            hour INTEGER NOT NULL,
            layer_tokens INTEGER NOT NULL DEFAULT 0,
            steps INTEGER NOT NULL DEFAULT 0,
            bytes INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (requester, hour))""",
        # Bans with exponential back-off: count is how many times this peer was banned.
        """CREATE TABLE bans (
            peer TEXT PRIMARY KEY,
            until REAL NOT NULL,
            reason TEXT NOT NULL,
            count INTEGER NOT NULL,
            first REAL NOT NULL,
            last REAL NOT NULL)""",
        # Misbehaviour reports, kept with their raw signed bytes so they can be re-checked.
        # verified: NULL = not checked, 0 = signature or evidence did not hold, 1 = verified.
        """CREATE TABLE reports (
            id INTEGER PRIMARY KEY,
            received REAL NOT NULL,
            reporter TEXT NOT NULL,
            accused TEXT NOT NULL,
            model_id TEXT,
            session TEXT,
            span_start INTEGER,
            span_end INTEGER,
            step INTEGER,
            inputs_hash TEXT,
            outputs_hash TEXT,
            signature BLOB,
            verified INTEGER,
            raw BLOB)""",
        "CREATE INDEX reports_accused ON reports (accused)",
        # The trace: one row per event (see store/trace.py for the kinds and their fields).
        # No secondary indexes: inserts stay cheap; readers scan or go by id.
        """CREATE TABLE trace (
            id INTEGER PRIMARY KEY,
            mono_ns INTEGER NOT NULL,
            wall REAL NOT NULL,
            peer TEXT NOT NULL,
            kind TEXT NOT NULL,
            session TEXT,
            step INTEGER,
            span_start INTEGER,
            span_end INTEGER,
            bytes INTEGER,
            duration REAL,
            remote TEXT,
            detail TEXT)""",
    ]
    for sql in statements:
        db.execute(sql)


def _migration_2(db: Database) -> None:
    """The ledger keeps when each requester's row was last added to: the hour alone made
    `tessera ledger` say "last 14:00" for work done at 14:58. Older rows keep NULL (their hour)."""
    db.execute("ALTER TABLE ledger ADD COLUMN last REAL")


MIGRATIONS: list[Callable[[Database], None]] = [_migration_1, _migration_2]


def current_version() -> int:
    """The schema version this code writes: the number of migrations."""
    return len(MIGRATIONS)


def db_version(db: Database) -> int:
    """The version a database is at; 0 for a fresh file with no version table."""
    if not db["schema_version"].exists():
        return 0
    row = db.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def migrate(db: Database, *, now: float | None = None) -> int:
    """Bring `db` forward to `current_version()`; return the version it was at.

    Raises `SchemaTooNew` if the database is ahead of this code.
    """
    target = current_version()
    with transaction(db):
        db.execute(
            "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied REAL NOT NULL)"
        )
        found = db_version(db)
        if found > target:
            raise SchemaTooNew(
                f"database is at schema version {found!r}, this Tessera knows up to {target!r}"
            )
        for version in range(found + 1, target + 1):
            MIGRATIONS[version - 1](db)
            db.execute(
                "INSERT INTO schema_version (version, applied) VALUES (?, ?)",
                (version, time.time() if now is None else now),
            )
    return found


def check_version(db: Database) -> None:
    """For read-only opens: raise `SchemaMismatch` unless `db` is exactly at our version."""
    found, want = db_version(db), current_version()
    if found != want:
        raise SchemaMismatch(
            f"database is at schema version {found!r}, this Tessera reads version {want!r};"
            " open it writable once to migrate it"
        )
