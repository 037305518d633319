"""MiMo-V2-Flash (`mimo_v2_flash`): what only it has beyond the conformance suite (test_conformance.py's
rows, which hold it to transformers, stacked, chunked, split, rolled back, through a swarm): the
layers read as configured, the published config's own keys read as what transformers computes, and a
folder holding multi-token-prediction blocks accepted, its blocks not run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.stages.assembly.stage import load_stage
from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.catalog import spec_from_config, spec_from_file
from tessera.stages.families.models.mimo_v2_flash import MIMO_V2_FLASH
from tessera.stages.weights.folder_check import check_folder

from .conformance import PROMPT
from .rows import saved_config

transformers = pytest.importorskip("transformers")

PUBLISHED, DEFAULT = "mimo_v2_flash/published", "mimo_v2_flash/default-pattern-fused"


def test_the_layers_are_read_as_configured(family_models):
    spec = spec_from_file(family_models.folder(PUBLISHED) / "config.json")
    full, sliding = spec.layers[0].attention, spec.layers[1].attention
    assert [layer.attention.window for layer in spec.layers] == [None, 8, 8, None]
    assert (full.num_kv_heads, sliding.num_kv_heads, full.head_dim, full.value_dim) == (2, 4, 16, 12)
    assert not full.sinks and sliding.sinks and full.value_scale == sliding.value_scale == 0.707
    assert (full.rope.theta, sliding.rope.theta, full.rope_dim, sliding.rope_dim) == (5e6, 1e4, 8, 8)
    assert [layer.mlp.kind for layer in spec.layers] == ["dense", "moe", "moe", "moe"]
    router = spec.layers[1].mlp.router
    assert (router.kind, router.num_groups, router.topk_groups, router.scale) == ("sigmoid_group_topk", 2, 1, 1.5)
    # the default pattern: global at 0 and 5; the window from sliding_window_size (the query's own included);
    # an explicit null value scale is 1 (transformers' `if not None else 1.0`)
    other = spec_from_file(family_models.folder(DEFAULT) / "config.json")
    assert [layer.attention.window for layer in other.layers] == [None, 6, 6, 6, 6, None]
    assert other.layers[0].attention.value_scale == 1.0 and other.layers[0].attention.qkv_bias


def test_the_published_config_reads_as_transformers_computes_it():
    """XiaomiMiMo/MiMo-V2-Flash's config.json, its own keys included: 309B parameters, 48 layers of
    which 9 global (0, 5, 11, ...), windows of 129 (128 + the query), 3 MTP blocks read and not run."""
    spec = spec_from_config(MIMO_V2_FLASH)
    assert round(spec.param_count / 1e9) == 309
    assert [i for i, layer in enumerate(spec.layers) if layer.attention.window is None] == \
        [0, 5, 11, 17, 23, 29, 35, 41, 47]
    assert {layer.attention.window for layer in spec.layers} == {None, 129}
    assert spec.mtp_layers == 3 and spec.layers[0].mlp.kind == "dense" and spec.layers[1].mlp.num_experts == 256
    config = transformers.MiMoV2FlashConfig(**{k: v for k, v in MIMO_V2_FLASH.items() if k != "architectures"})
    assert config.sliding_window == 129 and config.layer_types[5] == "full_attention"
    with pytest.raises(UnsupportedModel, match="swa_rope_theta 1000000.0 .* transformers computes 10000.0"):
        spec_from_config({**MIMO_V2_FLASH, "swa_rope_theta": 1e6})


def test_a_folder_with_mtp_blocks_loads_and_does_not_run_them(family_models, tmp_path):
    """`model.mtp.layers.{i}.` tensors (the published checkpoint's three MTP blocks) are accepted where the
    config counts them, read by nobody; the model computes what it computes without them. Where the
    config counts none, they are a tensor the model does not have: refused by name."""
    folder = tmp_path / "with-mtp"
    shutil.copytree(family_models.folder(PUBLISHED), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.mtp.layers.0.eh_proj.weight"] = torch.randn(64, 128)
    tensors["model.mtp.layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    check_folder(folder)
    ours = load_stage(folder, embed=True, head=True)
    plain = load_stage(family_models.folder(PUBLISHED), embed=True, head=True)
    for stage in (ours, plain):
        stage.open("m", capacity=32)
    assert torch.equal(ours.logits(ours.forward("m", ours.embed(PROMPT), 0)),
                       plain.logits(plain.forward("m", plain.embed(PROMPT), 0)))
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(UnsupportedModel, match="tensor 'model.mtp.layers.0.eh_proj.weight' is not part"):
        check_folder(folder)


def test_the_published_keys_change_nothing_when_they_agree():
    """A tiny config carrying the published config's own keys, each saying what transformers computes, reads
    as the config without them."""
    config = saved_config(PUBLISHED)
    own = {"hybrid_layer_pattern": [0, 1, 1, 0], "moe_layer_freq": [0, 1, 1, 1], "swa_num_attention_heads": 4,
           "swa_num_key_value_heads": 4, "swa_head_dim": 16, "swa_v_head_dim": 12, "rope_theta": 5e6,
           "swa_rope_theta": 1e4, "partial_rotary_factor": 0.5, "add_swa_attention_sink_bias": True,
           "add_full_attention_sink_bias": False, "layernorm_epsilon": config["rms_norm_eps"],
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_shared_experts": None,
           "sliding_window_size": 7, "attention_chunk_size": 7}
    assert spec_from_config({**config, **own}) == spec_from_config(config)


@pytest.mark.parametrize("name", [PUBLISHED, DEFAULT, "published"])
def test_any_value_in_any_key_is_read_or_refused_by_one_typed_error(name):
    from .conformance import check_any_value_is_read_or_refused

    check_any_value_is_read_or_refused(MIMO_V2_FLASH if name == "published" else saved_config(name))
