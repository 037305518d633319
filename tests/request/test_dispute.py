"""Two holders, one liar: a dispute no third peer can break is decided by the requester itself.

The decision (`rule`, `settle`) with each outcome — accused wrong, checker wrong, both wrong,
and cannot decide (no weights, over budget, quantized, no holder) — then the weights it
recomputes with (fetched from holders, every chunk checked: a liar's altered tensor is refused),
then a whole answer on the in-memory network with real StageServers: two peers hold the
second span, one perturbs every output, and there is no third.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch
import trio
from safetensors.torch import load_file, save_file

from tessera.peer.base.backoff import Failure
from tessera.peer.base.errors import DisputeUndecided
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.request.dispute import BY_RECOMPUTING, Dispute, kv_bytes, recompute_rows, rule, settle
from tessera.peer.request.policy import RequesterPolicy
from tessera.peer.request.ports import CheckPolicy
from tessera.peer.serve.faults import perturber
from tessera.peer.weights.errors import OverBudget, WeightsUnavailable
from tessera.peer.weights.on_demand import OnDemandSpans, float32_bytes, span_tensors
from tessera.peer.weights.source import WeightSource
from tessera.protocol.fingerprint import tolerance
from tessera.stages.decoding.generate import LocalEngine
from tessera.stages.assembly.stage import load_stage
from tessera.stages.weights import registry
from tessera.stages.weights.registry import MANIFEST, read_manifest, save_manifest

from .memory_swarm import PeerPlan, decisive_model, memory_swarm

DISPUTE = Dispute("accused", "checker", 2, 4, 3, 5)
TOKENS = 12
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return decisive_model(tmp_path_factory.mktemp("dispute") / "m")


def test_whoever_differs_from_the_recomputation_is_guilty():
    assert rule(DISPUTE, accused_agrees=False, checker_agrees=True) == ("accused",)
    assert rule(DISPUTE, accused_agrees=True, checker_agrees=False) == ("checker",)
    assert rule(DISPUTE, accused_agrees=False, checker_agrees=False) == ("accused", "checker")
    assert rule(DISPUTE, accused_agrees=True, checker_agrees=True) == ()  # an honest boundary case


class Loaded:
    """A SpanWeights over a local folder (or one that fails as told), counting its loads."""

    def __init__(self, folder: Path, *, fails: Exception | None = None) -> None:
        self.folder = folder
        self.id = registry.model_id(folder)
        self.fails = fails
        self.budgets: list[int] = []

    async def model_id(self):
        return self.id

    async def load(self, transport, start, end, holders, *, budget):
        self.budgets.append(budget)
        if self.fails is not None:
            raise self.fails
        return load_stage(self.folder, start=start, end=end)


def rows_of(folder: Path):
    """Inputs of layers [2, 4) for positions [0, 5), and the honest output rows [3, 5)."""
    inputs = load_stage(folder, start=0, end=0, embed=True).embed(PROMPT)
    inputs = recompute_rows(load_stage(folder, start=0, end=2), inputs, 0)
    honest = recompute_rows(load_stage(folder, start=2, end=4), inputs, 3)
    return inputs, honest, perturber(1.0, seed=3)(honest)


async def judge(folder: Path, weights, accused, checker, *, model_id=None, budget=1 << 30):
    inputs, _, _ = rows_of(folder)
    tol = tolerance("float32", "float32", 2)
    return await settle(DISPUTE, weights, transport=None, holders={}, model_id=model_id or registry.model_id(folder),
                        inputs=inputs, accused_rows=accused, checker_rows=checker, accused_tol=tol, checker_tol=tol,
                        budget=budget, hidden_size=64)


@pytest.mark.parametrize("case, guilty", [("accused wrong", ("accused",)), ("checker wrong", ("checker",)),
                                          ("both wrong", ("accused", "checker"))])
async def test_a_recomputation_decides_each_way(model, case, guilty):
    _, honest, wrong = rows_of(model)
    accused = wrong if "accused" in guilty else honest
    checker = wrong + 0.5 * (wrong - honest) if "checker" in guilty else honest  # both wrong, and differently
    weights = Loaded(model)
    ruling = await judge(model, weights, accused, checker)
    assert weights.budgets == [(1 << 30) - kv_bytes(2, 5, 64)]  # the KV cache of positions [0, 5) counts too
    assert ruling.settled and ruling.decided == BY_RECOMPUTING
    assert ruling.guilty == guilty
    for peer in ("accused", "checker"):
        assert (ruling.differences[peer] > tolerance("float32", "float32", 2)) == (peer in guilty)


async def test_what_cannot_be_recomputed_is_undecided_and_says_why(model):
    _, honest, wrong = rows_of(model)
    cases = {
        "no weights": (None, {}, "no way to load the model's weights"),
        "no holder": (Loaded(model, fails=WeightsUnavailable("no peer serves the weights of layers [2, 4)")), {},
                      "no peer serves the weights of layers [2, 4)"),
        "quantized": (Loaded(model), {"model_id": "int8-" + registry.model_id(model)}, "quantization error"),
    }
    for name, (weights, options, why) in cases.items():
        ruling = await judge(model, weights, wrong, honest, **options)
        assert not ruling.settled and ruling.guilty == (), name
        words = ruling.undecided_words()
        assert why in words and "accused" in words and "checker" in words and "layers [2, 4)" in words, words
        assert "positions [3, 5)" in words, words


async def test_over_budget_nothing_is_fetched(model):
    entries = span_tensors(read_manifest(model), 2, 4)
    need = float32_bytes(entries)
    assert set(entries) and all(e["group"] in ("layer.2", "layer.3") for e in entries.values())
    with pytest.raises(OverBudget, match=r"layers \[2, 4\) take .* MiB in float32, over the 0 MiB"):
        await OnDemandSpans(model).load(None, 2, 4, {}, budget=need - 1)  # no transport: nothing may be fetched
    # and through `settle`: the KV cache of the disputed positions counts too, and the ruling says why
    _, honest, wrong = rows_of(model)
    ruling = await judge(model, OnDemandSpans(model), wrong, honest, budget=need)
    assert not ruling.settled and "in float32, over the" in ruling.why


def partial_copy(folder: Path, target: Path) -> Path:
    """A requester's folder: the manifest (partial), the small files, and the embedding and head only."""
    target.mkdir()
    manifest = read_manifest(folder)
    for name in manifest["files"]:
        if not name.endswith(".safetensors"):
            (target / name).write_bytes((folder / name).read_bytes())
    state = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith("model.layers.")},
              str(target / "model.safetensors"), metadata={"format": "pt"})
    save_manifest(target, {**manifest, "partial": True})
    return target


def altered_copy(folder: Path, target: Path) -> Path:
    """A holder's folder with one tensor of layer 2 altered (its manifest the genuine one)."""
    target.mkdir()
    for item in folder.iterdir():
        if item.is_file():
            (target / item.name).write_bytes(item.read_bytes())
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.2.mlp.down_proj.weight"] *= 1.5
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


async def test_a_requester_fetches_the_span_from_holders_and_a_liar_cannot_feed_it(model, tmp_path):
    mine = partial_copy(model, tmp_path / "requester")
    liar_folder = altered_copy(model, tmp_path / "liar")
    assert (mine / MANIFEST).exists()
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        holders = {}
        for name, folder in (("liar", liar_folder), ("honest", model)):
            transport = await stack.enter_async_context(open_memory_transport(network, name))
            WeightSource(transport, folder, name=folder.name)
            holders[name] = tuple(transport.addrs())
        requester = await stack.enter_async_context(open_memory_transport(network, "requester"))
        stage = await OnDemandSpans(mine).load(requester, 2, 4, holders, budget=1 << 30)
    inputs, honest, _ = rows_of(model)
    assert torch.equal(recompute_rows(stage, inputs, 3), honest)
    assert not (mine / ".parts").exists() and not any(n.startswith("model.layers.") for n in registry.held_tensors(mine))
    async with AsyncExitStack() as stack:  # with only the liar to ask, the span cannot be had
        transport = await stack.enter_async_context(open_memory_transport(network, "liar2"))
        WeightSource(transport, liar_folder, name=liar_folder.name)
        requester = await stack.enter_async_context(open_memory_transport(network, "requester2"))
        with pytest.raises(WeightsUnavailable, match="model.layers.2.mlp.down_proj.weight"):
            await OnDemandSpans(mine).load(requester, 2, 4, {"liar2": tuple(transport.addrs())}, budget=1 << 30)


class NewcomerThenFail:
    """SpanWeights that cannot get the weights — and, as it tries, a fourth peer `d` holding the
    disputed span joins the requester's view (not a tie-breaker: it came too late for that)."""

    def __init__(self, world, model: Path) -> None:
        self.world = world
        self.id = registry.model_id(model)

    async def model_id(self):
        return self.id

    async def load(self, transport, start, end, holders, *, budget):
        self.world.advertise("d")
        raise WeightsUnavailable(f"no peer serves the weights of layers [{start}, {end})")


async def answer(model: Path, *, span_weights: str, route_wait: float = 30.0):
    """An answer through peers a [0, 2), b [2, 4) (perturbs every output; preferred) and c [2, 4):
    no third holder of [2, 4) (`d` joins only with `span_weights` "newcomer"). Returns (tokens or
    the error, info, world)."""
    async with AsyncExitStack() as stack:
        world = await memory_swarm(stack, model, [PeerPlan("a", 0, 2, 1000.0), PeerPlan("b", 2, 4, 2000.0),
                                                  PeerPlan("c", 2, 4, 1000.0), PeerPlan("d", 2, 4, 1000.0)],
                                   held_back=() if span_weights == "third holder" else ("d",))
        world.servers["b"].tamper = perturber(1.0, seed=0)
        world.swarm.span_weights = {"local": OnDemandSpans(model), "none": None,
                                    "newcomer": NewcomerThenFail(world, model), "third holder": None}[span_weights]
        info: dict = {}
        try:
            out = await world.swarm.complete_ids(PROMPT, max_new_tokens=TOKENS, info=info, route_wait=route_wait,
                                                 spot_check=CheckPolicy(rate=1.0, seed=0, final_check=False),
                                                 policy=RequesterPolicy(prefer=frozenset({world.ids["b"]})))
        except DisputeUndecided as undecided:
            out = undecided
        return out, info, world


async def test_the_liar_among_two_holders_is_convicted_by_recomputing(model):
    reference = LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)
    out, info, world = await answer(model, span_weights="local")
    liar, honest = world.ids["b"], world.ids["c"]
    assert out == reference
    verdicts = [v for v in info["checks"]["verdicts"] if v.get("convicted")]
    assert verdicts and all(v["guilty"] == liar and v["decided"] == BY_RECOMPUTING for v in verdicts), verdicts
    assert world.swarm.bans.failure(liar) is Failure.LIED and world.swarm.is_banned(liar)
    assert not world.swarm.is_banned(honest)
    assert all(h["peer"] != liar for h in info["route"])


async def test_undecided_with_no_other_holder_the_answer_ends_naming_both(model):
    out, info, world = await answer(model, span_weights="none", route_wait=0.5)
    liar, honest = world.ids["b"], world.ids["c"]
    assert isinstance(out, DisputeUndecided), out
    message = str(out)
    assert liar in message and honest in message and "layers [2, 4)" in message, message
    assert "could not decide" in message and "no way to load" in message, message
    for peer in (liar, honest):
        assert world.swarm.bans.failure(peer) is Failure.DISPUTED


async def test_undecided_the_answer_moves_to_another_holder_of_the_span(model):
    reference = LocalEngine(model, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)
    out, info, world = await answer(model, span_weights="newcomer")
    liar, honest, newcomer = world.ids["b"], world.ids["c"], world.ids["d"]
    assert out == reference
    undecided = [v for v in info["checks"]["verdicts"] if v.get("outcome") == "undecided"]
    assert undecided and set(undecided[0]["disputed"]) == {liar, honest}, info["checks"]
    assert "no peer serves the weights of layers [2, 4)" in undecided[0]["why"]
    for peer in (liar, honest):
        assert world.swarm.bans.failure(peer) is Failure.DISPUTED
    assert [h["peer"] for h in info["route"] if h["start"] >= 2] == [newcomer]


async def test_with_a_third_holder_the_verdict_names_the_tie_breaker(model, caplog):
    out, info, world = await answer(model, span_weights="third holder")
    liar = world.ids["b"]
    decided = [v for v in info["checks"]["verdicts"] if v.get("convicted")]
    assert decided and all(v["decided"] == "by a tie-breaker" and v["guilty"] == liar for v in decided)
    lines = [r.getMessage() for r in caplog.records if "spot check: peer" in r.getMessage()]
    tie_breaker = decided[0]["tie_breaker"]
    assert tie_breaker in (world.ids["c"], world.ids["d"])
    assert lines and f"a tie-breaker, peer {tie_breaker}, sides against it" in lines[0], lines
    assert "None" not in lines[0] and lines[0].endswith("banned for 24 h, reported"), lines
