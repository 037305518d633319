"""GLM-4.5 MoE (`glm4_moe`): what only it has beyond the conformance suite (test_conformance.py's rows,
which hold it to transformers, stacked, chunked, split, rolled back, through a swarm, and its
refusals): the layers read as configured, and the partial rotary factor read where transformers
reads it."""

from __future__ import annotations

import json

import pytest

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import spec_from_config, spec_from_file

transformers = pytest.importorskip("transformers")

GROUPS, QUARTER = "glm4_moe/qknorm-bias-groups-shared", "glm4_moe/quarter-yarn-raw-fused"


def test_the_layers_are_read_as_configured(family_models):
    first = spec_from_file(family_models.folder(GROUPS) / "config.json")
    assert [layer.mlp.kind for layer in first.layers] == ["dense", "moe", "moe"]
    attention, mlp = first.layers[1].attention, first.layers[1].mlp
    assert (attention.qk_norm, attention.qkv_bias, attention.o_bias, attention.rope_dim) == (True, True, False, 8)
    assert (mlp.router.kind, mlp.router.num_groups, mlp.router.topk_groups, mlp.router.scale) == (
        "sigmoid_group_topk", 2, 1, 1.5)
    assert mlp.shared_width == 32 and mlp.router.renormalize
    quarter = spec_from_file(family_models.folder(QUARTER) / "config.json")
    assert [layer.mlp.kind for layer in quarter.layers] == ["moe"] * 3
    attention = quarter.layers[0].attention
    assert (attention.rope.kind, attention.rope_dim, attention.qk_norm) == ("yarn", 4, False)
    assert quarter.layers[0].mlp.shared_width == 0 and not quarter.layers[0].mlp.router.renormalize


def test_the_partial_rotary_factor_is_read_where_transformers_reads_it(family_models):
    """The RoPE block's factor wins over the top-level key; with neither, GLM's 0.5."""
    config = json.loads((family_models.folder(GROUPS) / "config.json").read_text())
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


@pytest.mark.parametrize("change, error, words", [
    ({"partial_rotary_factor": 0.35}, UnsupportedModel, "partial_rotary_factor 0.35 .* turns 5 dims of 16"),
    ({"partial_rotary_factor": 1.5}, ModelFormatError, "partial_rotary_factor"),
])
def test_a_top_level_rotary_factor_it_cannot_turn_is_refused_by_name(family_models, change, error, words):
    """The top-level key counts only when the RoPE block has none (above): without it, these are read."""
    config = json.loads((family_models.folder(GROUPS) / "config.json").read_text())
    config["rope_parameters"].pop("partial_rotary_factor")
    with pytest.raises(error, match=words) as refused:
        spec_from_config({**config, **change})
    assert "\n" not in str(refused.value)
