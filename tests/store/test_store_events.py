"""Trace events are classes (store/events.py) shared by every emitter and reader.

- every class round-trips through a real store, a timeline and the JSONL export;
- an AST walk over peer/, tui/, store/ and bench/ finds every event constructed, every emit, and
  every kind or field named, and fails on a kind given as a string, a field no class defines, or
  a class nothing in peer/ ever emits (a documented kind that never happens);
- an old or foreign row (unknown kind, missing or extra field) is kept as `Unknown`, and a row
  without a usable time is one typed error.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sqlite3
from pathlib import Path

import pytest

from tessera.peer.net.transport import LinkKind
from tessera.store.db import PeerStore
from tessera.store.errors import BadTraceRow
from tessera.store.events import (BY_KIND, CONNECT_KINDS, EVENT_TYPES, ROW_COLUMNS, SPECS, Claim, Forward, SessionOpen, Stamped,
                                  TraceEvent, Unknown, field_names)
from tessera.store.export import export_jsonl
from tessera.store.timeline import load_timeline
from tessera.store.trace import MemoryTracer, TraceWriter
from tessera.store.writer import TRACE_COLUMNS

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("peer", "tui", "store", "bench")
EVENTS_MODULE = "tessera.store.events"
SAMPLES = {"str": "x", "int": 3, "float": 1.5, "bool": True, "Span": (2, 5), "SessionId": "ab12",
           "JSONList": ["a", 1]}


def sample(cls: type[TraceEvent]) -> TraceEvent:
    """An instance of `cls` with every field set (optional ones too)."""
    values = {}
    for f in SPECS[cls]:
        values[f.name] = "direct" if f.key == "kind" else SAMPLES[f.annotation]
    return cls(**values)


def test_every_event_class_round_trips_through_a_store_a_timeline_and_the_export(tmp_path):
    sent = [sample(cls) for cls in EVENT_TYPES]
    path = tmp_path / "t.db"
    with TraceWriter(path, peer="12D3KooWA") as tracer:
        for i, event in enumerate(sent):
            tracer.emit(event, wall=1000.0 + i)
    with PeerStore(path, readonly=True) as store:
        back = [row.event for row in store.events()]
        assert [row.event for row in store.events(kinds=(Claim, Forward))] == [sample(Claim), sample(Forward)]
    assert back == sent
    assert [e.event for e in load_timeline([path]).events] == sent
    export_jsonl([path], tmp_path / "t.jsonl")
    records = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == [cls.kind for cls in EVENT_TYPES]
    assert not any("unknown" in r for r in records)
    assert len(BY_KIND) == len(EVENT_TYPES)  # one class per kind


def test_connect_kinds_are_the_transports_link_kinds_and_row_columns_the_tables():
    assert sorted(CONNECT_KINDS) == sorted(k.value for k in LinkKind)
    assert TRACE_COLUMNS == ("mono_ns", "wall", "peer", "kind", *ROW_COLUMNS, "detail")


# --- the AST walk ----------------------------------------------------------------------------


def check_source(source: str, name: str) -> tuple[list[str], set[str]]:
    """Problems in one module's use of trace events, and the event classes it constructs."""
    tree = ast.parse(source, filename=name)
    classes: dict[str, str] = {}  # local name -> event class name
    modules: set[str] = set()  # local names of tessera.store.events
    reads_traces = False  # imports from tessera.store: a `.kind` here is a trace kind
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tessera.store"):
            reads_traces = True
        if isinstance(node, ast.ImportFrom) and node.module == EVENTS_MODULE:
            classes.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module == "tessera.store":
            modules.update(a.asname or a.name for a in node.names if a.name == "events")
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name == EVENTS_MODULE and a.asname)
    by_name = {cls.__name__: cls for cls in EVENT_TYPES}
    problems: list[str] = []
    built: set[str] = set()

    def where(node: ast.AST) -> str:
        return f"{name}:{getattr(node, 'lineno', '?')}"

    def event_class(func: ast.expr) -> str | None:
        if isinstance(func, ast.Name) and func.id in classes:
            return classes[func.id]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
            return func.attr
        return None

    def strings(node: ast.AST) -> list[str]:
        return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            cls_name = event_class(node.func)
            if cls_name in by_name:
                built.add(cls_name)
                fields = set(field_names(by_name[cls_name]))
                for kw in node.keywords:
                    if kw.arg is not None and kw.arg not in fields:
                        problems.append(f"{where(node)}: {cls_name} has no field {kw.arg!r}")
            elif cls_name is not None and isinstance(node.func, ast.Attribute):
                import tessera.store.events as module

                if not hasattr(module, cls_name):
                    problems.append(f"{where(node)}: tessera.store.events has no {cls_name!r}")
            method = node.func.attr if isinstance(node.func, ast.Attribute) else None
            if method == "emit":
                first = node.args[0] if node.args else None
                if first is None or (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                    problems.append(f"{where(node)}: emit() takes an event object, not a kind string")
            if method == "of_kind" and any(strings(a) for a in node.args):
                problems.append(f"{where(node)}: of_kind() takes an event class, not a string")
            for kw in node.keywords:
                if kw.arg == "kinds" and strings(kw.value):
                    problems.append(f"{where(node)}: kinds= takes event classes, not strings {strings(kw.value)}")
        elif isinstance(node, ast.Compare) and reads_traces:
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides):
                named = [v for s in sides for v in strings(s) if v in BY_KIND]
                if named:
                    problems.append(f"{where(node)}: compares .kind with {named}; use isinstance with the class")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "event":
            known = {"kind", *(f.name for spec in SPECS.values() for f in spec),
                     *(f.name for f in dataclasses.fields(Unknown))}
            if node.attr not in known:
                problems.append(f"{where(node)}: .event.{node.attr} is a field of no event class")
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
              and isinstance(node.slice, ast.Constant) and node.slice.value == "detail"):
            problems.append(f"{where(node)}: reads a raw ['detail']; decode the row into its event class")
    return problems, built


def project_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))
            if p.name != "events.py" or p.parent.name != "store"}


def test_emitters_and_readers_use_only_the_kinds_and_fields_the_module_defines():
    problems: list[str] = []
    emitted: set[str] = set()
    for name, source in project_sources().items():
        found, built = check_source(source, name)
        problems += found
        if name.startswith("peer/"):
            emitted |= built
    assert problems == []
    never = sorted(cls.__name__ for cls in EVENT_TYPES if cls.__name__ not in emitted)
    assert never == [], f"event classes nothing in peer/ constructs (documented, never emitted): {never}"


def test_the_walk_finds_each_kind_of_drift():
    bad = '''
from tessera.store import events
from tessera.store.events import Claim, Forward
tracer.emit("claim", span=(0, 1))
tracer.emit(Claim(span=(0, 1), throughput=1.0, capacity=1, shard=2))
tracer.emit(events.Forwad(session="ab", step=1, span=(0, 1), duration=0.1))
store.events(kinds=("forward",))
tracer.of_kind("forward")
if e.kind == "rollback" or row.kind == "claim":
    pass
x = e.event.throughpt + row["detail"]["batch"]
'''
    problems, built = check_source(bad, "bad.py")
    text = "\n".join(problems)
    assert "emit() takes an event object" in text
    assert "Claim has no field 'shard'" in text
    assert "has no 'Forwad'" in text
    assert "kinds= takes event classes" in text and "of_kind() takes an event class" in text
    assert "compares .kind with ['claim']" in text  # 'rollback' is no kind any more: not a kind string
    assert ".event.throughpt is a field of no event class" in text and "raw ['detail']" in text
    assert built == {"Claim"}
    good = "from tessera.store import events\ntracer.emit(events.Claim(span=(0, 1), throughput=1.0, capacity=1))\n"
    assert check_source(good, "good.py") == ([], {"Claim"})


# --- old and foreign rows ---------------------------------------------------------------------


def insert(path: Path, rows: list[dict]) -> None:
    conn = sqlite3.connect(path)
    with conn:
        for row in rows:
            full = {"mono_ns": 1, "wall": 1000.0, "peer": "12D3KooWOld", **row}
            conn.execute(f"INSERT INTO trace ({', '.join(full)}) VALUES ({', '.join('?' * len(full))})",
                         tuple(full.values()))
    conn.close()


def test_an_old_or_foreign_row_is_kept_as_unknown_and_a_legacy_span_is_read(tmp_path):
    path = tmp_path / "old.db"
    PeerStore(path).close()
    insert(path, [
        {"kind": "rollback", "session": "ab", "detail": '{"from": 5, "to": 3}'},  # a kind no longer emitted
        {"kind": "claim", "span_start": 0, "span_end": 4, "detail": '{"capacity": 4}'},  # throughput missing
        {"kind": "forward", "session": "ab", "step": 1, "span_start": 0, "span_end": 4, "duration": 0.1,
         "detail": '{"msg": 7}'},  # a detail key no class defines
        {"kind": "join", "detail": '{"addrs": "not a list", "model": "m"}'},  # a wrong type
        {"kind": "error", "detail": "[1, 2]"},  # a detail that is not an object
        {"kind": "session_open", "session": "ab", "detail": '{"group": "g", "span": [0, 4], "members": ["a"]}'},
    ])
    with PeerStore(path, readonly=True) as store:
        rows = store.events()
    unknown = [row.event for row in rows[:5]]
    assert all(isinstance(e, Unknown) for e in unknown), unknown
    assert [row.kind for row in rows[:5]] == ["rollback", "claim", "forward", "join", "error"]
    problems = [e.problem for e in unknown]  # type: ignore[attr-defined]
    assert "no event class has kind 'rollback'" in problems[0]
    assert "throughput is missing" in problems[1]
    assert "['msg']" in problems[2]
    assert "addrs must be a list" in problems[3] and "not a JSON object" in problems[4]
    assert rows[5].event == SessionOpen(session="ab", span=(0, 4), group="g", members=["a"])
    export_jsonl([path], tmp_path / "old.jsonl")
    records = [json.loads(line) for line in (tmp_path / "old.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["rollback", "claim", "forward", "join", "error", "session_open"]
    assert records[0]["detail"] == {"from": 5, "to": 3} and "rollback" in records[0]["unknown"]
    assert "unknown" not in records[5]


def test_a_row_without_a_usable_time_is_one_typed_error(tmp_path):
    path = tmp_path / "bad.db"
    PeerStore(path).close()
    insert(path, [{"kind": "leave", "wall": "yesterday"}])
    with pytest.raises(BadTraceRow, match="yesterday"):
        load_timeline([path])
    with PeerStore(path, readonly=True) as store, pytest.raises(BadTraceRow, match="wall"):
        store.events()


def test_the_memory_tracer_gives_events_back_as_a_store_would():
    tracer = MemoryTracer(peer="p")
    tracer.emit(Forward(session=b"\x0f", step=1, span=(0, 2), duration=0.5), peer="q", wall=5.0, mono_ns=7)
    assert tracer.events == [Stamped(1, 7, 5.0, "q", Forward(session="0f", step=1, span=(0, 2), duration=0.5))]
