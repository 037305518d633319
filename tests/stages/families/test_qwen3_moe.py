"""Qwen3-MoE (`qwen3_moe`): what only it has beyond the conformance suite (test_conformance.py's rows):
sparse layers among dense ones read per layer (`mlp_only_layers`, `decoder_sparse_step`), fused
experts read per expert, per-layer bytes where placement reads them, quantized experts against their
dequantized reference, and every expert in its layer's manifest group."""

from __future__ import annotations

import pytest
import torch

from .conformance import check_against_dequantized

pytest.importorskip("transformers")

DENSE_FIRST, STEP2 = "qwen3_moe/dense-first-renorm", "qwen3_moe/step2-window-fused"
NAMES = (DENSE_FIRST, STEP2)


def test_the_layers_are_read_as_configured(family_models):
    from tessera.stages.families.catalog import spec_from_file
    from tessera.stages.weights.folder import WeightFolder

    first = spec_from_file(family_models.folder(DENSE_FIRST) / "config.json")
    assert [layer.mlp.kind for layer in first.layers] == ["dense", "moe", "moe"]
    assert first.layers[1].mlp.router.renormalize and first.layers[1].mlp.router.top_k == 2
    step2 = spec_from_file(family_models.folder(STEP2) / "config.json")
    assert [layer.mlp.kind for layer in step2.layers] == ["dense", "moe", "dense"]
    assert not step2.layers[1].mlp.router.renormalize
    assert {layer.attention.window for layer in step2.layers} == {8}
    # the fused folder holds [E, 2I, H] and [E, H, I]; expert 5 is row 5 of each
    weights = WeightFolder(family_models.folder(STEP2))
    assert weights.has("model.layers.1.mlp.experts.gate_up_proj")
    assert not weights.has("model.layers.1.mlp.experts.5.gate_proj.weight")
    state = weights.layer_state(1, torch.float32)
    assert state["mlp.experts.5.w_gate_up.weight"].shape == (64, 64)


def test_a_sparse_layer_holds_its_experts_and_placement_counts_them(family_models):
    """A sparse layer's bytes are its 8 experts and its router; a dense layer's one MLP. Capacity in
    layers is the longest run every window of which fits."""
    from tessera.peer.node.config import KV_RESERVE_FRACTION, capacity_in_layers
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.families.catalog import spec_from_file
    from tessera.stages.kernels.quant import span_bytes

    folder = family_models.folder(DENSE_FIRST)
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


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_span_matches_its_dequantized_reference(family_models, scheme):
    """Every expert's matrices are stored as integers (the router stays in float), the span holds
    the bytes placement counts, and it computes its own dequantized float32 model."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.families.catalog import spec_from_file
    from tessera.stages.kernels.quant import Int4BlockLinear, Int8Linear, Quant, span_bytes

    folder, quant = family_models.folder(DENSE_FIRST), Quant.parse(scheme)
    spec = spec_from_file(folder / "config.json")
    stage = load_stage(folder, quant=quant)
    assert stage.weight_bytes == span_bytes(spec, 0, 3, 4, quant)
    expert = stage.blocks[1].mlp.experts[5]
    assert isinstance(expert.w_down, Int8Linear if scheme == "int8" else Int4BlockLinear)
    assert stage.blocks[1].mlp.router.weight.dtype == torch.float32
    check_against_dequantized(folder, stage)


@pytest.mark.parametrize("name", NAMES)
def test_the_manifest_puts_every_expert_in_its_layer(family_models, name, tmp_path):
    """The model id covers every tensor; a peer fetching layers [1, 3) from others asks for the
    groups of those layers, which hold their experts and routers in either layout."""
    import shutil

    from tessera.stages.weights import registry
    from tessera.stages.weights.tensor_table import groups_for_span

    folder = tmp_path / name.replace("/", "-")
    shutil.copytree(family_models.folder(name), folder)
    manifest = registry.write_manifest(folder)
    entries = manifest["tensors"]["entries"]
    experts = {n: e["group"] for n, e in entries.items() if ".experts." in n or n.endswith(".gate.weight")}
    assert experts and all(group == f"layer.{n.split('.')[2]}" for n, group in experts.items())
    wanted = groups_for_span(1, 3, 3, tied=False)
    assert {e["group"] for n, e in entries.items() if n.startswith(("model.layers.1.", "model.layers.2."))} <= wanted
    assert registry.model_id(folder) == manifest["model_id"] and registry.verify(folder) == []
