"""Reading config.json per family, beyond the conformance suite (test_conformance.py: each row's
round trip and refusals): how each family expands its config into layers, and impossible values
as format errors."""

from __future__ import annotations

import json

import pytest

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import FAMILIES, spec_from_config

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# family -> a config as transformers 5 writes it (its `to_dict`, as save_pretrained does)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=8),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, use_sliding_window=True, sliding_window=8, max_window_layers=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, **MOE, mlp_only_layers=[0], decoder_sparse_step=1,
                                                   norm_topk_prob=True),
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=8, sliding_window=8),
}


def config_of(family: str, **change) -> dict:
    config = CONFIGS[family]().to_dict()
    config["architectures"] = [FAMILIES[family].architecture]
    return {**json.loads(json.dumps(config)), **change}


def test_each_family_expands_into_its_layers():
    qwen3 = spec_from_config(config_of("qwen3")).layers
    assert [(l.attention.window, l.attention.qk_norm) for l in qwen3] == [(None, True)] * 2 + [(8, True)] * 2
    moe = spec_from_config(config_of("qwen3_moe")).layers
    assert [l.mlp.kind for l in moe] == ["dense", "moe", "moe", "moe"]
    assert (moe[1].mlp.num_experts, moe[1].mlp.width, moe[1].mlp.router.top_k) == (8, 32, 2)
    assert moe[0].mlp.width == 96
    step = spec_from_config(config_of("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=2)).layers
    assert [l.mlp.kind for l in step] == ["dense", "moe", "dense", "moe"]
    mixtral = spec_from_config(config_of("mixtral")).layers
    assert {(l.mlp.kind, l.mlp.router.renormalize, l.attention.window, l.attention.qk_norm) for l in mixtral} == {
        ("moe", True, 8, False)}
    assert spec_from_config(config_of("mixtral", rope_parameters=None)).layers[0].attention.rope.theta == 1e6


@pytest.mark.parametrize(
    "family, change, words",
    [
        ("qwen3_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen3_moe", {"mlp_only_layers": "0"}, "mlp_only_layers"),
        ("qwen3_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ("mixtral", {"num_local_experts": -1}, "num_local_experts"),
        ("qwen3", {"sliding_window": 0}, "sliding_window"),
        ("qwen3", {"hidden_size": None}, "hidden_size"),
    ],
)
def test_impossible_values_are_format_errors(family, change, words):
    with pytest.raises(ModelFormatError, match=words):
        spec_from_config(config_of(family, **change))


def test_other_architectures_are_refused_by_name():
    for arch in ("DeepseekV32ForCausalLM", "Gemma3ForCausalLM"):
        with pytest.raises(UnsupportedModel, match=f"unknown architecture \\['{arch}'\\]"):
            spec_from_config({**config_of("llama"), "architectures": [arch]})
