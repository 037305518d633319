"""A picture of a generation across peers, for a maintainer who would rather look than read.

    tessera trace plot a.db b.db c.db -o timeline.png

One row per peer (in order of first activity, labelled with its short id and role), a bar
per forward step (coloured by session, labelled with its step when there is room;
overlapping steps of concurrent sessions share the row in lanes), an arrow from each push
to its matching receive, and markers for the events that explain a surprise (failover,
ban, error, misbehaviour, move, leave, join) and for each step the requester got back
(a `Result`: the prompt, then one per decoded token). Times are
seconds since the start of the merged, clock-aligned timeline (store/timeline.py).

matplotlib is imported inside `plot_timeline` (Agg backend), so importing store/ stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from tessera.store.events import Ban, Error, Failover, Forward, Join, Leave, Misbehaviour, Move, Result, TraceEvent
from tessera.store.timeline import Event, Timeline, When, load_timeline

# Events drawn as markers on their peer's row: event class -> (marker, colour).
MARKERS: dict[type[TraceEvent], tuple[str, str]] = {
    Join: ("^", "#2a9d8f"),
    Leave: ("v", "#6c757d"),
    Failover: ("X", "#d62828"),
    Ban: ("s", "#000000"),
    Error: ("x", "#d62828"),
    Misbehaviour: ("D", "#9d0208"),
    Move: (">", "#577590"),
    Result: ("|", "#333333"),
}
SESSION_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
BAR_HEIGHT = 0.5


def _short(peer: str) -> str:
    """A peer id short enough for an axis label (libp2p ids all begin "12D3KooW": drop that)."""
    peer = peer.removeprefix("12D3KooW")
    return peer if len(peer) <= 14 else f"{peer[:6]}…{peer[-6:]}"


def _row_label(peer: str, events: list[Event]) -> str:
    """The peer's short id and what it did: "requester" or the layers it computed."""
    mine = [e.event for e in events if e.peer == peer]
    spans = sorted({e.span for e in mine if isinstance(e, Forward)})
    if spans:
        role = "layers " + ", ".join(f"{a}–{b}" for a, b in spans[:3])
    elif any(isinstance(e, Result) for e in mine):
        role = "requester"
    else:
        role = ""
    return f"{_short(peer)}\n{role}" if role else _short(peer)


def _lanes(intervals: list[tuple[float, float]]) -> tuple[list[int], int]:
    """Lane of each (start, end) so that no two in one lane overlap; and the number of lanes."""
    ends: list[float] = []
    lanes = [0] * len(intervals)
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i]):
        start, end = intervals[i]
        lane = next((k for k, last in enumerate(ends) if last <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        ends[lane] = end
        lanes[i] = lane
    return lanes, max(len(ends), 1)


def plot_timeline(
    db_paths: Sequence[Path | str], out_png: Path | str, *, title: str | None = None,
    since: When | None = None, until: When | None = None, sessions: Sequence[str] = (),
) -> dict[str, Any]:
    """Draw the merged timeline of `db_paths` into `out_png`; return what was drawn.

    `since`, `until`, `sessions`: draw only that window (`Timeline.window`), on the whole
    timeline's axis (its seconds are the ones `--since 12.5` names). Raises BadTimeWindow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timeline: Timeline = load_timeline(db_paths)
    windowed = since is not None or until is not None or bool(sessions)
    if windowed:
        timeline = timeline.window(since, until, sessions)
    peers = timeline.peers
    row = {peer: i for i, peer in enumerate(peers)}
    sessions: dict[str | None, int] = {}
    left = min((e.start for e in timeline.events), default=0.0) if windowed else 0.0
    right = max((e.t for e in timeline.events), default=1.0) or 1.0
    if since is not None:
        left = since.on(timeline)
    if until is not None:
        right = until.on(timeline)
    span = max(right - left, 1e-6)
    fig_h = 1.6 + 0.75 * max(len(peers), 1)
    fig, ax = plt.subplots(figsize=(12, fig_h), dpi=110)
    forwards = [e for e in timeline.events if isinstance(e.event, Forward)]
    for peer in peers:
        mine = [e for e in forwards if e.peer == peer]
        widths = [max(e.duration or 0.0, span / 2000) for e in mine]
        lanes, n_lanes = _lanes([(e.start, e.start + w) for e, w in zip(mine, widths)])
        height = BAR_HEIGHT / n_lanes
        for e, width, lane in zip(mine, widths, lanes):
            colour = SESSION_COLOURS[sessions.setdefault(e.event.session, len(sessions)) % len(SESSION_COLOURS)]
            y = row[peer] - BAR_HEIGHT / 2 + lane * height
            ax.broken_barh(
                [(e.start, width)], (y, height), facecolors=colour, edgecolors="white", linewidth=0.4
            )
            if e.event.step is not None and width > span / 80:
                ax.text(
                    e.start + width / 2,
                    y + height / 2,
                    str(e.event.step),
                    ha="center",
                    va="center",
                    fontsize=7 if n_lanes == 1 else 6,
                    color="white",
                )
    for push, receive in timeline.pairs:
        ax.annotate(
            "",
            xy=(receive.t, row[receive.peer]),
            xytext=(push.t, row[push.peer]),
            arrowprops={
                "arrowstyle": "-|>",
                "color": "#555555",
                "lw": 0.7,
                "alpha": 0.7,
                "shrinkA": 0,
                "shrinkB": 0,
            },
        )
    drawn_markers = set()
    for e in timeline.events:
        if type(e.event) in MARKERS:
            marker, colour = MARKERS[type(e.event)]
            y = row[e.peer] if isinstance(e.event, Result) else row[e.peer] - BAR_HEIGHT / 2 - 0.12
            ax.scatter(
                [e.t],
                [y],
                marker=marker,
                color=colour,
                s=36,
                zorder=5,
                label=e.kind if e.kind not in drawn_markers else None,
            )
            drawn_markers.add(e.kind)
    ax.set_yticks(range(len(peers)), [_row_label(p, timeline.events) for p in peers], fontsize=9)
    ax.set_ylim(len(peers) - 0.45, -0.75)  # first peer on top
    ax.set_xlim(left, left + span * 1.02)
    ax.set_xlabel("seconds since the first event (clocks aligned across peers)")
    ax.grid(axis="x", color="#e0e0e0", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_title(
        title
        or f"Tessera timeline: {len(peers)} peers, {len(forwards)} forward steps, "
        f"{len(timeline.pairs)} pushes",
        fontsize=11,
    )
    handles = [
        Patch(color=SESSION_COLOURS[i % len(SESSION_COLOURS)], label=f"session {(s or '-')[:8]}")
        for s, i in list(sessions.items())[:6]
    ]
    marker_handles, _ = ax.get_legend_handles_labels()
    if handles or marker_handles:
        ax.legend(
            handles=handles + marker_handles,
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0),
            fontsize=8,
            frameon=False,
        )
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return {
        "window": [left, right] if windowed else None,
        "peers": peers,
        "forward_steps": len(forwards),
        "pushes": len(timeline.pairs),
        "sessions": len(sessions),
        "non_causal": timeline.non_causal,
    }
