"""The main screen's panels. Each one draws a snapshot (tui/snapshot.py) or the ledger.

State flows one way: the app holds the reactive `snapshot` (and `rates`, `ledger`)
and binds it into the panels (`data_bind`); a panel only draws. Panels that are one
block of text render it in `render()`, so they redraw to whatever width the
terminal gives them.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive, var
from textual.widget import Widget
from textual.widgets import Sparkline, Static

from tessera.tui.render import (
    coverage_strip, fmt_bytes, fmt_duration, fmt_gb, fmt_ms, fmt_rate, fmt_span, gaps_text, meter, short_id,
    span_bar, state_word,
)

WAITING = Text("waiting for the peer…", style="dim")
# Rows a list (sessions, neighbours) may take: at 80x24 every row is spoken for; a
# taller terminal shows more before "… and N more".
SHORT_LIST, LONG_LIST, TALL_SCREEN = 2, 8, 40


def list_room(widget: Widget) -> int:
    return LONG_LIST if widget.app.size.height >= TALL_SCREEN else SHORT_LIST

def _swarm_words(snapshot: dict[str, Any]) -> tuple[str, str]:
    """('3 peers', 'joined 127.0.0.1:4001') (this one included), or ('1 peer', 'new swarm')."""
    swarm = snapshot["swarm"]
    size = _plural(swarm["peers"] + 1, "peer")
    private = "private " if swarm["private"] else ""
    if not swarm["join"]:
        return size, f"new {private}swarm"
    addr = swarm["join"][0].split("/")
    host = f"{addr[2]}:{addr[4]}" if len(addr) > 4 else swarm["join"][0]
    return size, f"joined {private}{host}"


def fit_header(state: str, who: str, parts: list[str], width: int) -> Text:
    """The header's line within `width` cells: the state, then `who`, then `parts` in order of
    importance; what does not fit goes from the end first (the join address), then `who` is
    shortened — never the state, uptime, reachability or swarm size (they were cut at 80x24)."""
    head = Text(f" {state.upper()} ", style="bold reverse")
    room = width - head.cell_len
    shown = list(parts)
    while len(shown) > 3 and len(" " + who) + sum(len(" │ " + p) for p in shown) > room:
        shown.pop()  # the least important part: the join address
    tail = "".join(f" │ {p}" for p in shown)
    if len(" " + who) + len(tail) > room:
        tail = "".join(f" {p}" for p in shown)  # narrower separators before a shorter name
    keep = max(8, room - len(tail) - 1)
    text = head.append(" " + (who if len(who) <= keep else who[: keep - 1] + "…"), style="bold")
    return text.append(tail)


class SnapshotPanel(Widget):
    """A widget drawn from the snapshot, repainted only when what it draws has changed.

    A snapshot arrives twice a second and is mostly the same as the last; the UI's CPU
    is the peer's CPU too, so each panel names the keys it draws (`SHOWN`) and a
    snapshot that leaves them alone costs no repaint.
    """

    SHOWN: tuple[str, ...] = ()
    snapshot: reactive[dict | None] = reactive(None, repaint=False)
    rows = 1  # lines drawn at the last layout: the panel's height is `auto`

    def shown(self, snap: dict) -> tuple:
        return tuple(snap.get(key) for key in self.SHOWN)

    def watch_snapshot(self, old: dict | None, new: dict | None) -> None:
        if new is not None and (old is None or self.shown(old) != self.shown(new)):
            # A repaint alone keeps the height of the last layout: a panel first laid out
            # as one "waiting…" line stayed clipped to it (seen at 100x32) until a resize.
            rows = self.render().plain.count("\n") + 1
            self.refresh(layout=rows != self.rows)
            self.rows = rows


class PeerHeader(SnapshotPanel):
    """One line: state, name and id, uptime, reachability, the swarm joined."""

    SHOWN = ("phase", "state", "paused", "name", "peer_id", "swarm", "reachability")

    def shown(self, snap: dict) -> tuple:
        return (*super().shown(snap), int(snap["uptime"]))

    def render(self) -> Text:
        snap = self.snapshot
        if snap is None:
            return Text(" STARTING  tessera peer", style="bold")
        size, joined = _swarm_words(snap)
        parts = [f"up {fmt_duration(snap['uptime'])}", f"reach: {snap['reachability']}", size, joined]
        return fit_header(state_word(snap), f"{snap['name'] or 'peer'} {short_id(snap['peer_id'])}", parts,
                          self.content_size.width or self.app.size.width)


def _update(static: Static, text: Text) -> None:
    """Set a Static's text, repainting only if it changed and laying out only if its height did.

    A layout pass re-renders the whole screen; a repaint, only the widget (see SnapshotPanel).
    """
    old = static.content
    if old != text:
        lines = old.plain.count("\n") if isinstance(old, Text) else -1
        static.update(text, layout=lines != text.plain.count("\n"))


def _block(lines: list[Text]) -> Text:
    """Lines as one text (app.tcss cuts each at the panel's edge rather than wrapping it)."""
    return Text("\n").join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class PeerPanel(SnapshotPanel):
    """This peer: model, claimed span against all layers, the weights on disk and a fetch
    under way, memory, device and speed."""

    SHOWN = ("model", "model_id", "device", "span", "shard", "num_layers", "forced_layers", "memory_used",
             "memory_offered", "throughput", "vram", "quant", "held", "fetch")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "This peer"

    def render(self) -> Text:
        snap = self.snapshot
        if snap is None:
            return WAITING
        width = max(8, self.content_size.width)
        span, layers = snap["span"], snap["num_layers"]
        forced = " (forced)" if snap["forced_layers"] else ""
        shard = snap.get("shard") or {}  # a tensor-sharded span: this peer holds one slice of it
        if shard.get("count", 1) > 1:
            forced += f", shard {shard['index'] + 1}/{shard['count']}"
        lines = [
            Text.assemble(("model ", "bold"), f"{snap['model']} {snap['model_id'][:8]} on {snap['device']}"
                          + (f" ({snap['quant']})" if snap.get("quant", "none") != "none" else "")),
            Text.assemble(("layers ", "bold"), f"{fmt_span(span)} of {layers}{forced}"),
            span_bar(span, layers, width),
            _memory_line(snap, width),
            Text.assemble(("speed ", "bold"), _speed(snap)),
        ]
        vram = snap.get("vram")  # a CUDA device: its own memory, as the card reports it now
        if vram:
            lines.insert(4, Text.assemble(("VRAM ", "bold"), f"{fmt_gb(vram['free'])} free of {fmt_gb(vram['total'])}"))
        disk = _held_words(snap.get("held"), layers)
        if disk:
            lines.insert(3, Text.assemble(("on disk ", "bold"), disk))
        fetch = snap.get("fetch")  # weights coming from the swarm before this span can load
        if fetch:
            lines[3:3] = [Text.assemble(("fetching ", "bold"), _fetch_words(fetch)),
                          meter(fetch["done"], fetch["total"], width)]
        return _block(lines)


def _memory_line(snap: dict[str, Any], width: int) -> Text:
    """'memory 0.40 of 1.00 GB ████░░░░' — the meter on the same row when it fits (rows are
    scarce at 80x24: the Events log had three), else on the next."""
    used, offered = snap["memory_used"], snap["memory_offered"]
    words = Text.assemble(("memory ", "bold"), f"{used / (1 << 30):.2f} of {fmt_gb(offered)} ")
    room = width - words.cell_len
    if room >= 8:
        return words.append_text(meter(used, offered, min(room, 30)))
    return Text("\n").join([words, meter(used, offered, width)])


def _held_words(held: list[list[int]] | None, layers: int) -> str:
    """'[14, 16) [20, 30)' for a folder fetched from the swarm; '' for a whole model (the
    usual case, not worth a row at 80x24) or a peer that does not say."""
    if not held or held == [[0, layers]]:
        return ""
    return " ".join(fmt_span(span) for span in held)


def _fetch_words(fetch: dict[str, Any]) -> str:
    """'layers [14, 16): 12.3 MB/28.0 MB (44%) · 30.1 MB/s · ETA 0:00:05 · from 2 peers'"""
    total = fetch["total"]
    pct = 100 * fetch["done"] / total if total else 100
    eta = fetch["eta_s"]
    return (f"{fetch['label']}: {fmt_bytes(fetch['done'])}/{fmt_bytes(total)} ({pct:.0f}%) · "
            f"{fmt_bytes(fetch['rate'])}/s · ETA {'?' if eta is None else fmt_duration(eta)} · "
            f"from {_plural(fetch['peers'], 'peer')}")


def _speed(snap: dict[str, Any]) -> str:
    per_layer = snap["throughput"]
    if not per_layer:
        return "measuring…"
    span = snap["span"]
    n = span[1] - span[0] if span else 0
    if not n:
        return f"{fmt_rate(per_layer)} per layer"
    return f"{fmt_rate(per_layer / n)} span · {per_layer:.0f}/layer"


class LivePanel(Vertical):
    """Live: tokens/s served (a sparkline over the last minutes), counters, running sessions."""

    # its children draw; these only feed them (a repaint of the whole panel would be waste)
    snapshot: var[dict | None] = var(None)
    rates: var[tuple[float, ...]] = var(())
    rate_now: var[float] = var(0.0)
    peak: var[float] = var(0.0)  # tui/rates.py's RateHistory.peak: moves only when tokens are served

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "Live"

    def compose(self) -> ComposeResult:
        yield Sparkline([], id="rate-spark")
        yield Static(WAITING, id="counters")
        yield Static("", id="sessions")

    def watch_rates(self, rates: tuple[float, ...]) -> None:
        self.query_one(Sparkline).data = list(rates) or [0.0]  # equal data: no repaint

    def watch_snapshot(self, snap: dict | None) -> None:
        if snap is not None:
            _update(self.query_one("#counters", Static), self.counters_text())
            _update(self.query_one("#sessions", Static), self.sessions_text())

    def watch_rate_now(self) -> None:
        if self.snapshot is not None:
            _update(self.query_one("#counters", Static), self.counters_text())

    def watch_peak(self) -> None:
        if self.snapshot is not None:
            _update(self.query_one("#counters", Static), self.counters_text())

    def counters_text(self) -> Text:
        stats = self.snapshot["stats"]
        peak = self.peak
        return Text.assemble(
            ("served ", "bold"), f"{fmt_rate(self.rate_now)} (peak {fmt_rate(peak)})\n",
            ("steps ", "bold"), f"{stats['steps']}  ", ("tokens ", "bold"), f"{stats['tokens']}\n",
            ("in ", "bold"), f"{fmt_bytes(stats['bytes_in'])}  ", ("out ", "bold"), fmt_bytes(stats["bytes_out"]),
        )

    def sessions_text(self) -> Text:
        snap = self.snapshot
        active = snap["active"]
        text = Text.assemble(("sessions ", "bold"), f"{len(active)}/{snap['max_sessions']}")
        shown = list_room(self)
        for s in active[:shown]:
            text.append(f"\n {s['id']} for {short_id(s['requester'])}: {_plural(s['steps'], 'step')}")
        if len(active) > shown:
            text.append(f"\n … and {len(active) - shown} more")
        return text


class SwarmPanel(SnapshotPanel):
    """Swarm: how many peers serve every layer (gaps marked), and neighbours with RTTs."""

    SHOWN = ("coverage", "gaps", "serving", "swarm", "neighbours")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "Swarm"

    def render(self) -> Text:
        snap = self.snapshot
        if snap is None:
            return WAITING
        width = max(8, self.content_size.width)
        neighbours = snap["neighbours"]
        lines = [
            Text.assemble(("peers per layer", "bold"), f" (of {snap['serving']} serving)"),
            coverage_strip(snap["coverage"], width),
            gaps_text(snap["gaps"]),
            Text.assemble(("neighbours ", "bold"), str(len(neighbours)) if neighbours else "none yet"),
        ]
        room = list_room(self)
        for n in neighbours[:room]:
            who = f"{n['name'][:8]} {short_id(n['peer_id'])}" if n["name"] else short_id(n["peer_id"])
            span = f"[{n['span'][0]},{n['span'][1]})" if n["span"] else n["state"]
            lines.append(Text(f" {who} {fmt_ms(n['rtt_ms'])} {n['kind']} {span}"))
        if len(neighbours) > room:
            lines.append(Text(f" … and {len(neighbours) - room} more"))
        return _block(lines)


class LedgerPanel(Widget):
    """Ledger: what this peer has contributed today and overall (from its store)."""

    ledger: reactive[dict | None] = reactive(None)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.border_title = "Ledger"

    def render(self) -> Text:
        ledger = self.ledger
        if ledger is None:
            return WAITING
        rows = [Text(f"{'':<8}{'layer·tok':>10}{'steps':>8}{'bytes':>10}", style="bold")]
        for name in ("today", "total"):
            s = ledger[name]
            rows.append(Text(f"{name:<8}{s['layer_tokens']:>10}{s['steps']:>8}{fmt_bytes(s['bytes']):>10}"))
        by = ledger["by_requester"]
        if by:
            top = next(iter(by))
            rows.append(Text(f"{len(by)} requester{'s' if len(by) != 1 else ''}; most: {short_id(top)}"))
        else:
            rows.append(Text("no requesters yet", style="dim"))
        return _block(rows)
