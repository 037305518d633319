"""Small pure functions that turn snapshot values into text for the panels.

Every drawing here reads without colour: a claimed layer is `█` and an unclaimed
one `░`, a layer nobody serves is `0` (and red, reversed) and is listed by range as
well, states are words. Widths are in terminal cells; a bar never grows wider
than it is given, and a model with more layers than cells draws one cell per
group of layers.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Any, Sequence

from rich.text import Text

from tessera.store.events import Stamped, row_fields

CLAIMED, UNCLAIMED = "█", "░"
GAP_STYLE = "bold reverse red"
ID_TAIL = 8  # peer ids are shown by their last 8 characters, as the CLI does
# A libp2p peer id (Ed25519: base58 of an identity multihash) inside free text, e.g. a log line.
PEER_ID_IN_TEXT = re.compile(r"\b12D3KooW[1-9A-HJ-NP-Za-km-z]{44}\b")


def short_id(peer_id: str | None) -> str:
    """'12D3KooWAbc...xyz12345' -> 'xyz12345' (what the CLI prints too); '-' for None."""
    return peer_id[-ID_TAIL:] if peer_id else "-"


def shorten_ids(text: str) -> str:
    """Every full peer id in `text` cut to its tail: 'link 12D3KooW…Wft9F: direct' -> 'link …Wft9F: direct'."""
    return PEER_ID_IN_TEXT.sub(lambda m: "…" + short_id(m.group(0)), text)


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KB' (binary units, as --memory GB is)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # unreachable; keeps type checkers calm


def fmt_gb(n: float) -> str:
    return f"{n / (1 << 30):.2f} GB"


def fmt_duration(seconds: float) -> str:
    """3725 -> '1:02:05'; a day or more -> '2d 03:04:05'."""
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}" if days else clock


def fmt_rate(tokens_per_second: float) -> str:
    return f"{tokens_per_second:.1f} tok/s" if tokens_per_second < 100 else f"{tokens_per_second:.0f} tok/s"


def fmt_ms(ms: float) -> str:
    return f"{ms:.1f}ms" if ms < 10 else f"{ms:.0f}ms"


def fmt_span(span: Sequence[int] | None) -> str:
    return f"[{span[0]}, {span[1]})" if span else "none yet"


def cells_for(num_layers: int, width: int) -> list[tuple[int, int]]:
    """Split layers [0, num_layers) into at most `width` cells, each a half-open layer range."""
    n = max(0, min(num_layers, width))
    return [(i * num_layers // n, (i + 1) * num_layers // n) for i in range(n)] if n else []


def span_bar(span: Sequence[int] | None, num_layers: int, width: int) -> Text:
    """This peer's span drawn against the model's layers: `█` claimed, `░` not."""
    text = Text()
    start, end = span if span else (0, 0)
    for a, b in cells_for(num_layers, width):
        mine = max(0, min(b, end) - max(a, start))
        text.append(CLAIMED if mine * 2 >= b - a and mine else UNCLAIMED, style="bold" if mine else "dim")
    return text


def coverage_strip(coverage: Sequence[int], width: int) -> Text:
    """How many peers serve each layer (a cell of several layers shows the least covered one).

    One digit per cell, `+` for ten or more; `0` (red, reversed) is a gap no route can cross.
    """
    text = Text()
    for a, b in cells_for(len(coverage), width):
        count = min(coverage[a:b])
        char = str(count) if count < 10 else "+"
        text.append(char, style=GAP_STYLE if count == 0 else ("bold" if count == 1 else ""))
    return text


def gaps_text(gaps: Sequence[Sequence[int]]) -> Text:
    if not gaps:
        return Text("gaps: none")
    text = Text("GAPS: ", style="bold")
    text.append(", ".join(fmt_span(g) for g in gaps), style=GAP_STYLE)
    return text


def meter(value: float, total: float, width: int) -> Text:
    """A bar of `width` cells filled in proportion value/total (`█` used, `░` free)."""
    width = max(0, width)
    filled = 0 if total <= 0 else min(width, round(width * value / total))
    return Text(CLAIMED * filled, style="bold").append(UNCLAIMED * (width - filled), style="dim")


def state_word(snapshot: dict[str, Any]) -> str:
    """One word for where the peer is: starting, loading, serving, draining, paused, leaving, left."""
    if snapshot["phase"] == "stopped":
        return "left" if snapshot["state"] == "leaving" else "stopped"
    if snapshot["paused"]:
        return "paused"
    if snapshot["phase"] == "starting":
        return "loading" if snapshot["span"] else "starting"
    return snapshot["state"]


def event_line(stamped: Stamped) -> str:
    """One trace event as a line: time, kind, then whatever fields it has (as stored).

    '10:05:26 session_open  s=3f2a9c01 [0, 15) from xyz12345'
    """
    row, detail = row_fields(stamped.event)
    parts = [datetime.fromtimestamp(stamped.wall).strftime("%H:%M:%S"), f"{stamped.kind:<13}"]
    if row.get("session"):
        parts.append(f"s={row['session'][:8]}")
    if row.get("step") is not None:
        parts.append(f"step {row['step']}")
    if row.get("span_start") is not None and row.get("span_end") is not None:
        parts.append(fmt_span((row["span_start"], row["span_end"])))
    if row.get("remote"):
        parts.append(f"peer {short_id(row['remote'])}")
    if row.get("bytes") is not None:
        parts.append(fmt_bytes(row["bytes"]))
    if row.get("duration") is not None:
        parts.append(f"{row['duration'] * 1000:.1f} ms")
    for key, value in detail.items():
        if isinstance(value, float) and math.isfinite(value):
            value = f"{value:.3g}"
        elif isinstance(value, (list, dict)) and len(str(value)) > 40:
            value = f"[{len(value)}]"  # e.g. every address a peer listens on: the count is enough here
        parts.append(f"{key}={value}"[:60])
    return shorten_ids(" ".join(parts))
