"""What only the hybrids have: Qwen3-Next (`qwen3_next`), Qwen3.5 (`qwen3_5`), Qwen3.5-MoE (`qwen3_5_moe`).

The conformance suite (test_conformance.py, their rows in rows.py) holds each of them to
transformers, stacked and chunked sessions, a split, rollback (speculative blocks cut short), the
refusals and a real swarm, and (as every family with a recurrent state) a whole, a chunked and a
replayed prefill against the same reference (a replacement's recurrent states equal the
uninterrupted ones), going back into a block equal to never having gone past it, and further back
refused. Here: the layers as configured; a linear layer's fixed state (what admission charges, at
any length); Qwen3.5 saved as transformers saves the multimodal model (a
vision tower, the text model under model.language_model.), whose text model runs; the compiled
decode step; an int8 span; and any value in any key read or refused by one typed error.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tessera.stages.assembly.stage import load_stage
from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import spec_from_config, spec_from_file, to_config
from tessera.stages.layers.state import RecurrentState

from .conformance import (
    build, check_any_value_is_read_or_refused, check_compiled_decode, check_matches_transformers, reference_run,
)
from .rows import HYBRID, saved_config

transformers = pytest.importorskip("transformers")

ROWS = {"qwen3_next": "qwen3_next/dense-first-moe", "qwen3_5": "qwen3_5/dense",
        "qwen3_5_moe": "qwen3_5_moe/full-second-fused"}
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)


def build_multimodal(root, name, config, *, seed):
    """`build` for a multimodal config: transformers' ...ForConditionalGeneration, saved whole."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Qwen3_5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.2 * torch.randn_like(p))
    folder = root / name
    model.save_pretrained(folder)
    template = build(root, name + "-tokenizer", transformers.Qwen3_5TextConfig(**dict(HYBRID, intermediate_size=96)),
                     seed=seed)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / file).write_bytes((template / file).read_bytes())
    return folder


@pytest.fixture(scope="module")
def folders(family_models, tmp_path_factory):
    """Each family's suite row, and Qwen3.5 saved as the multimodal model ("qwen3_5/multimodal")."""
    out = {family: family_models.folder(row) for family, row in ROWS.items()}
    config = transformers.Qwen3_5Config(text_config=dict(HYBRID, intermediate_size=96), vision_config=VISION)
    out["qwen3_5/multimodal"] = build_multimodal(tmp_path_factory.mktemp("qwen3_5-multimodal"), "qwen3_5-mm", config,
                                                 seed=63)
    return out


@pytest.fixture(scope="module")
def references(folders, family_models):
    out = {family: family_models.reference(row) for family, row in ROWS.items()}
    out["qwen3_5/multimodal"] = reference_run(folders["qwen3_5/multimodal"])
    return out


def test_a_multimodal_checkpoint_runs_its_text_model_as_transformers_does(folders, references):
    check_matches_transformers(folders["qwen3_5/multimodal"], references["qwen3_5/multimodal"])


def test_the_layers_are_read_as_configured(folders):
    spec = spec_from_file(folders["qwen3_next"] / "config.json")
    assert [layer.attention.kind for layer in spec.layers] == ["gated_deltanet"] * 3 + ["gqa"]
    assert [layer.mlp.kind for layer in spec.layers] == ["dense", "moe", "moe", "moe"]
    assert spec.layers[1].mlp.shared_gate and spec.layers[1].mlp.shared_width == 48
    assert spec.layers[0].attention.layout == "grouped" and spec.norm_offset == 1.0
    full = spec.layers[3].attention
    assert full.output_gate and full.qk_norm and full.rope_dim == 4  # partial rotary: 0.25 of 16
    multimodal = spec_from_file(folders["qwen3_5/multimodal"] / "config.json")
    assert multimodal.family == "qwen3_5" and multimodal.prefix == "model.language_model."
    assert {layer.mlp.kind for layer in multimodal.layers} == {"dense"}
    assert multimodal.layers[0].attention.layout == "split"
    moe = spec_from_file(folders["qwen3_5_moe"] / "config.json")
    assert [layer.attention.kind for layer in moe.layers] == ["gated_deltanet", "gqa", "gated_deltanet", "gated_deltanet"]
    assert {layer.mlp.router.renormalize for layer in moe.layers} == {True}


def test_a_linear_layer_holds_a_fixed_state_whatever_the_context(folders):
    """Admission prices a session as fixed + per position x positions, per layer: a linear layer's
    is all fixed, and a store holds no more than its spec says, at any length."""
    spec = spec_from_file(folders["qwen3_next"] / "config.json")
    linear, full = spec.layers[0].cache, spec.layers[3].cache
    assert linear.kind == "recurrent" and linear.bytes_per_position(4) == 0
    assert linear.bytes(16, 4) == linear.bytes(1 << 20, 4) == linear.fixed_bytes(4) > 0
    assert spec.state_bytes(0, 3, 1 << 20) == spec.state_bytes(0, 3, 1)  # a span of linear layers
    assert spec.state_bytes(0, 4, 1000) == spec.state_fixed_bytes(0, 4) + 1000 * full.bytes_per_position(4)
    assert spec.context_tokens(0, 3, linear.fixed_bytes(4) * 3) == spec.max_position
    assert spec.context_tokens(0, 3, linear.fixed_bytes(4) * 3 - 1) == 0
    budget = spec.state_fixed_bytes(0, 4) + 100 * full.bytes_per_position(4)
    assert spec.context_tokens(0, 4, budget) == 100
    stage = load_stage(folders["qwen3_next"], embed=True)
    stage.open("s", capacity=64)
    store = stage.sessions["s"].cache.layers[0]
    assert isinstance(store, RecurrentState)
    stage.forward("s", stage.embed(list(range(5, 25))), 0)  # a prefill of 20, then blocks of 4 and single tokens
    for n in (4, 1, 4, 4, 1, 1, 4):
        stage.forward("s", stage.embed(list(range(5, 5 + n))), stage.position("s"))
        assert store.nbytes <= linear.fixed_bytes(4)
    assert stage.session_bytes(64, 0, 3) == stage.session_bytes(4096, 0, 3) == 3 * linear.fixed_bytes(4)


def saved_multimodal() -> dict:
    """Qwen3.5's multimodal config as transformers writes it."""
    config = transformers.Qwen3_5Config(text_config=dict(HYBRID, intermediate_size=96), vision_config=VISION)
    return {**json.loads(json.dumps(config.to_dict())), "architectures": ["Qwen3_5ForConditionalGeneration"]}


def saved(family: str) -> dict:
    return saved_multimodal() if family == "qwen3_5/multimodal" else saved_config(ROWS[family])


def with_text(config: dict, **change) -> dict:
    """`config` with `change` applied where its text model's keys lie."""
    if "text_config" in config:
        return {**config, "text_config": {**config["text_config"], **change}}
    return {**config, **change}


def test_a_multimodal_config_reads_its_text_model_and_refuses_what_it_cannot():
    config = saved_multimodal()
    spec = spec_from_config(config)
    assert spec.family == "qwen3_5" and spec.prefix == "model.language_model."
    assert spec_from_config(to_config(spec)) == spec  # what synth writes for it: multimodal too
    assert spec_from_config(saved_config(ROWS["qwen3_5"])) == replace(spec, prefix="model.")  # the text-only form
    for change, words in (({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                          ({"attn_output_gate": False}, "attn_output_gate False"),
                          ({"linear_conv_bias": True}, "'linear_conv_bias'")):
        with pytest.raises(UnsupportedModel, match=words):  # the text model's keys, read where they lie
            spec_from_config(with_text(config, **change))
    with pytest.raises(UnsupportedModel, match="'speech_config'"):
        spec_from_config({**config, "speech_config": {}})
    with pytest.raises(UnsupportedModel, match="tie_word_embeddings"):
        spec_from_config({**config, "tie_word_embeddings": True})
    with pytest.raises(UnsupportedModel, match="ship quantized"):
        spec_from_config({**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    with pytest.raises(ModelFormatError, match="text_config"):
        spec_from_config({**config, "text_config": [1]})
    both = {**with_text(config, bos_token_id=1, eos_token_id=2), "bos_token_id": 1, "eos_token_id": [2, 3]}
    assert (spec_from_config(both).bos_token_id, spec_from_config(both).eos_token_ids) == (1, (2,))  # the text's
    top_only = {**with_text(config, eos_token_id=None), "eos_token_id": [2, 3]}
    assert spec_from_config(top_only).eos_token_ids == (2, 3)  # the top level's, where the text says none
    mrope = with_text(config, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                                               "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    assert spec_from_config(mrope) == spec_from_config(config)  # text positions: M-RoPE is RoPE


def test_the_compiled_decode_step_runs_full_attention_compiled_and_linear_layers_eagerly(folders, references):
    """Under `--compile inductor` the gated full-attention layers and the head decode compiled; the
    Gated DeltaNet layers decode eagerly inside the compiled step (no compiled form for a recurrent
    state yet), said once per layer kind; logits are transformers' to 1e-4 and tokens identical."""
    from tessera.stages.engine.compiled.build import compile_decode
    from tessera.stages.engine.compiled.inductor import HEAD

    folder = folders["qwen3_next"]
    stage, said = load_stage(folder, embed=True, head=True), []
    compile_decode(stage, "inductor", say=said.append, buckets=(1,))
    runner = stage.decode
    linear = {kind for kind in stage.spec.layers if kind.attention.kind == "gated_deltanet"}
    assert set(runner.eager) == linear and runner.compiled == set(stage.spec.layers) - linear | {HEAD}, said
    assert all("gated_deltanet attention" in why for why in runner.eager.values())
    check_compiled_decode(stage, references["qwen3_next"])


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_an_int8_span_matches_its_dequantized_reference_and_holds_what_placement_counts(folders, name):
    """The in- and out-projections of the linear layers are stored as integers like any matrix; the
    convolution, the decays and the norms stay float. Against its own dequantized float32 blocks, only
    float32 rounding differs (the int8 product scales its output, the reference its weight), which the
    recurrence carries on: within the recurrent rows' bound (conformance.RECURRENT_STACKED_RTOL,
    relative: 9e-4 of logits up to ~8 measured on the Qwen3.5-MoE row), tokens identical."""
    from tessera.stages.kernels.quant import Int8Linear, Quant, span_bytes

    from .conformance import RECURRENT_STACKED_RTOL, check_against_dequantized

    folder, quant = folders[name], Quant.parse("int8")
    stage = load_stage(folder, quant=quant)
    assert stage.weight_bytes == span_bytes(stage.spec, 0, 4, 4, quant)
    assert isinstance(stage.blocks[0].attn.w_in, Int8Linear) and stage.blocks[0].attn.conv.dtype == torch.float32
    check_against_dequantized(folder, stage, rtol=RECURRENT_STACKED_RTOL)


@pytest.mark.parametrize("name", [*sorted(ROWS), "qwen3_5/multimodal"])
def test_any_value_in_any_key_is_read_or_refused_by_one_typed_error(name):
    """Keys overwritten at random by JSON values (the text model's keys, in a multimodal config):
    a spec every layer of which builds, or ModelFormatError / UnsupportedModel in one line."""
    check_any_value_is_read_or_refused(saved(name), examples=60)
