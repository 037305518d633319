"""DeepSeek-V3 (`deepseek_v3`): what only it has beyond the conformance suite (test_conformance.py's
rows, which hold it to transformers, stacked, chunked, split, rolled back, through a swarm, and its
refusals): each MLA attention path alone against transformers and the cost that picks one, the
layers read as configured, the sigmoid router against transformers' own, the latent cache that
admission counts, per-layer bytes, int8 against its dequantized reference, and MTP tensors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.catalog import spec_from_config, spec_from_file

from .conformance import PROMPT, check_against_dequantized, fed_logits
from .rows import saved_config

transformers = pytest.importorskip("transformers")

LORA, PLAIN = "deepseek_v3/lora-groups-shared-yarn", "deepseek_v3/plain-q-raw-fused"
NAMES = (LORA, PLAIN)


def logits_with_path(folder, tokens, path):
    from tessera.stages.assembly.stage import load_stage

    stage = load_stage(folder, embed=True, head=True)
    for block in stage.blocks:
        block.attn.path = path
    return fed_logits(stage, tokens)


@pytest.mark.parametrize("path", ["expanded", "absorbed"])
@pytest.mark.parametrize("name", NAMES)
def test_each_attention_path_alone_matches_transformers(family_models, name, path):
    """Every step (prefill included) through one path: float32 logits within 1e-4, greedy the same."""
    tokens, want = family_models.reference(name)
    got = logits_with_path(family_models.folder(name), tokens, path)
    worst = max(float((a - b).abs().max()) for a, b in zip(want, got))
    assert worst <= 1e-4, f"{name} {path}: max |logits diff| {worst:.3g}"
    assert [int(g[-1].argmax()) for g in got] == tokens


def test_the_cost_decides_the_path():
    """The conformance runs go through both: a prefill from 0 expands, a decode step absorbs; a long
    context's chunk absorbs once its expansion would pass the byte bound."""
    from tessera.stages.layers.mla import EXPANDED_LIMIT_BYTES, absorbs

    spec = spec_from_config(saved_config(LORA)).layers[0].attention
    assert not absorbs(spec, len(PROMPT), len(PROMPT))
    assert absorbs(spec, 1, len(PROMPT) + 1) and absorbs(spec, 4, 40)
    per_position = spec.num_heads * (2 * spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim) * 4
    long = EXPANDED_LIMIT_BYTES // per_position + 1
    assert absorbs(spec, long, long) and not absorbs(spec, long - 1, long - 1)


def test_the_layers_are_read_as_configured(family_models):
    first = spec_from_file(family_models.folder(LORA) / "config.json")
    assert [layer.mlp.kind for layer in first.layers] == ["dense", "moe", "moe"]
    attention, mlp = first.layers[1].attention, first.layers[1].mlp
    assert (attention.kind, attention.q_lora_rank, attention.rope_interleave, attention.rope.kind) == ("mla", 24, True, "yarn")
    assert (mlp.num_experts, mlp.shared_width, mlp.router.kind) == (16, 32, "sigmoid_group_topk")
    assert (mlp.router.num_groups, mlp.router.topk_groups, mlp.router.top_k, mlp.router.scale) == (4, 2, 3, 2.5)
    assert mlp.router.renormalize
    plain = spec_from_file(family_models.folder(PLAIN) / "config.json")
    assert [layer.mlp.kind for layer in plain.layers] == ["moe"] * 3
    assert plain.layers[0].attention.q_lora_rank is None and plain.layers[0].attention.bias
    assert plain.layers[0].mlp.shared_width == 0 and not plain.layers[0].mlp.router.renormalize
    assert plain.mtp_layers == 1  # transformers' default: such tensors would be accepted and not read


def test_the_router_is_transformers_and_its_groups_and_bias_matter(family_models):
    """The sigmoid router's weights and picks equal DeepseekV3TopkRouter's on the saved weights; the
    group limit and the correction bias each change some token's picks (so the runs above test them)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.layers.routers import SigmoidGroupTopK

    config = transformers.DeepseekV3Config.from_pretrained(family_models.folder(LORA))
    router = load_stage(family_models.folder(LORA), start=1, end=2).blocks[0].mlp.router
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


def test_the_latent_cache_is_what_admission_counts(family_models):
    """An MLA layer keeps C + Dr values a position (16 + 8), whatever its heads: what a session's
    cache allocates, what session_bytes budgets, and what placement counts per position."""
    from tessera.stages.assembly.stage import load_stage

    stage = load_stage(family_models.folder(LORA), start=1, end=3)
    assert stage.spec.kv_bytes_per_position(1, 3, 4) == 2 * (16 + 8) * 4
    assert stage.session_bytes(100) == 100 * 2 * (16 + 8) * 4
    stage.open("s", capacity=100)
    stage.sessions["s"].cache.reserve(0, 100)  # a cache grows as steps reach positions
    assert stage.sessions["s"].cache.nbytes == stage.session_bytes(100)
    expanded = 4 * (16 + 8 + 12) * 4  # what the same positions would cost as keys and values per head
    assert stage.spec.kv_bytes_per_position(1, 2, 4) * 6 == expanded


def test_placement_counts_each_layer_and_the_span_holds_it(family_models):
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.kernels.quant import span_bytes

    folder = family_models.folder(LORA)
    spec = spec_from_file(folder / "config.json")
    assert spec.layer_bytes(4, layer=1) > 4 * spec.layer_bytes(4, layer=0)  # 16 experts + shared vs one MLP
    for start, end in ((0, 1), (1, 3), (0, 3)):
        assert load_stage(folder, start=start, end=end).weight_bytes == span_bytes(spec, start, end, 4)


def test_a_quantized_span_matches_its_dequantized_reference(family_models):
    """int8 MLA projections, experts and shared experts; Wkv_b, the norms and the router stay float."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.kernels.quant import Int8Linear, Quant, span_bytes

    folder, quant = family_models.folder(LORA), Quant.parse("int8")
    spec = spec_from_file(folder / "config.json")
    stage = load_stage(folder, quant=quant)
    assert stage.weight_bytes == span_bytes(spec, 0, 3, 4, quant)
    block = stage.blocks[1]
    assert all(isinstance(m, Int8Linear) for m in (block.attn.wq_b, block.attn.wkv_a, block.mlp.shared.w_down))
    assert block.attn.wkv_b.dtype == torch.float32 and block.mlp.router.correction_bias.dtype == torch.float32
    check_against_dequantized(folder, stage)


def test_multi_token_prediction_tensors_are_accepted_and_empty_shared_experts_ignored(family_models, tmp_path):
    """A published checkpoint carries its MTP module as layer L (transformers skips it too); a folder
    with n_shared_experts 0 holds [0, H] shared-expert tensors, which compute nothing."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tessera.stages.weights.folder_check import check_folder

    folder = tmp_path / "mtp"
    shutil.copytree(family_models.folder(PLAIN), folder)
    state = load_file(str(folder / "model.safetensors"))
    assert state["model.layers.0.mlp.shared_experts.gate_proj.weight"].shape == (0, 64)
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(folder / "model.safetensors"))
    check_folder(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(UnsupportedModel, match="model.layers.3.eh_proj.weight"):
        check_folder(folder)
