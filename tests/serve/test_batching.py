"""Batched serving: steps of many sessions as one stacked forward, each session exact.

The stage (`Stage.forward_batch`) against solo runs of the real model; the batcher
(`peer/serve/batcher.py`) on its own under trio's MockClock; and a real StageServer
over the in-memory transport, where a failing session leaves the others of its batch alone.
"""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing
from libp2p.peer.id import ID

from tessera.peer.base.errors import PeerFailed
from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.request.chain_state import RequesterContext
from tessera.peer.request.chain import RouteSession
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.serve.server import StageServer
from tessera.peer.serve.limits import ServerLimits
from tessera.peer.serve.batcher import BatchBudget, BatchInterrupted, StepBatcher
from tessera.protocol.keys import Identity
from tessera.stages.errors import ContextOverflow, SpanError, UnknownSession
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.store.events import Error, Forward
from tessera.store.trace import MemoryTracer

from ..waiting import await_until

# Float32 logits of a session in a stacked step against its solo step, relative to the
# row's largest logit. Only the matmuls differ (more rows take other kernel paths, which
# sum in another order); measured on SmolLM2-135M over 30 layers: ~1e-4 absolute on
# logits up to ~25, i.e. ~5e-6 relative, tens of float32 ulps. Greedy tokens must be identical.
STACKED_LOGITS_RTOL = 2e-5
STACKED_HIDDEN_RTOL = 2e-5  # the same measure for hidden states (a few outlier dimensions dominate)
N_NEW = 6

PROMPTS = [list(range(7 + 11 * i, 7 + 11 * i + 3 + 5 * i)) for i in range(8)]  # 3 .. 38 tokens


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference, relative to the largest entry of `want`."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max() / want.abs().max())


def solo_run(stage: Stage, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits that chose them, one session alone."""
    stage.open("solo", capacity=64)
    hidden = stage.forward("solo", stage.embed(prompt), 0)
    tokens, logits = [], []
    for _ in range(n):
        row = stage.logits(hidden[-1:])
        logits.append(row)
        tokens.append(int(row.argmax()))
        hidden = stage.forward("solo", stage.embed(tokens[-1:]), len(prompt) + len(tokens) - 1)
    stage.close("solo")
    return tokens, logits


@pytest.fixture(scope="module")
def solo(smol_stage) -> list[tuple[list[int], list[torch.Tensor]]]:
    return [solo_run(smol_stage, prompt, N_NEW) for prompt in PROMPTS]


def test_eight_sessions_stacked_equal_their_solo_runs(smol_stage, solo):
    """Eight sessions of different lengths join two at a time, so every stacked step mixes
    prefills with decodes of sessions at different positions."""
    stage = smol_stage
    for i in range(len(PROMPTS)):
        stage.open(("s", i), capacity=64)
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    pending: dict[int, torch.Tensor] = {}  # session -> the input of its next step
    worst = 0.0
    try:
        for step in range(N_NEW + len(PROMPTS) // 2):
            for i in (2 * step, 2 * step + 1):  # two newcomers a step
                if i < len(PROMPTS):
                    pending[i] = stage.embed(PROMPTS[i])
            order = sorted(pending)
            starts = [0 if not tokens[i] else len(PROMPTS[i]) + len(tokens[i]) - 1 for i in order]
            outputs = stage.forward_batch([(("s", i), pending[i], start) for i, start in zip(order, starts)])
            pending = {}
            for i, output in zip(order, outputs):
                assert isinstance(output, torch.Tensor), output
                row = stage.logits(output[-1:])
                worst = max(worst, relative_gap(row, solo[i][1][len(tokens[i])]))
                tokens[i].append(int(row.argmax()))
                if len(tokens[i]) < N_NEW:
                    pending[i] = stage.embed(tokens[i][-1:])
    finally:
        for i in range(len(PROMPTS)):
            stage.close(("s", i))
    assert tokens == [t for t, _ in solo]
    print(f"stacked vs solo logits: {worst:.2e} of the largest")
    assert worst <= STACKED_LOGITS_RTOL, worst


def test_a_stack_of_one_is_exactly_a_solo_step(smol_stage, solo):
    stage = smol_stage
    stage.open("one", capacity=64)
    try:
        (output,) = stage.forward_batch([("one", stage.embed(PROMPTS[3]), 0)])
        assert torch.equal(stage.logits(output[-1:]), solo[3][1][0])
    finally:
        stage.close("one")


def test_a_bad_step_fails_alone_and_moves_no_pointer(smol_stage):
    stage = smol_stage
    for name in ("good", "shape", "far"):
        stage.open(name, capacity=16)
    stage.open("ref", capacity=16)
    try:
        stage.forward_batch([(name, stage.embed([5, 6, 7]), 0) for name in ("good", "shape", "far", "ref")])
        x = stage.embed([9])
        got = stage.forward_batch([
            ("good", x, 3),
            ("nobody", x, 0),
            ("shape", torch.zeros(1, 7), 3),
            ("far", x, 9),  # past what the cache holds
            ("good", x, 3),  # the same session twice in one stack
        ])
        assert isinstance(got[1], UnknownSession)
        assert isinstance(got[2], SpanError) and "shape" in str(got[2])
        assert isinstance(got[3], ContextOverflow) and "9" in str(got[3])
        assert isinstance(got[4], SpanError) and "two steps" in str(got[4])
        assert stage.position("shape") == stage.position("far") == 3
        assert stage.position("good") == 4
        assert torch.equal(got[0], stage.forward("ref", x, 3))  # a stack of one: the solo step
    finally:
        for name in ("good", "shape", "far", "ref"):
            stage.close(name)


def test_rollback_and_sub_spans_inside_a_stack(smol_stage):
    """One session rewrites its last two positions with a 3-token block (a rejected draft,
    or a replay) while others decode; one runs only layers [5, 30). Each equals its solo run."""
    stage = smol_stage
    prompt = [11, 12, 13, 14, 15]
    hidden_in = stage.embed(prompt)

    def solo_hidden(name: str, steps: list[tuple[list[int], int]], start: int | None = None) -> torch.Tensor:
        stage.open(name, capacity=32, start=start)
        try:
            out = None
            for ids, pos in steps:
                x = stage.embed(ids) if start is None else sub_in[pos : pos + len(ids)]
                out = stage.forward(name, x, pos)
            return out
        finally:
            stage.close(name)

    # sub-span session input: the hidden states layer 5 would receive (any [T, H] will do)
    sub_in = torch.randn(12, stage.spec.hidden_size, generator=torch.Generator().manual_seed(1))
    rewind = [(prompt, 0), ([20], 5), ([21], 6), ([22, 23, 24], 5)]
    plain = [(prompt, 0), ([30], 5), ([31], 6), ([32], 7)]
    want_rewind = solo_hidden("r0", rewind)
    want_plain = solo_hidden("p0", plain)
    want_sub = solo_hidden("u0", plain, start=5)
    stage.open("r", capacity=32)
    stage.open("p", capacity=32)
    stage.open("u", capacity=32, start=5)
    try:
        for (ids_r, pos_r), (ids_p, pos_p) in zip(rewind, plain):
            got = stage.forward_batch([
                ("r", stage.embed(ids_r), pos_r),
                ("p", stage.embed(ids_p), pos_p),
                ("u", sub_in[pos_p : pos_p + len(ids_p)], pos_p),
            ])
        assert stage.position("r") == 8 and stage.position("p") == 8
        assert relative_gap(got[0], want_rewind) <= STACKED_HIDDEN_RTOL
        assert relative_gap(got[1], want_plain) <= STACKED_HIDDEN_RTOL
        assert relative_gap(got[2], want_sub) <= STACKED_HIDDEN_RTOL
    finally:
        for name in ("r", "p", "u"):
            stage.close(name)


# -- the batcher on its own ---------------------------------------------------------------------

class Recorder:
    """A `run` for StepBatcher that records each batch; a job "bad" fails alone; can be held."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = trio.Event()
        self.gate.set()

    async def __call__(self, jobs: list[str]) -> list[object]:
        await self.gate.wait()
        self.batches.append(list(jobs))
        await trio.sleep(0.01)  # the compute (on the mock clock)
        return [ValueError(f"bad job {job!r}") if job.startswith("bad") else job.upper() for job in jobs]


async def test_a_lone_session_never_waits(autojump_clock):
    run = Recorder()
    batcher = StepBatcher(run, BatchBudget(max_rows=8, max_wait=0.5))
    for _ in range(3):
        began = trio.current_time()
        assert await batcher.submit("a", "a", 1) == "A"
        assert trio.current_time() - began == pytest.approx(0.01)  # the compute, no wait
    assert run.batches == [["a"]] * 3


async def test_steps_that_queue_together_run_as_one_batch_and_fail_alone(autojump_clock):
    run = Recorder()
    run.gate = trio.Event()  # hold the first batch, so that the others queue behind it
    batcher = StepBatcher(run, BatchBudget(max_rows=8, max_wait=0.5))
    got: dict[str, object] = {}

    async def one(job: str) -> None:
        try:
            got[job] = await batcher.submit(job, job, 1)
        except ValueError as bad:
            got[job] = bad

    async with trio.open_nursery() as nursery:
        for job in ["a", "b", "bad1", "c", "d"]:
            nursery.start_soon(one, job)
        await trio.testing.wait_all_tasks_blocked()
        run.gate.set()
    first = run.batches[0]
    assert len(run.batches) == 2 and len(first) == 1
    assert sorted(first + run.batches[1]) == ["a", "b", "bad1", "c", "d"]
    assert isinstance(got.pop("bad1"), ValueError)
    assert got == {"a": "A", "b": "B", "c": "C", "d": "D"}
    assert batcher.stats.largest == 4


async def test_the_row_budget_splits_batches_and_a_big_step_runs_alone(autojump_clock):
    run = Recorder()
    run.gate = trio.Event()
    batcher = StepBatcher(run, BatchBudget(max_rows=4, max_wait=0.0))
    rows = {"first": 1, "a": 2, "b": 2, "c": 2, "prompt": 9}
    async with trio.open_nursery() as nursery:
        for job, n in rows.items():
            nursery.start_soon(batcher.submit, job, job, n)
            await trio.testing.wait_all_tasks_blocked()  # arrival order is the order above
        run.gate.set()
    # first come, first served, while the rows fit; the prompt over the budget runs alone
    assert run.batches == [["first"], ["a", "b"], ["c"], ["prompt"]]


async def test_a_batch_waits_for_its_regulars_at_most_max_wait(autojump_clock):
    run = Recorder()
    run.gate = trio.Event()
    batcher = StepBatcher(run, BatchBudget(max_rows=8, max_wait=0.5))

    async def twice(key: str) -> None:
        for _ in range(2):
            await batcher.submit(key, key, 1)

    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(twice, "a")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(twice, "b")
        await trio.testing.wait_all_tasks_blocked()
        run.gate.set()
    # a alone (b came during its compute); then both; then b, whose last company a is done:
    # b's batch waited for a the whole max_wait, and no longer
    assert [sorted(batch) for batch in run.batches] == [["a"], ["a", "b"], ["b"]]
    assert trio.current_time() - began == pytest.approx(3 * 0.01 + 0.5)

    async def late_b() -> None:
        await trio.sleep(0.1)
        await batcher.submit("b", "b", 1)

    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(late_b)
        await batcher.submit("a", "a", 1)  # b ran in the last batch: a waits for it
        waited = trio.current_time() - began
    assert sorted(run.batches[-1]) == ["a", "b"]
    assert waited == pytest.approx(0.1 + 0.01)
    batcher.forget("b")  # b's session ended: a no longer waits for it
    began = trio.current_time()
    await batcher.submit("a", "a", 1)
    assert trio.current_time() - began == pytest.approx(0.01)


async def test_a_failing_batch_interrupts_only_its_members(autojump_clock):
    gate = trio.Event()

    async def run(jobs: list[str]) -> list[object]:
        await gate.wait()
        if len(jobs) > 1:
            raise RuntimeError("the stage is gone")
        return [job.upper() for job in jobs]

    batcher = StepBatcher(run, BatchBudget(max_rows=8, max_wait=0.0))
    got: dict[str, object] = {}

    async def one(job: str) -> None:
        try:
            got[job] = await batcher.submit(job, job, 1)
        except (RuntimeError, BatchInterrupted) as bad:
            got[job] = type(bad)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "a")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, "b")
        nursery.start_soon(one, "c")
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert got.pop("a") == "A"  # its own batch, before the failing one
    # the member that dispatched the failing batch sees the error; the other learns its batch failed
    assert sorted(got.values(), key=lambda t: t.__name__) == [BatchInterrupted, RuntimeError]
    assert not batcher.busy and not batcher.pending


def test_a_budget_with_bad_numbers_is_refused():
    with pytest.raises(ValueError, match="max_rows"):
        BatchBudget(max_rows=0)
    with pytest.raises(ValueError, match="max_wait"):
        BatchBudget(max_wait=-1.0)


# -- a real StageServer over the in-memory transport -------------------------------------------

def ident(i: int) -> Identity:
    return Identity.from_seed(bytes([i + 40]) * 32)


def pid(identity: Identity) -> str:
    return ID(identity.peer_id).to_base58()


async def test_a_failing_session_does_not_fail_the_others_in_its_batch(tiny_llama):
    """Six sessions step on one server at once; one asks for a position past its cache.
    Its step alone fails; the others' outputs equal solo steps, and the trace shows the batch."""
    stage = load_stage(tiny_llama)
    spec = stage.spec
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    peer, requester = ident(0), ident(9)
    tracer = MemoryTracer(peer=pid(peer))
    inputs = [torch.randn(2 + i, spec.hidden_size, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    async with open_memory_transport(network, pid(peer)) as tp, open_memory_transport(network, pid(requester)) as tr:
        server = StageServer(tp, peer, stage, tracer=tracer, limits=ServerLimits(batch_rows=64, batch_wait=0.0))
        gate = trio.Event()

        async def held(fn):  # hold the first batch so that the others queue behind it
            await gate.wait()
            return await trio.to_thread.run_sync(fn)

        server.run_compute = held
        async with trio.open_nursery() as nursery:
            keeper = ViewKeeper(model_id="m", num_layers=spec.num_layers, clock=trio.current_time)
            ctx = RequesterContext(transport=tr, identity=requester, keeper=keeper, nursery=nursery,
                                   num_layers=spec.num_layers, hidden_size=spec.hidden_size)
            route = Route((Hop(pid(peer), 0, spec.num_layers),), 0.0)
            sessions = [RouteSession(ctx, route, max_length=16) for _ in inputs]
            for session in sessions:
                await session.open()
            got: dict[int, object] = {}

            async def step(i: int) -> None:
                start = 5 if i == 3 else 0  # session 3 writes past what its cache holds
                try:
                    got[i] = await sessions[i].step(inputs[i], start)
                except PeerFailed as failed:
                    got[i] = failed

            async def queued(n: int) -> None:
                await await_until(lambda: len(server.compute.batcher.pending) >= n, 30, f"{n} steps queued", interval=0.01)

            async with trio.open_nursery() as steps:
                for i in (0, 1, 2, 4, 5):
                    steps.start_soon(step, i)
                await queued(4)  # one of them is held in the first batch, four wait
                steps.start_soon(step, 3)  # the bad one joins them
                await queued(5)
                gate.set()
            for session in sessions:
                await session.close()
            nursery.cancel_scope.cancel()
    assert isinstance(got[3], PeerFailed) and "position" in str(got[3])
    solo = load_stage(tiny_llama)
    for i in (0, 1, 2, 4, 5):
        solo.open(i, capacity=16)
        torch.testing.assert_close(got[i], solo.forward(i, inputs[i], 0), rtol=0, atol=1e-5)
    batches = sorted(e.event.batch for e in tracer.of_kind(Forward))
    assert batches == [1] + [5] * 4  # the held first step alone, then four good ones and the bad one
    assert len(tracer.of_kind(Error)) == 1


def test_the_peer_flags_set_the_budget_and_bad_values_are_refused():
    from tessera.peer.cli.main import build_parser
    from tessera.peer.cli.peer import config_from
    from tessera.peer.base.errors import ConfigError

    parser = build_parser()
    config = config_from(parser.parse_args(["peer", "--batch-rows", "8", "--batch-wait-ms", "5"]))
    assert (config.batch_rows, config.batch_wait) == (8, 0.005)
    with pytest.raises(ConfigError, match=r"--batch-rows 0"):
        config_from(parser.parse_args(["peer", "--batch-rows", "0"]))
    with pytest.raises(ConfigError, match=r"max_wait"):
        config_from(parser.parse_args(["peer", "--batch-wait-ms", "-3"]))
