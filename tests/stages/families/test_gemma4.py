"""Gemma 4 (`gemma4`): what only it has beyond the conformance suite (test_conformance.py's rows, which
hold it to transformers, stacked, chunked, split, rolled back, through a swarm): the layers read as
configured, the published checkpoints' configs (their sizes, where spans may start, what crosses each
hop), a multimodal checkpoint whose text model runs as transformers runs it, the per-layer inputs each
stage takes and hands on, the KV-shared layers' one store, and the global shapes read from either
form a config gives them in."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.stages.assembly.stage import load_stage
from tessera.stages.errors import SpanError, UnsupportedModel
from tessera.stages.families.catalog import spec_from_config, spec_from_file, to_config
from tessera.stages.families.models.gemma4 import PUBLISHED
from tessera.stages.weights.folder_check import check_folder

from .conformance import PROMPT, build, check_matches_transformers, reference_run
from .rows import GEMMA4, GLOBAL, SLIDE, VOCAB, saved_config

transformers = pytest.importorskip("transformers")

SHARED, MOE = "gemma4/ple-kv-shared", "gemma4/moe-k-eq-v"


def test_the_layers_are_read_as_configured(family_models):
    spec = spec_from_file(family_models.folder(SHARED) / "config.json")
    assert [layer.attention.window for layer in spec.layers] == [8, None, 8, 8, None]
    assert [layer.attention.head_dim for layer in spec.layers] == [16, 32, 16, 16, 32]
    assert [layer.attention.kv_source for layer in spec.layers] == [None, None, None, 2, 1]  # the last two: shared
    assert [layer.mlp.width for layer in spec.layers] == [96, 96, 96, 192, 192]  # double-wide where shared
    assert {layer.per_layer_input for layer in spec.layers} == {8} and spec.per_layer_vocab == VOCAB
    assert spec.span_starts == (0, 1, 5)  # layers 2-4 stay together: 3 and 4 read 2's and 1's keys
    assert [spec.hop_width(i) for i in (0, 1, 5)] == [64 + 5 * 8, 64 + 4 * 8, 64]
    assert spec.embed_scale == 8.0 and spec.logit_softcap == 30.0 and spec.tie_embeddings
    first, full = spec.layers[0], spec.layers[1].attention
    assert first.sandwich and first.scalar and first.attention.scale == 1.0 and first.attention.v_norm
    assert full.rope.kind == "proportional" and full.rope.param("partial_rotary_factor") == 0.25
    moe = spec_from_file(family_models.folder(MOE) / "config.json")
    mlp, full = moe.layers[0].mlp, moe.layers[2].attention
    assert (mlp.kind, mlp.width, mlp.shared_width, mlp.num_experts, mlp.router.kind) == \
        ("dense_and_moe", 32, 96, 8, "normed_softmax_topk")
    assert full.k_eq_v and full.num_kv_heads == 1 and full.head_dim == 32 and not moe.layers[0].attention.k_eq_v
    assert full.rope.param("factor") == 2.0 and moe.per_layer_width == 0 and not moe.tie_embeddings


def test_the_published_checkpoints_read_as_published():
    """google/gemma-4-*: their parameters (text model), where a span may start (E2B: the 20 KV-shared layers read
    layers 13 and 14, so layers 14-34 stay on one peer), what a hop carries per token (E2B's per-layer inputs)."""
    specs = {name: spec_from_config(config) for name, config in PUBLISHED.items()}
    assert {name: round(spec.param_count / 1e9, 1) for name, spec in specs.items()} == \
        {"gemma-4-e2b": 4.6, "gemma-4-e4b": 7.5, "gemma-4-26b-a4b": 25.2, "gemma-4-31b": 30.7}
    e2b = specs["gemma-4-e2b"]
    assert e2b.prefix == "model.language_model." and e2b.eos_token_ids == (1, 106)
    assert e2b.span_starts == (*range(14), 35)
    assert (e2b.hop_width(0), e2b.hop_width(13), e2b.hop_width(35)) == (1536 + 35 * 256, 1536 + 22 * 256, 1536)
    assert {e2b.layers[i].attention.kv_source for i in range(15, 35)} == {13, 14}
    assert e2b.kv_bytes_per_position(0, 35, 2) == e2b.kv_bytes_per_position(0, 15, 2)  # shared layers cache nothing
    with pytest.raises(SpanError, match="layer 15 attends over the keys and values of layer 13"):
        e2b.check_span_start(14, 35)
    moe = specs["gemma-4-26b-a4b"]
    assert moe.hop_width(0) == 2816 and moe.layers[5].attention.k_eq_v and moe.layers[5].attention.num_kv_heads == 2
    assert moe.layers[0].mlp.num_experts == 128 and len(moe.span_starts) == 31
    for spec in specs.values():
        assert spec_from_config(to_config(spec)) == spec


def test_the_global_shapes_read_alike_from_either_form():
    """transformers writes a saved config's global head dims as per_layer_config; the published ones name
    global_head_dim (and num_global_key_value_heads): the same spec."""
    saved = saved_config(MOE)
    assert saved["per_layer_config"] == {"2": {"head_dim": 32, "num_key_value_heads": 1}}
    published = {k: v for k, v in saved.items() if k != "per_layer_config"}
    assert spec_from_config({**published, "global_head_dim": 32, "num_global_key_value_heads": 1}) == \
        spec_from_config(saved)
    with pytest.raises(UnsupportedModel, match="global_head_dim 64 .* per_layer_config gives the global layers 32"):
        spec_from_config({**saved, "global_head_dim": 64})


def test_each_stage_takes_the_per_layer_inputs_of_its_layers_and_hands_on_the_rest(family_models):
    folder = family_models.folder(SHARED)
    head, first = load_stage(folder, start=0, end=0, embed=True, head=True), load_stage(folder, start=0, end=1)
    hop = head.embed(PROMPT)
    assert hop.shape == (len(PROMPT), 64 + 5 * 8)
    first.open("p", capacity=32)
    out = first.forward("p", hop, 0)
    assert out.shape == (len(PROMPT), 64 + 4 * 8) and torch.equal(out[:, 64:], hop[:, 64 + 8 :])
    with pytest.raises(SpanError, match=r"expected \[T, 104\]"):
        first.forward("p", hop[:, :64], 0)
    with pytest.raises(SpanError, match="cannot start at layer 3 .* layer 3 attends over the keys and values of layer 2"):
        load_stage(folder, start=3)


def test_a_kv_shared_layer_keeps_no_store_of_its_own(family_models):
    stage = load_stage(family_models.folder(SHARED), start=1)
    stage.open("s", capacity=16)
    stores = stage.sessions["s"].cache.layers
    assert stores[2] is stores[1] and stores[3] is stores[0]  # layers 3 and 4 read layers 2's and 1's
    stage.forward("s", torch.randn(5, stage.spec.hop_width(1)), 0)
    assert stage.sessions["s"].cache.nbytes == stores[0].nbytes + stores[1].nbytes > 0  # four layers, two stores
    assert stage.session_bytes(256) == sum(stage.spec.layers[i].cache.bytes(256, 4) for i in (1, 2))


def test_a_multimodal_checkpoint_runs_its_text_model_as_transformers_does(tmp_path):
    """A Gemma4ForConditionalGeneration saved whole (a vision tower, the text model under model.language_model.):
    its towers accepted and not run, its text model the reference's."""
    text = dict(GEMMA4, num_hidden_layers=3, layer_types=[SLIDE, SLIDE, GLOBAL], hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=VOCAB)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                       eos_token_id=[2, 3])
    folder = build(tmp_path, "gemma4-multimodal", config, seed=122)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["Gemma4ForConditionalGeneration"] and "vision_config" in saved
    check_folder(folder)
    spec = spec_from_file(folder / "config.json")
    assert spec.family == "gemma4" and spec.prefix == "model.language_model." and spec.eos_token_ids == (2, 3)
    check_matches_transformers(folder, reference_run(folder))


def test_its_decode_runs_eagerly_and_says_why(family_models):
    """No compiled decode step carries per-layer inputs, reads another layer's store, or softcaps: a Gemma 4
    stage asked to compile decodes eagerly, with the reason, and its logits are the eager ones."""
    from tessera.stages.engine.compiled.build import compile_decode

    for name, why in ((SHARED, "per-layer inputs"), (MOE, "softcapped logits")):
        stage = load_stage(family_models.folder(name), embed=True, head=True)
        plan = compile_decode(stage, "inductor")
        assert plan.backend is None and why in plan.reason and stage.decode is None


@pytest.mark.parametrize("name", [SHARED, MOE, "published"])
def test_any_value_in_any_key_is_read_or_refused_by_one_typed_error(name):
    from .conformance import check_any_value_is_read_or_refused

    check_any_value_is_read_or_refused(PUBLISHED["gemma-4-e2b"] if name == "published" else saved_config(name))
