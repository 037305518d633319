"""Simulation: determinism, recovery after a leave, stability, failover, and policies compared."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import threading

import pytest

from tessera.peer.sim import dumps, format_summary, from_trace, simulate, synthetic
from tessera.peer.sim.errors import BadScenario, UnknownPolicy
from tessera.peer.sim.scenario import PeerPlan, RequestPlan, Scenario
from tessera.peer.sim.stage import FLOAT32_BYTES, sim_spec
from tessera.peer.sim.world import Timings

TIMINGS = Timings()  # a real peer's periods (peer/node/peer_node.py)


def small_swarm(seed: int = 5) -> Scenario:
    return synthetic(peers=6, requests=12, churn=0.5, seed=seed, capacity=(8, 16), prompt=(4, 16), tokens=(2, 5))


def test_the_same_scenario_and_seed_give_identical_bytes():
    first = dumps(simulate(small_swarm(), policy="default", seed=3))
    again = dumps(simulate(small_swarm(), policy="default", seed=3))
    assert first == again
    report = json.loads(first)
    assert report["summary"]["requests"] == 12 and report["summary"]["completed"] > 0
    assert (report["scenario"]["seed"], report["scenario"]["churn_per_minute"]) == (5, 0.5)  # what was run
    assert report["settings"]["handler_errors"] == 0
    other = dumps(simulate(small_swarm(), policy="default", seed=4))
    assert other != first  # the seed drives jitter and scheduling


def test_signals_arriving_during_a_run_change_nothing():
    """A signal wakes trio's loop in the main thread, and the task that reads the wake-up
    joins a batch of runnable tasks, which reorders the batch (a CI runner's signals cost an
    advertisement in one of two runs). The run must not hear them (peer/sim/schedule.py)."""
    scenario = synthetic(peers=4, requests=3, seed=2)
    quiet = dumps(simulate(scenario, seed=2))
    stop = threading.Event()

    def pester() -> None:
        while not stop.wait(0.0002):
            os.kill(os.getpid(), signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, lambda *_: None)
    thread = threading.Thread(target=pester, daemon=True)
    thread.start()
    try:
        noisy = [dumps(simulate(scenario, seed=2)) for _ in range(3)]
    finally:
        stop.set()
        thread.join()
        signal.signal(signal.SIGUSR1, old)
    assert all(report == quiet for report in noisy)


def sole_server_scenario(mode: str) -> Scenario:
    """Three peers tile [0, 30); d duplicates a third; c (the fastest, alone on its third) goes at t=60."""
    peers = (
        PeerPlan("a", 0.0, 100.0, 10),
        PeerPlan("b", 5.0, 100.0, 10),
        PeerPlan("c", 10.0, 300.0, 10, leave_at=60.0, leave_mode=mode),
        PeerPlan("d", 15.0, 100.0, 10),  # joins seeing the others' claims: duplicates a slow third
    )
    return Scenario("synthetic", 30, 64, None, peers, (), ())


@pytest.mark.parametrize("mode, view", [
    ("graceful", "shared"), ("crash", "shared"), ("vanish", "shared"),
    ("graceful", "gossip"), ("crash", "gossip"), ("vanish", "gossip"),
])
def test_a_sole_servers_layers_are_covered_again_within_a_bound(mode, view):
    report = simulate(sole_server_scenario(mode), policy="default", seed=0, until=200.0, view=view)
    coverage = report["summary"]["coverage"]
    # The bound: the dead peer's record must expire (crash, vanish), the next rebalance check
    # (jittered +20 %) must elect a redundant peer, which drains, loads and serves.
    bound = (TIMINGS.record_ttl if mode != "graceful" else 0.0) + 1.2 * TIMINGS.rebalance_interval \
        + TIMINGS.move_grace + 10 * TIMINGS.load_seconds_per_layer + 2 * TIMINGS.gossip_interval
    print(f"{mode}: gaps {coverage['gaps']}, moves {[(m['peer'], m['from'], m['to']) for m in report['moves']]}, "
          f"bound {bound:.1f} s")
    assert len(coverage["gaps"]) == 1
    start, end = coverage["gaps"][0]
    assert start == pytest.approx(60.0, abs=0.5)  # the gap opened when c went
    assert end - start <= bound
    assert report["coverage"][-1][2] == 0  # and the swarm is whole at the end
    assert any(m["reason"] == "rebalance" for m in report["moves"])


UPLINK = 3.125e6  # 25 Mbit/s: ten SmolLM2-shaped float32 layers take ~45 s to download


def fetched_disks_scenario(twin_disk: tuple[tuple[int, int], ...]) -> Scenario:
    """`sole_server_scenario` on peers that fetched their layers from the swarm (empty folders
    at the start, SmolLM2's shape), at home uplink speed. c goes at t=60; d duplicates a
    third, so d and that third's first server are the two that may fill c's layers."""
    peers = (
        PeerPlan("a", 0.0, 100.0, 10, disk=(), bandwidth=UPLINK),
        PeerPlan("b", 5.0, 100.0, 10, disk=(), bandwidth=UPLINK),
        PeerPlan("c", 10.0, 300.0, 10, leave_at=60.0, leave_mode="crash", disk=(), bandwidth=UPLINK),
        PeerPlan("d", 15.0, 100.0, 10, disk=twin_disk, bandwidth=UPLINK),
    )
    return Scenario("synthetic", 30, 576, None, peers, (), ())


def test_after_a_death_the_layers_are_re_claimed_by_a_peer_that_holds_them():
    """Records say what each peer has on disk: the gap is filled by the redundant peer that
    holds the dead peer's layers (a load), not by one that must download them."""
    def run(d_disk: tuple[tuple[int, int], ...]) -> tuple[dict, float]:
        report = simulate(fetched_disks_scenario(d_disk), policy="default", seed=0, until=300.0, view="gossip")
        assert report["coverage"][-1][2] == 0, report["summary"]  # whole again at the end
        (gap,) = report["summary"]["coverage"]["gaps"]
        (move,) = [m for m in report["moves"] if m["reason"] == "rebalance"]
        return move, gap[1] - move["t"]  # the move, and how long it took to serve (drain, fetch, load)

    download = 10 * sim_layer_bytes() / UPLINK
    # Nobody holds c's layers: d's twin on its third is elected, and downloads them first.
    fallback, slow = run(())
    lost = tuple(fallback["to"])
    assert fallback["peer"] != "d" and slow >= download, (fallback, slow)
    # d fetched c's layers once before (an earlier claim, say): now d is the one that moves.
    filler, fast = run((lost,))
    assert filler["peer"] == "d" and tuple(filler["to"]) == lost, filler
    assert fast <= TIMINGS.move_grace + 10 * TIMINGS.load_seconds_per_layer + 1.0, fast
    print(f"re-claim after a death: {slow:.1f} s with a download ({download:.1f} s of it), {fast:.1f} s from disk")


def sim_layer_bytes() -> int:
    return sim_spec(30, 576).layer_bytes(FLOAT32_BYTES)


def test_a_stable_swarm_makes_no_moves_for_an_hour():
    scenario = synthetic(peers=6, requests=0, seed=2, capacity=(8, 16))
    report = simulate(scenario, policy="default", seed=0, until=3600.0)
    settled = max(p.join_at for p in scenario.peers) + 120.0
    late = [m for m in report["moves"] if m["t"] > settled]
    print(f"moves while joining: {len(report['moves']) - len(late)}, after t={settled:.0f} s: {len(late)}")
    assert report["summary"]["coverage"]["covered_fraction"] == 1.0
    assert late == []


def failover_scenario() -> Scenario:
    """Two fast peers (the route), two slow spares; a is killed in the middle of the answer."""
    peers = (
        PeerPlan("a", 0.0, 400.0, 15, span=(0, 15), leave_at=14.0, leave_mode="crash"),
        PeerPlan("b", 0.0, 400.0, 15, span=(15, 30)),
        PeerPlan("c", 0.0, 100.0, 15, span=(0, 15)),
        PeerPlan("d", 0.0, 100.0, 15, span=(15, 30)),
    )
    request = RequestPlan(0, 10.0, "r", prompt_tokens=16, new_tokens=40)
    return Scenario("replay", 30, 64, None, peers, (request,), ("r",), link_latency={}, default_latency=0.01)


def test_a_peer_killed_mid_answer_is_replaced_and_the_answer_completes():
    report = simulate(failover_scenario(), policy="recorded", seed=0)
    (request,) = report["requests"]
    print(format_summary(report))
    assert request["completed"], request["error"]
    assert request["failovers"] >= 1
    assert request["routes"][0] == [["a", 0, 15], ["b", 15, 30]]
    assert ["c", 0, 15] in request["routes"][-1] and all(h[0] != "a" for h in request["routes"][-1])
    assert report["summary"]["events"]["failover"] >= 1


def test_policies_compared_on_a_fixed_synthetic_swarm(capsys):
    """default (peer/plan/placement.py) against random placement, on the same scenario and seed."""
    scenario = synthetic(peers=10, requests=16, seed=3, capacity=(5, 10), prompt=(4, 12), tokens=(2, 4))
    results = {name: simulate(scenario, policy=name, seed=0)["summary"] for name in ("default", "random")}
    with capsys.disabled():
        print()
        for name, s in results.items():
            cov = s["coverage"]
            print(f"  {name:8} completed {s['completed']:>2}/{s['requests']}  covered {cov['covered_fraction']:.3f}"
                  f"  mean bottleneck {cov['mean_bottleneck']:8.2f} tokens/s  moves {s['moves']}")
    default, random = results["default"], results["random"]
    assert default["coverage"]["mean_bottleneck"] > 1.2 * random["coverage"]["mean_bottleneck"]
    assert default["completed"] > random["completed"]


@pytest.mark.parametrize("apart", [2.0, 8.0])
def test_a_simulated_trace_replays_with_the_routes_it_took(tmp_path, apart):
    """simulate --trace writes every node's events; replaying them finds the same routes. The
    requests come one at a time (each done in about a second): a requester prices its own
    running answers (peer/plan/cost.py OWN_SESSION_PENALTY), so routes of overlapping answers depend
    on how their opens interleave, which a replay re-enacts only approximately. 8 s apart, a peer
    that moved meanwhile is an alternative the requester had measured far away: the replay's links
    are the measured round trips (`Rtt` events), not the median it gave links that carried no
    activations (2 of 4 routes matched then)."""
    db = tmp_path / "sim.db"
    scenario = synthetic(peers=4, requests=4, seed=1, capacity=(10, 20), prompt=(4, 8), tokens=(2, 3))
    scenario = dataclasses.replace(scenario, requests=tuple(
        dataclasses.replace(r, at=scenario.requests[0].at + apart * i) for i, r in enumerate(scenario.requests)))
    live = simulate(scenario, policy="default", seed=0, trace_path=db)
    replayed = from_trace([db])
    assert len(replayed.peers) == 4 and len(replayed.requests) == 4
    # each requester joins when it did live (its traced join), before its first request
    assert set(replayed.requester_joins) == set(replayed.requesters)
    for label, joined in replayed.requester_joins.items():
        assert joined < min(r.at for r in replayed.requests if r.requester == label)
    assert sorted((r.prompt_tokens, r.new_tokens) for r in replayed.requests) == sorted(
        (r["prompt_tokens"], r["new_tokens"]) for r in live["requests"])
    report = simulate(replayed, policy="recorded", seed=0)
    assert report["summary"]["route_matches"] == 4, [r["routes"] for r in report["requests"]]


def test_a_requester_joins_when_its_scenario_says_but_never_after_its_first_request(tmp_path):
    """A replay's requester joins when its trace says (here 2 s in: traced again, its join is then
    plus the time it took to pull its view), not REQUESTER_LEAD_S before its first request. But
    never after that request: the request's time comes from another peer's clock (the earliest
    event of its session), and clocks aligned only approximately can put the requester's own join
    after it. Joined later, the request would wait for it and its latency hold the skew."""
    db = tmp_path / "sim.db"
    scenario = synthetic(peers=4, requests=2, seed=1, capacity=(10, 20), prompt=(4, 8), tokens=(2, 3))
    (label,) = scenario.requesters
    first = min(r.at for r in scenario.requests)
    simulate(dataclasses.replace(scenario, requester_joins={label: 2.0}), policy="default", seed=0, trace_path=db)
    replayed = from_trace([db])
    (joined,) = replayed.requester_joins.values()
    assert 0 < (first - 2.0) - (min(r.at for r in replayed.requests) - joined) < 1.0
    at_first = simulate(dataclasses.replace(scenario, requester_joins={label: first}), policy="default", seed=0)
    late = simulate(dataclasses.replace(scenario, requester_joins={label: first + 60.0}), policy="default", seed=0)
    assert all(r["completed"] for r in late["requests"])
    assert late["requests"] == at_first["requests"]


def test_a_trace_without_a_requesters_join_leaves_it_to_join_before_its_first_request(tmp_path):
    """Traces recorded before requesters traced their join have none: the replay then gives the
    requester no join time (it joins REQUESTER_LEAD_S before its first request), rather than
    taking its first event, which is its first request's."""
    db = tmp_path / "sim.db"
    scenario = synthetic(peers=4, requests=2, seed=1, capacity=(10, 20), prompt=(4, 8), tokens=(2, 3))
    simulate(scenario, policy="default", seed=0, trace_path=db)
    (label,) = from_trace([db]).requesters
    with sqlite3.connect(db) as conn:  # as an older requester wrote it
        assert conn.execute("DELETE FROM trace WHERE kind = 'join' AND peer = ?", (label,)).rowcount == 1
    replayed = from_trace([db])
    assert replayed.requesters == (label,) and replayed.requester_joins == {}


def test_bad_options_are_clear_errors():
    with pytest.raises(UnknownPolicy, match="default"):
        simulate(small_swarm(), policy="nearest")
    with pytest.raises(BadScenario, match="recorded"):
        simulate(small_swarm(), policy="recorded")
    with pytest.raises(BadScenario, match="view"):
        simulate(small_swarm(), view="telepathy")
    with pytest.raises(BadScenario):
        synthetic(peers=0, requests=1)


def test_the_default_policys_shortcut_never_hides_a_move_plan_move_would_make():
    """DefaultPolicy.cannot_move skips plan_move only where plan_move would say no."""
    import random as stdlib_random

    from tessera.peer.plan.placement import plan_move
    from tessera.peer.sim.policies import DefaultPolicy
    from tessera.peer.plan.view import DRAINING, LOADING, PeerInfo, SwarmView

    rng = stdlib_random.Random(11)
    policy = DefaultPolicy()
    skipped = asked = moves = 0
    for _ in range(400):
        layers = rng.choice([4, 8, 30])
        peers = []
        for i in range(rng.randint(1, 14)):
            k = rng.randint(1, layers)
            start = rng.randint(0, layers - k)
            peers.append(PeerInfo(peer_id=f"p{i:03d}", model_id="m", start=start, end=start + k,
                                  throughput=rng.choice([10.0, 20.0, 30.0, rng.uniform(5, 50)]),
                                  state=rng.choice(["serving"] * 6 + [DRAINING, LOADING])))
        view = SwarmView.of(layers, peers)
        for p in view.peers:
            capacity = rng.choice([p.num_layers, rng.randint(1, layers)])
            plan = plan_move(view, me=p.peer_id, capacity_layers=capacity, throughput=p.throughput)
            moves += plan is not None
            if policy.cannot_move(view, p, capacity_layers=capacity, throughput=p.throughput):
                skipped += 1
                assert plan is None, (view, p.peer_id, capacity)
            else:
                asked += 1
    print(f"plan_move skipped {skipped} times, asked {asked} times; {moves} moves, none hidden")
    assert skipped > asked > moves > 20


def test_a_generation_routed_through_a_freshly_crashed_peer_routes_around_it():
    peers = (
        PeerPlan("a", 0.0, 400.0, 15, span=(0, 15), leave_at=10.0, leave_mode="crash"),
        PeerPlan("b", 0.0, 400.0, 15, span=(15, 30)),
        PeerPlan("c", 0.0, 100.0, 15, span=(0, 15)),
        PeerPlan("d", 0.0, 100.0, 15, span=(15, 30)),
    )
    request = RequestPlan(0, 11.0, "r", prompt_tokens=8, new_tokens=4)  # a's record is still valid
    scenario = Scenario("replay", 30, 64, None, peers, (request,), ("r",), link_latency={}, default_latency=0.01)
    (outcome,) = simulate(scenario, policy="recorded", seed=0)["requests"]
    assert outcome["completed"], outcome["error"]


def test_each_failed_request_is_classified_and_bans_are_counted_by_failure():
    """The sole peer of [0, 15) is killed mid-answer and nothing takes its layers: the request
    fails after the route wait as a real gap (no live peer served them: the recorder's ground
    truth), and the ban it cost is counted as a drop, not a refusal."""
    peers = (
        PeerPlan("a", 0.0, 400.0, 15, span=(0, 15), leave_at=14.0, leave_mode="crash"),
        PeerPlan("b", 0.0, 400.0, 15, span=(15, 30)),
    )
    request = RequestPlan(0, 10.0, "r", prompt_tokens=16, new_tokens=40)
    scenario = Scenario("replay", 30, 64, None, peers, (request,), ("r",), link_latency={}, default_latency=0.01)
    report = simulate(scenario, policy="recorded", seed=0)
    (outcome,) = report["requests"]
    assert outcome["error"].startswith("RouteLost") and outcome["failure"] == "gap"
    assert report["summary"]["failure_classes"] == {"gap": 1}
    assert report["summary"]["avoided"] == {"dropped": 1}
    assert "failed requests by class: gap 1" in format_summary(report)
    assert "bans by failure: dropped 1; refusals (skipped, not banned): 0" in format_summary(report)


def test_a_failure_is_a_gap_only_where_no_live_peer_served_the_layers():
    from tessera.peer.base.errors import NoRoute, PeerFailed, RouteLost
    from tessera.peer.sim.report import classify_failure

    def uncovered(ranges):
        return [layer for a, b in ranges for layer in range(a, b) if layer in (3, 4)]  # only 3 and 4 have no peer

    assert classify_failure(NoRoute("x", [(3, 5)]), uncovered) == "gap"
    assert classify_failure(RouteLost("x", [(2, 4)]), uncovered) == "gap"
    assert classify_failure(RouteLost("x", [(5, 9)]), uncovered) == "no replacement"  # served, but not usable
    assert classify_failure(NoRoute("x", [(5, 9)]), uncovered) == "no usable peer"
    assert classify_failure(PeerFailed("p", "could not repair the route"), uncovered) == "no replacement"


def test_a_replayed_peer_computes_at_its_recorded_steps_speed_and_advertises_its_claim(tmp_path):
    """A claim's throughput is one measurement at start-up: peers started together on a busy
    machine measure while the others import and load (tests/cli/test_trace_cli.py's run claimed
    61 tokens/s per layer and computed at 999), and a replay at it ran answers many times their
    live length, into the peers' recorded leaves. The steps' own times say how fast it computed;
    the claim is still what it advertises, so routing weighs peers as live routing did."""
    db = tmp_path / "live.db"
    peers = (
        PeerPlan("a", 0.0, 50.0, 30, span=(0, 15), compute_throughput=2000.0),
        PeerPlan("b", 0.0, 40.0, 30, span=(15, 30), compute_throughput=1000.0),
    )
    requests = (RequestPlan(0, 10.0, "r", prompt_tokens=40, new_tokens=4),
                RequestPlan(1, 10.5, "r", prompt_tokens=20, new_tokens=3))  # arrives while the first runs
    scenario = Scenario("replay", 30, 64, None, peers, requests, ("r",), link_latency={}, default_latency=0.01)
    live = simulate(scenario, policy="recorded", seed=0, trace_path=db)
    assert live["summary"]["completed"] == 2
    replayed = from_trace([db])
    speeds = sorted((p.span, p.throughput, p.compute_throughput) for p in replayed.peers)
    assert speeds == [((0, 15), 50.0, pytest.approx(2000.0)), ((15, 30), 40.0, pytest.approx(1000.0))]
    again = simulate(replayed, policy="recorded", seed=0)
    assert again["summary"]["completed"] == 2
    for run, request in zip(live["requests"], again["requests"]):
        assert request["latency"] == pytest.approx(run["latency"], rel=0.1), (run, request)
        assert request["ttft"] == pytest.approx(run["ttft"], rel=0.1)
    assert sorted(p["throughput"] for p in again["peers"].values()) == [40.0, 50.0]  # as advertised live


def test_a_failed_requests_error_names_peers_as_the_report_does():
    """The simulation gives nodes identities of its own; an error names the peer by its label."""
    peers = (PeerPlan("a", 0.0, 100.0, 15, span=(0, 15), leave_at=11.0),  # drains, then hands the answer back
             PeerPlan("b", 0.0, 100.0, 15, span=(15, 30)))
    request = RequestPlan(0, 10.0, "r", prompt_tokens=8, new_tokens=100)
    scenario = Scenario("replay", 30, 64, None, peers, (request,), ("r",), link_latency={}, default_latency=0.01)
    # a leave grace shorter than the answer (a leaving peer waits for it up to its cap: peer/serve/leaving.py)
    (outcome,) = simulate(scenario, policy="recorded", seed=0, timings=Timings(leave_grace=1.0))["requests"]
    assert not outcome["completed"]
    assert "(a: " in outcome["error"] and "12D3KooW" not in outcome["error"], outcome["error"]


def test_a_replays_links_are_half_the_fastest_measured_round_trip_else_the_fastest_push():
    from tessera.peer.sim.replay import MIN_LATENCY_S, link_latencies
    from tessera.store.events import Push, Receive, Rtt
    from tessera.store.timeline import Event

    def at(t: float, peer: str, event) -> Event:
        return Event(0, 0, 0, 0.0, peer, event, t)

    push, receive = Push(session=b"s", step=0, remote="b", bytes=10), Receive(session=b"s", step=0, remote="a", bytes=10)
    pairs = [(at(1.0, "a", push), at(1.05, "b", receive)), (at(2.0, "a", push), at(2.03, "b", receive)),
             (at(3.0, "c", push), at(3.02, "b", receive))]
    rtts = [at(4.0, "a", Rtt(remote="b", duration=0.016)), at(5.0, "b", Rtt(remote="a", duration=0.012)),
            at(6.0, "a", Rtt(remote="d", duration=0.0))]
    assert link_latencies(pairs) == {("a", "b"): pytest.approx(0.03), ("c", "b"): pytest.approx(0.02)}
    assert link_latencies(pairs, rtts) == {
        ("a", "b"): 0.006, ("b", "a"): 0.006,  # the fastest round trip either way, halved: no push's transfer time
        ("c", "b"): pytest.approx(0.02),  # no ping: its fastest push
        ("a", "d"): MIN_LATENCY_S, ("d", "a"): MIN_LATENCY_S,
    }
