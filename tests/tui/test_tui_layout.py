"""The TUI's edges (issue 34, item 7), each driven by Textual's pilot (`run_test()`).

What an operator met: the event filter let other kinds through; toasts covered the events;
lines were cut at 100x32; at 80x24 the header was cut and the log had three lines; the
sparkline of an idle peer redrew twice a second. The screen is the real `TesseraApp`; the
peer behind it is a stand-in handle serving fixed snapshots (the real peer behind the same
screen is tests/tui/test_tui.py's), and the events come from a real sqlite trace.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from textual.widgets import Sparkline
from textual.widgets._toast import Toast

from tessera.store.db import PeerStore
from tessera.store.events import Claim, Join
from tessera.store.trace import TraceWriter
from tessera.tui.app import TesseraApp
from tessera.tui.event_log import EventsPanel
from tessera.tui.events import EventFilter
from tessera.tui.panels import PeerHeader
from tessera.tui.rates import RateHistory

PEER = "12D3KooWLdc6XuAzhCZ7VyqEHqMpDxgDCB3fmzYbKSN3RSpS6m6E"


def snapshot(**changes) -> dict:
    """What tui/snapshot.py reads off a serving peer, with `changes`."""
    base = {
        "phase": "serving", "at": time.monotonic(), "peer_id": PEER, "name": "attic-pc", "addrs": [],
        "model_id": "52174c24beeba6f6", "num_layers": 30, "span": [0, 15], "shard": None, "state": "serving",
        "throughput": 500.0, "memory_offered": 1 << 30, "memory_used": 200 << 20, "device": "cpu", "vram": None,
        "quant": "none", "uptime": 3725.0, "sessions": 0,
        "stats": {"steps": 0, "tokens": 0, "bytes_in": 0, "bytes_out": 0, "layer_tokens": 0, "refused": 0},
        "coverage": [1] * 30, "gaps": [], "serving": 3, "held": [[0, 30]], "fetch": None, "model": "smollm2-135m",
        "neighbours": [{"peer_id": f"12D3KooWneighbour{i:035d}", "name": f"n{i}", "rtt_ms": 1.5, "kind": "direct",
                        "span": [15, 30], "state": "serving"} for i in range(2)],
        "active": [], "paused": False, "accepting": True, "reachability": "hole-punched",
        "swarm": {"peers": 2, "join": ["/ip4/192.168.100.200/tcp/4001/p2p/" + PEER], "private": True},
        "forced_layers": True, "max_sessions": 16,
    }
    return {**base, **changes}


def done() -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(None)
    return future


class StandInHandle:
    """The calls `TesseraApp` makes of a `PeerHandle`, over snapshots a test sets."""

    def __init__(self, db_path: Path, snap: dict, lines: list[str] = ()) -> None:
        self.db_path = db_path
        self.snap = snap
        self.lines = [(time.time(), line) for line in lines]
        self.finished = threading.Event()
        self.error = None
        self.snapshot_error = None
        self.node = SimpleNamespace(out=lambda line: self.lines.append((time.time(), line)),
                                    config=SimpleNamespace(leave_grace=2.0))

    def latest(self) -> dict:
        return self.snap

    def lines_since(self, seen: int) -> tuple[list[tuple[float, str]], int]:
        return self.lines[seen:], len(self.lines)

    drain = pause = resume = staticmethod(done)


def trace(tmp_path: Path) -> Path:
    """A peer's database with a join and a claim in its trace."""
    path = tmp_path / "tessera.db"
    with PeerStore(path) as store:
        tracer = TraceWriter(store, peer=PEER)
        tracer.emit(Join(addrs=["/ip4/127.0.0.1/tcp/4001"], model="m"))
        tracer.emit(Claim(span=(0, 15), throughput=500.0, capacity=15))
        tracer.close()
        store.flush()
    return path


def screen_text(app: TesseraApp) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def log_text(app: TesseraApp) -> str:
    return "\n".join(strip.text for strip in app.query_one("#event-log").lines)


async def settle(pilot, seconds: float = 1.5) -> None:
    for _ in range(int(seconds / 0.1)):
        await pilot.pause(0.1)


def test_asking_for_some_kinds_shows_only_them(tmp_path):
    """`/claim` showed claims and, beside them, every line the peer printed and logged."""
    assert not EventFilter.parse("claim").printed and EventFilter.parse("claim peer").printed
    assert EventFilter.parse("").printed and EventFilter.parse("all").printed
    handle = StandInHandle(trace(tmp_path), snapshot(), ["listening on /ip4/127.0.0.1/tcp/4001"])

    async def scenario() -> dict[str, str]:
        seen = {}
        app = TesseraApp(handle)
        async with app.run_test(size=(100, 32)) as pilot:
            box = app.query_one("#event-filter")
            for text in ("", "claim", "claim peer"):
                box.value = text
                await settle(pilot, 2.0)
                seen[text] = log_text(app)
        return seen

    seen = asyncio.run(scenario())
    assert "claim" in seen[""] and "(peer)" in seen[""] and "join" in seen[""]
    assert "claim" in seen["claim"] and "(peer)" not in seen["claim"] and " join " not in seen["claim"]
    assert "claim" in seen["claim peer"] and "(peer)" in seen["claim peer"]


def test_notes_go_to_the_events_log_and_only_errors_toast_at_the_top(tmp_path):
    handle = StandInHandle(trace(tmp_path), snapshot())

    async def scenario():
        app = TesseraApp(handle)
        async with app.run_test(size=(80, 24), notifications=True) as pilot:
            await settle(pilot)
            await pilot.press("d")  # drain: "drain: done"
            await settle(pilot)
            assert not app.query(Toast), "an ordinary note became a toast"
            assert "(tui)         drain: done" in log_text(app)
            app.notify("cannot read the peer's state: boom", severity="error")
            await settle(pilot, 0.5)
            (toast,) = app.query(Toast)
            events = app.query_one(EventsPanel).region
            assert not toast.region.overlaps(events), (toast.region, events)
            assert "cannot read the peer's state: boom" in log_text(app)

    asyncio.run(scenario())


def test_at_80x24_the_header_fits_and_the_log_keeps_five_lines(tmp_path):
    """Two neighbours, a private swarm joined at a long address, a name: the header was cut
    (state, uptime, reachability and size are never cut now; the join address goes first) and
    the log had three lines (the idle filter box and the memory meter each took a row)."""
    handle = StandInHandle(trace(tmp_path), snapshot(name="attic-pc-in-the-garden"),
                           [f"line {i}" for i in range(20)])

    async def scenario():
        app = TesseraApp(handle)
        async with app.run_test(size=(80, 24)) as pilot:
            await settle(pilot)
            header = screen_text(app).splitlines()[0]
            for part in ("SERVING", PEER[-8:], "up 1:02:05", "reach: hole-punched", "3 peers"):
                assert part in header, header
            assert len(app.query_one(PeerHeader).render().plain) <= 80
            assert app.query_one("#event-log").size.height >= 5, screen_text(app)
            assert not app.query_one("#event-filter").display  # no row for an idle filter box
            await pilot.press("slash")
            assert app.query_one("#event-filter").display and app.focused is app.query_one("#event-filter")

    asyncio.run(scenario())


def test_at_100x32_long_lines_wrap_instead_of_being_cut(tmp_path):
    fetch = {"label": "layers [14, 16)", "done": 11 << 20, "total": 25 << 20, "skipped": 0, "rate": 3 << 20,
             "eta_s": 4.7, "peers": 2}
    long_line = "compute: cpu float32, 1 thread; one layer decodes a token in 1.78 ms (18.7 tok/s through 30 layers)"
    handle = StandInHandle(trace(tmp_path), snapshot(fetch=fetch, held=[]), [long_line])

    async def scenario() -> str:
        app = TesseraApp(handle)
        async with app.run_test(size=(100, 32)) as pilot:
            await settle(pilot)
            return screen_text(app)

    text = asyncio.run(scenario())
    flat = " ".join(line.strip("│ ").strip() for line in text.splitlines())
    assert "from 2 peers" in flat and "…" not in text, text  # the fetch line's end, not an ellipsis
    assert "through 30 layers)" in flat, text  # the printed line's end


def test_an_idle_sparkline_does_not_redraw(tmp_path):
    """After a burst the counter stands still: the sparkline's buckets sat on the newest sample
    and slid over the samples at every snapshot (twice a second); on a fixed grid they move
    once a bucket (5 s). With no tokens in the window at all nothing changes."""
    history = RateHistory(window=300.0)
    history.add(0.0, 0)
    history.add(1.0, 400)  # a burst
    series = set()
    for i in range(2, 20):  # 9 s of snapshots, 0.5 s apart, counter still
        history.add(1.0 + i * 0.5, 400)
        series.add(tuple(history.series(60)))
    assert len(series) <= 3  # the grid moved at most twice in 9 s (5 s buckets), not 18 times
    handle = StandInHandle(trace(tmp_path), snapshot())

    async def scenario() -> int:
        app = TesseraApp(handle)
        async with app.run_test(size=(80, 24)) as pilot:
            await settle(pilot, 1.0)
            spark = app.query_one(Sparkline)
            changes = []
            spark.watch(spark, "data", lambda value: changes.append(value), init=False)
            for _ in range(12):  # 6 s of idle snapshots at 0 tok/s
                handle.snap = snapshot(at=time.monotonic())
                await pilot.pause(0.5)
            return len(changes)

    assert asyncio.run(scenario()) == 0
