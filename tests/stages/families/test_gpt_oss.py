"""gpt-oss (`gpt_oss`): what only it has beyond the conformance suite (test_conformance.py's rows,
which hold it to transformers, stacked, chunked, split, rolled back, through a swarm): the layers
read as configured, fused experts regrouped per expert (and the published MXFP4 layout's meaning),
the bytes placement counts, int8/int4 against their dequantized reference, and the published config
read, its refusals by name."""

from __future__ import annotations

import pytest
import torch

from tessera.stages.errors import UnsupportedModel

from .conformance import check_against_dequantized

transformers = pytest.importorskip("transformers")

ALTERNATING, CLAMPED = "gpt_oss/yarn-alternating", "gpt_oss/clamped-full-first"


def test_the_layers_are_read_as_configured(family_models):
    from tessera.stages.families.catalog import spec_from_file

    first = spec_from_file(family_models.folder(ALTERNATING) / "config.json")
    assert [layer.attention.window for layer in first.layers] == [8, None, 8]
    layer = first.layers[0]
    assert layer.attention.sinks and layer.attention.qkv_bias and layer.attention.o_bias
    assert layer.attention.rope.kind == "yarn" and layer.attention.rope.param("factor") == 32
    assert (layer.mlp.kind, layer.mlp.num_experts, layer.mlp.bias) == ("moe", 8, True)
    assert (layer.mlp.router.kind, layer.mlp.router.top_k, layer.mlp.router.bias) == ("topk_softmax", 2, True)
    assert (layer.mlp.glu.kind, layer.mlp.glu.alpha, layer.mlp.glu.limit) == ("clamped_swiglu", 1.702, 7.0)
    second = spec_from_file(family_models.folder(CLAMPED) / "config.json")
    assert [layer.attention.window for layer in second.layers] == [None, 5, 5]
    assert not second.layers[0].attention.qkv_bias and second.layers[0].mlp.glu.limit == 0.8


def test_fused_experts_are_regrouped_per_expert(family_models):
    """Expert e's engine matrices are row e of the fused tensors, transposed to [out, in], gate rows
    (the checkpoint's even columns) before up rows (its odd ones); the biases likewise."""
    from safetensors import safe_open

    from tessera.stages.weights.folder import WeightFolder

    folder = family_models.folder(ALTERNATING)
    state = WeightFolder(folder).layer_state(2, torch.float32)
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        gate_up = f.get_tensor("model.layers.2.mlp.experts.gate_up_proj")  # [E, H, 2I]
        gate_up_bias = f.get_tensor("model.layers.2.mlp.experts.gate_up_proj_bias")  # [E, 2I]
        down = f.get_tensor("model.layers.2.mlp.experts.down_proj")  # [E, I, H]
        sinks = f.get_tensor("model.layers.2.self_attn.sinks")
    e = 5
    assert torch.equal(state[f"mlp.experts.{e}.w_gate_up.weight"], torch.cat((gate_up[e][:, 0::2].T, gate_up[e][:, 1::2].T)))
    assert torch.equal(state[f"mlp.experts.{e}.w_gate_up.bias"], torch.cat((gate_up_bias[e][0::2], gate_up_bias[e][1::2])))
    assert torch.equal(state[f"mlp.experts.{e}.w_down.weight"], down[e].T)
    assert torch.equal(state["attn.sinks"], sinks) and state["mlp.router.bias"].shape == (8,)
    # the published MXFP4 form stores the same matrices [out, in]: what it means for expert e, regrouped
    # as `interleaved` says (and not transposed), is the same engine matrix
    from tessera.stages.families.catalog import tensors_of_layer

    spec = WeightFolder(folder).spec
    source = tensors_of_layer(spec, 2)[f"mlp.experts.{e}.w_gate_up.weight"][0]
    assert source.matrix_shape(0) == (8, 64, 64) and source.part_shape(0) == (64, 64)
    assert tensors_of_layer(spec, 2)[f"mlp.experts.{e}.w_down.weight"][0].matrix_shape(0) == (8, 64, 32)
    published = gate_up.transpose(1, 2)  # [E, 2I, H]: what transformers' MXFP4 dequantization gives before its transpose
    assert torch.equal(torch.cat((published[e][0::2], published[e][1::2])), state[f"mlp.experts.{e}.w_gate_up.weight"])


def test_a_span_holds_the_bytes_placement_counts(family_models):
    """Sinks, router bias and every expert's biases are counted in a layer's bytes."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.families.catalog import spec_from_file
    from tessera.stages.kernels.quant import span_bytes

    folder = family_models.folder(ALTERNATING)
    spec = spec_from_file(folder / "config.json")
    attention = 64 * 128 + 128 + 64 * 64 + 64 + 4  # wqkv and bias, wo and bias, a sink per head
    experts = 8 * (64 * 64 + 64 + 32 * 64 + 64) + 8 * 64 + 8  # each expert's matrices and biases; the router
    assert spec.layer_bytes(4, layer=0) == 4 * (attention + experts + 2 * 64)
    for start, end in ((0, 1), (1, 3)):
        assert load_stage(folder, start=start, end=end).weight_bytes == span_bytes(spec, start, end, 4)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_span_matches_its_dequantized_reference(family_models, scheme):
    """Every expert's matrices as integers (their biases, the router and the sinks in float), and the span
    computes its own dequantized float32 model."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.families.catalog import spec_from_file
    from tessera.stages.kernels.quant import Int4BlockLinear, Int8Linear, Quant, span_bytes

    folder, quant = family_models.folder(ALTERNATING), Quant.parse(scheme)
    spec = spec_from_file(folder / "config.json")
    stage = load_stage(folder, quant=quant)
    assert stage.weight_bytes == span_bytes(spec, 0, 3, 4, quant)
    expert = stage.blocks[1].mlp.experts[5]
    assert isinstance(expert.w_gate_up, Int8Linear if scheme == "int8" else Int4BlockLinear)
    assert expert.w_gate_up.bias is not None and stage.blocks[1].attn.sinks is not None
    check_against_dequantized(folder, stage)


def test_the_published_config_reads():
    """gpt-oss-120b's config.json as published (both top-k keys, the pretraining context note, RoPE in
    rope_scaling with a top-level base) reads into 36 alternating layers of 128 experts; its MXFP4
    MXFP4 quantization_config reads as the shipped form the peers load (stages/families/shipped.py)
    and any other method is refused by name."""
    from tessera.stages.families.catalog import spec_from_config, to_config
    from tessera.stages.families.shapes import SHAPES

    published = SHAPES["gpt-oss-120b"]
    spec = spec_from_config(published)
    assert spec.num_layers == 36 and [l.attention.window for l in spec.layers[:3]] == [128, None, 128]
    layer = spec.layers[0]
    assert (layer.mlp.num_experts, layer.mlp.router.top_k, layer.mlp.width, layer.attention.head_dim) == (128, 4, 2880, 64)
    assert layer.attention.rope.theta == 150000 and layer.attention.rope.optional("truncate") is False
    assert spec_from_config(to_config(spec)) == spec
    defaults = {k: v for k, v in published.items() if k not in ("rope_scaling", "rope_theta", "layer_types")}
    assert spec_from_config(defaults).layers[0].attention.rope == layer.attention.rope  # GptOssConfig's default RoPE
    shipped = spec_from_config({**published, "quantization_config": {"quant_method": "mxfp4"}}).shipped
    assert shipped is not None and shipped.method == "mxfp4"
    with pytest.raises(UnsupportedModel, match="quant_method 'awq'"):
        spec_from_config({**published, "quantization_config": {"quant_method": "awq"}})


@pytest.mark.parametrize(
    "change, words",
    [
        ({"experts_per_token": 2}, r"experts_per_token 2 .* differs from num_experts_per_tok \(4\)"),
        ({"num_experts": 64}, r"num_experts 64 .* differs from num_local_experts \(128\)"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 18}, "layer_types"),
        ({"sliding_window": None}, "layer_types .* needs sliding_window"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"router_type": "sigmoid"}, r"config key 'router_type' \(value 'sigmoid'\) is not one tessera knows"),
    ],
)
def test_what_the_engine_does_not_compute_is_refused_by_name(change, words):
    from tessera.stages.families.catalog import spec_from_config
    from tessera.stages.families.shapes import SHAPES

    with pytest.raises(UnsupportedModel, match=words) as refused:
        spec_from_config({**SHAPES["gpt-oss-120b"], **change})
    assert "\n" not in str(refused.value)
