"""Writing a merged timeline out: JSONL for scripts, Chrome trace-event JSON for Perfetto.

    tessera trace export a.db b.db c.db --format perfetto -o swarm.json
    # then open https://ui.perfetto.dev and drop swarm.json on it

Perfetto layout: one process per peer (named by a ``process_name`` metadata event, sorted
by first activity); inside it a ``compute`` thread with one complete slice (``ph: X``)
per forward step, a ``network`` thread with a slice per push and receive, an ``activity``
thread for other events that have a duration, and an ``events`` thread with instants
(``ph: i``) for the rest. Slices that overlap (concurrent sessions) go on extra lanes
(``compute #2`` ...) because Perfetto needs the slices of one thread to nest. Each matched
push -> receive becomes a flow arrow (``ph: s`` bound to the push slice, ``ph: f`` with
``bp: e`` bound to the receive slice). Timestamps are microseconds since the timeline's
origin, on the aligned clock (store/timeline.py).

`validate_perfetto()` checks a loaded file against what this module promises; the swarm
tests run it on real exports.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from tessera.store.events import Forward, Push, Receive, Unknown, row_fields
from tessera.store.timeline import Event, Timeline, load_timeline

# A zero-duration push or receive still needs a slice for its flow arrow to bind to.
MIN_SLICE_US = 1.0
# Our timestamps are relative to the timeline's start; anything past ~116 days means
# seconds-or-nanoseconds or absolute epoch time slipped in.
MAX_TS_US = 1e13
# Thread ids: lane k of a thread group is tid base + k (a peer rarely needs more than a few).
_LANES = {Forward: ("compute", 1000), Push: ("network", 2000), Receive: ("network", 2000)}
_ACTIVITY = ("activity", 3000)
_EVENTS_TID = 0
_PHASES = {"X", "B", "E", "i", "I", "s", "t", "f", "M", "C"}
_METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index", "process_labels"}


def _write_atomically(out_path: Path, text: str) -> None:
    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out_path)


def _summary(timeline: Timeline, **extra: Any) -> dict[str, Any]:
    return {
        "peers": timeline.peers,
        "events": len(timeline.events),
        "pairs": len(timeline.pairs),
        "non_causal": timeline.non_causal,
        "reference": str(timeline.paths[timeline.reference]) if timeline.reference is not None else None,
        "clock_offsets_s": {str(timeline.paths[i]): off for i, off in sorted(timeline.offsets.items())},
        **extra,
    }


# --- JSONL -----------------------------------------------------------------------------


def event_record(timeline: Timeline, e: Event) -> dict[str, Any]:
    """One merged event as plain data: the trace columns plus aligned times and provenance
    (and, for a row no event class fits, ``unknown``: why)."""
    offset = timeline.offsets.get(e.db, 0.0)
    columns, detail = row_fields(e.event)
    record = {
        "t": timeline.origin + e.t,  # aligned unix time (reference clock) of the event's end
        "start": timeline.origin + e.start,
        "peer": e.peer,
        "kind": e.kind,
        **columns,
        "detail": detail,
        "wall": e.wall,
        "mono_ns": e.mono_ns,
        "clock_offset": offset,
        "db": str(timeline.paths[e.db]),
        "id": e.id,
    }
    if isinstance(e.event, Unknown):
        record["unknown"] = e.event.problem
    return record


def export_jsonl(db_paths: Sequence[Path | str], out_path: Path | str) -> dict[str, Any]:
    """Write the merged timeline of `db_paths` as JSON lines, in aligned order; return a summary."""
    timeline = load_timeline(db_paths)
    lines = [json.dumps(event_record(timeline, e), sort_keys=True) for e in timeline.events]
    _write_atomically(Path(out_path), "".join(line + "\n" for line in lines))
    return _summary(timeline)


# --- Perfetto --------------------------------------------------------------------------


def _args(timeline: Timeline, e: Event) -> dict[str, Any]:
    args: dict[str, Any] = {"db": str(timeline.paths[e.db]), "id": e.id}
    columns, detail = row_fields(e.event)
    for name in ("session", "step", "bytes", "remote"):
        if columns[name] is not None:
            args[name] = columns[name]
    if columns["span_start"] is not None or columns["span_end"] is not None:
        args["span"] = f"[{columns['span_start']}, {columns['span_end']})"
    if columns["duration"] is not None:
        args["duration_ms"] = round(columns["duration"] * 1e3, 6)
    if detail:
        args["detail"] = detail
    if isinstance(e.event, Unknown):
        args["unknown"] = e.event.problem
    return args


def _assign_lanes(slices: list[dict[str, Any]], base: int) -> None:
    """Give each slice a tid so that no two slices of one tid overlap (greedy, by start)."""
    lane_ends: list[float] = []
    for item in sorted(slices, key=lambda s: (s["ts"], -s["dur"])):
        end = item["ts"] + item["dur"]
        for lane, last_end in enumerate(lane_ends):
            if last_end <= item["ts"]:
                lane_ends[lane] = end
                break
        else:
            lane_ends.append(end)
            lane = len(lane_ends) - 1
        item["tid"] = base + lane


def _thread_name(tid: int) -> str:
    if tid == _EVENTS_TID:
        return "events"
    for name, base in (*_LANES.values(), _ACTIVITY):
        if 0 <= tid - base < 1000:
            return name if tid == base else f"{name} #{tid - base + 1}"
    return f"thread {tid}"


def to_perfetto(timeline: Timeline) -> dict[str, Any]:
    """The Chrome trace-event JSON object for `timeline` (see the module docstring)."""
    pid_of = {peer: i + 1 for i, peer in enumerate(timeline.peers)}
    us = lambda seconds: round(seconds * 1e6, 3)  # noqa: E731
    slices: dict[tuple[int, str], list[dict[str, Any]]] = {}
    slice_of: dict[int, dict[str, Any]] = {}  # id(event) -> its slice
    out: list[dict[str, Any]] = []
    for e in timeline.events:
        pid = pid_of[e.peer]
        lane = _LANES.get(type(e.event)) or (_ACTIVITY if e.duration else None)
        if lane is None:
            out.append(
                {
                    "ph": "i",
                    "name": e.kind,
                    "cat": e.kind,
                    "pid": pid,
                    "tid": _EVENTS_TID,
                    "ts": us(e.t),
                    "s": "t",
                    "args": _args(timeline, e),
                }
            )
            continue
        end = us(e.t)
        dur = max(end - us(e.start), MIN_SLICE_US)
        item = {
            "ph": "X",
            "name": e.kind,
            "cat": e.kind,
            "pid": pid,
            "ts": round(end - dur, 3),
            "dur": round(dur, 3),
            "args": _args(timeline, e),
        }
        slices.setdefault((pid, lane[0]), []).append(item)
        slice_of[id(e)] = item
        out.append(item)
    bases = {name: base for name, base in (*_LANES.values(), _ACTIVITY)}
    for (_pid, name), items in slices.items():
        _assign_lanes(items, bases[name])
    for flow_id, (push, receive) in enumerate(timeline.pairs, start=1):
        ends = []
        for ev in (push, receive):
            item = slice_of[id(ev)]
            # Inside the slice, just before its end: where the bytes finished moving.
            ts = round(item["ts"] + item["dur"] - min(0.5, item["dur"] / 2), 3)
            ends.append((item, ts))
        (s_item, s_ts), (f_item, f_ts) = ends
        common = {"name": "activations", "cat": "flow", "id": flow_id}
        out.append({"ph": "s", **common, "pid": s_item["pid"], "tid": s_item["tid"], "ts": s_ts})
        out.append({"ph": "f", "bp": "e", **common, "pid": f_item["pid"], "tid": f_item["tid"], "ts": f_ts})
    low = min((ev["ts"] for ev in out), default=0.0)
    if low < 0:
        for ev in out:
            ev["ts"] = round(ev["ts"] - low, 3)
    meta: list[dict[str, Any]] = []
    for peer, pid in pid_of.items():
        meta.append(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"peer {peer}"}}
        )
        meta.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
    threads = sorted({(ev["pid"], ev["tid"]) for ev in out})
    for pid, tid in threads:
        meta.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": _thread_name(tid)}}
        )
        meta.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
    # otherData: flat strings and numbers only (viewers show it as trace metadata).
    other = {k: v for k, v in _summary(timeline).items() if k != "peers"}
    other["generator"] = "tessera"
    other["reference"] = other["reference"] or ""
    other["clock_offsets_s"] = json.dumps(other["clock_offsets_s"])
    return {"traceEvents": meta + out, "displayTimeUnit": "ms", "otherData": other}


def export_perfetto(db_paths: Sequence[Path | str], out_path: Path | str) -> dict[str, Any]:
    """Write the merged timeline as Chrome trace-event JSON (opens in Perfetto); return a summary."""
    timeline = load_timeline(db_paths)
    obj = to_perfetto(timeline)
    _write_atomically(Path(out_path), json.dumps(obj))
    slices = sum(1 for ev in obj["traceEvents"] if ev["ph"] == "X")
    return _summary(timeline, slices=slices, flows=len(timeline.pairs))


# --- the schema check --------------------------------------------------------------------


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_event(i: int, ev: Any, problems: list[str]) -> bool:
    """Per-event checks; returns False when the event is too broken for the cross-checks."""
    if not isinstance(ev, dict):
        problems.append(f"event {i}: not an object: {ev!r}")
        return False
    ph = ev.get("ph")
    where = f"event {i} (ph {ph!r})"
    if ph not in _PHASES:
        problems.append(f"{where}: unknown phase")
        return False
    need_name = ph in {"X", "B", "i", "I", "s", "t", "f", "M", "C"}
    if need_name and not isinstance(ev.get("name"), str):
        problems.append(f"{where}: name must be a str, got {ev.get('name')!r}")
    for key in ("pid", "tid"):
        if not (isinstance(ev.get(key), int) and not isinstance(ev.get(key), bool)):
            problems.append(f"{where}: {key} must be an int, got {ev.get(key)!r}")
    if "args" in ev and not isinstance(ev["args"], dict):
        problems.append(f"{where}: args must be an object, got {ev['args']!r}")
    if ph == "M":
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        if ev.get("name") not in _METADATA:
            problems.append(f"{where}: unknown metadata name {ev.get('name')!r}")
        elif ev["name"].endswith("_name") and not isinstance(args.get("name"), str):
            problems.append(f"{where}: {ev['name']} needs args.name as a str, got {args.get('name')!r}")
        elif ev["name"].endswith("_sort_index") and not isinstance(args.get("sort_index"), int):
            problems.append(f"{where}: {ev['name']} needs an int args.sort_index")
        return True
    ts = ev.get("ts")
    if not _number(ts) or ts < 0:
        problems.append(f"{where}: ts must be a finite number of µs >= 0, got {ts!r}")
        return False
    if ts > MAX_TS_US:
        problems.append(f"{where}: ts {ts!r} is not µs since the trace start (seconds, ns or epoch time?)")
    if ph == "X" and (not _number(ev.get("dur")) or ev["dur"] < 0):
        problems.append(f"{where}: dur must be a finite number of µs >= 0, got {ev.get('dur')!r}")
        return False
    if ph in {"i", "I"} and ev.get("s", "t") not in {"g", "p", "t"}:
        problems.append(f"{where}: scope s must be 'g', 'p' or 't', got {ev.get('s')!r}")
    if ph in {"s", "t", "f"}:
        if not isinstance(ev.get("id"), (int, str)) or isinstance(ev.get("id"), bool):
            problems.append(f"{where}: flow id must be an int or str, got {ev.get('id')!r}")
            return False
        if not isinstance(ev.get("cat"), str):
            problems.append(f"{where}: flow events need a cat str")
        if ph == "f" and ev.get("bp", "e") != "e":
            problems.append(f"{where}: bp must be 'e', got {ev.get('bp')!r}")
    if ph == "C" and not all(_number(v) for v in (ev.get("args") or {}).values()):
        problems.append(f"{where}: counter args must all be numbers")
    return True


def validate_perfetto(obj: Any) -> list[str]:
    """Problems with a Chrome trace-event object as Tessera writes it; empty means valid.

    Checks: the container; per phase, required keys and their types (ts/dur finite µs >= 0,
    relative to the trace start; int pid/tid; flow ids; metadata args); slices of a thread
    nest (Perfetto drops ones that do not); B/E balance; every flow id has exactly one
    start and one finish, the finish not before the start, each inside a slice of its
    thread; every process with events is named by a ``process_name`` metadata event.
    """
    if isinstance(obj, dict):
        events = obj.get("traceEvents")
        if not isinstance(events, list):
            return [f"traceEvents must be a list, got {type(events).__name__}"]
        if obj.get("displayTimeUnit", "ms") not in {"ms", "ns"}:
            return [f"displayTimeUnit must be 'ms' or 'ns', got {obj.get('displayTimeUnit')!r}"]
    elif isinstance(obj, list):
        events = obj
    else:
        return [f"a trace must be an object with traceEvents or a list, got {type(obj).__name__}"]
    problems: list[str] = []
    good = [ev for i, ev in enumerate(events) if _check_event(i, ev, problems)]
    named = {ev["pid"] for ev in good if ev["ph"] == "M" and ev.get("name") == "process_name"}
    used = {ev["pid"] for ev in good if ev["ph"] != "M"}
    for pid in sorted(used - named, key=repr):
        problems.append(f"pid {pid!r} has events but no process_name metadata")
    by_thread: dict[tuple, list[dict]] = {}
    for ev in good:
        if ev["ph"] in {"X", "B", "E", "s", "t", "f"}:
            by_thread.setdefault((ev.get("pid"), ev.get("tid")), []).append(ev)
    flows: dict[Any, dict[str, list]] = {}
    for thread, evs in by_thread.items():
        spans = sorted(
            ((ev["ts"], ev["ts"] + ev["dur"]) for ev in evs if ev["ph"] == "X"), key=lambda s: (s[0], -s[1])
        )
        stack: list[float] = []
        for start, end in spans:
            while stack and stack[-1] <= start:
                stack.pop()
            if stack and end > stack[-1] + 1e-3:
                problems.append(
                    f"thread {thread!r}: slice [{start}, {end}] overlaps its parent ending {stack[-1]}"
                )
            stack.append(end)
        depth = 0
        for ev in sorted((ev for ev in evs if ev["ph"] in {"B", "E"}), key=lambda ev: ev["ts"]):
            depth += 1 if ev["ph"] == "B" else -1
            if depth < 0:
                problems.append(f"thread {thread!r}: E at {ev['ts']} without a B")
                depth = 0
        if depth:
            problems.append(f"thread {thread!r}: {depth} B events never ended")
        for ev in evs:
            if ev["ph"] in {"s", "t", "f"}:
                flows.setdefault(ev["id"], {"s": [], "t": [], "f": []})[ev["ph"]].append(ev)
                if not any(a <= ev["ts"] <= b for a, b in spans):
                    problems.append(
                        f"flow {ev['id']!r} ({ev['ph']}) at {ev['ts']} is inside no slice of {thread!r}"
                    )
    for flow_id, ends in flows.items():
        if len(ends["s"]) != 1 or len(ends["f"]) != 1:
            problems.append(
                f"flow {flow_id!r}: {len(ends['s'])} starts and {len(ends['f'])} finishes (want 1 and 1)"
            )
        elif ends["f"][0]["ts"] < ends["s"][0]["ts"]:
            problems.append(
                f"flow {flow_id!r}: finishes at {ends['f'][0]['ts']} before it starts at {ends['s'][0]['ts']}"
            )
    return problems
