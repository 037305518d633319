"""GLM-4.5 MoE (`glm4_moe`): grouped-query attention with partial rotary, and DeepSeek-V3's MoE.

Attention is the Llama block's grouped-query attention with q, k and v biased when
`attention_bias` (the output projection never is), an RMSNorm over each head of q and k
before RoPE when `use_qk_norm`, and RoPE turning only the first
`partial_rotary_factor` x head_dim dims of each head (0.5 when the config says nothing, as
transformers' `Glm4MoeConfig` does), the rest passing through.

The MLP is DeepSeek-V3's (families/models/deepseek.py): dense SwiGLU before `first_k_dense_replace`,
then `n_routed_experts` experts picked by the sigmoid router with its correction bias and
`n_group` / `topk_group` groups, `norm_topk_prob`, `routed_scaling_factor`, plus
`n_shared_experts` shared experts.

A key the config leaves out means what `Glm4MoeConfig` defaults to. Refused (one line naming
the key): an activation other than SiLU, RoPE types other than default / linear / llama3 /
yarn, a partial rotary that turns an odd number of dims, shipped quantized weights, and any
key the reader does not know. Read and ignored: `num_nextn_predict_layers` (multi-token
prediction modules, not run: `ModelSpec.mtp_layers`).
"""

from __future__ import annotations

from typing import Any

from tessera.stages.families.config import ConfigReader
from tessera.stages.families.family import Family
from tessera.stages.families.models.deepseek import MoeDefaults, moe_config, read_mtp_layers, read_sigmoid_moe, rope_config
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.mtp import deepseek_mtp
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.model import ModelSpec

ARCHITECTURES = {"glm4_moe": "Glm4MoeForCausalLM"}
GLM4_MOE = MoeDefaults(10944, 1408, 128, 8, 1, 1.0, 1, 1, 1)
PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's default partial_rotary_factor


def read(config: ConfigReader) -> ModelSpec:
    """A GLM-4.5 MoE model from its config (module docstring)."""
    num_layers, hidden = config.int("num_hidden_layers"), config.int("hidden_size")
    heads = config.int("num_attention_heads")
    head_dim = config.int("head_dim", hidden // heads)
    rope, fraction = config.partial_rope(default_fraction=PARTIAL_ROTARY)
    turned = int(head_dim * fraction)  # as transformers sizes the rotary tables
    if turned % 2:
        raise config.refuse("partial_rotary_factor", f"it turns {turned} dims of {head_dim}, an odd number")
    bias = config.bool("attention_bias", False)
    attention = AttentionSpec(
        heads, config.int("num_key_value_heads", 8), head_dim, rope, qkv_bias=bias,
        qk_norm=config.bool("use_qk_norm", False), rotary_dim=None if turned == head_dim else turned,
    )
    mlps = read_sigmoid_moe(config, num_layers, GLM4_MOE)
    return ModelSpec(
        "glm4_moe", config.int("vocab_size"), hidden, tuple(LayerSpec(attention, mlp) for mlp in mlps),
        rms_norm_eps=config.float("rms_norm_eps", 1e-5), max_position=config.int("max_position_embeddings", 131072),
        tie_embeddings=config.bool("tie_word_embeddings", False),
        bos_token_id=config.bos_id(), eos_token_ids=config.eos_ids(), mtp_layers=read_mtp_layers(config),
    )


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec`."""
    attention = spec.layers[0].attention
    assert isinstance(attention, AttentionSpec), "GLM-4.5 attention is grouped-query"
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES["glm4_moe"]], "model_type": "glm4_moe",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim, "attention_bias": attention.qkv_bias, "use_qk_norm": attention.qk_norm,
        "partial_rotary_factor": attention.rope_dim / attention.head_dim, **rope_config(spec),
        "rms_norm_eps": spec.rms_norm_eps, "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_embeddings, **moe_config(spec, GLM4_MOE),
    }
    return with_special_ids(config, spec)


GLM_4_5 = {  # zai-org/GLM-4.5
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
    "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "use_cache": True, "use_qk_norm": True, "vocab_size": 151552,
}

FAMILY = Family("glm4_moe", ARCHITECTURES["glm4_moe"], read, to_config, shapes={"glm-4.5": GLM_4_5},
                mtp=deepseek_mtp)
