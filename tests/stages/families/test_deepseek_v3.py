"""DeepSeek-V3 (`deepseek_v3`): multi-head latent attention over a latent cache (expanded and
absorbed), the sigmoid router with group-limited top-k and correction bias, shared experts,
first-k dense layers, YaRN with DeepSeek's softmax correction. Against transformers (both
attention paths), stacked, rolled back, quantized, through a swarm; the latent cache is what
admission counts, and every key or value the engine does not compute is refused."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import spec_from_config, spec_from_file, to_config

from ...swarm_helpers import local_swarm
from .conformance import (
    PROMPT, build, check_against_dequantized, check_matches_transformers, check_rollback, check_stacked_sessions, check_swarm,
    reference_run, check_shard_refused,
)

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=1024,
             bos_token_id=1, eos_token_id=2, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=16,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
# YaRN from an original context of 256 to 1024 (the ramp and scale change every position), with DeepSeek's mscale pair:
# cos/sin scaled by mscale(4, 1) / mscale(4, 0.8), scores by mscale(4, 0.8)^2
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
CONFIGS = {
    # low-rank q, a dense first layer, 16 experts in 4 groups of which the best 2 are searched for the
    # top 3, renormalised and scaled by 2.5, one shared expert, interleaved YaRN
    "lora-groups-shared-yarn": (dict(q_lora_rank=24, first_k_dense_replace=1, n_routed_experts=16, n_group=4,
                                     topk_group=2, num_experts_per_tok=3, n_shared_experts=1, norm_topk_prob=True,
                                     routed_scaling_factor=2.5, rope_parameters=YARN), False),
    # plain q (q_lora_rank null), every layer sparse, no shared experts, raw top-2 weights of one group,
    # biased projections, rope in halves, the experts saved fused
    "plain-q-raw-fused": (dict(q_lora_rank=None, first_k_dense_replace=0, n_routed_experts=8, n_group=1, topk_group=1,
                               num_experts_per_tok=2, n_shared_experts=0, norm_topk_prob=False,
                               routed_scaling_factor=1.0, attention_bias=True, rope_interleave=False), True),
}
SWARM = "lora-groups-shared-yarn"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-v3")
    return {name: build(root, name, transformers.DeepseekV3Config(**SHAPE, **extra), seed=30 + i, fused=fused)
            for i, (name, (extra, fused)) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def references(folders):
    return {name: reference_run(folder) for name, folder in folders.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(folders, references, name):
    """Prefills attend expanded and decode steps absorbed (each path's cost decides: below)."""
    check_matches_transformers(folders[name], references[name])


def logits_with_path(folder, tokens, path):
    from tessera.stages.assembly.stage import load_stage

    stage = load_stage(folder, embed=True, head=True)
    for block in stage.blocks:
        block.attn.path = path
    stage.open("c", capacity=64)
    out, step, pos = [], PROMPT, 0
    for token in tokens:
        out.append(stage.logits(stage.forward("c", stage.embed(step), pos)))
        pos, step = pos + len(step), [token]
    return out


@pytest.mark.parametrize("path", ["expanded", "absorbed"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_attention_path_alone_matches_transformers(folders, references, name, path):
    """Every step (prefill included) through one path: float32 logits within 1e-4, greedy the same."""
    tokens, want = references[name]
    got = logits_with_path(folders[name], tokens, path)
    worst = max(float((a - b).abs().max()) for a, b in zip(want, got))
    assert worst <= 1e-4, f"{name} {path}: max |logits diff| {worst:.3g}"
    assert [int(g[-1].argmax()) for g in got] == tokens


def test_the_cost_decides_the_path():
    """The conformance runs go through both: a prefill from 0 expands, a decode step absorbs; a long
    context's chunk absorbs once its expansion would pass the byte bound."""
    from tessera.stages.layers.mla import EXPANDED_LIMIT_BYTES, absorbs

    spec = spec_from_config(CONFIGS_AS_SAVED[SWARM]()).layers[0].attention
    assert not absorbs(spec, len(PROMPT), len(PROMPT))
    assert absorbs(spec, 1, len(PROMPT) + 1) and absorbs(spec, 4, 40)
    per_position = spec.num_heads * (2 * spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim) * 4
    long = EXPANDED_LIMIT_BYTES // per_position + 1
    assert absorbs(spec, long, long) and not absorbs(spec, long - 1, long - 1)


CONFIGS_AS_SAVED = {name: (lambda extra=extra: {**json.loads(json.dumps(transformers.DeepseekV3Config(
    **SHAPE, **extra).to_dict())), "architectures": ["DeepseekV3ForCausalLM"]}) for name, (extra, _) in CONFIGS.items()}


def test_the_layers_are_read_as_configured(folders):
    first = spec_from_file(folders[SWARM] / "config.json")
    assert [layer.mlp.kind for layer in first.layers] == ["dense", "moe", "moe"]
    attention, mlp = first.layers[1].attention, first.layers[1].mlp
    assert (attention.kind, attention.q_lora_rank, attention.rope_interleave, attention.rope.kind) == ("mla", 24, True, "yarn")
    assert (mlp.num_experts, mlp.shared_width, mlp.router.kind) == (16, 32, "sigmoid_group_topk")
    assert (mlp.router.num_groups, mlp.router.topk_groups, mlp.router.top_k, mlp.router.scale) == (4, 2, 3, 2.5)
    assert mlp.router.renormalize
    plain = spec_from_file(folders["plain-q-raw-fused"] / "config.json")
    assert [layer.mlp.kind for layer in plain.layers] == ["moe"] * 3
    assert plain.layers[0].attention.q_lora_rank is None and plain.layers[0].attention.bias
    assert plain.layers[0].mlp.shared_width == 0 and not plain.layers[0].mlp.router.renormalize
    assert plain.mtp_layers == 1  # transformers' default: such tensors would be accepted and not read
    for spec in (first, plain):
        assert spec_from_config(to_config(spec)) == spec


def test_the_router_is_transformers_and_its_groups_and_bias_matter(folders):
    """The sigmoid router's weights and picks equal DeepseekV3TopkRouter's on the saved weights; the
    group limit and the correction bias each change some token's picks (so the runs above test them)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.layers.routers import SigmoidGroupTopK

    config = transformers.DeepseekV3Config.from_pretrained(folders[SWARM])
    router = load_stage(folders[SWARM], start=1, end=2).blocks[0].mlp.router
    theirs = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        theirs.weight.copy_(router.weight)
        theirs.e_score_correction_bias.copy_(router.correction_bias)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    weights, picks = router(x)
    _, their_weights, their_picks = theirs(x)
    assert torch.equal(picks, their_picks) and torch.equal(weights, their_weights)

    def picks_of(spec, bias):
        other = SigmoidGroupTopK(64, 16, spec)
        other.load_state_dict({"weight": router.weight, "correction_bias": bias})
        return {tuple(sorted(p)) for p in other(x)[1].tolist()}

    ours = {tuple(sorted(p)) for p in picks.tolist()}
    assert picks_of(replace(router.spec, topk_groups=4), router.correction_bias) != ours
    assert picks_of(router.spec, torch.zeros(16)) != ours


def test_the_latent_cache_is_what_admission_counts(folders):
    """An MLA layer keeps C + Dr values a position (16 + 8), whatever its heads: what a session's
    cache allocates, what session_bytes budgets, and what placement counts per position."""
    from tessera.stages.assembly.stage import load_stage

    stage = load_stage(folders[SWARM], start=1, end=3)
    assert stage.spec.kv_bytes_per_position(1, 3, 4) == 2 * (16 + 8) * 4
    assert stage.session_bytes(100) == 100 * 2 * (16 + 8) * 4
    stage.open("s", capacity=100)
    stage.sessions["s"].cache.reserve(0, 100)  # a cache grows as steps reach positions
    assert stage.sessions["s"].cache.nbytes == stage.session_bytes(100)
    expanded = 4 * (16 + 8 + 12) * 4  # what the same positions would cost as keys and values per head
    assert stage.spec.kv_bytes_per_position(1, 2, 4) * 6 == expanded


def test_placement_counts_each_layer_and_the_span_holds_it(folders):
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.kernels.quant import span_bytes

    folder = folders[SWARM]
    spec = spec_from_file(folder / "config.json")
    assert spec.layer_bytes(4, layer=1) > 4 * spec.layer_bytes(4, layer=0)  # 16 experts + shared vs one MLP
    for start, end in ((0, 1), (1, 3), (0, 3)):
        assert load_stage(folder, start=start, end=end).weight_bytes == span_bytes(spec, start, end, 4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stacked_sessions_equal_their_solo_runs(folders, name):
    """Stacked steps mix prefills (expanded) with decodes (absorbed, their absorptions in one bmm)."""
    check_stacked_sessions(folders[name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rollback_by_pointer(folders, references, name):
    check_rollback(folders[name], references[name][0])


def test_a_quantized_span_matches_its_dequantized_reference(folders):
    """int8 MLA projections, experts and shared experts; Wkv_b, the norms and the router stay float."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.kernels.quant import Int8Linear, Quant, span_bytes

    folder, quant = folders[SWARM], Quant.parse("int8")
    spec = spec_from_file(folder / "config.json")
    stage = load_stage(folder, quant=quant)
    assert stage.weight_bytes == span_bytes(spec, 0, 3, 4, quant)
    block = stage.blocks[1]
    assert all(isinstance(m, Int8Linear) for m in (block.attn.wq_b, block.attn.wkv_a, block.mlp.shared.w_down))
    assert block.attn.wkv_b.dtype == torch.float32 and block.mlp.router.correction_bias.dtype == torch.float32
    check_against_dequantized(folder, stage)


def test_a_tensor_shard_rank_is_refused_at_start_with_one_line(folders):
    check_shard_refused(folders[SWARM], "tensor shards of deepseek_v3 are not supported: layer 0 is 'mla'")


def test_multi_token_prediction_tensors_are_accepted_and_empty_shared_experts_ignored(folders, tmp_path):
    """A published checkpoint carries its MTP module as layer L (transformers skips it too); a folder
    with n_shared_experts 0 holds [0, H] shared-expert tensors, which compute nothing."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tessera.stages.weights.folder_check import check_folder

    folder = tmp_path / "mtp"
    shutil.copytree(folders["plain-q-raw-fused"], folder)
    state = load_file(str(folder / "model.safetensors"))
    assert state["model.layers.0.mlp.shared_experts.gate_proj.weight"].shape == (0, 64)
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(folder / "model.safetensors"))
    check_folder(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(UnsupportedModel, match="model.layers.3.eh_proj.weight"):
        check_folder(folder)


@pytest.mark.parametrize("change, error, words", [
    ({"scoring_func": "softmax"}, UnsupportedModel, "scoring_func 'softmax'"),
    ({"topk_method": "group_limited_greedy"}, UnsupportedModel, "topk_method 'group_limited_greedy'"),
    ({"moe_layer_freq": 2}, UnsupportedModel, "moe_layer_freq 2"),
    ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
    ({"partial_rotary_factor": 0.5}, UnsupportedModel, "partial_rotary_factor"),
    ({"rope_parameters": {**YARN, "rope_type": "longrope"}}, UnsupportedModel, "longrope"),
    # fp8 loads block-scaled (stages/families/shipped.py); one scale per tensor does not
    ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedModel, "weight_block_size null"),
    ({"quantization_config": {"quant_method": "awq"}}, UnsupportedModel, "quant_method 'awq'"),
    ({"use_qk_norm": True}, UnsupportedModel, "'use_qk_norm'"),  # GLM's key: not one DeepSeek-V3 computes
    ({"num_local_experts": 7}, UnsupportedModel, r"num_local_experts 7 .* differs from n_routed_experts \(16\)"),
    ({"n_group": 3}, ModelFormatError, "n_group"),  # 16 experts do not split into 3 groups
    ({"topk_group": 5}, ModelFormatError, "topk_group"),
    ({"topk_group": 1, "num_experts_per_tok": 5}, ModelFormatError, "num_experts_per_tok"),  # one group of 4
    ({"routed_scaling_factor": 0}, ModelFormatError, "routed_scaling_factor"),
    ({"n_shared_experts": -1}, ModelFormatError, "n_shared_experts"),
    ({"kv_lora_rank": 0}, ModelFormatError, "kv_lora_rank"),
    ({"qk_rope_head_dim": 7}, ModelFormatError, "qk_rope_head_dim"),
    ({"rope_interleave": "yes"}, ModelFormatError, "rope_interleave"),
])
def test_what_the_engine_does_not_compute_is_refused_by_name(change, error, words):
    with pytest.raises(error, match=words) as refused:
        spec_from_config({**CONFIGS_AS_SAVED[SWARM](), **change})
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def swarm(folders):
    with local_swarm([(0, 2), (2, 3)], model=str(folders[SWARM])) as procs:
        yield procs


@pytest.mark.slow
async def test_a_two_peer_swarm_matches_transformers(swarm, folders, references):
    await check_swarm(swarm, folders[SWARM], references[SWARM][0])
