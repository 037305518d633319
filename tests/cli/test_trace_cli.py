"""A real 3-peer run on loopback, recorded: export, plot, ledger and replay through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest
import trio
from libp2p.peer.id import ID

from tessera.peer.cli.main import main
from tessera.peer.request.client import Swarm
from tessera.protocol.keys import Identity
from tessera.stages.decoding.generate import prompt_ids
from tessera.store.events import Forward, Push, Receive, Result
from tessera.store.export import validate_perfetto
from tessera.store.timeline import load_timeline
from tessera.store.trace import TraceWriter

from ..conftest import FRANCE
from ..swarm_helpers import local_swarm

SPANS = [(0, 10), (10, 20), (20, 30)]
PROMPTS = [FRANCE, "Name three colours."]
NEW_TOKENS = 6
REQUESTER_SEED = bytes(range(32))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, smol_dir):
    """Three real peer processes and a traced requester; their four databases, and what happened live."""
    out = tmp_path_factory.mktemp("recorded")
    requester = ID(Identity.from_seed(REQUESTER_SEED).peer_id).to_base58()
    live: list[dict] = []

    async def ask(addrs: list[str]) -> None:
        # made before the requester has an id: Swarm.join binds its own (issue 34, item 8)
        with TraceWriter(out / "requester.db") as tracer:
            async with Swarm.join(addrs[:1], seed=REQUESTER_SEED, tracer=tracer) as swarm:
                await swarm.wait_for_route(30)
                for prompt in PROMPTS:
                    info: dict = {}
                    ids = prompt_ids(swarm.tokenizer, prompt, raw=False)
                    tokens = [t async for t in swarm.generate_ids(ids, max_new_tokens=NEW_TOKENS, info=info)]
                    live.append({"prompt": len(ids), "tokens": len(tokens), "route": info["route"]})

    with local_swarm(SPANS) as swarm:
        trio.run(ask, swarm.addrs)
        base = swarm.base_dir
    dbs = [base / f"peer{i}" / "tessera.db" for i in range(len(SPANS))] + [out / "requester.db"]
    return SimpleNamespace(dbs=[str(p) for p in dbs], base=base, out=out, live=live, requester=requester)


def cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.slow
def test_a_real_run_exports_to_valid_perfetto_with_every_forward_step_in_causal_order(recorded, tmp_path, capsys):
    out = tmp_path / "swarm.json"
    code, text = cli(capsys, "trace", "export", *recorded.dbs, "--format", "perfetto", "-o", str(out))
    assert code == 0, text
    trace = json.loads(out.read_text())
    assert validate_perfetto(trace) == []
    names = {ev["pid"]: ev["args"]["name"] for ev in trace["traceEvents"] if ev.get("name") == "process_name"}
    forwards: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)  # (session, step) -> peer -> slice
    for ev in trace["traceEvents"]:
        if ev["ph"] == "X" and ev["name"] == "forward":
            forwards[(ev["args"]["session"], ev["args"]["step"])][names[ev["pid"]]] = ev
    chain = [f"peer {hop['peer']}" for hop in recorded.live[0]["route"]]  # peers in route order
    first_seen: dict[str, float] = {}
    for (session, _), on in forwards.items():
        first_seen[session] = min([first_seen.get(session, float("inf"))] + [ev["ts"] for ev in on.values()])
    sessions = sorted(first_seen, key=first_seen.get)
    assert len(sessions) == len(PROMPTS)
    for session, run in zip(sessions, recorded.live):  # the generations ran one after the other
        steps = sorted(step for s, step in forwards if s == session)
        assert steps == list(range(1, run["tokens"] + 1))  # every step ...
        for step in steps:
            on = forwards[(session, step)]
            assert sorted(on) == sorted(chain)  # ... on every peer
            for a, b in zip(chain, chain[1:]):  # a step starts on the next peer after it ended here
                assert on[a]["ts"] + on[a]["dur"] <= on[b]["ts"], (session, step, a, b)
    timeline = load_timeline(recorded.dbs)
    assert timeline.non_causal == 0 and len(timeline.pairs) > 0
    # Every frame on every link is paired, the requester's too: its pushes with the first
    # peer's receives, the peers' taps and results with its receives. That puts the
    # requester's clock on the timeline, and each step's hops can be read off it.
    pushes = [e for e in timeline.events if isinstance(e.event, Push)]
    receives = [e for e in timeline.events if isinstance(e.event, Receive)]
    assert len(timeline.pairs) == len(pushes) == len(receives)
    links = {(push.peer, receive.peer) for push, receive in timeline.pairs}
    first, last_peer = recorded.live[0]["route"][0]["peer"], recorded.live[0]["route"][-1]["peer"]
    assert (recorded.requester, first) in links and (last_peer, recorded.requester) in links
    ends = {(e.event.session, e.event.step): e.t for e in timeline.events
            if isinstance(e.event, Forward) and f"peer {e.peer}" == chain[-1]}
    results = [e for e in timeline.events if isinstance(e.event, Result)]
    assert len(results) == len(ends)
    for e in results:  # on the aligned clock: a step's result comes after its last forward
        assert e.t >= ends[(e.event.session, e.event.step)], (e.event.session, e.event.step)


@pytest.mark.slow
def test_a_recorded_run_replays_deterministically_with_the_live_routes(recorded, tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for out in (first, second):
        code, text = cli(capsys, "replay", *recorded.dbs, "--report", str(out), "--seed", "7")
        assert code == 0, text
    assert first.read_bytes() == second.read_bytes()
    report = json.loads(first.read_text())
    print(text)
    live_routes = [[[h["peer"], h["start"], h["end"]] for h in run["route"]] for run in recorded.live]
    assert [r["recorded_route"] for r in report["requests"]] == live_routes
    assert [r["routes"][0] for r in report["requests"]] == live_routes  # the same choices, made again
    assert report["summary"]["route_matches"] == len(PROMPTS)
    assert [(r["prompt_tokens"], r["new_tokens"]) for r in report["requests"]] == [
        (run["prompt"], run["tokens"]) for run in recorded.live]
    assert report["summary"]["completed"] == len(PROMPTS) and report["settings"]["handler_errors"] == 0
    assert report["settings"]["view"] == "gossip"  # a small replay runs real gossip
    code, text = cli(capsys, "replay", *recorded.dbs, "--policy", "default", "--report", str(first))
    assert code == 0 and "policy default" in text


@pytest.mark.slow
def test_the_ledger_shows_what_each_peer_computed(recorded, capsys):
    served = sum(run["prompt"] + run["tokens"] - 1 for run in recorded.live)  # tokens through each span
    for i, (start, end) in enumerate(SPANS):
        code, text = cli(capsys, "ledger", "--data-dir", str(recorded.base / f"peer{i}"), "--json")
        assert code == 0, text
        summary = json.loads(text)
        assert summary["by_requester"][recorded.requester]["layer_tokens"] == served * (end - start)
        assert summary["total"]["steps"] == sum(run["tokens"] for run in recorded.live)
    code, text = cli(capsys, "ledger", "--data-dir", str(recorded.base / "peer0"))
    assert code == 0 and "layer-tokens" in text and recorded.requester[-24:] in text


@pytest.mark.slow
def test_trace_plot_draws_the_run(recorded, tmp_path, capsys):
    out = tmp_path / "timeline.png"
    code, text = cli(capsys, "trace", "plot", str(recorded.base), str(recorded.out), "-o", str(out))
    assert code == 0, text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = sum(run["tokens"] for run in recorded.live) * len(SPANS)
    assert f"{steps} forward steps on 4 peers" in text


@pytest.mark.slow
def test_generate_records_a_trace_that_replays(tmp_path, smol_dir, capsys):
    """Issue 34, item 8: `generate` (and `serve`, the same option) could not record a requester trace."""
    recording = tmp_path / "generate.db"
    with local_swarm([(0, 30)]) as swarm:
        done = subprocess.run([sys.executable, "-m", "tessera.peer.cli.main", "generate", FRANCE, "--join",
                               swarm.addrs[0], "--max-tokens", str(NEW_TOKENS), "--threads", "1", "--json",
                               "--record-trace", str(recording)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        peer_db = swarm.base_dir / "peer0" / "tessera.db"
    run = json.loads(done.stdout.splitlines()[-1])  # the last of its JSON lines: the whole answer
    report = tmp_path / "r.json"
    code, text = cli(capsys, "replay", str(peer_db), str(recording), "--report", str(report))
    assert code == 0, text
    (request,) = json.loads(report.read_text())["requests"]
    assert request["recorded_route"] == [[h["peer"], h["start"], h["end"]] for h in run["route"]]
    assert request["new_tokens"] == len(run["tokens"]) and request["completed"]


@pytest.mark.slow
def test_trace_plot_draws_a_window_and_a_session(recorded, tmp_path, capsys):
    out = tmp_path / "window.png"
    whole = load_timeline(recorded.dbs)
    forwards = [e for e in whole.events if isinstance(e.event, Forward)]
    sessions = sorted({e.event.session for e in forwards}, key=lambda s: min(e.t for e in forwards if e.event.session == s))
    first = [e for e in forwards if e.event.session == sessions[0]]
    code, text = cli(capsys, "trace", "plot", *recorded.dbs, "--session", sessions[0][:8], "-o", str(out))
    assert code == 0 and f"{len(first)} forward steps" in text, text
    end = max(e.t for e in first)
    code, text = cli(capsys, "trace", "plot", *recorded.dbs, "--until", f"{end:.6f}", "-o", str(out))
    assert code == 0 and f"{len(first)} forward steps" in text and out.read_bytes()[:4] == b"\x89PNG", text
    code, text = cli(capsys, "trace", "plot", *recorded.dbs, "--since", "99:99", "-o", str(out))
    assert code == 1 and text.startswith("error: '99:99' is not a time")
    code, text = cli(capsys, "trace", "plot", *recorded.dbs, "--since", "1e9", "-o", str(out))
    assert code == 1 and text.startswith("error: no events between")


def test_simulate_writes_the_same_report_twice(tmp_path, capsys):
    reports = []
    for name in ("a.json", "b.json"):
        code, text = cli(capsys, "simulate", "--peers", "4", "--requests", "3", "--seed", "2",
                         "--report", str(tmp_path / name))
        assert code == 0, text
        reports.append((tmp_path / name).read_bytes())
    assert reports[0] == reports[1]
    assert "requests: 3/3 completed" in text


def test_simulate_gives_the_same_bytes_in_another_process_with_another_hash_seed(tmp_path):
    """No set or dict order that Python randomises per process leaks into a report."""
    import os
    import subprocess
    import sys

    outs = []
    for hash_seed in ("1", "4242"):
        out = tmp_path / f"r{hash_seed}.json"
        subprocess.run([sys.executable, "-m", "tessera.peer.cli.main", "simulate", "--peers", "5", "--requests", "4",
                        "--churn", "1", "--seed", "3", "--report", str(out)],
                       check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_every_command_has_an_example(capsys):
    for argv in (["ledger"], ["trace", "export"], ["trace", "plot"], ["replay"], ["simulate"]):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        assert "example" in capsys.readouterr().out, argv


def test_bad_input_is_one_clean_error_line(tmp_path, capsys):
    code, text = cli(capsys, "ledger", "--data-dir", str(tmp_path / "nowhere"))
    assert code == 1 and text.startswith("error: no peer database")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 10)
    code, text = cli(capsys, "replay", str(junk))
    assert code == 1 and text.startswith("error:") and "Traceback" not in text
    code, text = cli(capsys, "trace", "export", str(tmp_path / "empty-dir-that-is-missing"), "--format", "jsonl",
                     "-o", str(tmp_path / "x.jsonl"))
    assert code == 1 and text.startswith("error:")


def test_the_ledgers_last_time_is_the_last_contribution(tmp_path, capsys):
    """It said the start of the hour ("last 14:00" for a step at 14:58): issue 34."""
    from datetime import datetime

    from tessera.store.db import PeerStore

    at = datetime(2026, 12, 5, 14, 58, 31).timestamp()
    with PeerStore(tmp_path / "tessera.db") as store:
        store.record_identity("12D3KooWpeer")
        store.add_ledger("12D3KooWrequester", 30, at=at - 600)
        store.add_ledger("12D3KooWrequester", 30, at=at)
    code, text = cli(capsys, "ledger", "--data-dir", str(tmp_path))
    assert code == 0 and "last 2026-12-05 14:58:31" in text, text


def test_the_ledger_finds_a_named_peer_as_the_tour_starts_it(tmp_path, capsys, monkeypatch):
    """Issue 46, item 6: after the tour's `tessera peer --name first`, `tessera ledger` looked in
    ~/.local/share/tessera/peer, and `--name` was not an option (it printed the top-level usage)."""
    from tessera.store.db import PeerStore

    monkeypatch.setenv("HOME", str(tmp_path))
    root = tmp_path / ".local" / "share" / "tessera"
    code, text = cli(capsys, "ledger")
    assert code == 1 and text.startswith("error: which peer? no peer has run on this machine"), text
    for name in ("first", "second"):
        (root / name).mkdir(parents=True)
        with PeerStore(root / name / "tessera.db") as store:
            store.record_identity(f"12D3KooW{name}")
        if name == "first":  # the only peer here: the one it reads
            code, text = cli(capsys, "ledger")
            assert code == 0 and text.startswith("peer 12D3KooWfirst"), text
    code, text = cli(capsys, "ledger", "--name", "second")
    assert code == 0 and text.startswith("peer 12D3KooWsecond"), text
    code, text = cli(capsys, "ledger")  # two: it names them
    assert code == 1 and text.strip() == "error: which peer? peers here: --name first, --name second (or --data-dir DIR)"
    code, text = cli(capsys, "ledger", "--name", "third")
    assert code == 1 and "no peer named 'third' on this machine" in text and "--name first, --name second" in text
