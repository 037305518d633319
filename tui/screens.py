"""The modal screens: a yes/no confirmation, the memory dialog, and the key help."""

from __future__ import annotations

import math

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

KEYS = (
    ("d", "drain: no new sessions; running ones finish"),
    ("p", "pause compute, or resume (also after a drain)"),
    ("m", "memory offered: re-claims a span that fits"),
    ("l", "leave the swarm; this screen stays open"),
    ("q", "quit: leave gracefully, then close"),
    ("/", "filter the events; Enter or Escape returns"),
    ("?", "this help"),
)
NOTES = (
    "Pausing or quitting with sessions running, leaving, and a memory change that moves the "
    "span ask first.",
    "Events filter: empty shows all but per-step events; event kinds (claim session_open "
    "session_close failover ban move error leave …) show only those; 'all' shows every kind; "
    "other words keep lines that contain them.",
)


class ConfirmScreen(ModalScreen[bool]):
    """Ask before an action that would drop work. Dismisses with True for yes."""

    AUTO_FOCUS = "#no"  # the safe answer is the default
    BINDINGS = [
        Binding("y", "answer(True)", "yes"),
        Binding("n,escape,q", "answer(False)", "no"),
    ]

    def __init__(self, question: str, *, yes: str = "Yes") -> None:
        super().__init__()
        self.question = question
        self.yes = yes

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog"):
            yield Static(self.question, id="question")
            with Horizontal(classes="buttons"):
                yield Button(f"{self.yes} (y)", id="yes", variant="error")
                yield Button("No (n)", id="no", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


def parse_gb(text: str) -> float:
    """'2.5' -> 2.5. Raises ValueError with a message fit to show the operator."""
    try:
        value = float(text.strip().lower().removesuffix("gb").strip())
    except ValueError:
        raise ValueError(f"{text.strip()!r} is not a number of GB") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"memory offered must be more than 0 GB, got {text.strip()!r}")
    return value


class MemoryDialog(ModalScreen[float | None]):
    """Ask for the memory to offer, in GB. Dismisses with the number, or None if cancelled."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]
    AUTO_FOCUS = "#gb"

    def __init__(self, current_gb: float) -> None:
        super().__init__()
        self.current_gb = current_gb

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog"):
            yield Label(f"Memory offered now: {self.current_gb:.2f} GB. Offer how many GB?")
            yield Input(value=f"{self.current_gb:g}", placeholder="GB, e.g. 2.5", id="gb")
            yield Static("", id="error")
            yield Label("Enter to apply, Escape to cancel", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        try:
            gb = parse_gb(event.value)
        except ValueError as bad:
            self.query_one("#error", Static).update(str(bad))
            return
        self.dismiss(gb)

    def action_cancel(self) -> None:
        self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    """Every key and what it does."""

    BINDINGS = [Binding("escape,q,question_mark", "close", "close")]
    AUTO_FOCUS = ""  # nothing to focus: keys go to the bindings
    def compose(self) -> ComposeResult:
        with Vertical(id="help", classes="dialog"):
            yield Static("Keys", classes="title")
            for key, what in KEYS:
                yield Static(f"[b]{key}[/b]  {what}", classes="key")
            for note in NOTES:
                yield Static(note, classes="hint")
            yield Static("Escape or ? closes this help.", classes="hint")

    def action_close(self) -> None:
        self.dismiss(None)
