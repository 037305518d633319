"""Running a scenario: peers and requesters on the memory transport, under trio's MockClock.

    report = simulate(synthetic(peers=50, requests=200, churn=0.05, seed=1), policy="default", seed=1)
    open("report.json", "wb").write(dumps(report))

One driver task walks the scenario's events in time order — a peer joins, a
peer leaves (drains, is killed, or vanishes), a recorded move, a requester
starts, a request arrives — sleeping on the mock clock in between; everything
else is the peers' and requesters' own tasks. The run ends when every request
has finished (or at `until`), and the report is built from what the recorder saw.

Determinism: every identity, RNG and link comes from the seed; the loop runs
under peer/sim/schedule.py `run_deterministic` (trio's MockClock, its scheduler in
deterministic mode, in a thread no signal reaches).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from pathlib import Path
from typing import Any

import torch
import trio
import trio.testing

from tessera.peer.base.ids import peer_id_text
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.sim.errors import BadScenario
from tessera.peer.sim.peer import SimPeer
from tessera.peer.sim.policies import get_policy
from tessera.peer.sim.report import Recorder
from tessera.peer.sim.requester import SimRequester
from tessera.peer.sim.schedule import run_deterministic
from tessera.peer.sim.scenario import ONE_WAY_S, REGIONS, RequestPlan, Scenario
from tessera.peer.sim.stage import sim_model_id, sim_spec
from tessera.peer.sim.policies import VIEW_MODES
from tessera.peer.sim.world import SharedViewKeeper, Timings, World, assign_identities, large_swarm_timings

# A replay of up to this many peers runs real gossip by default; bigger replays and synthetic
# swarms share one view. Gossip costs O(N^2) exchanges of N records per round, all verified, in
# one process: at 12 peers it already takes most of the wall time.
GOSSIP_MAX_PEERS = 16
# From this many peers on, a simulation uses large_swarm_timings() unless told otherwise.
LARGE_SWARM_PEERS = 200
# A requester joins this long before its first request (it needs a view to route with), unless
# the scenario says when (a replay: when the live requester joined).
REQUESTER_LEAD_S = 1.0
# A replay's links: measured latencies (peer/sim/replay.py), and a LAN's bandwidth — a
# trace holds no bandwidth figure, and a loopback or LAN swarm is not bandwidth-bound.
REPLAY_BANDWIDTH = 125e6

# The cyclic garbage collector is off while a simulation runs (reference counting still frees
# everything that is not in a cycle). Two reasons. Determinism: the memory network holds stream
# ends weakly (peer/net/memory.py), and membership closes a connection only when no stream end
# is left on it; an end caught in a reference cycle left the network only when the collector
# ran, which depends on everything the process allocated before — a replay run twice in one
# process after another simulation gave two reports (a peer left 0.27 ms later:
# tests/cli/test_trace_cli.py failed a full run). With the collector off, an end leaves when the
# last reference to it goes, or (in a cycle) not before the run ends: the same in every run.
# Speed: a simulation holds millions of long-lived objects that the collector walked again and
# again (bench/simulate.py at 1,000 peers and 3,000 requests: 52.3 -> 50.0 CPU s), and its
# cycles are few (peak memory 454 -> 458 MB).


def simulate(
    scenario: Scenario,
    *,
    policy: str = "default",
    seed: int = 0,
    timings: Timings | None = None,
    view: str | None = None,
    link: LinkSpec | None = None,
    until: float | None = None,
    trace_path: Path | str | None = None,
    profiler: Any = None,
) -> dict[str, Any]:
    """Run `scenario` and return its report (a dict; write it with `report.dumps`).

    policy:     a name from peer/sim/policies.py.
    seed:       identities, jitter and trio's scheduling all follow from it.
    timings:    periods and graces (default: a real peer's; large_swarm_timings() from
                LARGE_SWARM_PEERS peers on).
    view:       "gossip" or "shared" (default: gossip for a replay of up to
                GOSSIP_MAX_PEERS peers, else shared; see peer/sim/world.py).
    link:       one LinkSpec for every pair (default: the replay's measured latencies, or
                the synthetic peers' regions and bandwidths).
    until:      stop at this simulated second (default: when every request has finished).
    trace_path: also write every node's events into one trace database (`tessera trace`).
    profiler:   a cProfile.Profile to run the simulation under (bench/simulate.py --profile).

    Raises UnknownPolicy or BadScenario.
    """
    placement = get_policy(policy)
    if placement.name == "recorded" and scenario.source != "replay":
        raise BadScenario("the recorded policy replays a trace; a synthetic scenario has nothing recorded")
    if placement.name != "recorded":  # what if: the policy places every peer, whatever it did live
        scenario = dataclasses.replace(
            scenario, peers=tuple(dataclasses.replace(p, span=None, moves=()) for p in scenario.peers))
    if view is None:
        view = "gossip" if scenario.source == "replay" and len(scenario.peers) <= GOSSIP_MAX_PEERS else "shared"
    if view not in VIEW_MODES:
        raise BadScenario(f"view must be one of {VIEW_MODES!r}, got {view!r}")
    if timings is None:
        timings = Timings() if len(scenario.peers) <= LARGE_SWARM_PEERS else large_swarm_timings()
    writer = None
    if trace_path is not None:
        from tessera.store.trace import TraceWriter

        writer = TraceWriter(Path(trace_path), peer="simulation")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool only adds overhead to a one-thread simulation
    collecting = gc.isenabled()
    gc.disable()
    try:
        return run_deterministic(_run, scenario, placement, seed, timings, view, link, until, writer,
                                 seed=seed, profiler=profiler)
    finally:
        if collecting:
            gc.enable()
        torch.set_num_threads(threads)
        if writer is not None:
            writer.close()


async def _run(scenario: Scenario, placement, seed: int, timings: Timings, view: str, link: LinkSpec | None,
               until: float | None, writer) -> dict[str, Any]:
    spec = sim_spec(scenario.num_layers, scenario.hidden_size)
    model_id = scenario.model_id or sim_model_id(spec)
    recorder = Recorder(spec.num_layers, trio.current_time)
    world = World(network=None, spec=spec, model_id=model_id, timings=timings, policy=placement, view_mode=view,
                  seed=seed, recorder=recorder, trace_writer=writer)
    driver = _Driver(world, scenario, link)
    if view == "shared":
        world.keeper = SharedViewKeeper(model_id=model_id, num_layers=spec.num_layers,
                                        round_seconds=timings.view_round)
    async with trio.open_nursery() as nursery:
        world.nursery = nursery
        with trio.move_on_at(until if until is not None else math.inf):
            for at, _, kind, payload in _timeline(scenario, placement.name == "recorded"):
                if at > trio.current_time():
                    await trio.sleep_until(at)
                driver.dispatch(kind, payload)
            driver.dispatched()
            if until is not None:
                await trio.sleep_forever()  # observe until `until`
            await driver.all_done.wait()
            # and everything else due at this instant (a peer leaving as the last answer ends):
            # which of the two the scheduler ran first must not decide what the report holds
            await trio.testing.wait_all_tasks_blocked()
        end = trio.current_time()
        recorder.closed = True
        nursery.cancel_scope.cancel()
    settings = {
        "policy": placement.name,
        "seed": seed,
        "view": view,
        "view_note": ("one shared ViewKeeper: records signed and verified as on real peers, every node sees "
                      "them from the next view round (idealised dissemination)") if view == "shared"
        else "real gossip over the memory transport",
        "timings": timings.as_dict(),
        "links": _describe_links(scenario, link),
        "until": until,
        "handler_errors": world.network.handler_errors,
    }
    return recorder.report(scenario=scenario.describe(), settings=settings, end=end)


# Events at one instant happen in this order: a requester joins before its first request,
# a peer joins before it moves or leaves.
_EVENT_ORDER = {"requester": 0, "join": 1, "move": 2, "leave": 3, "request": 4}


def _timeline(scenario: Scenario, recorded: bool) -> list[tuple[float, int, str, Any]]:
    """The scenario's events, (time, tie-break, kind, payload), in the order they happen."""
    events: list[tuple[float, int, str, Any]] = []
    for order, plan in enumerate(scenario.peers):
        events.append((plan.join_at, order, "join", plan))
        if plan.leave_at is not None:
            events.append((plan.leave_at, order, "leave", plan))
        if recorded:
            events.extend((at, order, "move", (plan, span)) for at, span in plan.moves)
    first_request: dict[str, float] = {}
    for request in scenario.requests:
        first_request[request.requester] = min(first_request.get(request.requester, math.inf), request.at)
        events.append((request.at, len(scenario.peers) + request.id, "request", request))
    for label in scenario.requesters:
        first = first_request.get(label, 0.0)
        at = min(scenario.requester_joins.get(label, first - REQUESTER_LEAD_S), first)
        events.append((max(0.0, at), -1, "requester", label))
    events.sort(key=lambda e: (e[0], _EVENT_ORDER[e[2]], e[1]))
    return events


class _Driver:
    """Carries out the scenario's events on the world: starts, stops and crashes nodes."""

    def __init__(self, world: World, scenario: Scenario, link: LinkSpec | None) -> None:
        self.world = world
        self.scenario = scenario
        self.locations: dict[str, tuple[int, float]] = {}  # node id -> (region, bandwidth)
        world.network = MemoryNetwork(link if link is not None else self.link_model)
        self.peer_ids = assign_identities([p.label for p in scenario.peers], world.seed, kind="peer")
        self.requester_ids = assign_identities(list(scenario.requesters), world.seed, kind="requester")
        self.requesters: dict[str, SimRequester] = {}
        self.ready = {label: trio.Event() for label in scenario.requesters}
        self.outstanding = len(scenario.requests)
        self.all_dispatched = False
        self.all_done = trio.Event()

    def link_model(self, a: str, b: str) -> LinkSpec:
        """A replay's measured latencies, or the synthetic peers' regions and bandwidths."""
        scenario = self.scenario
        if scenario.link_latency is not None:
            key = (self.world.label(a), self.world.label(b))
            return LinkSpec(latency=scenario.link_latency.get(key, scenario.default_latency),
                            bandwidth=REPLAY_BANDWIDTH)
        ra, ba = self.locations.get(a, (0, 125e6))
        rb, bb = self.locations.get(b, (0, 125e6))
        return LinkSpec(latency=ONE_WAY_S[ra][rb], bandwidth=min(ba, bb))

    def dispatch(self, kind: str, payload: Any) -> None:
        world, nursery = self.world, self.world.nursery
        if kind == "join":
            peer = SimPeer(world, payload, self.peer_ids[payload.label])
            world.peers[payload.label] = peer
            world.labels[peer.peer_id] = payload.label
            self.locations[peer.peer_id] = (payload.region, payload.bandwidth)
            nursery.start_soon(peer.run)
        elif kind == "leave":
            peer = world.peers[payload.label]
            if payload.leave_mode == "graceful":
                peer.stop()
            else:
                peer.crash(silent=payload.leave_mode == "vanish")
        elif kind == "move":
            plan, span = payload
            peer = world.peers.get(plan.label)
            if peer is not None and peer.serving and tuple(span) != peer.span:
                nursery.start_soon(peer.move_to, tuple(span), "recorded")
        elif kind == "requester":
            nursery.start_soon(self.requester_task, payload)
        elif kind == "request":
            nursery.start_soon(self.request_task, payload)

    def dispatched(self) -> None:
        self.all_dispatched = True
        if self.outstanding == 0:
            self.all_done.set()

    async def requester_task(self, label: str) -> None:
        identity = self.requester_ids[label]
        node_id = peer_id_text(identity.peer_id)
        self.world.labels[node_id] = label
        self.locations[node_id] = (self.scenario.requester_regions.get(label, 0), 125e6)
        async with open_memory_transport(self.world.network, node_id) as transport:
            async with trio.open_nursery() as nursery:
                requester = SimRequester(self.world, label, identity, transport, nursery)
                self.requesters[label] = requester
                await requester.connect(self.world.bootstrap_addrs())
                nursery.start_soon(requester.swarm.refresh_forever)
                self.ready[label].set()
                await trio.sleep_forever()

    async def request_task(self, request: RequestPlan) -> None:
        try:
            await self.ready[request.requester].wait()  # still joining: the wait counts in the latency
            await self.requesters[request.requester].run_request(request)
        finally:
            self.outstanding -= 1
            if self.outstanding == 0 and self.all_dispatched:
                self.all_done.set()


def _describe_links(scenario: Scenario, link: LinkSpec | None) -> dict[str, Any]:
    if link is not None:
        return {"latency_s": link.latency, "bandwidth_Bps": link.bandwidth}
    if scenario.link_latency is not None:
        return {"measured_one_way_s": {f"{a} -> {b}": v for (a, b), v in sorted(scenario.link_latency.items())},
                "default_one_way_s": scenario.default_latency, "bandwidth_Bps": REPLAY_BANDWIDTH}
    return {"regions": list(REGIONS), "one_way_s": [list(r) for r in ONE_WAY_S]}


__all__ = ["simulate", "GOSSIP_MAX_PEERS", "LARGE_SWARM_PEERS"]
