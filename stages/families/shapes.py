"""Published models' shapes, by name: what `tessera model synth --shape NAME` builds at real size.

Each shape is the model's published `config.json` (the keys that shape it and every switch
it sets), so the family's own reader (families/catalog.py) turns it into the `ModelSpec` a
real checkpoint of that model would have: the same refusals, the same layers. Left out:
`quantization_config` (a synthetic model holds float weights), `auto_map` (remote-code
pointers) and bookkeeping such as `transformers_version`. `shape_spec` reads one and
trims it for a bench: the first `layers` layers, `experts` experts per sparse layer (each
token still picks as many as the model's router does, up to that count), a `vocab`.

A shape whose family this engine does not run yet is kept here all the same and refused
by its reader with one line.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import spec_from_config
from tessera.stages.families.spec import ModelSpec

_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4,
    "num_experts_per_tok": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_key_value_heads": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": {  # meta-llama/Meta-Llama-3-8B
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "use_cache": True, "vocab_size": 128256,
    },
    "qwen3-8b": {  # Qwen/Qwen3-8B
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
        "max_position_embeddings": 40960, "max_window_layers": 36, "num_attention_heads": 32,
        "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
        "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 32000,
    },
    "gpt-oss-20b": {  # openai/gpt-oss-20b (its experts ship as MXFP4; float here)
        **_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
    },
    "gpt-oss-120b": {  # openai/gpt-oss-120b
        **_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
    },
    "deepseek-v3": {  # deepseek-ai/DeepSeek-V3 (ships as FP8 blocks; float here)
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
        "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
        "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
        "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "use_cache": True,
        "v_head_dim": 128, "vocab_size": 129280,
    },
    "glm-4.5": {  # zai-org/GLM-4.5
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
        "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
        "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 131072,
        "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
        "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False, "use_cache": True, "use_qk_norm": True, "vocab_size": 151552,
    },
    "glm-5": {  # zai-org/GLM-5, as transformers' GlmMoeDsaConfig defaults to it (ships bf16 and FP8; float here)
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3,
        "hidden_act": "silu", "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048,
        "initializer_range": 0.02, "intermediate_size": 12288, "kv_lora_rank": 512,
        "max_position_embeddings": 202752, "moe_intermediate_size": 2048, "n_group": 1, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": 78, "num_key_value_heads": 64, "num_nextn_predict_layers": 1, "q_lora_rank": 2048,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False, "topk_group": 1, "use_cache": True, "v_head_dim": 256, "vocab_size": 154880,
    },
}


def shape_spec(name: str, *, layers: int | None = None, experts: int | None = None,
               vocab: int | None = None) -> ModelSpec:
    """The spec of published shape `name`, trimmed as the module docstring says. Raises
    UnsupportedModel for an unknown name or a family the engine does not run,
    ModelFormatError for a trim the shape cannot take."""
    if name not in SHAPES:
        raise UnsupportedModel(f"unknown shape {name!r}: tessera knows {sorted(SHAPES)}")
    spec = spec_from_config(SHAPES[name])
    if layers is not None:
        if not 0 < layers <= spec.num_layers:
            raise ModelFormatError(f"{name} has {spec.num_layers} layers: cannot keep {layers}")
        spec = replace(spec, layers=spec.layers[:layers])
    if experts is not None:
        if experts < 1:
            raise ModelFormatError(f"cannot keep {experts} experts")
        spec = replace(spec, layers=tuple(
            replace(layer, mlp=replace(layer.mlp, num_experts=min(experts, layer.mlp.num_experts), router=replace(
                layer.mlp.router, top_k=min(layer.mlp.router.top_k, experts))))
            if layer.mlp.kind == "moe" and layer.mlp.router is not None else layer
            for layer in spec.layers))
    if vocab is not None:
        spec = replace(spec, vocab_size=vocab)  # ModelFormatError unless > 0
    return spec
