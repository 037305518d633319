"""gpt-oss (`gpt_oss`): a sparse MLP in every layer, with biased experts, a biased router and a
clamped SwiGLU; attention with sinks and biases, sliding and full layers alternating.

Each layer has `num_local_experts` experts of `intermediate_size`; the router's logits
(x Wᵀ + b) pick the top `num_experts_per_tok`, whose softmax weighs them (kind
"topk_softmax"). An expert is down(g σ(α g) (u + 1)) + b_down, with gate and up from one
biased matmul, g clamped above at `swiglu_limit` and u to ±`swiglu_limit`, α = `swiglu_alpha`
(GluSpec "clamped_swiglu"). Attention is GQA with q/k/v/o biases (`attention_bias`) and one
learned sink logit per head in its softmax's denominator; `layer_types` lists each layer's
kind ("sliding_attention": within `sliding_window`; by default every even layer), RoPE is
YaRN by default (base 150000).

Tensors (`layer_tensors`): the router is `mlp.router.weight` [E, H] and `.bias` [E], the
sinks `self_attn.sinks` [A]. The experts come fused, as transformers holds them and
`save_pretrained` writes them (also the published bf16 re-exports):

    mlp.experts.gate_up_proj       [E, H, 2I]  stored [in, out]; columns alternate gate, up
    mlp.experts.gate_up_proj_bias  [E, 2I]     alternating likewise
    mlp.experts.down_proj          [E, I, H]   stored [in, out]
    mlp.experts.down_proj_bias     [E, H]

Expert e's engine tensors are the per-expert names every MoE family uses
(`mlp.experts.{e}.w_gate_up.weight` [2I, H], gate rows first, `.bias` [2I];
`mlp.experts.{e}.w_down.weight` [H, I], `.bias` [H]): row e of the fused tensor,
transposed and its interleaved rows regrouped (`Stacked.transposed`, `.interleaved`).
The published checkpoints ship the expert matrices as MXFP4 instead
(`gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 with `gate_up_proj_scales` [E, 2I, H/32];
`down_proj_blocks` [E, H, I/32, 16] with `down_proj_scales` [E, H, I/32]): the same
checkpoint matrices (`mlp.experts.gate_up_proj`, `down_proj`) stored [out, in], of the
logical shape `Stacked.matrix_shape` gives ([E, 2I, H], [E, H, I]), so expert e's engine
matrix is row e of blocks and scales with its rows regrouped as above (rows are independent
in MXFP4: its blocks run along the input), not transposed. Both layouts carry the same
`*_bias` tensors, and map to the same engine tensors.

Refused (one line naming the key): `layer_types` other than sliding/full or sliding without
a window, `num_experts` or `experts_per_token` disagreeing with their twins, RoPE types the
engine does not compute, shipped quantized weights (until MXFP4 loads), and any key the
reader does not know.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tessera.stages.families import tensors
from tessera.stages.families.config import ConfigReader
from tessera.stages.families.family import Family
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import GluSpec, MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.tensors import Choices, Stacked, one

ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}
LAYER_KINDS = ("full_attention", "sliding_attention")
DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
# GptOssConfig's defaults (gpt-oss-120b's sizes), used when a config leaves a key out
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def read(config: ConfigReader) -> ModelSpec:
    """A gpt-oss model from its config (module docstring)."""
    config.value("hidden_act", None)  # unread by transformers' gpt-oss: its experts apply the clamped SwiGLU
    config.value("initial_context_length", None)  # the published config's note of the pretraining context
    num_layers = config.int("num_hidden_layers", 36)
    hidden, heads = config.int("hidden_size", 2880), config.int("num_attention_heads", 64)
    bias = config.bool("attention_bias", True)
    if not (config.has("rope_parameters") or config.has("rope_scaling")):
        # GptOssConfig fills in its YaRN block when a config names no RoPE: read it as if written
        config.config = {**config.config, "rope_parameters": DEFAULT_ROPE}
    attention = AttentionSpec(
        heads, config.int("num_key_value_heads", heads), config.int("head_dim", 64),
        config.rope(default_theta=DEFAULT_THETA), qkv_bias=bias, o_bias=bias, sinks=True,
    )
    # absent: GptOssConfig's 128; null: no window (transformers keeps None), which no sliding layer may have
    window = config.int("sliding_window", None if "sliding_window" in config.config else 128)
    kinds = config.value("layer_types", None)
    if kinds is None:  # GptOssConfig.__post_init__'s default: sliding, full, sliding, ...
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - set(LAYER_KINDS):
        raise config.refuse("layer_types", f"one of {LAYER_KINDS} per layer ({num_layers})")
    if "sliding_attention" in kinds and window is None:
        raise config.refuse("layer_types", "a sliding layer needs sliding_window")
    experts = config.int("num_local_experts", 128)
    twin = config.int("num_experts", None)  # GptOssConfig's attribute_map name for it
    if twin is not None and twin != experts:
        raise config.refuse("num_experts", f"it differs from num_local_experts ({experts})")
    top_k = config.int("num_experts_per_tok", 4)
    twin = config.int("experts_per_token", None)  # the published config.json carries both
    if twin is not None and twin != top_k:
        raise config.refuse("experts_per_token", f"it differs from num_experts_per_tok ({top_k})")
    glu = GluSpec("clamped_swiglu", config.float("swiglu_alpha", 1.702), config.float("swiglu_limit", 7.0))
    mlp = MlpSpec(config.int("intermediate_size", 2880), "moe", experts, RouterSpec("topk_softmax", top_k, bias=True),
                  glu=glu, bias=True)
    full, sliding = LayerSpec(attention, mlp), LayerSpec(replace(attention, window=window), mlp)
    return ModelSpec(
        "gpt_oss", config.int("vocab_size", 201088), hidden,
        tuple(sliding if kind == "sliding_attention" else full for kind in kinds),
        rms_norm_eps=config.float("rms_norm_eps", 1e-5),
        max_position=config.int("max_position_embeddings", 131072),
        tie_embeddings=config.bool("tie_word_embeddings", False),
        bos_token_id=config.bos_id(), eos_token_ids=config.eos_ids(),
    )


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec`."""
    attention, mlp = spec.layers[0].attention, spec.layers[0].mlp
    assert mlp.router is not None and mlp.glu.kind == "clamped_swiglu", "every gpt-oss layer is sparse"
    windows = {layer.attention.window for layer in spec.layers} - {None}
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES["gpt_oss"]], "model_type": "gpt_oss",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim, "attention_bias": attention.qkv_bias, "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_type": attention.rope.kind, "rope_theta": attention.rope.theta,
                            **dict(attention.rope.params)},
        "max_position_embeddings": spec.max_position, "tie_word_embeddings": spec.tie_embeddings,
        "sliding_window": min(windows, default=None),
        "layer_types": ["full_attention" if layer.attention.window is None else "sliding_attention"
                        for layer in spec.layers],
        "intermediate_size": mlp.width, "num_local_experts": mlp.num_experts,
        "num_experts_per_tok": mlp.router.top_k, "swiglu_alpha": mlp.glu.alpha, "swiglu_limit": mlp.glu.limit,
    }
    return with_special_ids(config, spec)


def layer_tensors(spec: ModelSpec, layer: int) -> dict[str, Choices]:
    """Engine name -> checkpoint layouts for every tensor of layer `layer` (module docstring): the
    attention and norms as every family names them, the sinks, the router and the experts."""
    out = {name: c for name, c in tensors.layer_tensors(spec, layer).items() if not name.startswith("mlp.")}
    ls, h = spec.layers[layer], spec.hidden_size
    p = f"model.layers.{layer}."
    if ls.attention.sinks:
        out["attn.sinks"] = one(p + "self_attn.sinks", (ls.attention.num_heads,))
    e_count, i = ls.mlp.num_experts, ls.mlp.width
    out["mlp.router.weight"] = one(p + "mlp.router.weight", (e_count, h))
    out["mlp.router.bias"] = one(p + "mlp.router.bias", (e_count,))
    x = p + "mlp.experts."
    for e in range(e_count):
        out[f"mlp.experts.{e}.w_gate_up.weight"] = (
            Stacked((x + "gate_up_proj",), ((e_count, h, 2 * i),), e, transposed=True, interleaved=True),)
        out[f"mlp.experts.{e}.w_gate_up.bias"] = (
            Stacked((x + "gate_up_proj_bias",), ((e_count, 2 * i),), e, interleaved=True),)
        out[f"mlp.experts.{e}.w_down.weight"] = (Stacked((x + "down_proj",), ((e_count, i, h),), e, transposed=True),)
        out[f"mlp.experts.{e}.w_down.bias"] = (Stacked((x + "down_proj_bias",), ((e_count, h),), e),)
    return out


# what both published gpt-oss configs share (openai/gpt-oss-20b, -120b)
GPT_OSS_CONFIG = {
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
GPT_OSS_20B = {  # openai/gpt-oss-20b (its experts ship as MXFP4; float here)
    **GPT_OSS_CONFIG, "num_hidden_layers": 24, "num_local_experts": 32,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}
GPT_OSS_120B = {  # openai/gpt-oss-120b
    **GPT_OSS_CONFIG, "num_hidden_layers": 36, "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}

FAMILY = Family("gpt_oss", ARCHITECTURES["gpt_oss"], read, to_config, tensors=layer_tensors,
                shapes={"gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B})
