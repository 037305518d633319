"""The operator's terminal UI: `tessera peer ... --tui`.

    from tessera.tui.app import run_with_tui
    run_with_tui(build_peer(config))    # serves while the UI runs; `q` leaves gracefully

The peer runs in its own thread behind a `PeerHandle` (tui/bridge.py: why a thread,
and the only calls that cross); the app pulls the handle's latest snapshot a few
times a second into the reactive `snapshot`, which the panels are bound to. The
trace and the ledger are sqlite reads, done in thread workers on a read-only
connection of the UI's own (tui/events.py). Layout is in app.tcss. While the app
runs, logging goes to the Events panel, and the screen is drawn on the terminal
even when stderr is a file (tui/terminal.py).

Keys: d drain, p pause/resume, m memory offered, l leave, q quit, / filter events,
? help. An action that would drop work asks first: pausing or quitting with
sessions running, leaving, and a memory change that moves the span.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import signal
import sys
import traceback

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.css.query import NoMatches
from textual.reactive import var
from textual.widgets import Footer, Input, RichLog
from textual.worker import get_current_worker

from tessera.peer.node.config import MOVE_GRACE
from tessera.peer.node.peer_node import PeerNode
from tessera.store.errors import StoreError

from tessera.tui.bridge import SNAPSHOT_INTERVAL, PeerHandle, PeerNotRunning
from tessera.tui.event_log import EventsPanel
from tessera.tui.events import StoreReader
from tessera.tui.panels import LedgerPanel, LivePanel, PeerHeader, PeerPanel, SwarmPanel
from tessera.tui.rates import RateHistory
from tessera.tui.render import fmt_span, state_word
from tessera.tui.screens import ConfirmScreen, HelpScreen, MemoryDialog
from tessera.tui.terminal import driver_for, logs_to, ui_terminal

LEDGER_INTERVAL = 2.0  # seconds between ledger reads: it changes once per step, a person reads it slower
FINISH_MARGIN = 10.0  # beyond the peer's leave grace, for it to close its host and store
GB = 1 << 30
SPARK_BUCKETS = 60  # the sparkline's 5 minutes (rates.WINDOW) in 5-second averages
PEER_ACTIONS = ("drain", "toggle_pause", "memory", "leave", "quit")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class TesseraApp(App[int]):
    """The main screen over one running peer (see module docstring)."""

    CSS_PATH = "app.tcss"
    TITLE = "tessera"
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = "#event-log"  # not the filter box: letters there would be typed, not obeyed
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-medium"), (160, "-wide")]
    BINDINGS = [
        Binding("d", "drain", "drain"),
        Binding("p", "toggle_pause", "pause/resume"),
        Binding("m", "memory", "memory"),
        Binding("l", "leave", "leave"),
        Binding("q", "quit", "quit"),
        # As without the UI: the first Ctrl-C leaves gracefully, a second one stops at once.
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("question_mark", "help", "help"),
        # priority: run as the key arrives, before the next key is handed to the focused widget
        # (a normal binding runs when the key has bubbled up from the log, by which time fast
        # typing had sent "claim" to the global keys: `l` asked to leave, `m` opened memory)
        Binding("slash", "filter", "filter", show=False, priority=True),
        Binding("escape", "focus_log", "back to the log", show=False),
    ]

    # State, not drawing: `var`s (reactives that never repaint the app, which would
    # repaint the whole screen). The panels bound to them repaint what changed.
    snapshot: var[dict | None] = var(None)
    rates: var[tuple[float, ...]] = var(())
    rate_now: var[float] = var(0.0)
    rate_peak: var[float] = var(0.0)
    ledger: var[dict | None] = var(None)
    quitting: var[bool] = var(False)  # q was confirmed: exit once the peer has left
    state: var[str] = var("starting")  # state_word(snapshot): which keys apply

    def __init__(self, handle: PeerHandle, *, leave_on_sigterm: bool = False, driver_class: type | None = None) -> None:
        super().__init__(driver_class=driver_class)
        self.handle = handle
        self.leave_on_sigterm = leave_on_sigterm
        self.reader = StoreReader(handle.db_path)
        self.history = RateHistory()
        self._ledger_worker = None
        self._reported_end = False
        self._reported_snapshot_error: str | None = None
        self._logs = contextlib.ExitStack()  # logging goes to the Events panel while the app runs

    def compose(self) -> ComposeResult:
        yield PeerHeader(id="header").data_bind(TesseraApp.snapshot)
        with Grid(id="panels"):
            yield PeerPanel(id="peer", classes="panel").data_bind(TesseraApp.snapshot)
            yield LivePanel(id="live", classes="panel").data_bind(
                TesseraApp.snapshot, TesseraApp.rates, TesseraApp.rate_now, peak=TesseraApp.rate_peak)
            yield SwarmPanel(id="swarm", classes="panel").data_bind(TesseraApp.snapshot)
            yield LedgerPanel(id="ledger", classes="panel").data_bind(TesseraApp.ledger)
        yield EventsPanel(self.reader, self.handle.lines_since, id="events", classes="panel")
        yield Footer()

    def on_mount(self) -> None:
        self._logs.enter_context(logs_to(self.handle.node.out))
        if self.leave_on_sigterm:  # `kill PID` (a service manager) stops the peer as cleanly as q does,
            # and so does `kill -INT PID` (Ctrl-C typed here is a key, not a signal: the binding above);
            # without a handler, an outside SIGINT went unheard while Textual held the main thread
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self.on_stop_signal)
            loop.add_signal_handler(signal.SIGINT, self.on_stop_signal)
        self.set_interval(SNAPSHOT_INTERVAL / 2, self.pull_snapshot)
        self.set_interval(LEDGER_INTERVAL, self.refresh_ledger)
        self.refresh_ledger()

    def on_unmount(self) -> None:
        self._logs.close()
        self.reader.close()

    # -- state --------------------------------------------------------------------------

    def pull_snapshot(self) -> None:
        """Take the handle's newest snapshot (never waits on the peer)."""
        latest = self.handle.latest()
        if latest is not None and latest is not self.snapshot:
            self.snapshot = latest
        error = self.handle.snapshot_error
        if error and error != self._reported_snapshot_error:
            self._reported_snapshot_error = error
            self.notify(f"cannot read the peer's state: {error}", severity="error")
        if self.handle.finished.is_set():
            self._peer_ended()

    def watch_snapshot(self, snapshot: dict | None) -> None:
        if snapshot is None:
            return
        self.state = state_word(snapshot)
        if self.history.add(snapshot["at"], snapshot["stats"]["tokens"]):
            self.rates = tuple(self.history.series(SPARK_BUCKETS))
            self.rate_now = self.history.current()
            self.rate_peak = self.history.peak

    def watch_state(self, state: str) -> None:
        self.sub_title = state
        self.refresh_bindings()  # which keys apply depends on the state

    def _peer_ended(self) -> None:
        if self.quitting:
            self.exit(return_code=0 if self.handle.error is None else 1)
            return
        if not self._reported_end:
            self._reported_end = True
            error = self.handle.error
            if error is not None:
                self.notify(f"the peer stopped: {type(error).__name__}: {error}", severity="error", timeout=30)
                self.query_one("#event-log", RichLog).write(f"(the peer stopped: {type(error).__name__}: {error})")
            else:
                self.notify("the peer has left the swarm; q closes this screen", timeout=10)

    @work(thread=True, exclusive=True, group="ledger", exit_on_error=False)
    def read_ledger(self) -> None:
        worker = get_current_worker()
        try:
            summary = self.reader.store.ledger_summary()
        except StoreError:
            return  # the next tick tries again; the panel keeps the last figures
        if not worker.is_cancelled:
            self.call_from_thread(setattr, self, "ledger", summary)

    def refresh_ledger(self) -> None:
        if self._ledger_worker is None or not self._ledger_worker.is_running:
            self._ledger_worker = self.read_ledger()

    # -- keys ---------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """True: the key applies now; None: shown but does nothing in this state."""
        if action in PEER_ACTIONS and len(self.screen_stack) > 1:
            return False  # a dialog is open: answer it first
        if action == "filter" and (len(self.screen_stack) > 1 or isinstance(self.focused, Input)):
            return False  # "/" is a character there: the box being typed in takes it
        state = self.state
        over = self.handle.finished.is_set() or self.quitting
        if action == "drain":
            return None if over or state != "serving" else True
        if action == "toggle_pause":
            return None if over or state not in ("serving", "draining", "paused") else True
        if action == "memory":
            return None if over or state not in ("serving", "draining", "paused") else True
        if action == "leave":
            return None if over or state in ("leaving", "left", "stopped") else True
        return True

    def active_sessions(self) -> int:
        return len(self.snapshot["active"]) if self.snapshot else 0

    async def confirm(self, question: str, yes: str) -> bool:
        return bool(await self.push_screen_wait(ConfirmScreen(question, yes=yes)))

    def action_drain(self) -> None:
        self.run_command("drain", self.handle.drain)

    @work(group="dialogs", exclusive=True)
    async def action_toggle_pause(self) -> None:
        if self.state in ("paused", "draining"):
            self.run_command("resume", self.handle.resume)
            return
        n = self.active_sessions()
        if n and not await self.confirm(
            f"{_plural(n, 'session')} running here. Pausing holds their steps, so their requesters "
            "will fail over to other peers. Pause?", yes="Pause"):
            return
        self.run_command("pause", self.handle.pause)

    @work(group="dialogs", exclusive=True)
    async def action_memory(self) -> None:
        current = self.snapshot["memory_offered"] / GB if self.snapshot else 1.0
        gb = await self.push_screen_wait(MemoryDialog(current))
        if gb is None:
            return
        try:
            preview = await asyncio.wrap_future(self.handle.preview_memory(gb))
        except Exception as error:  # noqa: BLE001 - whatever the peer raised, the operator sees it
            self.notify(f"memory: {error}", severity="error")
            return
        if preview["moves"]:
            n = self.active_sessions()
            drops = f"; the {_plural(n, 'running session')} get {MOVE_GRACE:g} s to finish, then are dropped" if n else ""
            if not await self.confirm(
                f"Offering {gb:g} GB moves this peer from layers {fmt_span(preview['current'])} to "
                f"{fmt_span(preview['span'])}: it stops taking sessions and loads the new layers{drops}. Go ahead?",
                yes="Move"):
                return
        self.run_command(f"offer {gb:g} GB", lambda: self.handle.set_memory_offered(gb))

    def grace_words(self) -> str:
        """How long running answers would get to finish if the peer left now: 'up to 12 s'."""
        grace = (self.snapshot or {}).get("in_flight", {}).get("grace", 0.0)
        return f"up to {grace:.0f} s (the time they need at their pace so far)"

    @work(group="dialogs", exclusive=True)
    async def action_leave(self) -> None:
        n = self.active_sessions()
        finish = f", gives the {_plural(n, 'running session')} {self.grace_words()} to finish" if n else ""
        if await self.confirm(
            f"Leave the swarm? This peer stops taking sessions, tells the swarm it is leaving{finish}, "
            "and stops serving for good. This screen stays open; q closes it.", yes="Leave"):
            self._leave()

    @work(group="dialogs", exclusive=True)
    async def action_quit(self) -> None:
        if self.handle.finished.is_set():
            self.exit(return_code=0 if self.handle.error is None else 1)
            return
        if self.quitting:  # a second q while leaving: stop now, like a second Ctrl-C
            self.notify("stopping now: running answers go back to their requesters")
            try:
                self.handle.force_stop()
            except PeerNotRunning:
                self._peer_ended()
            return
        n = self.active_sessions()
        if n and not await self.confirm(
            f"{_plural(n, 'session')} running here. Quitting stops taking sessions, tells the swarm, "
            f"and gives them {self.grace_words()} to finish before closing (q again: hand them "
            "to other peers at once). Quit?", yes="Quit"):
            return
        self.quit_without_asking()

    def on_stop_signal(self) -> None:
        """SIGTERM or SIGINT from outside: leave as `q` does, without asking; a second one stops
        now, as a second `q` does (running answers go back to their requesters)."""
        if not self.quitting:
            self.quit_without_asking()
        elif not self.handle.finished.is_set():
            self.notify("stopping now: running answers go back to their requesters")
            try:
                self.handle.force_stop()
            except PeerNotRunning:
                self._peer_ended()

    def quit_without_asking(self) -> None:
        if not self.quitting:
            self.quitting = True
            self.refresh_bindings()
            self._leave()

    def _leave(self) -> None:
        try:
            self.handle.leave()
            self.notify("leaving: no new sessions; telling the swarm")
        except PeerNotRunning:
            self._peer_ended()

    def notify(self, message: str, *, title: str = "", severity: str = "information", timeout: float | None = None,
               markup: bool = True) -> None:
        """A note from the UI ("drain: done") is a line of the Events log, which a toast would
        cover at 80x24; an error is both, its toast at the top (app.tcss), over the panels."""
        try:
            self.query_one(EventsPanel).note(f"{title}: {message}" if title else message)
        except NoMatches:
            pass  # not composed yet, or gone: the toast alone says it
        if severity == "error":
            super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_filter(self) -> None:
        # focus now, not via Widget.focus() (which waits for the queue): the next key goes to the box
        box = self.query_one("#event-filter", Input)
        box.display = True  # hidden while not in use (tui/event_log.py)
        self.set_focus(box)

    def action_focus_log(self) -> None:
        self.query_one("#event-log", RichLog).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "event-filter":
            self.action_focus_log()

    def run_command(self, what: str, send) -> None:
        """Send a command to the peer (`send` returns its future) and report how it went."""
        try:
            future = send()
        except PeerNotRunning as error:
            self.notify(f"{what}: {error}", severity="error")
            return
        self._report(what, future)

    @work(group="commands")
    async def _report(self, what: str, future: concurrent.futures.Future) -> None:
        try:
            await asyncio.wrap_future(future)
        except Exception as error:  # noqa: BLE001 - whatever the peer raised, the operator sees it
            self.notify(f"{what} failed: {error}", severity="error")
        else:
            self.notify(f"{what}: done")
        self.pull_snapshot()


def run_with_tui(node: PeerNode) -> int:
    """Run `node` with the UI in front of it until `q`; then it has left. Returns the exit status.

    Raises what the peer raised if it failed (a `PeerError` is printed by the CLI).
    """
    handle = PeerHandle(node)
    try:
        # the peer logs from its first moment; not onto the terminal the UI is about to take
        with logs_to(node.out), ui_terminal() as terminal:  # draw on stderr only if it is a terminal
            handle.start()
            app = TesseraApp(handle, leave_on_sigterm=True, driver_class=driver_for(terminal))
            app.run()
    finally:
        _stop(handle)  # the UI may have ended some other way (a crash): the peer still leaves gracefully
        for _, line in handle.lines:  # what the peer said, now that the terminal is ours again
            print(line)
    if handle.error is not None:
        if isinstance(handle.error, Exception):
            raise handle.error
        traceback.print_exception(handle.error, file=sys.stderr)
        return 1
    return app.return_code or 0


def _stop(handle: PeerHandle) -> None:
    """Leave gracefully unless already gone; past the leave grace's cap (and a margin), hand running
    answers back at once; past another margin, stop the loop."""
    grace = handle.node.config.leave_grace + FINISH_MARGIN
    for stop in (handle.leave, handle.force_stop, handle.abort):
        if handle.finished.is_set():
            return
        try:
            stop()
        except PeerNotRunning:
            return  # it finished between the check and the call
        handle.join(grace)
        grace = FINISH_MARGIN
