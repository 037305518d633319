"""The operator's TUI, driven by Textual's pilot over a real peer in a loopback swarm.

The peer under the UI is an in-process `PeerNode` behind `tessera.tui.bridge.PeerHandle`
(its own trio thread, as `tessera peer --tui` runs it); the rest of the swarm is a
real `tessera peer` process; requests come from a `tessera.peer.request.client.Swarm` in another
thread. Textual runs on asyncio, so each UI test is a plain function that runs its
scenario with `asyncio.run` (this suite's async tests run under trio).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from pathlib import Path

import pytest
import trio

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import memory_for_layers
from tessera.peer.base.errors import NoRoute, SessionRefused
from tessera.peer.node.config import PeerConfig
from tessera.peer.node.compose import build_peer
from tessera.peer.request.chain import RouteSession
from tessera.peer.plan.routing import Hop, Route
from tessera.stages.decoding.generate import prompt_ids
from tessera.store.db import PeerStore
from tessera.store.events import Drain, Leave, Pause, Resume
from tessera.tui.app import TesseraApp
from tessera.tui.bridge import PeerHandle, PeerNotRunning
from tessera.tui.panels import LedgerPanel, LivePanel, PeerHeader, PeerPanel, SwarmPanel
from tessera.tui.render import state_word
from tessera.tui.screens import ConfirmScreen, HelpScreen, MemoryDialog

from ..conftest import FRANCE
from ..screenshots import offline_svg, screenshot_dir
from ..swarm_helpers import local_swarm

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
STARTUP = 120.0  # a peer imports, measures a layer and loads its span (slow on a busy 2-core box)
SETTLE = 30.0  # for the UI to show a change the peer has made (snapshots every 0.5 s)
LEAVE_GRACE = 2.0  # the node under test gives held sessions this long when it leaves
MAX_NEW = 12


# -- against a real peer -----------------------------------------------------------------

@pytest.fixture(scope="module")
def other_peer(smol_dir):
    """The rest of the swarm: a `tessera peer` process serving layers [10, 30)."""
    with local_swarm([(10, 30)]) as swarm:
        yield swarm


def make_handle(tmp_path: Path, join: list[str], **config) -> PeerHandle:
    settings = dict(layers=(0, 15), memory_gb=1.0, leave_grace=LEAVE_GRACE, rebalance_interval=3600.0,
                    listen=["/ip4/127.0.0.1/tcp/0"])
    settings.update(config)
    node = build_peer(PeerConfig(join=join, data_dir=tmp_path / "tui-peer", threads=1, name="tui-peer", **settings))
    handle = PeerHandle(node)
    handle.start()
    return handle


def stop_now(handle: PeerHandle) -> None:
    """End a peer that is still running, without grace: running answers back, then its loop."""
    for stop in (handle.force_stop, handle.abort):
        try:
            stop()
        except PeerNotRunning:
            return
        if handle.join(LEAVE_GRACE + SETTLE):
            return


@pytest.fixture
def start_peer(tmp_path):
    """`make_handle` for one test. A peer the test did not see leave (it failed first) is stopped
    at its end: left running, it would serve [0, 15) to every later test here (a second cover,
    a route where the test wants none)."""
    started: list[PeerHandle] = []

    def start(join: list[str], **config) -> PeerHandle:
        started.append(handle := make_handle(tmp_path, join, **config))
        return handle

    yield start
    for handle in started:
        if not handle.finished.is_set():
            stop_now(handle)


def plain(widget) -> str:
    """What a panel draws, as plain text."""
    return widget.render().plain


def log_text(app: TesseraApp) -> str:
    return "\n".join(strip.text for strip in app.query_one("#event-log").lines)


async def until(pilot, predicate, what: str, timeout: float = SETTLE, *, peer: PeerHandle | None = None) -> None:
    """Poll `predicate` while the UI runs; on timeout, fail saying what the peer last did."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}" + (told(peer) if peer else ""))
        await pilot.pause(0.1)


def told(handle: PeerHandle) -> str:
    """The peer's state, error and last lines, for a failure message (CI shows only the message)."""
    lines = [line for _, line in handle.lines_since(0)[0]][-8:]
    return (f"; peer finished={handle.finished.is_set()} error={handle.error!r}; its last lines: "
            + " | ".join(lines))


def left(handle: PeerHandle) -> None:
    """The peer's thread ended cleanly (it leaves within its grace; a loaded CI box is slow)."""
    assert handle.join(LEAVE_GRACE + SETTLE), "the peer's thread is still running" + told(handle)
    assert handle.error is None, told(handle)


def my_addr(handle: PeerHandle) -> str:
    return handle.latest()["addrs"][0]


def generate(addrs: list[str], n: int) -> tuple[list[int], list[int], dict]:
    """A requester in its own thread and trio loop: one greedy answer through the swarm."""
    async def go():
        async with Swarm.join(addrs) as swarm:
            await swarm.wait_for_route(60)
            ids = prompt_ids(swarm.tokenizer, FRANCE, raw=False)
            info: dict = {}
            tokens = [t async for t in swarm.generate_ids(ids, max_new_tokens=n, info=info)]
            return ids, tokens, info

    return trio.run(go)


@pytest.mark.slow
def test_main_screen_shows_span_coverage_and_live_counters(other_peer, start_peer, local_engine, smol_tokenizer):
    """A generation through the peer under the UI: the panels show what it served, exactly."""
    handle = start_peer(other_peer.addrs)

    async def scenario():
        app = TesseraApp(handle)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: handle.ready.is_set(), "the peer to serve", STARTUP, peer=handle)
            await until(pilot, lambda: app.snapshot and app.snapshot["phase"] == "serving"
                        and not app.snapshot["gaps"], "full coverage")
            peer_text = plain(app.query_one(PeerPanel))
            assert "[0, 15) of 30 (forced)" in peer_text
            assert "█" * 15 + "░" * 15 in peer_text
            swarm_text = plain(app.query_one(SwarmPanel))
            assert "1" * 10 + "2" * 5 + "1" * 15 in swarm_text  # [0,10) me; [10,15) both; [15,30) the other
            assert "gaps: none" in swarm_text
            assert "SERVING" in plain(app.query_one(PeerHeader))

            ids, tokens, info = await asyncio.to_thread(generate, [my_addr(handle)], MAX_NEW)
            mine = [h for h in info["route"] if h["peer"] == handle.latest()["peer_id"]]
            assert len(mine) == 1 and mine[0]["start"] == 0  # only this peer serves layer 0
            steps, served = len(tokens), len(ids) + len(tokens) - 1  # prefill + one step per later token
            await until(pilot, lambda: app.snapshot["stats"]["steps"] == steps, "the steps to show")
            live = app.query_one(LivePanel)
            counters = str(live.query_one("#counters").render())
            assert f"steps {steps}" in counters and f"tokens {served}" in counters
            assert max(app.rates) > 0 and live.peak > 0  # the sparkline saw tokens go through
            stats = app.snapshot["stats"]
            assert stats["bytes_in"] > 0 and stats["bytes_out"] > 0
            assert stats["layer_tokens"] == served * (mine[0]["end"] - mine[0]["start"])
            await until(pilot, lambda: app.ledger and app.ledger["today"]["steps"] == steps, "the ledger")
            ledger_text = plain(app.query_one(LedgerPanel))
            assert f"{stats['layer_tokens']:>10}{steps:>8}" in ledger_text
            await until(pilot, lambda: "session_close" in log_text(app), "the session in the events")
            assert "session_open" in log_text(app) and "serving layers [0, 15) of 30" in log_text(app)

            ARTIFACTS.mkdir(exist_ok=True)
            shot = app.save_screenshot("tui-main.svg", path=str(ARTIFACTS))
            assert "This&#160;peer" in Path(shot).read_text()  # SVG text keeps spaces as &#160;
            if (folder := screenshot_dir()) is not None:  # make screenshots: the manual's picture of the TUI
                (folder / "tui.svg").write_text(offline_svg(app.export_screenshot()))
            # The event came from the trace; the snapshot the question reads is taken every 0.5 s
            # and can still hold the session (a q then asks, and this test would wait for ever).
            await until(pilot, lambda: not app.snapshot["active"], "the session to end", peer=handle)
            await pilot.press("q")  # no sessions running: no question
            await until(pilot, lambda: handle.finished.is_set(), "the peer to leave", LEAVE_GRACE + SETTLE, peer=handle)
            await pilot.pause(0.5)
        return tokens

    tokens = asyncio.run(scenario())
    assert tokens == local_engine.generate_ids(prompt_ids(smol_tokenizer, FRANCE, raw=False), max_new_tokens=MAX_NEW)
    left(handle)


def try_sessions(addrs: list[str], me: str) -> tuple[BaseException, BaseException]:
    """Ask the swarm for an answer (the view says we drain: no route), then ask us directly."""
    async def go():
        async with Swarm.join(addrs) as swarm:
            ids = prompt_ids(swarm.tokenizer, FRANCE, raw=False)
            with pytest.raises(NoRoute) as no_route:
                async for _ in swarm.generate_ids(ids, max_new_tokens=2, route_wait=3.0):
                    pass
            with pytest.raises(SessionRefused) as refused:
                await RouteSession(swarm.ctx, Route((Hop(me, 0, 15),), 0.0), max_length=64).open()
            return no_route.value, refused.value

    return trio.run(go)


@pytest.mark.slow
def test_drain_key_refuses_new_sessions_and_quit_leaves(other_peer, start_peer):
    handle = start_peer(other_peer.addrs)

    async def scenario():
        app = TesseraApp(handle)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.state == "serving", "the peer to serve", STARTUP, peer=handle)
            await pilot.press("d")
            await until(pilot, lambda: app.state == "draining" and not app.snapshot["accepting"], "draining")
            assert "DRAINING" in plain(app.query_one(PeerHeader))
            me = app.snapshot["peer_id"]
            no_route, refused = await asyncio.to_thread(try_sessions, [my_addr(handle)], me)
            assert isinstance(no_route, NoRoute)  # only a draining peer serves layers 0..9
            assert refused.code == "draining"
            await until(pilot, lambda: app.snapshot["stats"]["refused"] >= 1, "the refusal to be counted")
            await pilot.press("q")
            await until(pilot, lambda: handle.finished.is_set(), "the peer to leave", LEAVE_GRACE + SETTLE, peer=handle)
            await until(pilot, lambda: app.return_code is not None, "the app to exit")
        return app.return_code

    assert asyncio.run(scenario()) == 0, told(handle)
    left(handle)
    assert handle.printed("left the swarm")
    with PeerStore(handle.db_path, readonly=True) as store:
        assert [e.kind for e in store.events(kinds=(Leave,))] == ["leave"]


def hold_session(addrs: list[str], me: str, opened: threading.Event, release: threading.Event,
                 out: dict) -> None:
    """Keep one session open on our peer (in the requester's own thread) until `release`."""
    async def go():
        async with Swarm.join(addrs) as swarm:
            out["requester"] = swarm.peer_id
            session = RouteSession(swarm.ctx, Route((Hop(me, 0, 15),), 0.0), max_length=64)
            await session.open()
            opened.set()
            await trio.to_thread.run_sync(release.wait)
            with trio.move_on_after(5):
                await session.close()  # the peer may have dropped it already by leaving

    trio.run(go)


@pytest.mark.slow
def test_actions_that_would_drop_work_ask_first(other_peer, start_peer):
    """Quit and pause with a session running ask first; `n` keeps serving; leave asks, then leaves."""
    handle = start_peer(other_peer.addrs)
    opened, release, out = threading.Event(), threading.Event(), {}

    async def scenario():
        app = TesseraApp(handle)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.state == "serving", "the peer to serve", STARTUP, peer=handle)
            holder = threading.Thread(target=hold_session, args=([my_addr(handle)], app.snapshot["peer_id"],
                                                                 opened, release, out))
            holder.start()
            try:
                await until(pilot, lambda: app.snapshot["active"], "the held session")
                sessions = str(app.query_one(LivePanel).query_one("#sessions").render())
                assert "sessions 1/16" in sessions and out["requester"][-8:] in sessions

                await pilot.press("q")
                await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the quit question")
                assert "1 session running" in str(app.screen.question)
                await pilot.press("n")
                await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen), "the answer")
                await pilot.pause(1.0)
                assert app.state == "serving" and not handle.finished.is_set() and not app.quitting

                await pilot.press("p")
                await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the pause question")
                await pilot.press("y")
                await until(pilot, lambda: app.state == "paused", "paused")
                assert "PAUSED" in plain(app.query_one(PeerHeader))
                await pilot.press("p")  # resuming drops nothing: no question
                await until(pilot, lambda: app.state == "serving", "resumed")

                await pilot.press("l")
                await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the leave question")
                await pilot.press("y")
                await until(pilot, lambda: handle.finished.is_set(), "the peer to leave", LEAVE_GRACE + SETTLE, peer=handle)
                await until(pilot, lambda: app.state == "left", "the header to say so")
                swarm = plain(app.query_one(SwarmPanel))  # a peer that left serves nothing (issue 34, item 3)
                assert "(of 1 serving)" in swarm and "GAPS: [0, 10)" in swarm, swarm
                assert app.return_code is None  # leaving keeps the screen open
                assert "LEFT" in plain(app.query_one(PeerHeader))
                await pilot.press("q")  # the peer is gone: q just closes
                await until(pilot, lambda: app.return_code is not None, "the app to exit")
            finally:
                release.set()
                await asyncio.to_thread(holder.join, 30)

    asyncio.run(scenario())
    left(handle)
    assert handle.printed("left the swarm")


@pytest.mark.slow
def test_memory_dialog_and_help_screen(other_peer, start_peer):
    """`m` checks what is typed and asks before a change that moves the span; `?` lists the keys."""
    offered = memory_for_layers("smollm2-135m", 30)  # room for every layer: placement claims [0, 30)
    handle = start_peer(other_peer.addrs, layers=None, memory_gb=offered)

    async def scenario():
        app = TesseraApp(handle)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.state == "serving", "the peer to serve", STARTUP, peer=handle)
            assert app.snapshot["span"] == [0, 30]

            await pilot.press("question_mark")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
            shown = " ".join(str(w.render()) for w in app.screen.query(".key"))
            for key in "dpmlq?":
                assert f"{key}  " in shown
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, HelpScreen), "the help to close")

            await pilot.press("m")
            await until(pilot, lambda: isinstance(app.screen, MemoryDialog), "the memory dialog")
            dialog = app.screen
            dialog.query_one("#gb").value = "lots"
            await pilot.press("enter")
            await until(pilot, lambda: "not a number" in str(dialog.query_one("#error").render()), "the error")
            assert isinstance(app.screen, MemoryDialog)  # still asking
            small = memory_for_layers("smollm2-135m", 10)
            dialog.query_one("#gb").value = f"{small:.4f}"
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the move question")
            assert "[0, 30) to [0, 10)" in str(app.screen.question)  # the gap nobody else serves
            await pilot.press("n")
            await pilot.pause(1.0)
            assert app.snapshot["span"] == [0, 30]  # declined: nothing moved

            await pilot.press("m")
            await until(pilot, lambda: isinstance(app.screen, MemoryDialog), "the memory dialog")
            app.screen.query_one("#gb").value = f"{small:.4f}"
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the move question")
            await pilot.press("y")
            await until(pilot, lambda: app.snapshot["span"] == [0, 10] and app.state == "serving", "the move")
            assert "█" * 10 + "░" * 20 in plain(app.query_one(PeerPanel))
            assert app.snapshot["memory_offered"] == int(float(f"{small:.4f}") * (1 << 30))
            await pilot.press("q")
            await until(pilot, lambda: handle.finished.is_set(), "the peer to leave", LEAVE_GRACE + SETTLE, peer=handle)

    asyncio.run(scenario())
    left(handle)


def test_this_peer_panel_shows_a_fetch_under_way_and_the_layers_on_disk():
    from textual.app import App

    class OnePanel(App):
        def compose(self):
            yield PeerPanel()

    base = {"model": "smollm2-135m", "model_id": "abcdef0123", "device": "cpu", "span": [14, 16], "shard": None,
            "num_layers": 30, "forced_layers": True, "memory_used": 0, "memory_offered": 1 << 30,
            "throughput": 0.0, "quant": "none", "vram": None, "held": [[0, 30]], "fetch": None}
    fetch = {"label": "layers [14, 16)", "done": 11 << 20, "total": 25 << 20, "skipped": 0, "rate": 3 << 20,
             "eta_s": 4.7, "peers": 2}

    async def scenario() -> list[str]:
        app = OnePanel()
        seen = []
        async with app.run_test(size=(80, 24)) as pilot:
            panel = app.query_one(PeerPanel)
            for snap in (base, {**base, "held": [], "fetch": fetch}, {**base, "held": [[0, 8], [14, 16]]}):
                panel.snapshot = snap
                await pilot.pause()
                seen.append(panel.render().plain)
        return seen

    whole, fetching, fetched = asyncio.run(scenario())
    assert "fetching" not in whole and "on disk" not in whole  # a whole model: no row spent on it
    assert "fetching layers [14, 16): 11.0 MB/25.0 MB (44%) · 3.0 MB/s · ETA 0:00:04 · from 2 peers" in fetching
    lines = fetching.splitlines()
    bar = lines[next(i for i, line in enumerate(lines) if "fetching" in line) + 1]
    assert 0.35 < bar.count("█") / len(bar.strip()) < 0.53, bar  # 44% of the bar filled
    assert "on disk [0, 8) [14, 16)" in fetched and "fetching" not in fetched


def test_state_words_read_without_colour():
    base = {"phase": "serving", "state": "serving", "paused": False, "span": [0, 1]}
    assert state_word(base) == "serving"
    assert state_word({**base, "paused": True}) == "paused"
    assert state_word({**base, "phase": "starting", "span": None}) == "starting"
    assert state_word({**base, "phase": "starting"}) == "loading"
    assert state_word({**base, "phase": "stopped", "state": "leaving"}) == "left"


# -- layout, the events log, typing, operator events (one peer under several UIs) ---------

@pytest.fixture(scope="module")
def ui_peer(other_peer, tmp_path_factory):
    """One in-process peer serving [0, 15) behind a handle, shared by the UIs below (the last one drains it)."""
    handle = make_handle(tmp_path_factory.mktemp("ui"), other_peer.addrs)
    assert handle.wait_ready(STARTUP), handle.error
    yield handle
    try:
        handle.leave()
    except PeerNotRunning:
        pass
    handle.join(LEAVE_GRACE + SETTLE)


def rows(widget) -> int:
    return plain(widget).count("\n") + 1


def swarm_snapshot(neighbours: int) -> dict:
    """The keys SwarmPanel draws, for `neighbours` neighbours."""
    return {"coverage": [1] * 30, "gaps": [], "serving": neighbours + 1, "swarm": {"peers": neighbours},
            "neighbours": [{"peer_id": f"12D3KooWpeer{i:08d}", "name": f"n{i}", "rtt_ms": 1.5, "kind": "direct",
                            "span": [0, 30], "state": "serving"} for i in range(neighbours)]}


@pytest.mark.parametrize("size", [(80, 24), (100, 32)])
def test_swarm_panel_grows_and_shrinks_with_its_rows(size):
    """The panel's height is `auto`: a new neighbour (and nothing else changing) must lay it out
    again; a repaint alone kept the height of the first layout ("waiting…": one line)."""
    from textual.app import App

    class OnePanel(App):
        CSS = "SwarmPanel { height: auto; border: round white; }"

        def compose(self):
            yield SwarmPanel()

    async def scenario():
        app = OnePanel()
        async with app.run_test(size=size) as pilot:
            panel = app.query_one(SwarmPanel)
            await pilot.pause()
            assert panel.content_size.height == 1  # "waiting for the peer…"
            for n in (0, 1, 2, 5, 1):
                panel.snapshot = swarm_snapshot(n)
                await pilot.pause()
                assert panel.content_size.height == rows(panel), (n, panel.content_size.height, rows(panel))

    asyncio.run(scenario())


@pytest.mark.slow
def test_panels_show_all_their_rows_at_80x24_and_100x32(ui_peer):
    """At 100x32 the Swarm panel stayed one line high (its first layout drew "waiting…") until a resize."""
    async def at(size: tuple[int, int]) -> None:
        app = TesseraApp(ui_peer)
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.snapshot and app.snapshot["neighbours"] and app.ledger, "neighbours")
            await until(pilot, lambda: "neighbours" in plain(app.query_one(SwarmPanel)), "the swarm panel")
            await pilot.pause()
            for panel in (app.query_one(PeerPanel), app.query_one(SwarmPanel), app.query_one(LedgerPanel)):
                assert panel.content_size.height >= rows(panel), \
                    f"{type(panel).__name__} at {size}: {panel.content_size.height} of {rows(panel)} rows shown"
            assert app.query_one("#event-log").size.height >= 2  # and the log keeps room of its own

    for size in ((100, 32), (80, 24)):
        asyncio.run(at(size))


def test_start_up_lines_say_memory_device_and_speed(ui_peer):
    """What `tessera peer` prints once it serves (without the UI these lines go to stdout)."""
    node = ui_peer.node
    weights = node.stage.weight_bytes / (1 << 30)
    assert ui_peer.printed(f"memory: {weights:.2f} GB used by the weights of layers [0, 15) + up to 0.25 GB "
                           "for KV caches, of 1.00 GB offered")  # make_handle offers 1 GB; a quarter is for KV
    assert ui_peer.printed("compute: cpu float32, 1 thread; one layer decodes a token in ")
    ms = 1000 / node.throughput
    assert ui_peer.printed(f"in {ms:.2f} ms ({node.throughput / 15:.1f} tok/s through 15 layers)")


@pytest.mark.slow
def test_a_draining_peer_shows_the_gap_routing_sees(ui_peer):
    """Issue 34, item 3: draining, the TUI said "gaps: none" while `swarm status` and every
    requester saw [0, 10) uncovered. Both now read peer/plan/coverage.py, with this peer as it is now."""
    async def scenario():
        app = TesseraApp(ui_peer)
        async with app.run_test(size=(100, 32)) as pilot:
            await until(pilot, lambda: app.state == "serving" and app.snapshot["serving"] == 2, "two serving")
            swarm = app.query_one(SwarmPanel)
            assert "gaps: none" in plain(swarm) and "(of 2 serving)" in plain(swarm)
            await pilot.press("d")
            await until(pilot, lambda: app.state == "draining", "draining")
            await until(pilot, lambda: "GAPS: [0, 10)" in plain(swarm), "the gap the drain opens", peer=ui_peer)
            assert "(of 1 serving)" in plain(swarm)
            assert app.snapshot["coverage"] == [0] * 10 + [1] * 20  # the other peer's [10, 30) only
            await pilot.press("p")  # resume
            await until(pilot, lambda: app.state == "serving" and "gaps: none" in plain(swarm), "covered again")

    asyncio.run(scenario())


def burst_of_keys(app: TesseraApp, keys: str) -> None:
    """Keys as a fast typist sends them: all queued before the app handles the first."""
    from textual import events

    for char in keys:
        event = events.Key("slash" if char == "/" else char, char)
        event.set_sender(app)
        app.post_message(event)


def at_tail(log) -> bool:
    return log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y


@pytest.mark.slow
def test_events_tail_filter_typing_and_operator_events(ui_peer):
    """At 80x24: the log shows its newest lines (and stays put while scrolled up); "/" then fast
    typing goes to the filter box; drain, resume, pause, resume each leave an event in the log;
    the peer's logging shows in the log too."""
    for i in range(40):
        ui_peer.node.out(f"backlog line {i}")

    # the peer is shared with other tests: theirs are the events stamped before this one began
    since = time.time()

    def operator_events() -> list[str]:
        with PeerStore(ui_peer.db_path, readonly=True) as store:
            return [e.kind for e in store.events(kinds=(Drain, Pause, Resume)) if e.wall >= since]

    async def scenario():
        app = TesseraApp(ui_peer)
        async with app.run_test(size=(80, 24)) as pilot:
            log = app.query_one("#event-log")
            await until(pilot, lambda: "backlog line 39" in log_text(app) and app.snapshot, "the backlog")
            # lines keep arriving (the peer's own events), and the log scrolls after each repaint
            await until(pilot, lambda: at_tail(log), "the log to show its tail")
            await pilot.resize_terminal(80, 20)  # the log gets shorter, as when the panels grow
            await until(pilot, lambda: at_tail(log), "the shorter log to show its tail")

            log.scroll_to(y=0, animate=False)  # the operator reads further up
            await pilot.pause()
            ui_peer.node.out("a line while reading up")
            await until(pilot, lambda: "a line while reading up" in log_text(app), "the new line")
            await pilot.pause()
            assert log.scroll_y == 0  # left where the operator is reading
            log.scroll_end(animate=False)
            await pilot.pause()
            logging.getLogger("tessera.peer.net.gossip").warning("a warning while the UI runs")
            # a logged line is long: the log wraps it (issue 34) over two rows
            await until(pilot, lambda: "a warning while the UI runs" in " ".join(log_text(app).split()), "the warning")
            await until(pilot, lambda: at_tail(log), "the log to follow again")  # back at the end: following

            burst_of_keys(app, "/claim")
            await pilot.pause()
            assert len(app.screen_stack) == 1, app.screen  # no memory dialog, no leave question
            box = app.query_one("#event-filter")
            assert box.value == "claim" and app.focused is box
            await until(pilot, lambda: re.search(r"\d\d:\d\d:\d\d claim\s", log_text(app))
                        and not re.search(r"\d\d:\d\d:\d\d join\s", log_text(app)), "only claims shown")
            await pilot.press("escape")
            box.value = ""

            for key, state in (("d", "draining"), ("p", "serving"), ("p", "paused"), ("p", "serving")):
                await pilot.press(key)
                await until(pilot, lambda: app.state == state, state)
            await until(pilot, lambda: all(re.search(rf"\d\d:\d\d:\d\d {kind}\s", log_text(app))
                                           for kind in ("drain", "pause", "resume")), "the operator's events")

    asyncio.run(scenario())

    # the trace writer commits in batches: the last resume may land a moment after the UI shows it
    deadline = time.monotonic() + 15
    while len(kinds := operator_events()) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kinds == ["drain", "resume", "pause", "resume"]
