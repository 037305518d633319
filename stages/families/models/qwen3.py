"""Qwen3 (`qwen3`) and Qwen3-MoE (`qwen3_moe`).

Qwen3 is the Llama block with an RMSNorm over each head of q and k, before RoPE
(`qk_norm`), and `attention_bias` biasing q, k, v and the output projection. With
`use_sliding_window`, layers from `max_window_layers` on attend within `sliding_window`
(or as `layer_types` lists them).

Qwen3-MoE has Qwen3's attention and a sparse MLP in layer i when i is not in
`mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step`: `num_experts`
SwiGLU experts of `moe_intermediate_size`, a softmax router taking the top
`num_experts_per_tok`, renormalised when `norm_topk_prob`; the other layers are dense
SwiGLU of `intermediate_size`. `use_sliding_window` windows every layer (as transformers
does for this family; `max_window_layers` is not consulted).

Refused (one line naming the key): an activation other than SiLU, `layer_types` naming a
sliding layer without a window, RoPE types other than default / linear / llama3, partial
rotary, shipped quantized weights, and any key the reader does not know.

GGUF: llama.cpp's "qwen3" and "qwen3moe" files (every layer sparse, the top-k weights
renormalised: llama.cpp always does for qwen3moe).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tessera.stages.families.config import ConfigReader
from tessera.stages.families.family import Family
from tessera.stages.families.gguf import GgufForm, GgufMetadata, biased_attention, llama_block_config
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
LAYER_KINDS = ("full_attention", "sliding_attention")
QWEN3_HEAD_DIM = 128  # Qwen3Config's default head_dim (not hidden / heads)


def read_attention(config: ConfigReader, *, head_dim_default: int) -> tuple[AttentionSpec, int | None]:
    """Qwen3's attention for a full layer, and the sliding window (None: no sliding layers)."""
    config.expect("hidden_act", ("silu",), default="silu")
    heads = config.int("num_attention_heads")
    bias = config.bool("attention_bias", False)
    window = config.int("sliding_window", None) if config.bool("use_sliding_window", False) else None
    if window is None:
        config.value("sliding_window", None)
    attention = AttentionSpec(
        heads, config.int("num_key_value_heads", heads), config.int("head_dim", head_dim_default),
        config.rope(), qkv_bias=bias, o_bias=bias, qk_norm=True,
    )
    return attention, window


def read_qwen3(config: ConfigReader) -> ModelSpec:
    """A Qwen3 model from its config (module docstring)."""
    num_layers = config.int("num_hidden_layers")
    full, window = read_attention(config, head_dim_default=QWEN3_HEAD_DIM)
    first_sliding = config.int("max_window_layers", 28, minimum=0)
    kinds = config.value("layer_types", None)
    if kinds is None:  # transformers' default list (Qwen3Config.__post_init__)
        kinds = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                 for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - set(LAYER_KINDS):
        raise config.refuse("layer_types", f"one of {LAYER_KINDS} per layer ({num_layers})")
    if "sliding_attention" in kinds and window is None:
        raise config.refuse("layer_types", "a sliding layer needs use_sliding_window and sliding_window")
    mlp = MlpSpec(config.int("intermediate_size"))
    full_layer = LayerSpec(full, mlp)
    sliding_layer = LayerSpec(replace(full, window=window), mlp) if window else full_layer
    layers = tuple(sliding_layer if kind == "sliding_attention" else full_layer for kind in kinds)
    return model(config, "qwen3", layers, max_position=32768)


def read_qwen3_moe(config: ConfigReader) -> ModelSpec:
    """A Qwen3-MoE model from its config (module docstring)."""
    num_layers = config.int("num_hidden_layers")
    hidden, heads = config.int("hidden_size"), config.int("num_attention_heads")
    attention, window = read_attention(config, head_dim_default=hidden // heads)
    config.value("max_window_layers", None)  # transformers windows every layer of this family
    if window is not None:
        attention = replace(attention, window=window)
    experts = config.int("num_experts", None, minimum=0)
    also = config.int("num_local_experts", None, minimum=0)  # what transformers 5 writes for it
    if experts is not None and also is not None and experts != also:
        raise config.refuse("num_local_experts", f"it differs from num_experts ({experts})")
    experts = experts if experts is not None else (also if also is not None else 128)
    dense_only = set(config.int_list("mlp_only_layers"))
    step = config.int("decoder_sparse_step", 1)
    dense = LayerSpec(attention, MlpSpec(config.int("intermediate_size", 6144)))
    if experts:
        router = RouterSpec("softmax_topk", config.int("num_experts_per_tok", 8), config.bool("norm_topk_prob", False))
        sparse = LayerSpec(attention, MlpSpec(config.int("moe_intermediate_size", 768), "moe", experts, router))
    else:
        for key in ("num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size"):
            config.value(key, None)
    layers = tuple(sparse if experts and i not in dense_only and (i + 1) % step == 0 else dense
                   for i in range(num_layers))
    return model(config, "qwen3_moe", layers, max_position=32768)


def model(config: ConfigReader, family: str, layers: tuple[LayerSpec, ...], *, max_position: int) -> ModelSpec:
    """The spec around `layers`, from the config's model-wide keys."""
    return ModelSpec(
        family, config.int("vocab_size"), config.int("hidden_size"), layers,
        rms_norm_eps=config.float("rms_norm_eps", 1e-6),
        max_position=config.int("max_position_embeddings", max_position),
        tie_embeddings=config.bool("tie_word_embeddings", False),
        bos_token_id=config.bos_id(), eos_token_ids=config.eos_ids(),
    )


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read_qwen3` / `read_qwen3_moe` read back into `spec`."""
    sparse = [i for i, layer in enumerate(spec.layers) if layer.mlp.kind == "moe"]
    attention = spec.layers[0].attention
    windows = {layer.attention.window for layer in spec.layers} - {None}
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[spec.family]], "model_type": spec.family,
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim, "attention_bias": attention.qkv_bias, "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_type": attention.rope.kind, "rope_theta": attention.rope.theta,
                            **dict(attention.rope.params)},
        "max_position_embeddings": spec.max_position, "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu", "use_sliding_window": bool(windows), "sliding_window": min(windows, default=None),
    }
    dense = [layer.mlp for layer in spec.layers if layer.mlp.kind == "dense"]
    if spec.family == "qwen3":
        config["intermediate_size"] = dense[0].width
        config["layer_types"] = ["full_attention" if layer.attention.window is None else "sliding_attention"
                                 for layer in spec.layers]
        return with_special_ids(config, spec)
    moe = spec.layers[sparse[0]].mlp if sparse else None
    config.update({
        "intermediate_size": dense[0].width if dense else 6144,
        "num_experts": moe.num_experts if moe else 0,
        "mlp_only_layers": [i for i in range(spec.num_layers) if i not in sparse] if moe else [],
        "decoder_sparse_step": 1,
    })
    if moe is not None and moe.router is not None:
        config.update({"moe_intermediate_size": moe.width, "num_experts_per_tok": moe.router.top_k,
                       "norm_topk_prob": moe.router.renormalize})
    return with_special_ids(config, spec)


def gguf_qwen3(meta: GgufMetadata) -> dict[str, Any]:
    return {**llama_block_config(meta, ARCHITECTURES["qwen3"]), "attention_bias": biased_attention(meta)}


def gguf_qwen3_moe(meta: GgufMetadata) -> dict[str, Any]:
    """Every layer sparse, the top-k weights renormalised (llama.cpp always does for qwen3moe)."""
    return {**gguf_qwen3(meta), "architectures": [ARCHITECTURES["qwen3_moe"]], "num_experts": meta.experts,
            "num_experts_per_tok": int(meta.arch("expert_used_count")), "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            "moe_intermediate_size": int(meta.arch("expert_feed_forward_length"))}


QWEN3_8B = {  # Qwen/Qwen3-8B
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}

QWEN3 = Family("qwen3", ARCHITECTURES["qwen3"], read_qwen3, to_config, gguf=GgufForm("qwen3", gguf_qwen3),
               shapes={"qwen3-8b": QWEN3_8B})
QWEN3_MOE = Family("qwen3_moe", ARCHITECTURES["qwen3_moe"], read_qwen3_moe, to_config,
                   gguf=GgufForm("qwen3moe", gguf_qwen3_moe), shapes={"qwen3-30b-a3b": QWEN3_30B_A3B})
