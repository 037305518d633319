"""Qwen3-MoE (`qwen3_moe`): sparse layers (softmax router, top-k, renormalised or not) among dense
ones (`mlp_only_layers`, `decoder_sparse_step`), Qwen3's attention, sliding windows; experts
saved one tensor each (as published) and fused (as transformers 5 holds them). Against
transformers, stacked, rolled back, and through a swarm; per-layer bytes where placement reads them."""

from __future__ import annotations

import pytest
import torch

from ...swarm_helpers import local_swarm
from .conformance import (
    SHAPE, build, check_matches_transformers, check_rollback, check_stacked_sessions, check_swarm,
    reference_run, check_shard_refused,
)

transformers = pytest.importorskip("transformers")

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)
CONFIGS = {
    # a dense first layer, then sparse ones whose top-2 weights are renormalised
    "dense-first-renorm": (dict(**MOE, mlp_only_layers=[0], norm_topk_prob=True), False),
    # every second layer sparse (layer 1), raw top-2 weights, every layer windowed (8 < the prompt),
    # the experts saved fused
    "step2-window-fused": (dict(**MOE, decoder_sparse_step=2, norm_topk_prob=False, use_sliding_window=True,
                                sliding_window=8), True),
}
SWARM = "dense-first-renorm"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-moe")
    return {name: build(root, name, transformers.Qwen3MoeConfig(**SHAPE, **extra), seed=10 + i, fused=fused)
            for i, (name, (extra, fused)) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def references(folders):
    """transformers' greedy tokens and logits for each configuration."""
    return {name: reference_run(folder) for name, folder in folders.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(folders, references, name):
    check_matches_transformers(folders[name], references[name])


def test_the_layers_are_read_as_configured(folders):
    from tessera.stages.families.catalog import spec_from_file
    from tessera.stages.weights.folder import WeightFolder

    first = spec_from_file(folders["dense-first-renorm"] / "config.json")
    assert [layer.mlp.kind for layer in first.layers] == ["dense", "moe", "moe"]
    assert first.layers[1].mlp.router.renormalize and first.layers[1].mlp.router.top_k == 2
    step2 = spec_from_file(folders["step2-window-fused"] / "config.json")
    assert [layer.mlp.kind for layer in step2.layers] == ["dense", "moe", "dense"]
    assert not step2.layers[1].mlp.router.renormalize
    assert {layer.attention.window for layer in step2.layers} == {8}
    # the fused folder holds [E, 2I, H] and [E, H, I]; expert 5 is row 5 of each
    weights = WeightFolder(folders["step2-window-fused"])
    assert weights.has("model.layers.1.mlp.experts.gate_up_proj")
    assert not weights.has("model.layers.1.mlp.experts.5.gate_proj.weight")
    state = weights.layer_state(1, torch.float32)
    assert state["mlp.experts.5.w_gate_up.weight"].shape == (64, 64)


def test_a_sparse_layer_holds_its_experts_and_placement_counts_them(folders):
    """A sparse layer's bytes are its 8 experts and its router; a dense layer's one MLP. Capacity in
    layers is the longest run every window of which fits."""
    from tessera.peer.node.config import KV_RESERVE_FRACTION, capacity_in_layers
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.families.catalog import spec_from_file
    from tessera.stages.kernels.quant import span_bytes

    folder = folders["dense-first-renorm"]
    spec = spec_from_file(folder / "config.json")
    dense, sparse = spec.layer_bytes(4, layer=0), spec.layer_bytes(4, layer=1)
    assert sparse - dense == 4 * (8 * 3 * 64 * 32 + 8 * 64 - 3 * 64 * 96)
    for start, end in ((0, 1), (1, 3), (0, 3)):
        assert load_stage(folder, start=start, end=end).weight_bytes == span_bytes(spec, start, end, 4)
    with pytest.raises(ValueError, match="differ"):
        spec.layer_bytes(4)
    usable = lambda n: n / (1 - KV_RESERVE_FRACTION)  # noqa: E731  (memory whose usable part is n bytes)
    assert capacity_in_layers(spec, int(usable(dense + 2 * sparse)) + 8, 4) == 3
    assert capacity_in_layers(spec, int(usable(2 * sparse)) + 8, 4) == 2  # [0, 2) and [1, 3) both fit
    # [0, 2) would fit, [1, 3) not: any window of the length claimed must fit, so one layer
    assert capacity_in_layers(spec, int(usable(dense + sparse)) + 8, 4) == 1
    assert capacity_in_layers(spec, int(usable(dense)), 4) == 1  # never less than one


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stacked_sessions_equal_their_solo_runs(folders, name):
    check_stacked_sessions(folders[name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rollback_by_pointer(folders, references, name):
    check_rollback(folders[name], references[name][0])


def test_a_tensor_shard_rank_is_refused_at_start_with_one_line(folders):
    check_shard_refused(folders[SWARM], "tensor shards of qwen3_moe are not supported: layer 1 is 'moe'")


@pytest.fixture(scope="module")
def swarm(folders):
    with local_swarm([(0, 1), (1, 3)], model=str(folders[SWARM])) as procs:
        yield procs


@pytest.mark.slow
async def test_a_two_peer_swarm_matches_transformers(swarm, folders, references):
    await check_swarm(swarm, folders[SWARM], references[SWARM][0])


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_span_matches_its_dequantized_reference(folders, scheme):
    """Every expert's matrices are stored as integers (the router stays in float), the span holds
    the bytes placement counts, and it computes its own dequantized float32 model."""
    from tessera.stages.engine.stage import Stage
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.families.catalog import spec_from_file
    from tessera.stages.assembly.blocks import dense_block
    from tessera.stages.kernels.quant import Int4BlockLinear, Int8Linear, Quant, span_bytes

    folder, quant = folders[SWARM], Quant.parse(scheme)
    spec = spec_from_file(folder / "config.json")
    stage = load_stage(folder, quant=quant)
    assert stage.weight_bytes == span_bytes(spec, 0, 3, 4, quant)
    expert = stage.blocks[1].mlp.experts[5]
    assert isinstance(expert.w_down, Int8Linear if scheme == "int8" else Int4BlockLinear)
    assert stage.blocks[1].mlp.router.weight.dtype == torch.float32
    head = load_stage(folder, start=0, end=0, embed=True, head=True)
    reference = Stage(spec, 0, [dense_block(b, spec) for b in stage.blocks])
    ids = list(range(5, 25))
    for span in (stage, reference):
        span.open("q", capacity=32)
    worst, tokens = 0.0, ([], [])
    for pos, step in [(0, ids), *((len(ids) + i, None) for i in range(6))]:
        rows = []
        for i, span in enumerate((stage, reference)):
            fed = step if step is not None else tokens[i][-1:]
            rows.append(head.logits(span.forward("q", head.embed(fed), pos))[-1])
            tokens[i].append(int(rows[-1].argmax()))
        worst = max(worst, float((rows[0] - rows[1]).abs().max()))
    assert tokens[0] == tokens[1]
    assert worst <= 3e-4  # tests/stages/test_quant.py's float32 bound for a span against its reference


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_manifest_puts_every_expert_in_its_layer(folders, name, tmp_path):
    """The model id covers every tensor; a peer fetching layers [1, 3) from others asks for the
    groups of those layers, which hold their experts and routers in either layout."""
    import shutil

    from tessera.stages.weights import registry
    from tessera.stages.weights.tensor_table import groups_for_span

    folder = tmp_path / name
    shutil.copytree(folders[name], folder)
    manifest = registry.write_manifest(folder)
    entries = manifest["tensors"]["entries"]
    experts = {n: e["group"] for n, e in entries.items() if ".experts." in n or n.endswith(".gate.weight")}
    assert experts and all(group == f"layer.{n.split('.')[2]}" for n, group in experts.items())
    wanted = groups_for_span(1, 3, 3, tied=False)
    assert {e["group"] for n, e in entries.items() if n.startswith(("model.layers.1.", "model.layers.2."))} <= wanted
    assert registry.model_id(folder) == manifest["model_id"] and registry.verify(folder) == []
