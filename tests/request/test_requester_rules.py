"""The requester's rules of issue 43, each where it lives: what peers report is priced and ages
(peer/request/loads.py); the only cover of a span gets one parole in a route wait, a leaving
notice is no strike, and every ban says why in the peer's words (peer/base/backoff.py,
peer/request/repair.py); an open asks each peer for the queue it was priced with, idlest first, and a failover
replays only where there is room; one rewound-answer loop (`Swarm.answer_ids`) that the command
line and the gateway both read; and nothing below the repair loop calls back up."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from libp2p.peer.id import ID

from tessera.peer.base.backoff import BAN_BASE, REFUSED_SKIP, SOLE_PAROLE_AFTER, Bans, Failure
from tessera.peer.base.errors import NoRoute, PeerFailed, SessionRefused
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.net.pinger import Pinger
from tessera.peer.plan.cost import Reported
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.request.answer import Rewind
from tessera.peer.request.client import Swarm
from tessera.peer.request.requester_model import RequesterModel
from tessera.peer.request.failures import refusal_failure, reported_failure
from tessera.peer.request.loads import REPORT_TTL, LoadBook, no_room, open_order
from tessera.peer.request.repair import BOUNCE_WAIT, AnswerRewound, ResilientSession, max_waits
from tessera.peer.sim.stage import sim_spec
from tessera.protocol.crypto import sign_record
from tessera.protocol.error_codes import BUSY, LEAVING
from tessera.protocol.keys import Identity
from tessera.protocol.records import LoadReport, PeerRecord
from tessera.store import events
from tessera.store.trace import MemoryTracer

PEER = Path(__file__).resolve().parents[2] / "peer"


# -- what peers say, as it holds now -------------------------------------------------------------


def test_a_reported_wait_drains_with_time_and_is_forgotten_after_its_ttl() -> None:
    now = [100.0]
    book = LoadBook(lambda: now[0])
    book.report("p", LoadReport(sessions=8, max_sessions=16, wait=3.0))
    book.report("q", None)  # said nothing: nothing known
    assert book.reported() == {"p": Reported(load=0.5, wait_ms=3000.0)}
    now[0] += 1.0
    assert book.reported()["p"].wait_ms == 2000.0  # the queue drains as time passes
    book.queued("p", 4.0)  # a step of ours is queued 4 s there: at least that now
    assert book.reported()["p"].wait_ms == 4000.0
    now[0] += REPORT_TTL + 1
    assert book.reported() == {} and not book.heard


# -- bans: why, how long, and the one parole ------------------------------------------------------


def test_a_refusal_busy_or_leaving_is_a_skip_without_a_strike() -> None:
    bans = Bans()
    for code in (BUSY, LEAVING):  # one kind: the peer did its job, and said so
        assert refusal_failure(code) is Failure.REFUSED and reported_failure(code) is Failure.REFUSED
    assert bans.register("p", 0.0, Failure.REFUSED) == REFUSED_SKIP
    assert bans.strikes("p") == 0 and bans.is_banned("p", 1.0)
    assert bans.register("q", 0.0, Failure.REFUSED, seconds=3.0) == 3.0 and bans.strikes("q") == 0
    assert not bans.comeback_candidates(1.0, ["p"])  # not probed for a comeback: its skip says when
    assert not bans.sole_parole_due("p", 100.0) and not bans.parole("p", 1.0, sole=True)


def record(ident: Identity, span: tuple[int, int], addrs: tuple[str, ...], now: float) -> object:
    return sign_record(ident, PeerRecord(
        peer_id=ident.peer_id, name=f"p{span[0]}", model_id="m", start=span[0], end=span[1], shard_index=0,
        shard_count=1, throughput=100.0, free_memory=0, load=0.0, max_sessions=16, state="serving",
        reachability="public", addrs=addrs, neighbours=(), issued_at=now, expires_at=now + 3600, seq=1))


def test_the_only_cover_of_a_span_gets_one_parole_in_a_route_wait() -> None:
    """b alone serves [15, 30) and was banned BROKE for BAN_BASE (as long as a route wait): it
    answers probes, so it is paroled SOLE_PAROLE_AFTER into the wait, once; banned again in the
    same wait it is not paroled again, and the wait ends. A liar never is. (Before: the answer
    failed at the end of the wait, 'banned (broke) for 0 s more'.)"""
    a, b = Identity.from_seed(b"\x11" * 32), Identity.from_seed(b"\x12" * 32)

    b_id = ID(b.peer_id).to_base58()

    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        async with open_memory_transport(network, b_id) as tb, open_memory_transport(network, "r") as tr, \
                trio.open_nursery() as nursery:
            Pinger(tb)  # b answers pings
            tracer = MemoryTracer(peer="r")
            swarm = Swarm(tr, nursery, identity=Identity.from_seed(b"\x13" * 32),
                          model=RequesterModel(sim_spec(30), "m"), clock=trio.current_time,
                          ban_clock=trio.current_time, tracer=tracer, reports=False)
            now = trio.current_time()
            swarm.keeper.merge([record(a, (0, 15), (), now), record(b, (15, 30), tuple(tb.addrs()), now)])
            swarm.bans.register(b_id, swarm.clock(), Failure.BROKE)
            assert BAN_BASE >= 30.0
            with pytest.raises(NoRoute):  # no parole without a wait that keeps them
                await swarm.wait_for_route(10.0)
            paroled: set[str] = set()
            began = trio.current_time()
            chosen = await swarm.wait_for_route(15.0, paroled=paroled)
            assert b_id in chosen.peer_ids and paroled == {b_id}
            assert trio.current_time() - began <= SOLE_PAROLE_AFTER + 2.5
            assert any(e.event.remote == b_id for e in tracer.of_kind(events.Parole))
            swarm.bans.register(b_id, swarm.clock(), Failure.BROKE)  # fails again, same wait
            with pytest.raises(NoRoute):
                await swarm.wait_for_route(10.0, paroled=paroled)
            swarm.bans.clear()
            swarm.bans.register(b_id, swarm.clock(), Failure.LIED)
            with pytest.raises(NoRoute):
                await swarm.wait_for_route(10.0, paroled=set())
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_every_ban_says_why_in_the_peers_own_words(caplog: pytest.LogCaptureFixture) -> None:
    """A refusal's code and message, and a peer's reported error, in `-v` output and the trace."""

    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        async with open_memory_transport(network, "r") as tr, trio.open_nursery() as nursery:
            tracer = MemoryTracer(peer="r")
            swarm = Swarm(tr, nursery, identity=Identity.from_seed(b"\x14" * 32),
                          model=RequesterModel(sim_spec(30), "m"), clock=trio.current_time,
                          ban_clock=trio.current_time, tracer=tracer, reports=False)
            session = ResilientSession(swarm, max_length=64, route_wait=30.0)
            with caplog.at_level(logging.INFO, logger="tessera.peer.request.repair"):
                assert session.ban_for(SessionRefused("p1", BUSY, "16 sessions open (the limit is 16)",
                                                      retry_after=2.0)) is Failure.REFUSED
                assert session.ban_for(PeerFailed("p2", "compute-failed: step 3: NaN in the output",
                                                  Failure.BROKE)) is Failure.BROKE
            nursery.cancel_scope.cancel()
        said = [e.event.reason for e in tracer.events if isinstance(e.event, (events.Error, events.Ban))]
        assert any("busy: 16 sessions open (the limit is 16)" in r for r in said)
        assert any("compute-failed: step 3: NaN in the output" in r for r in said)
        logged = caplog.text
        assert "skipping peer p1 for 2 s (refused): refused: busy: 16 sessions open" in logged
        assert "banning peer p2 for 30 s (broke): compute-failed: step 3: NaN in the output" in logged

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- room: an open's queue, a failover's replay ---------------------------------------------------


def test_an_open_asks_for_the_queue_it_was_priced_with_likeliest_refusal_first_and_a_replay_needs_room() -> None:
    """An open tells each plain hop the queue its route was priced with, plus BOUNCE_WAIT (a peer
    with a longer one refuses: tests/serve/test_load.py); its hops are asked one by one, a peer
    that said it is full first, then the idlest-looking (the peer every requester that heard the
    same is heading for); a group's ranks are not asked. A failover's replay needs room on every
    replacement."""
    hops = (Hop("a", 0, 10), Hop("b", 10, 20), Hop("g", 20, 30, members=("g0", "g1")), Hop("c", 30, 40))
    priced = {"a": Reported(load=0.5, wait_ms=3000.0), "c": Reported(load=0.25)}
    assert max_waits(Route(hops, 1.0), priced) == {"a": 3.0 + BOUNCE_WAIT, "b": BOUNCE_WAIT, "c": BOUNCE_WAIT}
    assert open_order(list(hops), priced) == [1, 2, 3, 0]  # b and the group heard of as idle, then c, then a
    assert open_order(list(hops), {}) == [0, 1, 2, 3]  # nothing heard: route order
    full = {**priced, "c": Reported(load=1.0)}  # every slot of c held: it is asked first, then as before
    assert open_order(list(hops), full) == [3, 1, 2, 0]
    long = LoadReport(sessions=3, max_sessions=16, wait=BOUNCE_WAIT + 2.0)
    no_room({"a": LoadReport(1, 16, wait=1.0)}, 5.0)
    with pytest.raises(SessionRefused) as refused:
        no_room({"a": LoadReport(1, 16, wait=1.0), "b": long}, 5.0)
    assert refused.value.peer == "b" and refused.value.code == BUSY and refused.value.retry_after == long.wait


def test_answers_waiting_for_a_route_share_one_refresh() -> None:
    """Every answer waiting for a route refreshes (a gossip round, a ping of every connected
    peer) after each wake: refreshes asked at once run as one, and one that ended less than
    REFRESH_SHARED ago serves the next caller too, so a requester carrying hundreds of answers
    does not ping every peer hundreds of times a second (peer/request/client.py)."""
    from tessera.peer.request.client import REFRESH_SHARED

    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        async with open_memory_transport(network, "p") as tp, open_memory_transport(network, "r") as tr, \
                trio.open_nursery() as nursery:
            Pinger(tp)  # p answers pings
            tracer = MemoryTracer(peer="r")
            swarm = Swarm(tr, nursery, identity=Identity.from_seed(b"\x15" * 32),
                          model=RequesterModel(sim_spec(30), "m"), clock=trio.current_time,
                          ban_clock=trio.current_time, tracer=tracer, reports=False)
            await swarm.pinger.ping("p", addrs=tuple(tp.addrs()))  # connected
            pinged = lambda: sum(1 for e in tracer.events if isinstance(e.event, events.Rtt))  # noqa: E731
            before = pinged()
            async with trio.open_nursery() as waiting:
                for _ in range(50):
                    waiting.start_soon(swarm.refresh)
            assert pinged() == before + 1
            await swarm.refresh()  # just refreshed: nothing new to ask
            assert pinged() == before + 1
            await trio.sleep(REFRESH_SHARED)
            await swarm.refresh()
            assert pinged() == before + 2
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- one rewound-answer loop ---------------------------------------------------------------------------


async def test_an_answer_goes_on_past_a_rewind() -> None:
    """`answer_ids` (what `complete_ids`, `tessera generate` and the gateway read): tokens, then a
    Rewind saying how many stand, then the tokens that follow from the last right one."""
    calls: list[list[int]] = []

    async def generate_ids(ids, *, max_new_tokens, info, **options):
        calls.append(list(ids))
        info["failovers"] = 1
        if len(calls) == 1:
            for t in (7, 8, 9):
                yield t
            raise AnswerRewound(1, 5)
        for t in (5, 6)[:max_new_tokens]:
            yield t

    stub = SimpleNamespace(generate_ids=generate_ids)
    info: dict = {}
    items = [item async for item in Swarm.answer_ids(stub, [1, 2], max_new_tokens=4, info=info)]
    assert items == [7, 8, 9, Rewind(1), 5, 6]
    assert calls == [[1, 2], [1, 2, 7]] and info["rewinds"] == 1 and info["failovers"] == 2
    stub.answer_ids = lambda *a, **k: Swarm.answer_ids(stub, *a, **k)
    calls.clear()
    assert await Swarm.complete_ids(stub, [1, 2], max_new_tokens=4) == [7, 5, 6]


async def test_the_gateway_answers_with_the_corrected_text(smol_tokenizer) -> None:
    """Through `tessera serve` a rewound answer was a 502; now the whole answer is the corrected
    text, and a stream goes on with a newline and the corrected text so far."""
    from tessera.peer.http.generation import Generation
    from tessera.stages.decoding.sampling import SamplingParams

    wrong, right = smol_tokenizer.encode("The capital is Lyon"), smol_tokenizer.encode("The capital is Paris.")
    keep = next(i for i, (x, y) in enumerate(zip(wrong, right)) if x != y)

    def swarm():
        async def answer_ids(ids, **options):
            for t in wrong:
                yield t
            yield Rewind(keep)
            for t in right[keep:]:
                yield t

        return SimpleNamespace(answer_ids=answer_ids, tokenizer=smol_tokenizer, spec=SimpleNamespace(eos_token_ids=()))

    whole = Generation(swarm(), [1], max_tokens=len(right), sampling=SamplingParams())
    assert await whole.text() == "The capital is Paris." and whole.rewinds == 1
    assert whole.usage["completion_tokens"] == len(right)
    streamed = Generation(swarm(), [1], max_tokens=len(right), sampling=SamplingParams())
    await streamed.start()
    deltas = []
    while (delta := await streamed.step()) is not None:
        deltas.append(delta)
    text = "".join(deltas)
    assert text.startswith("The capital is Lyon") and text.endswith("\nThe capital is Paris.")


# -- one place decides -----------------------------------------------------------------------------------


def calls_in(path: Path) -> set[str]:
    """The names of the attributes called in a module (`x.ban(...)` -> "ban")."""
    tree = ast.parse(path.read_text())
    return {node.func.attr for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}


def test_nothing_below_the_repair_loop_calls_back_up() -> None:
    """Segments and the spot checker report and offer; only peer/request/repair.py bans,
    re-routes and repairs (chain.replace once called the repair's ban and reroute, the checker
    reached through RepairPort), and the ports that allowed it are gone."""
    deciding = {"ban", "ban_for", "reroute", "repair", "register", "wait_for_route", "replace_span"}
    for name in ("chain.py", "group.py", "segmented.py", "verify.py"):
        assert not calls_in(PEER / "request" / name) & deciding, name
    ports = (PEER / "request" / "ports.py").read_text()
    for gone in ("SegmentRepair", "RepairPort", "StepChecker"):
        assert gone not in ports
    # one rewound-answer loop: the command line and the gateway read Swarm.answer_ids
    for user in (PEER / "cli" / "swarm_generate.py", PEER / "http" / "generation.py"):
        text = user.read_text()
        assert "answer_ids" in text and "AnswerRewound" not in text, user


def test_the_gateway_waits_for_a_route_as_long_as_the_command_line() -> None:
    """One constant (peer/base/backoff.py ROUTE_WAIT): the gateway's 10 s turned a sole peer's
    restart (7-10 s to serve again) into a 502 that `tessera generate` rode out."""
    from tessera.peer.base.backoff import ROUTE_WAIT
    from tessera.peer.cli.main import build_parser
    from tessera.peer.http.defaults import DEFAULT_ROUTE_WAIT
    from tessera.peer.http.generation import Generation

    assert DEFAULT_ROUTE_WAIT == ROUTE_WAIT == 30.0
    assert Generation.__dataclass_fields__["route_wait"].default == ROUTE_WAIT
    parser = build_parser()
    assert parser.parse_args(["generate", "x", "--join", "/ip4/1.2.3.4/tcp/1/p2p/x"]).route_wait == ROUTE_WAIT
    assert parser.parse_args(["serve", "--join", "/ip4/1.2.3.4/tcp/1/p2p/x"]).route_wait == ROUTE_WAIT
