"""GLM-4.5 MoE (`glm4_moe`): partial rotary (half the head by default, a quarter with YaRN), qk-norm,
q/k/v bias, first-k dense layers, the sigmoid router (groups, correction bias, renormalised or
not, scaled), shared experts on and off; experts as published and fused. Against transformers,
stacked, rolled back, through a swarm; unknown keys and values refused by name."""

from __future__ import annotations

import json

import pytest

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import spec_from_config, spec_from_file, to_config

from ...swarm_helpers import local_swarm
from .conformance import (
    SHAPE, build, check_matches_transformers, check_rollback, check_stacked_sessions, check_swarm, reference_run, check_shard_refused,
)

transformers = pytest.importorskip("transformers")

MOE = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8)
CONFIGS = {
    # qk-norm, biased q/k/v, RoPE on half of each head (the default), a dense first layer, top-2 of
    # the best of 2 groups, renormalised and scaled, one shared expert
    "qknorm-bias-groups-shared": (dict(**MOE, use_qk_norm=True, attention_bias=True, first_k_dense_replace=1,
                                       n_group=2, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True,
                                       routed_scaling_factor=1.5, n_shared_experts=1), False),
    # no qk-norm, no bias, YaRN on a quarter of each head, every layer sparse, raw top-3 weights, no
    # shared experts, the experts saved fused
    "quarter-yarn-raw-fused": (dict(**MOE, first_k_dense_replace=0, num_experts_per_tok=3, norm_topk_prob=False,
                                    n_shared_experts=0, rope_parameters={
                                        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 256, "partial_rotary_factor": 0.25}),
                               True),
}
SWARM = "qknorm-bias-groups-shared"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4-moe")
    return {name: build(root, name, transformers.Glm4MoeConfig(**{**SHAPE, **extra}), seed=50 + i, fused=fused)
            for i, (name, (extra, fused)) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def references(folders):
    return {name: reference_run(folder) for name, folder in folders.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(folders, references, name):
    check_matches_transformers(folders[name], references[name])


def test_the_layers_are_read_as_configured(folders):
    first = spec_from_file(folders[SWARM] / "config.json")
    assert [layer.mlp.kind for layer in first.layers] == ["dense", "moe", "moe"]
    attention, mlp = first.layers[1].attention, first.layers[1].mlp
    assert (attention.qk_norm, attention.qkv_bias, attention.o_bias, attention.rope_dim) == (True, True, False, 8)
    assert (mlp.router.kind, mlp.router.num_groups, mlp.router.topk_groups, mlp.router.scale) == (
        "sigmoid_group_topk", 2, 1, 1.5)
    assert mlp.shared_width == 32 and mlp.router.renormalize
    quarter = spec_from_file(folders["quarter-yarn-raw-fused"] / "config.json")
    assert [layer.mlp.kind for layer in quarter.layers] == ["moe"] * 3
    attention = quarter.layers[0].attention
    assert (attention.rope.kind, attention.rope_dim, attention.qk_norm) == ("yarn", 4, False)
    assert quarter.layers[0].mlp.shared_width == 0 and not quarter.layers[0].mlp.router.renormalize
    for spec in (first, quarter):
        assert spec_from_config(to_config(spec)) == spec


def test_the_partial_rotary_factor_is_read_where_transformers_reads_it(folders):
    """The RoPE block's factor wins over the top-level key; with neither, GLM's 0.5."""
    config = json.loads((folders[SWARM] / "config.json").read_text())
    block = {k: v for k, v in config["rope_parameters"].items() if k != "partial_rotary_factor"}
    for change, turned in [
        ({"rope_parameters": block}, 8),
        ({"rope_parameters": block, "partial_rotary_factor": 0.25}, 4),
        ({"rope_parameters": {**block, "partial_rotary_factor": 1.0}, "partial_rotary_factor": 0.25}, 16),
    ]:
        given = json.loads(json.dumps({**config, **change}))  # transformers fills the block it is given in place
        theirs = transformers.Glm4MoeConfig(**{k: v for k, v in given.items() if k != "architectures"})
        assert int(16 * theirs.rope_parameters["partial_rotary_factor"]) == turned
        assert spec_from_config({**config, **change}).layers[0].attention.rope_dim == turned


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stacked_sessions_equal_their_solo_runs(folders, name):
    check_stacked_sessions(folders[name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rollback_by_pointer(folders, references, name):
    check_rollback(folders[name], references[name][0])


def test_a_tensor_shard_rank_is_refused_at_start_with_one_line(folders):
    check_shard_refused(folders[SWARM], "tensor shards of glm4_moe are not supported: layer 0 turns")


@pytest.mark.parametrize("change, error, words", [
    ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
    ({"partial_rotary_factor": 0.35}, UnsupportedModel, "partial_rotary_factor 0.35 .* turns 5 dims of 16"),
    ({"partial_rotary_factor": 1.5}, ModelFormatError, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, UnsupportedModel, "dynamic"),
    ({"scoring_func": "sigmoid"}, UnsupportedModel, "'scoring_func'"),  # DeepSeek's key: GLM's config has none
    ({"q_lora_rank": 16}, UnsupportedModel, "'q_lora_rank'"),
    ({"n_group": 3}, ModelFormatError, "n_group"),
    ({"use_qk_norm": 1}, ModelFormatError, "use_qk_norm"),
    # fp8 loads block-scaled (stages/families/shipped.py); one scale per tensor does not
    ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedModel, "weight_block_size null"),
    ({"quantization_config": {"quant_method": "awq"}}, UnsupportedModel, "quant_method 'awq'"),
])
def test_what_the_engine_does_not_compute_is_refused_by_name(folders, change, error, words):
    config = json.loads((folders[SWARM] / "config.json").read_text())
    if "partial_rotary_factor" in change:  # the top-level key counts only when the RoPE block has none
        config["rope_parameters"].pop("partial_rotary_factor")
    with pytest.raises(error, match=words) as refused:
        spec_from_config({**config, **change})
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def swarm(folders):
    with local_swarm([(0, 2), (2, 3)], model=str(folders[SWARM])) as procs:
        yield procs


@pytest.mark.slow
async def test_a_two_peer_swarm_matches_transformers(swarm, folders, references):
    await check_swarm(swarm, folders[SWARM], references[SWARM][0])
