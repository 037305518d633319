"""Real peers over libp2p on 127.0.0.1 answer exactly what one machine would."""

from __future__ import annotations

import pytest
import trio

from tessera.peer.request.client import Swarm
from tessera.peer.base.errors import NoRoute
from tessera.stages.decoding.generate import prompt_ids
from tessera.store.db import PeerStore
from tessera.store.events import Forward, SessionOpen

from ..conftest import FRANCE
from ..resident import held_bytes, mib, no_huge_pages, resident_parts
from ..swarm_helpers import local_swarm

pytestmark = pytest.mark.slow

PROMPTS = [
    (FRANCE, False),
    ("Write a haiku about the sea.", False),
    ("The quick brown fox", True),
]
MAX_NEW = 24


def reference(local_engine, tokenizer, prompt: str, raw: bool, n: int = MAX_NEW) -> list[int]:
    return local_engine.generate_ids(prompt_ids(tokenizer, prompt, raw=raw), max_new_tokens=n)


async def swarm_tokens(swarm: Swarm, prompt: str, raw: bool, n: int = MAX_NEW, info: dict | None = None) -> list[int]:
    ids = prompt_ids(swarm.tokenizer, prompt, raw=raw)
    return [t async for t in swarm.generate_ids(ids, max_new_tokens=n, info=info)]


@pytest.fixture(scope="module")
def three_peers(smol_dir):
    with local_swarm([(0, 10), (10, 20), (20, 30)]) as swarm:
        yield swarm


async def test_three_peers_match_local_engine(three_peers, local_engine, smol_tokenizer):
    before = [last_event(three_peers, i, SessionOpen) for i in range(3)]
    async with Swarm.join(three_peers.addrs[:1]) as swarm:
        await swarm.wait_for_route(30)
        for prompt, raw in PROMPTS:
            info: dict = {}
            got = await swarm_tokens(swarm, prompt, raw, info=info)
            assert got == reference(local_engine, smol_tokenizer, prompt, raw), prompt
            assert [(h["start"], h["end"]) for h in info["route"]] == [(0, 10), (10, 20), (20, 30)]
        assert swarm.transport.dedicated.opened == 3 * len(PROMPTS)  # a session stream per peer per answer
    # and every peer ran its sessions and its links to the next peer on dedicated connections
    opened = await session_opens(three_peers, before, len(PROMPTS))
    assert [{(e.via, e.next_via) for e in opens} for opens in opened] == [
        {("dedicated", "dedicated")}, {("dedicated", "dedicated")}, {("dedicated", None)}]


@pytest.mark.parametrize("case", ["middle peer without", "requester without"])
async def test_streams_without_dedicated_connections_give_the_same_answer(case, smol_dir, local_engine,
                                                                           smol_tokenizer):
    """Where a peer (or the requester) takes no dedicated connections, its streams fall back to
    libp2p and every other stream keeps its own connection; the answer is the same."""
    per_peer = [[], ["--no-dedicated"], []] if case == "middle peer without" else None
    with local_swarm([(0, 10), (10, 20), (20, 30)], per_peer=per_peer) as peers:
        async with Swarm.join(peers.addrs[:1], dedicated=case != "requester without") as swarm:
            await swarm.wait_for_route(30)
            got = await swarm_tokens(swarm, FRANCE, False)
        opened = await session_opens(peers, [0, 0, 0], 1)
    assert got == reference(local_engine, smol_tokenizer, FRANCE, False)
    kinds = [[(e.via, e.next_via) for e in opens] for opens in opened]
    if case == "middle peer without":  # it dials none and takes none: both its links are libp2p
        assert kinds == [[("dedicated", "libp2p")], [("libp2p", "libp2p")], [("dedicated", None)]]
    else:  # the requester dials none; the peers' links to each other stay dedicated
        assert kinds == [[("libp2p", "dedicated")], [("libp2p", "dedicated")], [("libp2p", None)]]


async def session_opens(peers, before: list[int], per_peer: int) -> list[list]:
    """Each peer's SessionOpen events after `before`, once `per_peer` of them are stored."""
    with trio.fail_after(BATCH_SEEN_WAIT):
        while True:
            opened = [[e.event for e in peer_store(peers, i).events(after_id=before[i], kinds=(SessionOpen,))]
                      for i in range(len(before))]
            if all(len(o) >= per_peer for o in opened):
                return opened
            await trio.sleep(0.25)


LONG_PROMPT = " ".join(f"{FRANCE} ({i})" for i in range(30))  # ~300 tokens (raw)
FORCED_CHUNK = 64


async def test_pipelined_prefill_of_a_long_prompt_matches_local_engine(three_peers, local_engine, smol_tokenizer):
    """A ~300-token prompt sent in 64-token chunks back to back (peer/request/prefill.py): the same
    tokens as one machine, and every peer ran the prompt as those chunks (its trace says so)."""
    ids = smol_tokenizer.encode(LONG_PROMPT)[:300]
    want = local_engine.generate_ids(ids, max_new_tokens=8)
    before = [last_forward(three_peers, i) for i in range(3)]
    async with Swarm.join(three_peers.addrs[:1]) as swarm:
        await swarm.wait_for_route(30)
        got = [t async for t in swarm.generate_ids(ids, max_new_tokens=8, prefill_chunk=FORCED_CHUNK)]
    assert got == want
    starts = [(a, b - a) for a in range(0, 300, FORCED_CHUNK) for b in [min(a + FORCED_CHUNK, 300)]]
    with trio.fail_after(BATCH_SEEN_WAIT):
        while True:
            seen = [[(e.event.start_pos, e.event.n_tokens) for e in peer_store(three_peers, i).events(
                after_id=before[i], kinds=(Forward,))] for i in range(3)]
            if all(len(s) >= len(starts) for s in seen):
                break
            await trio.sleep(0.25)
    for i in range(3):
        assert seen[i][: len(starts)] == starts, f"peer {i}"


# Eight requesters' prompts of different lengths (raw ones: 3 to 12 tokens; chat ones longer).
CONCURRENT = [
    (FRANCE, False), ("Name three colours.", False), ("Once upon a time", True), ("1, 2, 3,", True),
    ("Hi", True), ("Write a haiku about the sea.", False), ("The quick brown fox jumps over the lazy", True),
    ("def fibonacci(n):", True),
]
CONCURRENT_NEW = 8
BATCH_SEEN_WAIT = 10.0  # the peers' trace writers flush every 0.25 s; this is 40 flushes


async def test_eight_concurrent_sessions_are_batched_and_all_exact(three_peers, local_engine, smol_tokenizer):
    """Eight generations at once through the same peers: their steps meet on every peer and
    run stacked (the peers' traces say so), and every answer is what one machine gives."""
    got: dict[int, list[int]] = {}
    before = [last_forward(three_peers, i) for i in range(3)]
    async with Swarm.join(three_peers.addrs[:1]) as swarm:
        await swarm.wait_for_route(30)

        async def one(i: int) -> None:
            got[i] = await swarm_tokens(swarm, *CONCURRENT[i], n=CONCURRENT_NEW)

        async with trio.open_nursery() as nursery:
            for i in range(len(CONCURRENT)):
                nursery.start_soon(one, i)
    for i, (prompt, raw) in enumerate(CONCURRENT):
        assert got[i] == reference(local_engine, smol_tokenizer, prompt, raw, CONCURRENT_NEW), prompt
    with trio.fail_after(BATCH_SEEN_WAIT):
        while True:
            forwards = [e for i in range(3) for e in peer_store(three_peers, i).events(
                after_id=before[i], kinds=(Forward,))]
            if len(forwards) >= 3 * sum(map(len, got.values())):  # a step per token, on each peer
                break
            await trio.sleep(0.25)
    batches = [e.event.batch for e in forwards]
    print(f"batch sizes seen on the peers: largest {max(batches)}, mean {sum(batches) / len(batches):.1f}")
    assert max(batches) > 1


def peer_store(peers, i: int) -> PeerStore:
    return PeerStore(peers.base_dir / f"peer{i}" / "tessera.db", readonly=True)


def last_forward(peers, i: int) -> int:
    return last_event(peers, i, Forward)


def last_event(peers, i: int, kind: type) -> int:
    events = peer_store(peers, i).events(kinds=(kind,))
    return events[-1].id if events else 0


@pytest.mark.parametrize("spans", [
    [(0, 15), (15, 30)],
    [(0, 3), (3, 17), (17, 18), (18, 29), (29, 30)],  # five peers, uneven spans
])
async def test_other_swarm_shapes_match(spans, smol_dir, local_engine, smol_tokenizer):
    with local_swarm(spans) as peers:
        async with Swarm.join(peers.addrs[:1]) as swarm:
            await swarm.wait_for_route(30)
            info: dict = {}
            got = await swarm_tokens(swarm, FRANCE, False, info=info)
    assert got == reference(local_engine, smol_tokenizer, FRANCE, False)
    assert [(h["start"], h["end"]) for h in info["route"]] == spans


async def test_each_peer_loaded_only_its_span(smol_dir):
    """Memory held (anonymous and weight-file pages, no huge pages: tests/resident.py), after each
    peer ran a step (weights are memory-mapped until used): a 10-layer peer holds about 20 layers'
    bytes less than a 30-layer one."""
    from tessera.peer.request.chain import RouteSession
    from tessera.peer.plan.routing import Hop, Route
    from tessera.stages.families.catalog import spec_from_file

    layer = spec_from_file(smol_dir / "config.json").layer_bytes(4)
    no_huge_pages()  # the peer processes started now inherit it
    try:
        with local_swarm([(0, 10), (0, 30)]) as peers:
            no_huge_pages(False)
            async with Swarm.join(peers.addrs[:1]) as swarm:
                await swarm.wait_for_route(30)
                for addr, end in zip(peers.addrs, (10, 30)):
                    session = RouteSession(swarm.ctx, Route((Hop(addr.split("/p2p/")[1], 0, end),), 0.0), max_length=8)
                    await session.open()
                    await session.step(swarm.head.embed([1, 2, 3]), 0)
                    await session.close()
            small, whole = (held_bytes(p.pid) for p in peers.procs)
            for p, span in zip(peers.procs, ("[0, 10)", "[0, 30)")):
                print(f"peer of {span}: {mib(resident_parts(p.pid))}")
    finally:
        no_huge_pages(False)
    print(f"held: 10-layer peer {small / 2**20:.0f} MiB, 30-layer peer {whole / 2**20:.0f} MiB, "
          f"20 layers = {20 * layer / 2**20:.0f} MiB")
    assert 0.8 * 20 * layer < whole - small < 1.3 * 20 * layer


async def test_session_beyond_limits_is_refused_then_routed_elsewhere(smol_dir, local_engine, smol_tokenizer):
    """Peers with one session slot: a second session is refused with a clear code, the
    requester routes to the replica, and when every replica is full it reports NoRoute."""
    from tessera.peer.base.errors import SessionRefused
    from tessera.peer.request.chain import RouteSession
    from tessera.peer.plan.routing import Hop, Route

    with local_swarm([(0, 30), (0, 30)], extra=["--max-sessions", "1"]) as peers:
        async with Swarm.join(peers.addrs[:1]) as swarm:
            await swarm.wait_for_route(30)
            a, b = sorted(p.peer_id for p in swarm.keeper.snapshot().peers)
            held = RouteSession(swarm.ctx, Route((Hop(a, 0, 30),), 0.0), max_length=64)
            await held.open()
            with pytest.raises(SessionRefused) as refused:
                await RouteSession(swarm.ctx, Route((Hop(a, 0, 30),), 0.0), max_length=64).open()
            assert refused.value.code == "busy"
            info: dict = {}
            got = await swarm_tokens(swarm, FRANCE, False, n=8, info=info)  # lands on b
            assert [h["peer"] for h in info["route"]] == [b]
            assert got == reference(local_engine, smol_tokenizer, FRANCE, False, 8)
            other = RouteSession(swarm.ctx, Route((Hop(b, 0, 30),), 0.0), max_length=64)
            await other.open()
            ids = prompt_ids(swarm.tokenizer, FRANCE, raw=False)
            with pytest.raises(NoRoute):
                async for _ in swarm.generate_ids(ids, max_new_tokens=4, route_wait=1.0):
                    pass
            await held.close()
            await other.close()
