"""gpt-oss (`gpt_oss`): biased experts with the clamped SwiGLU, a biased top-k-then-softmax router,
attention sinks and biases, sliding and full layers (`layer_types`, windows shorter than the prompt),
YaRN RoPE; experts fused as transformers saves them ([E, H, 2I], gate and up interleaved). Against
transformers, stacked, rolled back, quantized, and through a swarm; the published config read."""

from __future__ import annotations

import pytest
import torch

from tessera.stages.errors import UnsupportedModel

from ...swarm_helpers import local_swarm
from .conformance import (
    SHAPE, build, check_matches_transformers, check_rollback, check_stacked_sessions, check_swarm,
    reference_run, check_shard_refused,
)

transformers = pytest.importorskip("transformers")

CONFIGS = {
    # GptOssConfig's own defaults where it has them: YaRN (factor 32 over 4096 positions, not
    # truncated), sliding / full / sliding layers with a window of 8 (< the prompt), biased
    # attention, swiglu limit 7; top-2 of 8 experts
    "yarn-alternating": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8),
    # a full first layer then two sliding ones (window 5), no attention bias, a limit of 0.8 that
    # clamps often (and alpha 1.2), top-3 of 6 experts, a truncated YaRN whose original context
    # (16) the sequence outgrows
    "clamped-full-first": dict(
        num_local_experts=6, num_experts_per_tok=3, intermediate_size=32, sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], attention_bias=False,
        swiglu_limit=0.8, swiglu_alpha=1.2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 8.0, "truncate": True}),
}
SWARM = "yarn-alternating"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss")
    return {name: build(root, name, transformers.GptOssConfig(**SHAPE, **extra), seed=30 + i)
            for i, (name, extra) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def references(folders):
    """transformers' greedy tokens and logits for each configuration."""
    return {name: reference_run(folder) for name, folder in folders.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(folders, references, name):
    check_matches_transformers(folders[name], references[name])


def test_the_layers_are_read_as_configured(folders):
    from tessera.stages.families.catalog import spec_from_file

    first = spec_from_file(folders["yarn-alternating"] / "config.json")
    assert [layer.attention.window for layer in first.layers] == [8, None, 8]
    layer = first.layers[0]
    assert layer.attention.sinks and layer.attention.qkv_bias and layer.attention.o_bias
    assert layer.attention.rope.kind == "yarn" and layer.attention.rope.param("factor") == 32
    assert (layer.mlp.kind, layer.mlp.num_experts, layer.mlp.bias) == ("moe", 8, True)
    assert (layer.mlp.router.kind, layer.mlp.router.top_k, layer.mlp.router.bias) == ("topk_softmax", 2, True)
    assert (layer.mlp.glu.kind, layer.mlp.glu.alpha, layer.mlp.glu.limit) == ("clamped_swiglu", 1.702, 7.0)
    second = spec_from_file(folders["clamped-full-first"] / "config.json")
    assert [layer.attention.window for layer in second.layers] == [None, 5, 5]
    assert not second.layers[0].attention.qkv_bias and second.layers[0].mlp.glu.limit == 0.8


def test_fused_experts_are_regrouped_per_expert(folders):
    """Expert e's engine matrices are row e of the fused tensors, transposed to [out, in], gate rows
    (the checkpoint's even columns) before up rows (its odd ones); the biases likewise."""
    from safetensors import safe_open

    from tessera.stages.weights.folder import WeightFolder

    folder = folders["yarn-alternating"]
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


def test_a_span_holds_the_bytes_placement_counts(folders):
    """Sinks, router bias and every expert's biases are counted in a layer's bytes."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.families.catalog import spec_from_file
    from tessera.stages.kernels.quant import span_bytes

    folder = folders["yarn-alternating"]
    spec = spec_from_file(folder / "config.json")
    attention = 64 * 128 + 128 + 64 * 64 + 64 + 4  # wqkv and bias, wo and bias, a sink per head
    experts = 8 * (64 * 64 + 64 + 32 * 64 + 64) + 8 * 64 + 8  # each expert's matrices and biases; the router
    assert spec.layer_bytes(4, layer=0) == 4 * (attention + experts + 2 * 64)
    for start, end in ((0, 1), (1, 3)):
        assert load_stage(folder, start=start, end=end).weight_bytes == span_bytes(spec, start, end, 4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stacked_sessions_equal_their_solo_runs(folders, name):
    check_stacked_sessions(folders[name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rollback_by_pointer(folders, references, name):
    check_rollback(folders[name], references[name][0])


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_span_matches_its_dequantized_reference(folders, scheme):
    """Every expert's matrices as integers (their biases, the router and the sinks in float), and the span
    computes its own dequantized float32 model."""
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
    assert isinstance(expert.w_gate_up, Int8Linear if scheme == "int8" else Int4BlockLinear)
    assert expert.w_gate_up.bias is not None and stage.blocks[1].attn.sinks is not None
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


def test_a_tensor_shard_rank_is_refused_at_start_with_one_line(folders):
    check_shard_refused(folders[SWARM], "tensor shards of gpt_oss are not supported: layer 0 is 'moe'")


@pytest.fixture(scope="module")
def swarm(folders):
    with local_swarm([(0, 1), (1, 3)], model=str(folders[SWARM])) as procs:
        yield procs


@pytest.mark.slow
async def test_a_two_peer_swarm_matches_transformers(swarm, folders, references):
    await check_swarm(swarm, folders[SWARM], references[SWARM][0])
