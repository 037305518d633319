"""The events panel: a scrolling, filterable tail of the peer's trace and of what it printed.

Reading the trace is sqlite work, so it runs in a thread worker (one at a time,
`exclusive` within its group): the poll timer starts a read only when none is in
flight, a filter change starts one that replaces any in flight, and every result
carries the filter generation it was read for — a result read for an older filter
is dropped rather than shown under the new one.

The filter box takes a row only while it is typed in or holds a filter (the Events
title says what filters the log); rows are scarce at 80x24. Long lines wrap rather than
being cut at the edge. The UI's own notes ("drain: done") are lines of this log, beside
what the peer printed, not toasts over it.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Callable

from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.events import Resize
from textual.reactive import reactive
from textual.widgets import Input, RichLog
from textual.worker import Worker, get_current_worker

from tessera.store.errors import StoreError

from tessera.tui.events import EventFilter, StoreReader, read_backlog, read_new
from tessera.tui.render import event_line, shorten_ids

POLL_INTERVAL = 1.0  # seconds between reads of new events: a person reads a log no faster
KEPT_LINES = 1000  # lines the log keeps for scrolling back

PeerLines = Callable[[int], tuple[list[tuple[float, str]], int]]  # PeerHandle.lines_since


def peer_line(wall: float, line: str, source: str = "(peer)") -> str:
    return f"{datetime.fromtimestamp(wall).strftime('%H:%M:%S')} {source:<13} {shorten_ids(line)}"


class TailLog(RichLog):
    """A log that keeps its newest line in view until the operator scrolls up.

    RichLog scrolls to the end when a line is written, but not when the log gets
    shorter (at 80x24 the panels above grow once the first snapshot arrives, and
    the log was left showing its oldest lines), and it jumps to the end on every
    write even while someone reads further up. Here: `following` is whether the view
    is at the end; scrolling up clears it, scrolling back to the end sets it, and
    while it is set a write or a resize scrolls to the end.
    """

    following = True

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        self.following = new >= self.max_scroll_y

    def write(self, content, width=None, expand=False, shrink=True, scroll_end=None, animate=False):  # type: ignore[override]
        return super().write(content, width, expand, shrink, self.following if scroll_end is None else scroll_end,
                             animate)

    def on_resize(self, event: Resize) -> None:  # RichLog's own on_resize runs too (Textual calls each class's)
        if self.following:
            self.scroll_end(animate=False, immediate=False, x_axis=False)


class EventsPanel(Vertical):
    """Trace events (filterable) and the peer's own messages, newest at the bottom."""

    filter_text: reactive[str] = reactive("", init=False)

    def __init__(self, reader: StoreReader, peer_lines: PeerLines, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reader = reader
        self.peer_lines = peer_lines
        self.border_title = "Events"
        self.generation = 0
        self.after_id: int | None = None  # None: the backlog has not been read yet
        self.lines_seen = 0
        self._inflight: Worker | None = None
        self.last_error: str | None = None  # shown once, not every poll
        self.notes: list[tuple[float, str]] = []  # the UI's own (wall, line), kept for a filter change

    def compose(self) -> ComposeResult:
        yield Input(placeholder="filter: kinds (claim session_open …), 'peer', 'all', or any text; Enter",
                    id="event-filter")
        yield TailLog(id="event-log", max_lines=KEPT_LINES, wrap=True, markup=False)

    def note(self, text: str) -> None:
        """A line of the UI's own ("drain: done"), shown wherever the peer's printed lines are."""
        wall = time.time()
        self.notes.append((wall, text))
        del self.notes[:-KEPT_LINES]
        if self.event_filter.printed:
            line = peer_line(wall, text, "(tui)")
            if self.event_filter.keeps(line):
                self.query_one(RichLog).write(line)

    def on_descendant_focus(self) -> None:
        self.show_filter_box()

    def on_descendant_blur(self) -> None:
        self.show_filter_box()

    def show_filter_box(self) -> None:
        """The box is shown while focused or holding a filter; the title names the filter."""
        box = self.query_one(Input)
        box.display = box.has_focus or bool(self.filter_text)
        self.border_title = f"Events — filter: {self.filter_text}" if self.filter_text else "Events"

    def on_mount(self) -> None:
        self.set_interval(POLL_INTERVAL, self.poll)
        self.show_filter_box()
        self.restart()

    @property
    def event_filter(self) -> EventFilter:
        return EventFilter.parse(self.filter_text)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.filter_text = event.value

    def watch_filter_text(self) -> None:
        self.show_filter_box()
        self.restart()

    def restart(self) -> None:
        """Forget what is shown and read the backlog under the current filter."""
        self.generation += 1
        self.after_id = None
        self.lines_seen = 0
        self.query_one(RichLog).clear()
        self._inflight = self.fetch(self.generation, self.event_filter, None, 0)

    def poll(self) -> None:
        if self._inflight is not None and self._inflight.is_running:
            return  # the last read is still going; the next tick will catch up
        self._inflight = self.fetch(self.generation, self.event_filter, self.after_id, self.lines_seen)

    @work(thread=True, exclusive=True, group="events", exit_on_error=False)
    def fetch(self, generation: int, flt: EventFilter, after_id: int | None, lines_seen: int) -> None:
        worker = get_current_worker()
        error = None
        try:
            if after_id is None:
                rows, tail = read_backlog(self.reader.store, flt)
            else:
                rows = read_new(self.reader.store, flt, after_id)
                tail = rows[-1].id if rows else after_id
        except StoreError as failed:  # e.g. the database is locked for longer than the busy timeout
            rows, tail, error = [], after_id, f"(cannot read the trace: {failed})"
        entries = [(row.wall, event_line(row)) for row in rows]
        printed, lines_seen = self.peer_lines(lines_seen)
        if flt.printed:  # asked for some kinds only: their events, not every line the peer printed
            entries += [(wall, peer_line(wall, line)) for wall, line in printed]
            if after_id is None:  # a fresh read (a new filter): the UI's notes so far, too
                entries += [(wall, peer_line(wall, line, "(tui)")) for wall, line in list(self.notes)]
        entries.sort(key=lambda entry: entry[0])
        shown = [text for _, text in entries if flt.keeps(text)]
        if not worker.is_cancelled:
            self.app.call_from_thread(self.show, generation, shown, tail, lines_seen, error)

    def show(self, generation: int, lines: list[str], tail: int | None, lines_seen: int, error: str | None) -> None:
        if generation != self.generation:
            return  # read for a filter the operator has since changed
        self.after_id = tail  # still None if the backlog could not be read: the next poll tries again
        self.lines_seen = lines_seen
        log = self.query_one(RichLog)
        if error is not None and error != self.last_error:
            log.write(error)
        self.last_error = error
        for line in lines:
            log.write(line)
