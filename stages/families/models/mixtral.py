"""Mixtral (`mixtral`): the Llama block's attention, and a sparse MLP in every layer.

Each layer has `num_local_experts` SwiGLU experts of `intermediate_size`, published one
tensor per expert (`block_sparse_moe.experts.{e}.w1 / w3 / w2`: gate, up, down); a softmax
router takes the top `num_experts_per_tok` and always renormalises their weights.
`sliding_window` windows every layer. RoPE's base defaults to 1e6 (transformers'
`default_theta` for this family).

Refused (one line naming the key): an activation other than SiLU, RoPE types other than
default / linear / llama3, partial rotary, shipped quantized weights, and any key the
reader does not know. (`router_jitter_noise` is read and ignored: it only applies in
training.)

GGUF: llama.cpp writes Mixtral as a "llama" file with experts (q/k rows permuted for its RoPE).
"""

from __future__ import annotations

from typing import Any

from tessera.stages.families.config import ConfigReader
from tessera.stages.families.family import Family
from tessera.stages.families.gguf import GgufForm, GgufMetadata, llama_block_config
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.tensors import ExpertNames

ARCHITECTURES = {"mixtral": "MixtralForCausalLM"}
DEFAULT_THETA = 1e6
EXPERTS = ExpertNames("block_sparse_moe", "w1", "w3", "w2")  # gate, up, down


def read(config: ConfigReader) -> ModelSpec:
    """A Mixtral model from its config (module docstring)."""
    config.expect("hidden_act", ("silu",), default="silu")
    hidden, heads = config.int("hidden_size"), config.int("num_attention_heads")
    attention = AttentionSpec(heads, config.int("num_key_value_heads", heads), config.int("head_dim", hidden // heads),
                              config.rope(default_theta=DEFAULT_THETA), window=config.int("sliding_window", None))
    router = RouterSpec("softmax_topk", config.int("num_experts_per_tok", 2), renormalize=True)
    mlp = MlpSpec(config.int("intermediate_size"), "moe", config.int("num_local_experts", 8), router)
    return ModelSpec(
        "mixtral", config.int("vocab_size"), hidden, (LayerSpec(attention, mlp),) * config.int("num_hidden_layers"),
        rms_norm_eps=config.float("rms_norm_eps", 1e-5),
        max_position=config.int("max_position_embeddings", 4096 * 32),
        tie_embeddings=config.bool("tie_word_embeddings", False),
        bos_token_id=config.bos_id(), eos_token_ids=config.eos_ids(),
    )


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec`."""
    layer = spec.layers[0]
    attention, mlp = layer.attention, layer.mlp
    assert mlp.router is not None, "every Mixtral layer is sparse"
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES["mixtral"]], "model_type": "mixtral",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim, "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_type": attention.rope.kind, "rope_theta": attention.rope.theta,
                            **dict(attention.rope.params)},
        "max_position_embeddings": spec.max_position, "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu", "sliding_window": attention.window, "intermediate_size": mlp.width,
        "num_local_experts": mlp.num_experts, "num_experts_per_tok": mlp.router.top_k,
    }
    return with_special_ids(config, spec)


def gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    return {**llama_block_config(meta, ARCHITECTURES["mixtral"]), "num_local_experts": meta.experts,
            "num_experts_per_tok": int(meta.arch("expert_used_count"))}


MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 32000,
}

FAMILY = Family("mixtral", ARCHITECTURES["mixtral"], read, to_config, EXPERTS,
                gguf=GgufForm("llama", gguf_config, claims=lambda meta: meta.experts > 0, permuted_rope=True),
                shapes={"mixtral-8x7b": MIXTRAL_8X7B})
