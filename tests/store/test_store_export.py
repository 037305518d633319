"""Export: three peers with skewed clocks merge into one causal timeline; Perfetto JSON validates."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tessera.store.errors import NotATraceDatabase
from tessera.store.events import (Connect, Error, Failover, Forward, Join, Push, Receive, Result, SessionClose,
                                  SessionOpen, TraceEvent)
from tessera.store.export import export_jsonl, export_perfetto, to_perfetto, validate_perfetto
from tessera.store.plot import plot_timeline
from tessera.store.timeline import Event, estimate_offsets, load_timeline
from tessera.store.trace import TraceWriter

EPOCH = 1_760_000_000.0
REQ, A, B = "12D3KooWRequester", "12D3KooWAlpha", "12D3KooWBravo"
SKEW = {REQ: 0.0, A: +5.0, B: -3.0}  # how far each peer's clock reads ahead of true time
SESSIONS = {"5e55a1": 0.0, "5e55b2": 0.004}  # two sessions, the second 4 ms behind: overlapping steps
STEPS = 6


def build_swarm(tmp_path: Path) -> dict[str, Path]:
    """A requester and two peers serving a pipeline ring R -> A -> B -> R, written with each
    peer's own (skewed) clock. Returns peer -> database path."""
    paths = {peer: tmp_path / f"{peer[8:].lower()}.db" for peer in SKEW}
    tracers = {peer: TraceWriter(path, peer=peer) for peer, path in paths.items()}

    def emit(peer: str, event: TraceEvent, true_end: float) -> None:
        wall = EPOCH + true_end + SKEW[peer]
        tracers[peer].emit(event, wall=wall, mono_ns=int((true_end + 1000) * 1e9))

    route = [[A, 0, 15], [B, 15, 30]]
    for peer in SKEW:
        emit(peer, Join(addrs=["/ip4/127.0.0.1/tcp/1"], model="m"), 0.0)
    emit(REQ, Connect(remote=A, link="direct"), 0.01)
    emit(A, Connect(remote=B, link="punched"), 0.011)
    for session, lag in SESSIONS.items():
        emit(REQ, SessionOpen(session=session, route=route, max_length=64), 0.02 + lag)
        for step in range(STEPS):
            t = 0.05 + step * 0.05 + lag
            ids = dict(session=session, step=step)
            # pushes and receives carry no duration: each is a 1 µs slice for its flow arrow
            emit(REQ, Push(remote=A, bytes=2304, start_pos=step, n_tokens=1, **ids), t)
            emit(A, Receive(remote=REQ, bytes=2304, **ids), t + 0.002)
            emit(A, Forward(span=(0, 15), duration=0.010, **ids), t + 0.012)
            emit(A, Push(remote=B, bytes=2304, span=(0, 15), **ids), t + 0.0125)
            emit(B, Receive(remote=A, bytes=2304, span=(15, 30), **ids), t + 0.0155)
            emit(B, Forward(span=(15, 30), duration=0.012, **ids), t + 0.0275)
            emit(B, Push(remote=REQ, bytes=2304, span=(15, 30), **ids), t + 0.028)
            emit(REQ, Receive(remote=B, bytes=2304, **ids), t + 0.030)
            emit(REQ, Result(duration=0.031, start_pos=step, n_tokens=1, **ids), t + 0.031)
        emit(REQ, SessionClose(session=session, reason="done"), 0.4 + lag)
    emit(REQ, Failover(session="5e55a1", remote=A, duration=0.01, reason="gone", position=6, route=route), 0.44)
    emit(B, Error(remote=A, reason="link to A dropped"), 0.45)
    for tracer in tracers.values():
        tracer.close()
    return paths


@pytest.fixture
def swarm(tmp_path):
    return build_swarm(tmp_path)


N_PAIRS = 3 * STEPS * len(SESSIONS)
N_FORWARDS = 2 * STEPS * len(SESSIONS)
N_RESULTS = STEPS * len(SESSIONS)


def _pairs_in_order(records: list[dict]) -> list[tuple[int, int]]:
    """(index of push, index of receive) for every receive in `records`."""
    push_at = {
        (r["peer"], r["remote"], r["session"], r["step"]): i
        for i, r in enumerate(records)
        if r["kind"] == "push"
    }
    return [
        (push_at[(r["remote"], r["peer"], r["session"], r["step"])], i)
        for i, r in enumerate(records)
        if r["kind"] == "receive"
    ]


def test_raw_clocks_are_not_causal(swarm):
    """The fixture really needs alignment: by raw wall time, receives come before their pushes."""
    events = []
    for path in swarm.values():
        events += [{"peer": e.peer, "kind": e.kind, "remote": e.event.remote, "session": e.event.session,
                    "step": e.event.step, "t": e.wall} for e in load_timeline([path]).events]
    records = sorted(events, key=lambda e: e["t"])
    assert any(p > r for p, r in _pairs_in_order(records))


def test_jsonl_merge_is_causal_and_recovers_the_skew(swarm, tmp_path):
    out = tmp_path / "trace.jsonl"
    summary = export_jsonl(list(swarm.values()), out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == summary["events"] == sum(1 for r in records)
    assert [r["t"] for r in records] == sorted(r["t"] for r in records)
    order = _pairs_in_order(records)
    assert len(order) == summary["pairs"] == N_PAIRS
    for push_index, receive_index in order:
        assert push_index < receive_index
        assert records[push_index]["t"] < records[receive_index]["t"]
    assert summary["non_causal"] == 0
    offsets = {peer: summary["clock_offsets_s"][str(path)] for peer, path in swarm.items()}
    # The ring's round trip is 7.5 ms of delay; the estimate spreads it, so it is off by less.
    assert offsets[A] - offsets[REQ] == pytest.approx(SKEW[A] - SKEW[REQ], abs=0.0075)
    assert offsets[B] - offsets[REQ] == pytest.approx(SKEW[B] - SKEW[REQ], abs=0.0075)
    assert summary["clock_offsets_s"][summary["reference"]] == 0.0
    assert {r["kind"] for r in records} >= {
        "join",
        "connect",
        "push",
        "receive",
        "forward",
        "result",
        "failover",
    }


def test_the_merge_does_not_depend_on_argument_order(swarm, tmp_path):
    one = export_jsonl(list(swarm.values()), tmp_path / "1.jsonl")
    two = export_jsonl(list(reversed(swarm.values())), tmp_path / "2.jsonl")
    assert one["reference"] == two["reference"]
    assert one["clock_offsets_s"] == two["clock_offsets_s"]
    strip = lambda p: [
        (r["peer"], r["kind"], r["id"], r["t"]) for r in map(json.loads, p.read_text().splitlines())
    ]  # noqa: E731
    assert strip(tmp_path / "1.jsonl") == strip(tmp_path / "2.jsonl")


def test_perfetto_export_validates_with_tracks_slices_and_flows(swarm, tmp_path):
    out = tmp_path / "trace.json"
    summary = export_perfetto(list(swarm.values()), out)
    obj = json.loads(out.read_text())
    assert validate_perfetto(obj) == []
    events = obj["traceEvents"]
    names = {
        ev["pid"]: ev["args"]["name"] for ev in events if ev["ph"] == "M" and ev["name"] == "process_name"
    }
    assert sorted(names.values()) == sorted(f"peer {p}" for p in SKEW)
    assert {ev["pid"] for ev in events} == set(names)  # one process (track group) per peer
    pid_of = {name.removeprefix("peer "): pid for pid, name in names.items()}
    forwards = [ev for ev in events if ev["ph"] == "X" and ev["name"] == "forward"]
    assert len(forwards) == N_FORWARDS
    # + pushes, receives, the requester's results and its failover (events with a duration)
    assert summary["slices"] == N_FORWARDS + 2 * N_PAIRS + N_RESULTS + 1
    assert {(pid_of[A], s, k) for s in SESSIONS for k in range(STEPS)} <= {
        (ev["pid"], ev["args"]["session"], ev["args"]["step"]) for ev in forwards
    }
    # Two sessions overlap on A's compute: Perfetto needs them on two lanes.
    assert len({ev["tid"] for ev in forwards if ev["pid"] == pid_of[A]}) == 2
    starts = {ev["id"]: ev for ev in events if ev["ph"] == "s"}
    finishes = {ev["id"]: ev for ev in events if ev["ph"] == "f"}
    assert len(starts) == len(finishes) == summary["flows"] == N_PAIRS
    assert set(starts) == set(finishes)
    links = {(starts[i]["pid"], finishes[i]["pid"]) for i in starts}
    assert links == {(pid_of[REQ], pid_of[A]), (pid_of[A], pid_of[B]), (pid_of[B], pid_of[REQ])}
    assert all(finishes[i]["ts"] > starts[i]["ts"] for i in starts)
    instants = {ev["name"] for ev in events if ev["ph"] == "i"}
    assert instants == {"join", "connect", "session_open", "session_close", "error"}  # no duration


def _broken(obj: dict, how: str) -> dict:
    obj = copy.deepcopy(obj)
    events = obj["traceEvents"]
    first = lambda ph, **kw: next(
        ev for ev in events if ev["ph"] == ph and all(ev.get(k) == v for k, v in kw.items())
    )  # noqa: E731
    if how == "missing flow finish":
        events.remove(first("f"))
    elif how == "negative duration":
        first("X")["dur"] = -5.0
    elif how == "seconds since epoch":
        first("i")["ts"] = EPOCH * 1e6
    elif how == "ts as string":
        first("X")["ts"] = "12"
    elif how == "unnamed process":
        events.remove(first("M", name="process_name"))
    elif how == "overlapping slices":
        lanes = sorted({ev["tid"] for ev in events if ev["ph"] == "X" and ev["name"] == "forward"})
        for ev in events:
            if ev["ph"] in {"X", "s", "f"} and ev.get("tid") == lanes[1]:
                ev["tid"] = lanes[0]
    elif how == "flow outside any slice":
        first("s")["ts"] += 1e5
    elif how == "unknown phase":
        events.append({"ph": "Q", "name": "x", "pid": 1, "tid": 0, "ts": 1})
    elif how == "no events list":
        obj.pop("traceEvents")
    return obj


@pytest.mark.parametrize(
    "how",
    [
        "missing flow finish",
        "negative duration",
        "seconds since epoch",
        "ts as string",
        "unnamed process",
        "overlapping slices",
        "flow outside any slice",
        "unknown phase",
        "no events list",
    ],
)
def test_validate_perfetto_catches_a_broken_trace(swarm, how):
    obj = to_perfetto(load_timeline(list(swarm.values())))
    assert validate_perfetto(obj) == []
    problems = validate_perfetto(_broken(obj, how))
    assert problems, f"{how} went unnoticed"


def _event(db: int, kind: type[Push] | type[Receive], wall: float, *, remote: str) -> Event:
    return Event(db=db, id=0, mono_ns=0, wall=wall, peer=f"p{db}",
                 event=kind(session="aa", step=0, remote=remote, bytes=0))


def test_two_way_pairs_give_the_ntp_estimate_and_lonely_peers_keep_zero():
    # db1's clock is 10 s ahead; delays 3 ms out, 5 ms back: NTP's error is (3 - 5) / 2 = -1 ms.
    pairs = [
        (_event(0, Push, 100.0, remote="p1"), _event(1, Receive, 100.0 + 10 + 0.003, remote="p0")),
        (_event(1, Push, 200.0 + 10, remote="p0"), _event(0, Receive, 200.005, remote="p1")),
    ]
    offsets, reference = estimate_offsets(3, pairs, [("p0",), ("p1",), ("p2",)])
    assert reference == 0
    assert offsets[1] == pytest.approx(10 - 0.001, abs=1e-9)
    assert offsets[2] == 0.0  # no messages: nothing to align on


def test_one_way_link_assumes_the_fastest_message_was_instant():
    pairs = [
        (
            _event(0, Push, 100.0 + i, remote="p1"),
            _event(1, Receive, 100.0 + i - 3 + 0.002 + i / 100, remote="p0"),
        )
        for i in range(3)
    ]
    offsets, _ = estimate_offsets(2, pairs, [("p0",), ("p1",)])
    assert offsets[1] == pytest.approx(-3 + 0.002 - 1e-6, abs=1e-9)


def test_export_refuses_what_is_not_a_trace(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(NotATraceDatabase):
        export_jsonl([junk], tmp_path / "out.jsonl")
    with pytest.raises(NotATraceDatabase):
        export_jsonl([tmp_path / "missing.db"], tmp_path / "out.jsonl")


def test_plot_timeline_writes_a_png(swarm, tmp_path):
    out = tmp_path / "timeline.png"
    drawn = plot_timeline(list(swarm.values()), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert drawn["forward_steps"] == N_FORWARDS and drawn["pushes"] == N_PAIRS and len(drawn["peers"]) == 3


def test_a_simulation_database_with_many_peers_shares_one_clock(tmp_path):
    path = tmp_path / "sim.db"
    with TraceWriter(path, peer="sim") as tracer:
        for step in range(3):
            t = 10.0 + step
            tracer.emit(Push(remote="s2", session="01", step=step, bytes=8), peer="s1", wall=t)
            tracer.emit(Receive(remote="s1", session="01", step=step, bytes=8), peer="s2", wall=t + 0.01)
            tracer.emit(Forward(session="01", step=step, span=(0, 1), duration=0.02), peer="s2", wall=t + 0.03)
    timeline = load_timeline([path])
    assert timeline.offsets == {0: 0.0} and len(timeline.pairs) == 3 and timeline.peers == ["s1", "s2"]
    obj = to_perfetto(timeline)
    assert validate_perfetto(obj) == []
    assert len({ev["pid"] for ev in obj["traceEvents"]}) == 2
    empty = tmp_path / "empty.db"
    TraceWriter(empty, peer="idle").close()
    assert validate_perfetto(to_perfetto(load_timeline([empty]))) == []
