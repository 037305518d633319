"""MiniMax-M2 (`minimax_m2`): grouped-query attention with q and k normed over all heads, and a
sigmoid-routed MoE in every layer.

Attention is the Llama block's GQA without biases, with two differences (transformers'
`MiniMaxM2Attention`): q and k each get ONE RMSNorm over all their heads' dims at once (A x D
and K x D weights, `AttentionSpec.qk_norm_whole`), before RoPE; and RoPE turns only the first
`rotary_dim` dims of each head (the published configs' key; transformers reads it as
`partial_rotary_factor` = rotary_dim / head_dim, and an explicit factor wins), the rest pass
unrotated. RoPE's base defaults to 5e6.

Every layer is sparse: `num_local_experts` SwiGLU experts of `intermediate_size` (the expert
width: the model has no dense MLP), published one tensor per expert under Mixtral's names
(`block_sparse_moe.experts.{e}.w1 / w3 / w2`: gate, up, down); the router takes sigmoid scores
(float32), adds a learned correction bias (`e_score_correction_bias`) only to choose the top
`num_experts_per_tok`, and weighs the picks by their uncorrected scores divided by their sum:
DeepSeek-V3's router with one group and no scaling (layers/routers.py "sigmoid_group_topk"; its
1e-20 beside the sum cannot change a float32 sum of sigmoids).

Refused (one line naming the key): an activation other than SiLU, a config whose own switches
say otherwise than the above (`use_qk_norm` false, `qk_norm_type` other than per_layer,
`scoring_func` other than sigmoid, `use_routing_bias` false, shared experts,
`attn_type_list` naming a layer other than full attention — MiniMax-01's lightning attention —,
a sliding window, residual scalings other than 1), a `rotary_dim` that disagrees with
`partial_rotary_factor` or turns an odd number of dims, RoPE types the engine does not compute,
and any key the reader does not know. Read and ignored: `num_experts` (transformers' name for
`num_local_experts`, refused if it differs), and the multi-token-prediction switches (`use_mtp`,
`num_mtp_modules`, `mtp_transformer_layers`: transformers does not run them either; a folder
holding their tensors is refused by name at its check).
"""

from __future__ import annotations

from typing import Any

from tessera.stages.families.config import ConfigReader
from tessera.stages.families.family import Family
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.tensors import ExpertNames

ARCHITECTURES = {"minimax_m2": "MiniMaxM2ForCausalLM"}
DEFAULT_THETA = 5e6  # MiniMaxM2Config.default_theta
EXPERTS = ExpertNames("block_sparse_moe", "w1", "w3", "w2", correction_bias="e_score_correction_bias")
MTP_KEYS = ("use_mtp", "num_mtp_modules", "mtp_transformer_layers")
# the residual scalings MiniMax-01 carried (deepnorm-style alpha and beta); M2 computes a plain residual
RESIDUAL_SCALES = ("layernorm_full_attention_alpha", "layernorm_full_attention_beta", "layernorm_mlp_alpha",
                   "layernorm_mlp_beta", "layernorm_linear_attention_alpha", "layernorm_linear_attention_beta")
FULL_ATTENTION = 1  # attn_type_list's full (softmax) attention; 0 is MiniMax-01's lightning attention


def read(config: ConfigReader) -> ModelSpec:
    """A MiniMax-M2 model from its config (module docstring)."""
    config.expect("hidden_act", ("silu",), default="silu")
    config.expect("use_qk_norm", (True,), default=True)
    config.expect("qk_norm_type", ("per_layer",), default="per_layer")
    config.expect("scoring_func", ("sigmoid",), default="sigmoid")
    config.expect("use_routing_bias", (True,), default=True)
    config.expect("shared_intermediate_size", (0,), default=0)
    config.expect("sliding_window", (None,), default=None)
    for key in RESIDUAL_SCALES:
        config.expect(key, (1, 1.0), default=1.0)
    for key in MTP_KEYS:
        config.value(key, None)
    num_layers = config.int("num_hidden_layers", 62)
    kinds = config.value("attn_type_list", None)
    if kinds is not None and kinds != [FULL_ATTENTION] * num_layers:
        raise config.refuse("attn_type_list", f"every layer of this family is full attention ({FULL_ATTENTION})")
    hidden, heads = config.int("hidden_size", 3072), config.int("num_attention_heads", 48)
    head_dim = config.int("head_dim", 128)
    rotary = config.int("rotary_dim", None)
    rope, fraction = config.partial_rope(default_fraction=1.0 if rotary is None else rotary / head_dim,
                                         default_theta=DEFAULT_THETA)
    turned = int(head_dim * fraction)  # as transformers sizes the rotary tables
    if rotary is not None and rotary != turned:
        raise config.refuse("rotary_dim", f"it differs from partial_rotary_factor {fraction} x head_dim {head_dim}")
    if turned % 2:
        raise config.refuse("partial_rotary_factor", f"it turns {turned} dims of {head_dim}, an odd number")
    attention = AttentionSpec(heads, config.int("num_key_value_heads", 8), head_dim, rope, qk_norm=True,
                              qk_norm_whole=True, rotary_dim=None if turned == head_dim else turned)
    experts = config.int("num_local_experts", 256)
    twin = config.int("num_experts", None)  # MiniMaxM2Config's attribute_map name for it
    if twin is not None and twin != experts:
        raise config.refuse("num_experts", f"it differs from num_local_experts ({experts})")
    router = RouterSpec("sigmoid_group_topk", config.int("num_experts_per_tok", 8), renormalize=True)
    mlp = MlpSpec(config.int("intermediate_size", 1536), "moe", experts, router)
    return ModelSpec(
        "minimax_m2", config.int("vocab_size", 200064), hidden, (LayerSpec(attention, mlp),) * num_layers,
        rms_norm_eps=config.float("rms_norm_eps", 1e-6), max_position=config.int("max_position_embeddings", 196608),
        tie_embeddings=config.bool("tie_word_embeddings", False),
        bos_token_id=config.bos_id(), eos_token_ids=config.eos_ids(),
    )


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec`."""
    layer = spec.layers[0]
    attention, mlp = layer.attention, layer.mlp
    assert isinstance(attention, AttentionSpec) and mlp.router is not None, "every MiniMax-M2 layer is GQA and sparse"
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES["minimax_m2"]], "model_type": "minimax_m2",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim, "rotary_dim": attention.rope_dim, "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_type": attention.rope.kind, "rope_theta": attention.rope.theta,
                            "partial_rotary_factor": attention.rope_dim / attention.head_dim,
                            **dict(attention.rope.params)},
        "max_position_embeddings": spec.max_position, "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu", "intermediate_size": mlp.width, "num_local_experts": mlp.num_experts,
        "num_experts_per_tok": mlp.router.top_k,
    }
    return with_special_ids(config, spec)


# MiniMax-M2's sizes as transformers' MiniMaxM2Config defaults to them, with the rotary_dim of the
# published MiniMaxAI/MiniMax-M2 config (it ships FP8 blocks; float here)
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 200064,
    "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48,
    "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 196608, "rms_norm_eps": 1e-06, "rope_theta": 5000000,
    "bos_token_id": 200034, "eos_token_id": 200020, "tie_word_embeddings": False, "num_experts_per_tok": 8,
    "num_local_experts": 256, "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
    "qk_norm_type": "per_layer",
}

FAMILY = Family("minimax_m2", ARCHITECTURES["minimax_m2"], read, to_config, EXPERTS,
                shapes={"minimax-m2": MINIMAX_M2})
