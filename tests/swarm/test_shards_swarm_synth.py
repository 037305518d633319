"""Tensor shards over real libp2p processes, on a synthetic model shaped for groups of 2 and 4:
exact and audited with forced routes, chosen by routing on its own, and never run by one rank alone."""

from __future__ import annotations

import pytest

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.base.errors import SessionRefused
from tessera.peer.request.chain import RouteSession
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.plan.audit import check
from tessera.peer.request.segmented import SegmentedSession
from tessera.stages.decoding.generate import LocalEngine
from tessera.stages.assembly.stage import load_stage
from tessera.store.trace import MemoryTracer

from ..shard_helpers import (
    DECODE_STEPS, LOGITS_TOLERANCE, collect_audit, greedy_run, group_hop, network_greedy, rank_args, wait_for_peers,
)

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 260, 42, 99, 3, 250]
TWO, FOUR = ["peer0", "peer1"], ["peer2", "peer3", "peer4", "peer5"]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from tessera.peer.cli.model_files import synthesise

    out = tmp_path_factory.mktemp("shard-swarm") / "synth"
    return synthesise(out, hidden=128, layers=4, heads=8, kv_heads=4, intermediate=256, vocab=320, seed=11)


@pytest.fixture(scope="module")
def procs(synth):
    args = [*rank_args((0, 4), "two", 2), *rank_args((0, 4), "four", 4)]
    swarm = LocalSwarm(len(args), model=str(synth), extra_args=args)
    try:
        swarm.start(together=True)
        yield swarm
    finally:
        swarm.stop(timeout=15)


@pytest.mark.parametrize("names, group", [(TWO, "two"), (FOUR, "four")], ids=["n=2", "n=4"])
async def test_a_group_matches_the_unsharded_model(procs, synth, names, group):
    whole = load_stage(synth, embed=True, head=True)
    reference = greedy_run(whole, [whole], PROMPT)
    tracer = MemoryTracer(peer="requester")
    async with Swarm.join(procs.addrs[:1], model=synth, tracer=tracer) as swarm:
        ids = await wait_for_peers(swarm, TWO + FOUR)
        session = SegmentedSession(swarm.ctx, Route((group_hop(ids, names, group, 0, 4),), 0.0), max_length=64)
        await session.open()
        try:
            tokens, logits = await network_greedy(swarm, session, PROMPT)
        finally:
            await session.close()
    assert tokens == reference[0]
    worst = max(float((a - b).abs().max()) for a, b in zip(reference[1], logits))
    assert worst <= LOGITS_TOLERANCE
    report = check(collect_audit(procs, tracer, [session.segments[0].session_id.hex()]))
    print(f"group of {len(names)}: max |logits diff| {worst:.2e}; {report.summary()}")
    assert report.ok, report.summary()
    assert report.closure == f"{DECODE_STEPS + 1}/{DECODE_STEPS + 1}"


async def test_the_requester_routes_through_a_group_on_its_own(procs, synth):
    """Swarm.generate_ids: routing picks a group hop, recovery runs it in segments, output exact."""
    expected = LocalEngine(synth, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=12)
    async with Swarm.join(procs.addrs[:1], model=synth) as swarm:
        await wait_for_peers(swarm, TWO + FOUR)
        info: dict = {}
        got = [t async for t in swarm.generate_ids(PROMPT, max_new_tokens=12, info=info)]
    assert got == expected
    (hop,) = info["route"]
    assert hop["peer"].startswith("group:") and (hop["start"], hop["end"]) == (0, 4)


async def test_a_rank_alone_refuses_a_plain_session(procs, synth):
    async with Swarm.join(procs.addrs[:1], model=synth) as swarm:
        ids = await wait_for_peers(swarm, TWO + FOUR)
        lone = RouteSession(swarm.ctx, Route((Hop(ids["peer0"], 0, 4),), 0.0), max_length=16)
        with pytest.raises(SessionRefused) as refused:
            await lone.open()
    assert refused.value.code == "bad-span" and "rank 0/2 of group 'two'" in str(refused.value)


async def test_swarm_status_shows_the_groups(procs, synth):
    from tessera.peer.cli.status import format_status, gather_status

    report = await gather_status(procs.addrs[:1], model=str(synth))
    groups = {g["group"]: g for g in report["groups"]}
    assert groups["two"]["complete"] and groups["two"]["count"] == 2 and groups["two"]["span"] == [0, 4]
    assert groups["four"]["complete"] and len(groups["four"]["ranks"]) == 4
    assert report["replicas"] == [2, 2, 2, 2]  # two complete groups; the 6 ranks are not 6 replicas
    text = format_status(report)
    assert "two [0,4) 2 ranks, complete: peer0, peer1" in text and "#3/4" in text
