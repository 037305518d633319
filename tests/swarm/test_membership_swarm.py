"""Twelve real libp2p peer processes on loopback, gossiping: each holds at most the membership
bound of connections (peer/net/membership.py), set low here so that it is below the eleven a
peer would hold if it dialled everyone, and still every peer ends up with the whole view.

The bound is on the connections a peer's membership holds. A peer also sees, for a moment,
connections that others opened and are closing: an ask it refused (full), a link the other
side dropped in its refresh. Those are the opener's to close, within a period or two; the
test holds them to CLOSED_WITHIN, so a leak still fails it. (Counting them against the bound
failed CI once: a full peer, three asks arriving in the same tick, 8 connections for 0.3 s.)

The peers are membership-only (tests/swarm/gossip_member.py: a host, a signed record, the
real `Gossip`; no model), so the test costs twelve processes' start-up and a few seconds of
gossip. It prints each peer's largest connection count and how long the views took to agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.slow

PEERS = 12
OUTBOUND, INBOUND = 2, 3
# membership.MAX_CONNECTIONS with these settings: the neighbours (2 dialled or being asked,
# 3 accepted), one dropped by a refresh until it closes, one probe.
BOUND = OUTBOUND + INBOUND + 2
ENV = {"TESSERA_GOSSIP_INTERVAL": "0.5", "TESSERA_GOSSIP_OUTBOUND": str(OUTBOUND),
       "TESSERA_GOSSIP_INBOUND": str(INBOUND)}
START_TIMEOUT = 120.0  # twelve processes importing torch and libp2p on two loaded cores
AGREE_TIMEOUT = 120.0
WATCH_S = 10.0  # 20 gossip periods: two refreshes of every peer's sample
# 30 periods for the opener of a refused ask or a dropped link to close it (seen: < 0.8 s alone, 7.3 s
# once in the full suite on 2 busy cores); a leak never closes, so it still fails the test
CLOSED_WITHIN = 15.0


def last_states(files: list[Path]) -> list[dict | None]:
    out = []
    for path in files:
        lines = path.read_text().splitlines() if path.exists() else []
        out.append(json.loads(lines[-1]) if lines else None)
    return out


def test_twelve_peers_each_hold_at_most_the_bound_and_agree(tmp_path):
    assert BOUND < PEERS - 1  # else the bound would hold by itself
    env = {**os.environ, **ENV}
    files = [tmp_path / f"m{i}.jsonl" for i in range(PEERS)]
    procs: list[subprocess.Popen] = []
    began = time.monotonic()
    try:
        seed = subprocess.Popen([sys.executable, "-m", "tests.swarm.gossip_member", "--index", "0", "--out",
                                 str(files[0])], stdout=subprocess.PIPE, text=True, env=env)
        procs.append(seed)
        join = seed.stdout.readline().strip()
        assert "/p2p/" in join, join
        for i in range(1, PEERS):
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.swarm.gossip_member", "--index", str(i),
                                           "--join", join, "--out", str(files[i])], stdout=subprocess.DEVNULL,
                                          env=env))
        wait_until(lambda: all(s is not None for s in last_states(files)), START_TIMEOUT, "every member to start")
        started = time.monotonic()

        def agreed() -> bool:
            states = last_states(files)
            return all(s["records"] == PEERS for s in states) and len({s["hash"] for s in states}) == 1

        wait_until(agreed, AGREE_TIMEOUT, "all twelve views to hold the same twelve records", interval=0.25)
        agreed_after = time.monotonic() - started
        watch_from = time.time()
        time.sleep(WATCH_S)  # the scenario itself: a steady swarm, refreshing its samples
        assert agreed(), last_states(files)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    most, held_most, others_longest = [], [], []
    for path in files:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        watched = [r for r in rows if r["t"] >= watch_from]
        assert watched, path
        most.append(max(r["connections"] for r in watched))
        held_most.append(max(r["held"] for r in watched))
        assert max(r["neighbours"] for r in watched) <= OUTBOUND + INBOUND, (path.name, watched[-1])
        others_longest.append(max(open_spans(watched).values(), default=0.0))
    print(f"\nlargest connection count per peer over {WATCH_S:.0f} s: held by membership {held_most} (bound {BOUND}), "
          f"all {most}; longest-open connection another peer opened: {max(others_longest):.1f} s; views agreed "
          f"{agreed_after:.1f} s after all had started; test {time.monotonic() - began:.0f} s")
    assert max(held_most) <= BOUND, held_most
    assert max(others_longest) <= CLOSED_WITHIN, others_longest


def open_spans(rows: list[dict]) -> dict[str, float]:
    """For each peer seen among a member's `others`, the longest time it stayed there (seconds
    between the first and the last of a run of samples holding it; still there at the end counts)."""
    longest: dict[str, float] = {}
    since: dict[str, float] = {}
    for row in rows:
        now = set(row["others"])
        for peer in list(since):
            if peer not in now:
                longest[peer] = max(longest.get(peer, 0.0), row["t"] - since.pop(peer))
        for peer in now:
            since.setdefault(peer, row["t"])
    for peer, began in since.items():
        longest[peer] = max(longest.get(peer, 0.0), rows[-1]["t"] - began)
    return longest
