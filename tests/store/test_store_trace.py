"""TraceWriter: events land from many threads, batches follow the interval, emit never waits
for a locked database, and a kill -9 loses at most the last second."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tessera.store import schema
from tessera.store.db import PeerStore
from tessera.store.errors import BadTraceField, NotJSON, StoreClosed, UnknownEventKind
from tessera.store.events import EVENT_TYPES, Connect, Error, Forward, Join, Unknown
from tessera.store.trace import MemoryTracer, NullTracer, Tracer, TraceWriter

from ..waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def step(i: int, **fields) -> Forward:
    """A forward step with the fields these tests do not look at filled in."""
    return Forward(**{"session": "5e55", "step": i, "span": (0, 1), "duration": 0.0, **fields})


def _count(path: Path) -> int:
    """Rows in the trace as another process would see them (its own connection)."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT count(*) FROM trace").fetchone()[0]
    finally:
        conn.close()


def test_every_field_round_trips(tmp_path):
    path = tmp_path / "t.db"
    with TraceWriter(path, peer="12D3KooWA") as tracer:
        tracer.emit(Forward(session=b"\xbe\xef", step=3, span=(0, 15), bytes=2304, duration=0.012, batch=1))
        tracer.emit(Connect(remote="12D3KooWB", link="punched"), mono_ns=42, wall=1234.5)
        # a simulation writes several peers into one db
        tracer.emit(Join(addrs=["/ip4/127.0.0.1/tcp/1"], model="m"), peer="12D3KooWSim")
    with PeerStore(path, readonly=True) as store:
        forward, connect, join = store.events()
        raw = store._query("SELECT kind, session, span_start, span_end, detail FROM trace ORDER BY id")
    assert (forward.peer, forward.kind, forward.event.session, forward.event.step) == (
        "12D3KooWA",
        "forward",
        "beef",
        3,
    )
    assert (forward.event.span, forward.event.bytes) == ((0, 15), 2304)
    assert forward.event.duration == pytest.approx(0.012) and forward.event.batch == 1
    assert abs(forward.wall - time.time()) < 60 and forward.mono_ns > 0
    assert (connect.mono_ns, connect.wall, connect.event.remote) == (42, 1234.5, "12D3KooWB")
    assert connect.event == Connect(remote="12D3KooWB", link="punched") and connect.event.session is None
    assert join.peer == "12D3KooWSim" and join.event == Join(addrs=["/ip4/127.0.0.1/tcp/1"], model="m")
    # the rows keep the format traces had before the event classes (columns + a JSON detail)
    assert raw[0] == {"kind": "forward", "session": "beef", "span_start": 0, "span_end": 15, "detail": '{"batch":1}'}
    assert raw[1]["detail"] == '{"kind":"punched"}'
    assert json.loads(raw[2]["detail"]) == {"addrs": ["/ip4/127.0.0.1/tcp/1"], "model": "m"}


@pytest.mark.parametrize("tracer_cls", [NullTracer, MemoryTracer])
def test_bad_events_are_refused_by_every_tracer(tmp_path, tracer_cls):
    for tracer in (tracer_cls(), TraceWriter(tmp_path / f"{tracer_cls.__name__}.db", peer="p")):
        assert isinstance(tracer, Tracer)
        with pytest.raises(UnknownEventKind):
            tracer.emit("forward")  # type: ignore[arg-type]  # a kind is a class now, not a string
        with pytest.raises(TypeError, match="stpe"):
            step(1, stpe=1)  # a field the class does not define fails where it is written
        with pytest.raises(BadTraceField, match="step"):
            tracer.emit(step(-1))
        with pytest.raises(BadTraceField, match="session"):
            tracer.emit(step(1, session="not-hex"))
        with pytest.raises(BadTraceField, match="duration"):
            tracer.emit(step(1, duration=float("nan")))
        with pytest.raises(BadTraceField, match="teleported"):
            tracer.emit(Connect(remote="q", link="teleported"))
        with pytest.raises(BadTraceField, match="message"):
            tracer.emit(Error(message=object()))  # type: ignore[arg-type]
        with pytest.raises(NotJSON):
            tracer.emit(Join(addrs=[object()], model="m"))
        tracer.close()


def test_memory_tracer_keeps_events_as_read_back():
    tracer = MemoryTracer(peer="p")
    tracer.emit(step(1, session=b"\xab"))
    tracer.emit(Connect(remote="q", link="direct"))
    assert [e.kind for e in tracer.events] == ["forward", "connect"] and [e.id for e in tracer.events] == [1, 2]
    assert tracer.events[0].event.session == "ab"  # hex, as a store gives it back
    assert [e.event for e in tracer.of_kind(Connect)] == [Connect(remote="q", link="direct")]
    assert not any(isinstance(e.event, Unknown) for e in tracer.events) and len(EVENT_TYPES) > 2


def test_events_from_many_threads_all_land(tmp_path):
    path = tmp_path / "t.db"
    threads, per_thread = 8, 500
    tracer = TraceWriter(path, peer="p", flush_interval=0.02)

    def work(k: int) -> None:
        for i in range(per_thread):
            tracer.emit(step(i), peer=f"thread{k}")

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    tracer.close()
    tracer.close()  # idempotent
    with pytest.raises(StoreClosed):
        tracer.emit(step(0))
    conn = sqlite3.connect(path)
    rows = conn.execute("SELECT peer, step, id FROM trace ORDER BY id").fetchall()
    assert len(rows) == threads * per_thread
    assert {(p, s) for p, s, _ in rows} == {
        (f"thread{k}", i) for k in range(threads) for i in range(per_thread)
    }
    for k in range(threads):  # each thread's events keep their order
        steps = [s for p, s, _ in rows if p == f"thread{k}"]
        assert steps == sorted(steps)


def test_writer_waits_for_the_interval_then_writes_without_being_asked(tmp_path):
    slow = tmp_path / "slow.db"
    with TraceWriter(slow, peer="p", flush_interval=30.0) as tracer:
        tracer.emit(Join(addrs=[], model="m"))
        time.sleep(0.3)
        assert _count(slow) == 0  # not written per event: it waits for the interval
        tracer.flush()
        assert _count(slow) == 1
    fast = tmp_path / "fast.db"
    with TraceWriter(fast, peer="p", flush_interval=0.05) as tracer:
        tracer.emit(Join(addrs=[], model="m"))
        wait_until(lambda: _count(fast) > 0, 10, "the periodic flush", interval=0.01)
        assert _count(fast) == 1  # written by the periodic flush, no flush() call


def test_a_tracer_on_a_shared_store_flushes_only_and_tightens_the_interval(tmp_path):
    with PeerStore(tmp_path / "t.db", flush_interval=1.0) as store:
        tracer = TraceWriter(store, peer="p", flush_interval=0.1)
        assert store.writer.flush_interval == 0.1
        TraceWriter(store, peer="q", flush_interval=5.0)
        assert store.writer.flush_interval == 0.1
        tracer.emit(Join(addrs=[], model="m"))
        tracer.close()  # flushes; the store stays open for its owner
        assert [e.peer for e in store.events()] == ["p"]
        store.record_identity("12D3KooWStillOpen")


def test_events_are_batched_one_transaction_per_interval(tmp_path):
    interval = 0.1
    with TraceWriter(tmp_path / "t.db", peer="p", flush_interval=interval) as tracer:
        writer = tracer.store.writer
        start = time.monotonic()
        for i in range(1500):
            tracer.emit(step(i))
            if i % 50 == 0:
                time.sleep(0.02)
        elapsed = time.monotonic() - start
        tracer.flush()
        batches = writer.batches
    assert elapsed > 2 * interval
    assert 2 <= batches <= elapsed / interval + 2, (batches, elapsed)
    assert writer.written == 1500 and writer.failed == 0


def test_emit_does_not_wait_for_a_locked_database(tmp_path, monkeypatch):
    monkeypatch.setattr(schema, "BUSY_TIMEOUT_S", 0.1)  # the writer gives up quickly and retries
    path = tmp_path / "t.db"
    store = PeerStore(path, flush_interval=0.02)
    tracer = TraceWriter(store, peer="p")
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another connection holds the write lock
    blocker.execute("INSERT INTO settings (key, value, updated) VALUES ('x', '1', 0)")
    emitted = threading.Event()

    def emit_all() -> None:
        for i in range(1000):
            tracer.emit(step(i))
        store.add_ledger("r", 10)
        emitted.set()

    threading.Thread(target=emit_all, daemon=True).start()
    assert emitted.wait(20), "emit blocked while another connection held the write lock"
    time.sleep(0.5)  # several failed write attempts (busy timeout 0.1 s) happen meanwhile
    assert store.writer.pending() == 1001  # nothing lost, nothing written yet
    blocker.execute("COMMIT")
    blocker.close()
    tracer.flush()
    assert _count(path) == 1000
    assert store.ledger()[0]["layer_tokens"] == 10
    assert store.writer.failed == 0 and store.writer.dropped == 0
    store.close()


CHILD = r"""
import sys, time
from tessera.store.events import Forward
from tessera.store.trace import TraceWriter
tracer = TraceWriter(sys.argv[1], peer="victim", flush_interval=0.25)
i = 0
while True:
    tracer.emit(Forward(session="5e55", step=i, span=(0, 1), duration=0.0005, start_pos=i, n_tokens=64))
    if i == 0:
        print("ready", flush=True)
    i += 1
    time.sleep(0.0005)
"""


def test_kill_9_loses_at_most_the_last_second(tmp_path):
    path = tmp_path / "victim.db"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(2.0)
        killed_at = time.time()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    count, last_step, last_wall = conn.execute("SELECT count(*), max(step), max(wall) FROM trace").fetchone()
    assert count > 100, "the child barely wrote anything"
    assert count == last_step + 1  # nothing missing in the middle: only the tail can be lost
    assert killed_at - last_wall < 1.0, f"lost {killed_at - last_wall:.2f} s of events"
    detail = conn.execute("SELECT detail FROM trace ORDER BY id DESC LIMIT 1").fetchone()[0]
    assert json.loads(detail) == {"start_pos": last_step, "n_tokens": 64}
    conn.close()
    with PeerStore(path) as store:  # and the peer can reopen it and carry on
        store.record_identity("12D3KooWAfterCrash")
        assert store.identity() == "12D3KooWAfterCrash"


def test_a_tracer_made_before_its_peer_id_is_bound_later(tmp_path):
    """The manual's `TraceWriter("requester.db")` for `Swarm.join(..., tracer=...)`: the requester's
    id exists only once it joins, and it binds it (issue 34, item 8)."""
    import pytest

    from tessera.store.db import PeerStore
    from tessera.store.errors import BadTraceField
    from tessera.store.events import Claim
    from tessera.store.trace import TraceWriter

    with TraceWriter(tmp_path / "requester.db") as tracer:
        with pytest.raises(BadTraceField, match="no peer id yet"):
            tracer.emit(Claim(span=(0, 1), throughput=1.0, capacity=1))
        tracer.bind("12D3KooWrequester")
        tracer.bind("12D3KooWsomeone-else")  # the first binding stays
        tracer.emit(Claim(span=(0, 1), throughput=1.0, capacity=1))
    with PeerStore(tmp_path / "requester.db", readonly=True) as store:
        assert [e.peer for e in store.events()] == ["12D3KooWrequester"]


def test_a_timeline_window_keeps_what_overlaps_it():
    from datetime import datetime

    import pytest

    from tessera.store.errors import BadTimeWindow
    from tessera.store.events import Forward
    from tessera.store.timeline import Event, Timeline, When, parse_when

    events = [Event(0, i, 0, 100.0 + i, "p", Forward(session=s, step=i, span=(0, 1), duration=0.5), t=float(i))
              for i, s in enumerate(["aa01", "aa01", "bb02", "bb02"])]
    timeline = Timeline([], events, {0: 0.0}, 0, 100.0)
    # each event ends at t and lasted 0.5 s: [0.8, 2.0] overlaps 1 ([0.5, 1]) and 2 ([1.5, 2]), not 3 ([2.5, 3])
    assert [e.id for e in timeline.window(When(seconds=0.8), When(seconds=2.0)).events] == [1, 2]
    assert [e.id for e in timeline.window(When(seconds=1.2), When(seconds=2.0)).events] == [2]
    assert [e.id for e in timeline.window(sessions=["BB"]).events] == [2, 3]
    assert [e.id for e in timeline.window(When(wall=102.6)).events] == [3]  # on the reference clock: t = 2.6
    with pytest.raises(BadTimeWindow, match="no sessions cc"):
        timeline.window(sessions=["cc"])
    with pytest.raises(BadTimeWindow, match="after --until"):
        timeline.window(When(seconds=3), When(seconds=1))
    assert parse_when("12.5") == When(seconds=12.5)
    day = datetime(2026, 12, 5, 9, 0)
    assert parse_when("14:03", today=day) == When(wall=datetime(2026, 12, 5, 14, 3).timestamp())
    assert parse_when("2026-12-05T14:03:20") == When(wall=datetime(2026, 12, 5, 14, 3, 20).timestamp())
    with pytest.raises(BadTimeWindow, match="not a time"):
        parse_when("soon")
