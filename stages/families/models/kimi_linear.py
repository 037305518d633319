"""Kimi Linear (`kimi_linear`): Kimi Delta Attention beside MLA layers, and a sigmoid-routed MoE
(the layout of Kimi K3).

Layers mix two token mixers by `layer_types` ("linear_attention" / "full_attention"), or, in the
published configs, by `linear_attn_config`'s `kda_layers` and `full_attn_layers` (1-based);
absent both, transformers' default: full attention at every fourth layer but the first (4, 8 ...):

- Kimi Delta Attention (families/spec/recurrent.py `KdaSpec`): `linear_num_heads` heads of
  `linear_head_dim` for q, k and v (`linear_attn_config`'s `num_heads`, `head_dim`), a causal
  convolution of `linear_conv_kernel_dim` (`short_conv_kernel_size`), a decay per key channel
  from a low-rank forget gate, a sigmoid-gated output norm. Its session state is fixed: a [d, d]
  matrix per head and the convolution's window (`RecurrentStateSpec`), whatever the context.
- MLA without positions (NoPE, `mla_use_nope`): DeepSeek's multi-head latent attention
  (`MlaSpec`: `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, low-rank q
  when `q_lora_rank`) whose "rope" dims are turned by nothing (`RopeSpec` kind "none"); scores
  scaled by (nope + rope dims)^-1/2. Its cache is the latent per position.

MLPs by `mlp_layer_types` ("dense" / "sparse"), else dense before `first_k_dense_replace` (1):
dense SwiGLU of `intermediate_size`; sparse: `num_experts` SwiGLU experts of
`moe_intermediate_size`, DeepSeek-V3's sigmoid router (a correction bias to choose, groups
`num_expert_group` of which `topk_group` are searched, `num_experts_per_token` picked, weights
renormalised when `moe_renormalize`, times `routed_scaling_factor`), and `num_shared_experts`
shared experts as one SwiGLU. transformers writes several keys under other names
(`num_experts` for `num_local_experts`, `num_experts_per_token` for `num_experts_per_tok`,
`moe_renormalize` for `norm_topk_prob`, `num_expert_group` for `n_group`, `num_shared_experts` for
`n_shared_experts`, `model_max_length` for `max_position_embeddings`): either is read, and two
that differ are refused.

Checkpoints name a layer's tensors as published (the MoE under `block_sparse_moe`, experts
`w1`/`w3`/`w2`, the convolutions `q_conv1d`, `k_conv1d`, `v_conv1d`, the forget gate's tensors on
the attention) or as transformers 5 holds them (`mlp`, fused experts, one `conv1d`, under
`forget_gate`): `tensors` lists both.

Read and ignored: `head_dim` and `qk_head_dim` (transformers derives them), `rope_theta` (NoPE:
nothing is turned), `auto_map`. Refused (one line naming the key): an activation other than SiLU,
`mla_use_nope` false, a RoPE block with scaling (nothing is turned to scale),
`num_key_value_heads` other than the heads (MLA expands a key and a value per head), a router
other than the grouped sigmoid (`moe_router_activation_func`, `use_grouped_topk`),
`moe_layer_freq` other than 1, multi-token-prediction layers, shipped quantized weights, any key
the reader does not know.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.config import ConfigReader
from tessera.stages.families.models.deepseek import read_alias
from tessera.stages.families.family import Family
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mla import MlaSpec
from tessera.stages.families.spec.mlp import MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.recurrent import KdaSpec
from tessera.stages.families.spec.rope import RopeSpec
from tessera.stages.families.tensors import (
    Choices, ExpertNames, Stacked, mla_tensors, mlp_tensors, one, stacked,
)

ARCHITECTURE = "KimiLinearForCausalLM"
LAYER_KINDS = ("linear_attention", "full_attention")
MLP_LAYER_KINDS = ("dense", "sparse")
NOPE = RopeSpec("none")
IGNORED = ("head_dim", "qk_head_dim", "auto_map")
LINEAR_KEYS = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
               "short_conv_kernel_size": "linear_conv_kernel_dim"}
# KimiLinearConfig's defaults: what a config that leaves a key out means (Kimi-Linear-48B-A3B's shape)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
    num_attention_heads=32, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    n_shared_experts=1, routed_scaling_factor=2.446, n_group=1, topk_group=1, num_experts_per_tok=8,
    num_local_experts=256, rms_norm_eps=1e-5, max_position_embeddings=1048576, linear_head_dim=128,
    linear_num_heads=32, linear_conv_kernel_dim=4, first_k_dense_replace=1,
)


def read(config: ConfigReader) -> ModelSpec:
    """A Kimi Linear model from its config (module docstring)."""
    if config.has("quantization_config"):
        raise UnsupportedModel(f"{config.family} weights that ship quantized are not read yet (no shipped form of its "
                               "recurrent layers' projections is mapped): use a float checkpoint")
    config.expect("hidden_act", ("silu",), default="silu")
    config.expect("mla_use_nope", (True,), default=True)
    config.expect("moe_router_activation_func", ("sigmoid",), default="sigmoid")
    config.expect("use_grouped_topk", (True,), default=True)
    config.expect("moe_layer_freq", (1,), default=1)
    config.expect("num_nextn_predict_layers", (0,), default=0)
    for key in IGNORED:
        config.value(key, None)
    if config.rope().kind != "default":
        raise config.refuse("rope_scaling" if config.has("rope_scaling") else "rope_parameters",
                            "its attention encodes no positions (NoPE): there is no rotary embedding to scale")
    num_layers = config.int("num_hidden_layers", DEFAULTS["num_hidden_layers"])
    heads = config.int("num_attention_heads", DEFAULTS["num_attention_heads"])
    if config.int("num_key_value_heads", heads) != heads:
        raise config.refuse("num_key_value_heads", f"MLA expands a key and a value for each of the {heads} heads")
    linear = read_linear_config(config)
    kda = KdaSpec(linear["linear_num_heads"], linear["linear_head_dim"], linear["linear_conv_kernel_dim"])
    mla = MlaSpec(
        heads, config.int("kv_lora_rank", DEFAULTS["kv_lora_rank"]),
        config.int("qk_nope_head_dim", DEFAULTS["qk_nope_head_dim"]),
        config.int("qk_rope_head_dim", DEFAULTS["qk_rope_head_dim"]), config.int("v_head_dim", DEFAULTS["v_head_dim"]),
        q_lora_rank=config.int("q_lora_rank", None),
        rope=NOPE, bias=config.bool("attention_bias", False),
    )
    kinds = layer_kinds(config, num_layers, linear)
    mlps = read_mlps(config, num_layers)
    return ModelSpec(
        "kimi_linear", config.int("vocab_size", DEFAULTS["vocab_size"]), config.int("hidden_size", DEFAULTS["hidden_size"]),
        tuple(LayerSpec(mla if kind == "full_attention" else kda, mlp) for kind, mlp in zip(kinds, mlps)),
        rms_norm_eps=config.float("rms_norm_eps", DEFAULTS["rms_norm_eps"]),
        max_position=read_alias(config, "max_position_embeddings", "model_max_length",
                                DEFAULTS["max_position_embeddings"], minimum=1),
        tie_embeddings=config.bool("tie_word_embeddings", False), bos_token_id=config.bos_id(),
        eos_token_ids=config.eos_ids(),
    )


def read_linear_config(config: ConfigReader) -> dict[str, Any]:
    """The KDA sizes: the top-level keys, or `linear_attn_config`'s (the published form), refused where
    both are given and differ; plus its `kda_layers` and `full_attn_layers` when it has them."""
    block = config.value("linear_attn_config", {})
    if not isinstance(block, dict):
        raise ModelFormatError(f"config field linear_attn_config has an impossible value {block!r}")
    unknown = sorted(set(block) - set(LINEAR_KEYS) - {"kda_layers", "full_attn_layers"})
    if unknown:
        raise config.refuse("linear_attn_config", f"its key {unknown[0]!r} is not one tessera knows")
    out: dict[str, Any] = {}
    for inner, key in LINEAR_KEYS.items():
        top = config.int(key, None)
        nested = block.get(inner)
        if nested is not None and (isinstance(nested, bool) or not isinstance(nested, int) or nested < 1):
            raise ModelFormatError(f"config field linear_attn_config.{inner} has an impossible value {nested!r}")
        if top is not None and nested is not None and top != nested:
            raise config.refuse(key, f"it differs from linear_attn_config's {inner} ({nested})")
        out[key] = nested if nested is not None else (top if top is not None else DEFAULTS[key])
    for name in ("kda_layers", "full_attn_layers"):
        numbers = block.get(name)
        if numbers is not None and (not isinstance(numbers, list)
                                    or any(isinstance(n, bool) or not isinstance(n, int) for n in numbers)):
            raise ModelFormatError(f"config field linear_attn_config.{name} has an impossible value {numbers!r}")
        out[name] = numbers
    return out


def layer_kinds(config: ConfigReader, num_layers: int, linear: dict[str, Any]) -> list[str]:
    """Each layer's mixer (module docstring), refused unless every layer is one of LAYER_KINDS and the
    two forms agree where both are given."""
    numbered = None
    if linear["kda_layers"] is not None and linear["full_attn_layers"] is not None:
        numbered = [None] * num_layers
        for kind, numbers in (("full_attention", linear["full_attn_layers"]), ("linear_attention", linear["kda_layers"])):
            for n in numbers:
                if not 1 <= n <= num_layers:
                    raise ModelFormatError(f"config field linear_attn_config names layer {n} of {num_layers} (1-based)")
                numbered[n - 1] = kind
    kinds = config.value("layer_types", None)
    if kinds is None:
        kinds = numbered if numbered is not None else [
            "full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    elif numbered is not None and kinds != numbered:
        raise config.refuse("layer_types", "it differs from linear_attn_config's kda_layers and full_attn_layers")
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(kind not in LAYER_KINDS for kind in kinds):
        raise config.refuse("layer_types", f"one of {LAYER_KINDS} per layer ({num_layers})")
    return kinds


def read_mlps(config: ConfigReader, num_layers: int) -> list[MlpSpec]:
    """Each layer's MLP (module docstring)."""
    kinds = config.value("mlp_layer_types", None)
    first_sparse = config.int("first_k_dense_replace", DEFAULTS["first_k_dense_replace"], minimum=0)
    by_first = ["dense" if i < first_sparse else "sparse" for i in range(num_layers)]
    if kinds is None:
        kinds = by_first
    elif config.has("first_k_dense_replace") and kinds != by_first:
        raise config.refuse("mlp_layer_types", f"it differs from first_k_dense_replace ({first_sparse})")
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(kind not in MLP_LAYER_KINDS for kind in kinds):
        raise config.refuse("mlp_layer_types", f"one of {MLP_LAYER_KINDS} per layer ({num_layers})")
    dense = MlpSpec(config.int("intermediate_size", DEFAULTS["intermediate_size"]))
    width = config.int("moe_intermediate_size", DEFAULTS["moe_intermediate_size"])
    given = [config.bool(key) if config.value(key, None) is not None else None
             for key in ("norm_topk_prob", "moe_renormalize")]
    if None not in given and given[0] != given[1]:
        raise config.refuse("moe_renormalize", f"it differs from norm_topk_prob ({given[0]})")
    renormalize = next((g for g in given if g is not None), True)
    router = RouterSpec(
        "sigmoid_group_topk",
        read_alias(config, "num_experts_per_tok", "num_experts_per_token", DEFAULTS["num_experts_per_tok"], minimum=1),
        renormalize=renormalize,
        num_groups=read_alias(config, "n_group", "num_expert_group", DEFAULTS["n_group"], minimum=1),
        topk_groups=config.int("topk_group", DEFAULTS["topk_group"]),
        scale=config.float("routed_scaling_factor", DEFAULTS["routed_scaling_factor"]),
    )
    experts = read_alias(config, "num_local_experts", "num_experts", DEFAULTS["num_local_experts"], minimum=1)
    shared = read_alias(config, "n_shared_experts", "num_shared_experts", DEFAULTS["n_shared_experts"], minimum=0)
    sparse = MlpSpec(width, "moe", experts, router, shared_width=shared * width)
    return [dense if kind == "dense" else sparse for kind in kinds]


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec` (in the key names transformers writes)."""
    mla = next((layer.attention for layer in spec.layers if isinstance(layer.attention, MlaSpec)),
               MlaSpec(32, DEFAULTS["kv_lora_rank"], DEFAULTS["qk_nope_head_dim"], DEFAULTS["qk_rope_head_dim"],
                       DEFAULTS["v_head_dim"], rope=NOPE))
    kda = next((layer.attention for layer in spec.layers if isinstance(layer.attention, KdaSpec)),
               KdaSpec(DEFAULTS["linear_num_heads"], DEFAULTS["linear_head_dim"], DEFAULTS["linear_conv_kernel_dim"]))
    dense = next((layer.mlp for layer in spec.layers if layer.mlp is not None and layer.mlp.kind == "dense"), None)
    sparse = next((layer.mlp for layer in spec.layers if layer.mlp is not None and layer.mlp.kind == "moe"), None)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": "kimi_linear", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers, "hidden_act": "silu",
        "num_attention_heads": mla.num_heads, "num_key_value_heads": mla.num_heads, "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "attention_bias": mla.bias,
        "linear_num_heads": kda.num_heads, "linear_head_dim": kda.head_dim, "linear_conv_kernel_dim": kda.conv_kernel,
        "layer_types": ["full_attention" if isinstance(layer.attention, MlaSpec) else "linear_attention"
                        for layer in spec.layers],
        "mlp_layer_types": ["sparse" if layer.mlp is not None and layer.mlp.kind == "moe" else "dense"
                            for layer in spec.layers],
        "intermediate_size": dense.width if dense is not None else DEFAULTS["intermediate_size"],
        "rms_norm_eps": spec.rms_norm_eps, "model_max_length": spec.max_position,
        "tie_word_embeddings": spec.tie_embeddings,
    }
    if sparse is not None and sparse.router is not None:
        config.update({
            "moe_intermediate_size": sparse.width, "num_experts": sparse.num_experts,
            "num_experts_per_token": sparse.router.top_k, "num_shared_experts": sparse.shared_width // sparse.width,
            "routed_scaling_factor": sparse.router.scale, "num_expert_group": sparse.router.num_groups,
            "topk_group": sparse.router.topk_groups, "moe_renormalize": sparse.router.renormalize,
        })
    return with_special_ids(config, spec)


# published: the MoE under `block_sparse_moe`, experts w1 (gate) / w3 (up) / w2 (down)
EXPERTS = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")


def tensors(spec: ModelSpec, layer: int) -> dict[str, Choices]:
    """Engine name -> checkpoint layouts for every tensor of layer `layer` (module docstring): KDA's or
    MLA's, then the MLP's, each as published first and as transformers 5 holds it second."""
    ls, h = spec.layers[layer], spec.hidden_size
    p = f"{spec.prefix}layers.{layer}."
    assert ls.mlp is not None, "every Kimi Linear layer has an MLP"
    mixer = kda_tensors(p, ls.attention, h) if isinstance(ls.attention, KdaSpec) else mla_tensors(p, ls.attention, h)
    mlp = mlp_tensors(p, ls, h, EXPERTS)
    # the dense MLP as published (`mlp.`) or as transformers writes it back (`block_sparse_moe.`); the shared
    # experts as published (`block_sparse_moe.`) or as transformers holds them (`mlp.`)
    for name in [n for n in mlp if n.startswith(("mlp.w_", "mlp.shared."))]:
        mlp[name] = (*mlp[name], *(renamed(c, ".mlp.", ".block_sparse_moe.") or renamed(c, ".block_sparse_moe.", ".mlp.")
                                   for c in mlp[name]))
    return {**mixer, **mlp}


def renamed(layout: Stacked, old: str, new: str) -> Stacked | None:
    """`layout` with `old` replaced by `new` in every name, or None where a name lacks it."""
    if not all(old in name for name in layout.names):
        return None
    return replace(layout, names=tuple(name.replace(old, new) for name in layout.names))


def kda_tensors(p: str, at: KdaSpec, h: int) -> dict[str, Choices]:
    """A KDA layer's attention norm and tensors under prefix `p`: as published (three convolutions, the
    forget gate's tensors on the attention), or as transformers 5 holds them (one `conv1d`, `forget_gate.`)."""
    a, size, d, hk = p + "self_attn.", at.size, at.head_dim, at.num_heads
    w_in_shapes = [(size, h), (size, h), (size, h), (hk, h), (d, h), (d, h)]
    w_in = [a + f"{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")]
    fused = [name.replace("f_a_proj", "forget_gate.f_a_proj") for name in w_in]
    convs = [a + f"{x}_conv1d.weight" for x in "qkv"]
    return {
        "attn_norm.weight": one(p + "input_layernorm.weight", (h,)),
        "attn.w_in.weight": (*stacked(w_in, w_in_shapes), *stacked(fused, w_in_shapes)),
        "attn.w_fb.weight": (*one(a + "f_b_proj.weight", (size, d)), *one(a + "forget_gate.f_b_proj.weight", (size, d))),
        "attn.w_gb.weight": one(a + "g_b_proj.weight", (size, d)),
        "attn.conv": (*stacked(convs, [(size, 1, at.conv_kernel)] * 3),
                      *one(a + "conv1d.weight", (at.conv_channels, 1, at.conv_kernel))),
        "attn.A_log": (*one(a + "A_log", (1, 1, hk, 1)), *one(a + "forget_gate.A_log", (1, 1, hk, 1))),
        "attn.dt_bias": (*one(a + "dt_bias", (size,)), *one(a + "forget_gate.dt_bias", (size,))),
        "attn.out_norm.weight": one(a + "o_norm.weight", (d,)),
        "attn.w_out.weight": one(a + "o_proj.weight", (h, size)),
    }


KIMI_LINEAR_48B_A3B = {  # moonshotai/Kimi-Linear-48B-A3B-Instruct (3 KDA layers to 1 MLA, MoE from layer 2)
    "architectures": [ARCHITECTURE], "model_type": "kimi_linear", "bos_token_id": 163584, "eos_token_id": 163586,
    "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304,
    "initializer_range": 0.02, "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 163839,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False,
    "topk_group": 1, "use_cache": True, "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
}

FAMILY = Family("kimi_linear", ARCHITECTURE, read, to_config, EXPERTS, tensors=tensors,
                shapes={"kimi-linear-48b-a3b": KIMI_LINEAR_48B_A3B})
