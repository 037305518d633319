"""PeerStore: every table it writes round-trips, the ledger accumulates, the schema migrates."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest

from tessera.store import schema
from tessera.store.db import PeerStore, hour_bucket
from tessera.store.errors import (
    BadRecord,
    ReadOnlyStore,
    ReportTooLarge,
    SchemaMismatch,
    SchemaTooNew,
    StoreClosed,
)
from tessera.store.reputation import MAX_REPORT_BYTES


@pytest.fixture
def store(tmp_path):
    with PeerStore(tmp_path / "data" / "tessera.db", flush_interval=0.05) as s:
        yield s


def test_the_database_and_its_wal_files_are_the_owners_alone(tmp_path):
    """The ledger says which requester asked for what: 0600 like the key, -wal and -shm too
    (they hold the latest writes), under the usual umask; an older 0644 database is made 0600."""
    old_umask = os.umask(0o022)
    try:
        path = tmp_path / "tessera.db"
        with PeerStore(path, flush_interval=0.05) as store:
            store.add_ledger("12D3KooWrequester", 30, at=1.0)
            store.flush()
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
        assert modes == {"tessera.db": 0o600, "tessera.db-wal": 0o600, "tessera.db-shm": 0o600}, modes
        older = tmp_path / "older.db"
        PeerStore(older).close()
        older.chmod(0o644)
        PeerStore(older).close()
        assert stat.S_IMODE(older.stat().st_mode) == 0o600
    finally:
        os.umask(old_umask)


def test_fresh_database_is_wal_versioned_and_has_every_table(tmp_path):
    path = tmp_path / "tessera.db"
    PeerStore(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {
        "schema_version",
        "identity",
        "settings",
        "claims",
        "sessions",
        "ledger",
        "bans",
        "reports",
        "trace",
    } <= tables
    assert conn.execute("SELECT max(version) FROM schema_version").fetchone()[0] == schema.current_version()


def test_identity_round_trips(store):
    assert store.identity() is None
    store.record_identity("12D3KooWOld", at=100.0)
    store.record_identity("12D3KooWNew", at=200.0)
    store.record_identity("12D3KooWOld", at=300.0)  # already known: created stays 100
    assert store.identity() == "12D3KooWNew"
    with pytest.raises(BadRecord):
        store.record_identity("")


def test_claims_history(store):
    store.record_claim("m1", (0, 10), at=1.0)
    store.record_claim("m1", (10, 20), shard=(1, 2), at=2.0)
    store.record_claim("m1", (20, 30), action="move", moved_from=(0, 10), reason="rebalance", at=3.0)
    store.record_claim("m1", (10, 20), shard=(1, 2), action="release", reason="drain", at=4.0)
    history = store.claims()
    assert [(c["action"], c["span_start"], c["span_end"]) for c in history] == [
        ("claim", 0, 10),
        ("claim", 10, 20),
        ("move", 20, 30),
        ("release", 10, 20),
    ]
    assert history[1]["shard_index"] == 1 and history[1]["shard_count"] == 2
    assert history[2]["reason"] == "rebalance" and history[2]["moved_from_start"] == 0
    assert [c["action"] for c in store.claims(limit=2)] == ["move", "release"]
    for bad in [
        dict(span=(5, 5)),
        dict(span=(-1, 3)),
        dict(span=(0, 3), action="steal"),
        dict(span=(0, 3), shard=(2, 2)),
    ]:
        with pytest.raises(BadRecord):
            store.record_claim("m1", **bad)


def test_ledger_accumulates_per_requester_per_hour(store):
    base = 1_700_000_000.0 - 1_700_000_000.0 % 3600  # an hour boundary
    store.add_ledger("alice", 30, bytes=1000, at=base + 5)
    store.add_ledger("alice", 30, bytes=1000, at=base + 3599)
    store.add_ledger("alice", 60, steps=2, bytes=10, at=base + 3600)  # next hour
    store.add_ledger("bob", 500, steps=1, at=base + 7300)
    store.flush()
    rows = [(r["requester"], r["hour"], r["layer_tokens"], r["steps"], r["bytes"]) for r in store.ledger()]
    assert rows == [
        ("alice", base, 60, 2, 2000),
        ("alice", base + 3600, 60, 2, 10),
        ("bob", base + 7200, 500, 1, 0),
    ]
    summary = store.ledger_summary(base + 8000, day_start=base + 3600)
    assert summary["total"] == {"layer_tokens": 620, "steps": 5, "bytes": 2010}
    assert summary["today"] == {"layer_tokens": 560, "steps": 3, "bytes": 10}
    assert list(summary["by_requester"]) == ["bob", "alice"]  # biggest contribution first
    assert summary["by_requester"]["alice"] == {
        "layer_tokens": 120,
        "steps": 4,
        "bytes": 2010,
        "last": base + 3600,
    }
    # the latest contribution, not the start of its hour (issue 34: "last 14:00" for work at 14:58)
    store.add_ledger("alice", 1, at=base + 3600 + 3500.25)
    store.add_ledger("alice", 1, at=base + 3600 + 10)  # an older one arriving later changes nothing
    store.flush()
    assert store.ledger_summary(base + 8000)["by_requester"]["alice"]["last"] == base + 3600 + 3500.25
    assert hour_bucket(base + 3599.9) == base
    with pytest.raises(BadRecord):
        store.add_ledger("alice", -1)


def test_reports_round_trip(store):
    store.add_report(
        "12D3KooWA",
        "12D3KooWB",
        span=(3, 9),
        step=17,
        inputs_hash=b"\x01" * 32,
        outputs_hash="ff" * 32,
        signature=b"\x07" * 64,
        raw=b"\xa1cbor",
        session=b"\x5e",
        model_id="m1",
        verified=True,
        received=50.0,
    )
    store.add_report(
        "12D3KooWC",
        "12D3KooWB",
        span=None,
        step=None,
        inputs_hash=None,
        outputs_hash=None,
        signature=None,
        received=60.0,
    )
    newest, oldest = store.reports(accused="12D3KooWB")
    assert newest["reporter"] == "12D3KooWC" and newest["verified"] is None
    assert oldest["verified"] is True and oldest["raw"] == b"\xa1cbor" and oldest["signature"] == b"\x07" * 64
    assert oldest["inputs_hash"] == "01" * 32 and oldest["outputs_hash"] == "ff" * 32
    assert (oldest["span_start"], oldest["span_end"], oldest["step"], oldest["session"]) == (3, 9, 17, "5e")
    assert store.reports(accused="nobody") == []
    with pytest.raises(ReportTooLarge):
        store.add_report(
            "a",
            "b",
            span=None,
            step=None,
            inputs_hash=None,
            outputs_hash=None,
            signature=None,
            raw=b"x" * (MAX_REPORT_BYTES + 1),
        )


def test_reads_see_writes_made_before_them_without_explicit_flush(tmp_path):
    with PeerStore(tmp_path / "t.db", flush_interval=60.0) as s:  # the writer would wait a minute
        s.record_identity("12D3KooWK")
        assert s.identity() == "12D3KooWK"


def test_closed_store_refuses_writes(tmp_path):
    s = PeerStore(tmp_path / "t.db")
    s.close()
    s.close()  # idempotent
    with pytest.raises(StoreClosed):
        s.record_identity("12D3KooWK")
    with pytest.raises(StoreClosed):
        s.add_ledger("r", 1)


def test_readonly_store_reads_and_refuses_writes(tmp_path):
    path = tmp_path / "t.db"
    with PeerStore(path) as s:
        s.record_identity("12D3KooWV")
    with PeerStore(path, readonly=True) as ro:
        assert ro.identity() == "12D3KooWV"
        with pytest.raises(ReadOnlyStore):
            ro.record_identity("12D3KooWW")


def _migration_2(db):  # a next migration, whatever the current version is
    db.execute("ALTER TABLE claims ADD COLUMN note TEXT")
    db.execute("UPDATE claims SET note = 'from v1'")


NEXT = schema.current_version() + 1


def test_a_ledger_written_before_it_kept_last_times_migrates(tmp_path, monkeypatch):
    """Schema 2 (issue 34): the ledger keeps each row's latest contribution."""
    path = tmp_path / "t.db"
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:1])
    PeerStore(path).close()
    with sqlite3.connect(path) as conn:  # a row as schema 1 wrote it
        conn.execute("INSERT INTO ledger (requester, hour, layer_tokens, steps, bytes) VALUES ('old', 7200, 5, 1, 0)")
    monkeypatch.undo()
    with PeerStore(path) as s:
        s.add_ledger("old", 5, at=7200 + 61.5)
        s.add_ledger("new", 5, at=10_000.0)
        s.flush()
        by = s.ledger_summary(20_000.0)["by_requester"]
    assert by["old"]["last"] == 7200 + 61.5 and by["old"]["layer_tokens"] == 10 and by["new"]["last"] == 10_000.0


def test_old_database_migrates_forward(tmp_path, monkeypatch):
    path = tmp_path / "t.db"
    with PeerStore(path) as s:  # written at the current version
        s.record_claim("m1", (0, 4), at=1.0)
        s.record_identity("12D3KooWKept")
    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, _migration_2])
    with pytest.raises(SchemaMismatch):
        PeerStore(path, readonly=True)  # a reader must not migrate, and cannot read an old schema
    with PeerStore(path) as s:
        assert schema.db_version(s._reader) == NEXT
        assert s.claims()[0]["note"] == "from v1"
        assert s.identity() == "12D3KooWKept"
    with PeerStore(path) as s:  # reopening does not migrate twice
        assert schema.db_version(s._reader) == NEXT
    versions = [
        r[0] for r in sqlite3.connect(path).execute("SELECT version FROM schema_version ORDER BY version")
    ]
    assert versions == list(range(1, NEXT + 1))


def test_newer_database_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "t.db"
    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, _migration_2])
    PeerStore(path).close()
    monkeypatch.undo()
    with pytest.raises(SchemaTooNew, match=f"version {NEXT}"):
        PeerStore(path)


def test_a_failing_migration_leaves_the_old_version(tmp_path, monkeypatch):
    path = tmp_path / "t.db"
    PeerStore(path).close()

    def broken(db):
        db.execute("ALTER TABLE claims ADD COLUMN half TEXT")
        raise RuntimeError("disk pulled out mid-migration")

    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, broken])
    with pytest.raises(RuntimeError):
        PeerStore(path)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT max(version) FROM schema_version").fetchone()[0] == NEXT - 1
    assert "half" not in {r[1] for r in conn.execute("PRAGMA table_info(claims)")}
