"""Real peer processes on loopback keep one view: after a leave and a memory change that moves
a span (issue 16's split), after an idle period longer than a record's lifetime, and as
`tessera swarm status --json --only --join <peer>` shows each peer's own view.

Short periods (TESSERA_GOSSIP_INTERVAL, TESSERA_RECORD_TTL) make it run in seconds; the
memory change goes through the peer's command pipe (`--control-stdin`, peer/cli/control.py),
the same `node.set_memory_offered` the TUI's `m` key calls.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import trio

from tessera.peer.cli.demo import LocalSwarm, memory_for_layers
from tessera.peer.cli.status import gather_status

pytestmark = pytest.mark.slow

GOSSIP_S = 1.0
TTL_S = 6.0  # advertised every min(3, TTL / 5) = 1.2 s
ENV = {"TESSERA_GOSSIP_INTERVAL": str(GOSSIP_S), "TESSERA_RECORD_TTL": str(TTL_S)}
# How long the views may take to agree, waited on as a condition. The bound is 2 gossip periods
# plus 2 exchanges (peer/net/gossip.py; tests/net/test_gossip_convergence.py checks it on simulated
# time); here peer processes share two loaded cores with other tests, and a move drains for
# MOVE_GRACE and loads its layers first, so the wait is generous. The time taken is printed.
AGREE_TIMEOUT = 90.0
POLL_S = 0.5
MOVED_TIMEOUT = 120.0  # the memory command: drain (MOVE_GRACE 5 s), load 22 layers, serve


def views(swarm: LocalSwarm, live: list[int]) -> dict[int, frozenset]:
    """Each live peer's own view: (name, span, state) of every record it holds."""

    async def one(addr: str) -> frozenset:
        report = await gather_status([addr], model=swarm.model, only=True)
        return frozenset((p["name"], tuple(p["span"]), p["state"]) for p in report["peers"])

    return {i: trio.run(one, swarm.addrs[i]) for i in live}


def agreed(swarm: LocalSwarm, live: list[int], expect: dict[str, tuple[int, int]]) -> dict[int, frozenset] | None:
    seen = views(swarm, live)
    first = next(iter(seen.values()))
    serving = {(name, span, "serving") for name, span in expect.items()}
    if all(v == first for v in seen.values()) and serving <= first:
        return seen
    return None


def wait_agreed(swarm: LocalSwarm, live: list[int], expect: dict[str, tuple[int, int]]) -> tuple[dict, float]:
    began = time.monotonic()
    last = None
    while time.monotonic() - began < AGREE_TIMEOUT:
        try:
            seen = agreed(swarm, live, expect)
        except Exception as error:  # a peer busy loading may not answer one poll
            last = error
            seen = None
        if seen is not None:
            return seen, time.monotonic() - began
        time.sleep(POLL_S)
    raise AssertionError(f"views did not agree in {AGREE_TIMEOUT} s: {views(swarm, live)} (last error {last})")


def span_of(log: str, marker: str) -> tuple[int, int]:
    line = [l for l in log.splitlines() if marker in l][-1]
    a, b = line.split("[", 1)[1].split(")", 1)[0].split(",")
    return int(a), int(b)


@pytest.fixture(scope="module")
def swarm(smol_dir):
    args = [["--layers", "0:11"], ["--layers", "11:30"], ["--layers", "0:15"],
            ["--memory", f"{memory_for_layers('smollm2-135m', 8):.4f}", "--rebalance-interval", "100000"]]
    swarm = LocalSwarm(4, extra_args=args, env=ENV, control=True)
    try:
        swarm.start(together=True)
        yield swarm
    finally:
        swarm.stop(timeout=15)


def test_a_leave_and_a_memory_move_leave_every_peer_with_the_same_view(swarm):
    names = {0: "peer0", 1: "peer1", 2: "peer2", 3: "peer3"}
    expect = {"peer0": (0, 11), "peer1": (11, 30), "peer2": (0, 15), "peer3": span_of(swarm.log(3), "serving layers")}
    wait_agreed(swarm, [0, 1, 2, 3], expect)

    swarm.stop(2)  # leaves gracefully
    del expect["peer2"]
    swarm.command(3, f"memory {memory_for_layers('smollm2-135m', 22):.4f}")
    began = time.monotonic()
    while "(moved:" not in swarm.log(3):
        assert time.monotonic() - began < MOVED_TIMEOUT, swarm.log(3)[-2000:]
        time.sleep(POLL_S)
    moved = span_of(swarm.log(3), "(moved:")
    assert moved[1] - moved[0] == 22
    expect["peer3"] = moved
    seen, took = wait_agreed(swarm, [0, 1, 3], expect)
    print(f"views agreed {took:.1f} s after peer3 served its new span {moved} (gossip period {GOSSIP_S} s)")
    for view in seen.values():  # the peer that left: gone, or still shown as leaving until its record expires
        assert {(n, s) for n, s, state in view if state == "serving"} == set(expect.items())
        assert all(state == "leaving" for n, _, state in view if n == names[2])


def test_views_stay_whole_across_an_idle_period_longer_than_a_record_lifetime(swarm):
    expect = {"peer0": (0, 11), "peer1": (11, 30), "peer3": span_of(swarm.log(3), "serving layers")}
    wait_agreed(swarm, [0, 1, 3], expect)
    time.sleep(3 * TTL_S)  # the scenario itself: nothing happens for three record lifetimes
    seen, took = wait_agreed(swarm, [0, 1, 3], expect)
    for view in seen.values():
        assert view == {(n, s, "serving") for n, s in expect.items()}  # the left peer's record expired


def status_reports(swarm: LocalSwarm, peers: tuple[int, ...]) -> list[dict]:
    """`tessera swarm status --json --only --join <peer>` for each peer, run at once."""
    procs = [subprocess.Popen([sys.executable, "-m", "tessera.peer.cli.main", "swarm", "status", "--json", "--only",
                               "--join", swarm.addrs[i]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=swarm.env) for i in peers]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    return reports


def test_the_status_command_shows_each_peers_own_view_and_they_agree(swarm):
    expect = {"peer0": (0, 11), "peer1": (11, 30), "peer3": span_of(swarm.log(3), "serving layers")}
    wait_agreed(swarm, [0, 1, 3], expect)
    want = {(n, s, "serving") for n, s in expect.items()}
    # Three CLI processes starting at once load the two shared cores; with the test's 6 s record
    # lifetime a starved peer's refresh can arrive late and a view briefly lack it. Agreement
    # within the bound is the claim, so ask again (as a condition, not a sleep) until it holds.
    began = time.monotonic()
    while True:
        reports = status_reports(swarm, (0, 1, 3))
        spans = [{(p["name"], tuple(p["span"]), p["state"]) for p in r["peers"]} for r in reports]
        if spans[0] == spans[1] == spans[2] == want or time.monotonic() - began > AGREE_TIMEOUT:
            break
    assert spans[0] == spans[1] == spans[2] == want, spans
    assert all(r["gaps"] == [] for r in reports)
