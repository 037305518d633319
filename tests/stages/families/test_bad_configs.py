"""Any value in any key of a DeepSeek-V3 or GLM-4.5 config is read into a spec or refused with one
typed error (ModelFormatError or UnsupportedModel, one line): never another exception, never a
spec the engine could not build. Configs as transformers writes them, with keys overwritten at
random by JSON values."""

from __future__ import annotations

import json

import pytest

from .conformance import check_any_value_is_read_or_refused

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)
BASES = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**SHAPE, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                                         qk_nope_head_dim=16, v_head_dim=12, n_group=2, topk_group=1),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**SHAPE, num_key_value_heads=2, head_dim=16, use_qk_norm=True),
}
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
SAVED = {family: {**json.loads(json.dumps(make().to_dict())), "architectures": [ARCHITECTURES[family]]}
         for family, make in BASES.items()}


@pytest.mark.parametrize("family", sorted(BASES))
def test_any_value_is_read_or_refused_by_one_typed_error(family):
    check_any_value_is_read_or_refused(SAVED[family], examples=150)
