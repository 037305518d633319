"""Nemotron-H (`nemotron_h`): Mamba2 state-space layers mixed with attention and MLP layers by a pattern.

A Nemotron-H layer is ONE block: a norm and one mixer, added to the residual. `layers_block_type`
(or the older `hybrid_override_pattern`, a character per layer) says which:

- "linear_attention" (`M`; legacy "mamba"): Mamba2 (families/spec/recurrent.py `Mamba2Spec`): `mamba_num_heads`
  heads of `mamba_head_dim`, a state of `ssm_state_size` per head, B and C shared by `n_groups`
  groups, a causal convolution of `conv_kernel` (with a bias when `use_conv_bias`), the scan run
  in chunks of `chunk_size`, a gated RMSNorm per group. Its session state is fixed: an [P, N]
  matrix per head and the convolution's window (`RecurrentStateSpec`), whatever the context.
- "full_attention" (`*`; legacy "attention"): grouped-query attention with no position encoding
  at all (RoPE kind "none"): `num_attention_heads`, `num_key_value_heads`, `head_dim`, no biases.
- "mlp" (`-`): relu(up x)^2 down, no gate (`GluSpec` "relu2"), of `intermediate_size`.
- "moe" (`E`): `n_routed_experts` such relu^2 experts of `moe_intermediate_size`, DeepSeek-V3's
  sigmoid router (correction bias, `n_group` / `topk_group`, `num_experts_per_tok`,
  `norm_topk_prob`, `routed_scaling_factor`), and one shared relu^2 expert of
  `moe_shared_expert_intermediate_size` (Nemotron 3's MoE layers).

So a layer is `LayerSpec(mixer, None)` or `LayerSpec(None, mlp)`; each has the one norm of its
half. Its checkpoints lie under "backbone." (`layers.{i}.norm`, `layers.{i}.mixer.*`, the embedding
`embeddings`, the final norm `norm_f`), the norms' epsilon `layer_norm_epsilon`.

dt's lower clamp (layers/recurrent/mamba2.py): the published model clamps dt = softplus(dt + dt_bias) to
`time_step_limit` (by default [0, inf): not at all), and so does this engine, in every step.
transformers 5.24 clamps its chunked (prefill) scan at `time_step_min` instead and its one-token
step not at all, so it disagrees with itself wherever dt falls below `time_step_min` (0.001):
the logits of a prompt then differ from transformers' by what that clamp changes, and decode
steps agree. tests/stages/families/test_nemotron_h.py measures it.

Read and ignored: `time_step_min`, `time_step_max`, `time_step_floor` (initialisation, but for
transformers' clamp above), `expand` (the width is heads x head dim), `num_logits_to_keep`,
`use_mamba_kernels`, `rescale_prenorm_residual`, `residual_in_fp32` (transformers keeps the
residual in the model's dtype: the float32 reference is unchanged), `moe_shared_expert_overlap`
(an execution schedule), `mtp_layers_block_type` with no MTP layers, `auto_map`. Refused (one line
naming the key): activations other than SiLU (Mamba) and relu^2 (MLP), biases transformers does
not compute (`attention_bias`, `mamba_proj_bias`, `mlp_bias`), a sliding window, a state cache
other than float32, `time_step_limit` with a finite upper bound, an MoE's latent projection
(`moe_latent_size`), `n_shared_experts` other than 1, multi-token-prediction layers, shipped
quantized weights, any key the reader does not know.
"""

from __future__ import annotations

import math
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.config import MAX_LAYERS, ConfigReader
from tessera.stages.families.models.deepseek import read_alias
from tessera.stages.families.family import Family
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import GluSpec, MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.recurrent import Mamba2Spec
from tessera.stages.families.spec.rope import RopeSpec
from tessera.stages.families.tensors import Choices, Stacked, one, stacked

ARCHITECTURE = "NemotronHForCausalLM"
PREFIX = "backbone."
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers remaps them alike
RELU2 = GluSpec("relu2")
NOPE = RopeSpec("none")
IGNORED = ("time_step_min", "time_step_max", "time_step_floor", "mamba_dt_min", "mamba_dt_max",
           "mamba_dt_init_floor", "expand", "mamba_expand", "num_logits_to_keep", "use_mamba_kernels",
           "rescale_prenorm_residual", "residual_in_fp32", "moe_shared_expert_overlap", "auto_map")
# NemotronHConfig's defaults: what a config that leaves a key out means
DEFAULTS: dict[str, Any] = dict(
    vocab_size=131072, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=4096, intermediate_size=21504, ssm_state_size=128, mamba_num_heads=128,
    mamba_head_dim=64, n_groups=8, conv_kernel=4, chunk_size=128, n_routed_experts=8, moe_intermediate_size=7688,
    moe_shared_expert_intermediate_size=7688, num_experts_per_tok=2, routed_scaling_factor=1.0, n_group=1,
    topk_group=1, layer_norm_epsilon=1e-5,
)
DEFAULT_KINDS = ["linear_attention", "moe", "full_attention", "mlp"]  # NemotronHConfig's, absent any pattern


def read(config: ConfigReader) -> ModelSpec:
    """A Nemotron-H model from its config (module docstring)."""
    if config.has("quantization_config"):
        raise UnsupportedModel(f"{config.family} weights that ship quantized are not read yet (no shipped form of its "
                               "recurrent layers' projections is mapped): use a float checkpoint")
    config.expect("mamba_hidden_act", ("silu",), default="silu")
    config.expect("mlp_hidden_act", ("relu2",), default="relu2")
    for key in ("attention_bias", "mamba_proj_bias", "mlp_bias"):  # transformers builds none of these biases
        config.expect(key, (False,), default=False)
    config.expect("mamba_ssm_cache_dtype", ("float32",), default="float32")
    config.expect("num_nextn_predict_layers", (0,), default=0)
    config.value("mtp_layers_block_type", None)  # the MTP layers' kinds: there are none (above)
    config.value("mtp_hybrid_override_pattern", None)
    if config.value("sliding_window", None) is not None:
        raise config.refuse("sliding_window", "its attention layers attend to every position")
    for key in IGNORED:
        config.value(key, None)
    kinds = layer_kinds(config)
    eps = config.float("layer_norm_epsilon", DEFAULTS["layer_norm_epsilon"])
    if config.has("rms_norm_eps") and config.float("rms_norm_eps") != eps:
        raise config.refuse("rms_norm_eps", f"it differs from layer_norm_epsilon ({eps}), which transformers reads")
    config.value("rms_norm_eps", None)
    blocks = {"linear_attention": LayerSpec(read_mamba(config), None),
              "full_attention": LayerSpec(read_attention(config), None),
              "mlp": LayerSpec(None, MlpSpec(config.int("intermediate_size", DEFAULTS["intermediate_size"]), glu=RELU2)),
              "moe": LayerSpec(None, read_moe(config))}
    return ModelSpec(
        "nemotron_h", config.int("vocab_size", DEFAULTS["vocab_size"]), config.int("hidden_size", DEFAULTS["hidden_size"]),
        tuple(blocks[kind] for kind in kinds), rms_norm_eps=eps,
        max_position=config.int("max_position_embeddings", DEFAULTS["max_position_embeddings"]),
        tie_embeddings=config.bool("tie_word_embeddings", False), bos_token_id=config.bos_id(),
        eos_token_ids=config.eos_ids(), prefix=PREFIX,
    )


def layer_kinds(config: ConfigReader) -> list[str]:
    """`layers_block_type`, else `hybrid_override_pattern` read a character a layer, else transformers'
    default; refused where both are given and differ, or `num_hidden_layers` says another count."""
    listed = config.value("layers_block_type", None)
    pattern = config.value("hybrid_override_pattern", None)
    if pattern is not None:
        if not isinstance(pattern, str) or any(c not in PATTERN for c in pattern) or not 0 < len(pattern) <= MAX_LAYERS:
            raise config.refuse("hybrid_override_pattern", f"one of {sorted(PATTERN)} per layer (up to {MAX_LAYERS})")
    if listed is not None:
        if not isinstance(listed, list) or not 0 < len(listed) <= MAX_LAYERS \
                or any(not isinstance(k, str) or LEGACY_KINDS.get(k, k) not in PATTERN.values() for k in listed):
            raise config.refuse("layers_block_type", f"one of {sorted(PATTERN.values())} per layer (up to {MAX_LAYERS})")
        kinds = [LEGACY_KINDS.get(k, k) for k in listed]
        if pattern is not None and kinds != [PATTERN[c] for c in pattern]:
            raise config.refuse("hybrid_override_pattern", "it differs from layers_block_type")
    else:
        kinds = [PATTERN[c] for c in pattern] if pattern is not None else DEFAULT_KINDS
    if config.int("num_hidden_layers", len(kinds)) != len(kinds):
        raise config.refuse("num_hidden_layers", f"its layers_block_type has {len(kinds)} layers")
    return kinds


def read_mamba(config: ConfigReader) -> Mamba2Spec:
    """The Mamba2 mixer's sizes (module docstring; transformers' older key names read alike)."""
    return Mamba2Spec(
        config.int("mamba_num_heads", DEFAULTS["mamba_num_heads"]), config.int("mamba_head_dim", DEFAULTS["mamba_head_dim"]),
        config.int("ssm_state_size", DEFAULTS["ssm_state_size"]),
        read_alias(config, "n_groups", "mamba_n_groups", DEFAULTS["n_groups"], minimum=1),
        read_alias(config, "conv_kernel", "mamba_d_conv", DEFAULTS["conv_kernel"], minimum=1),
        chunk=read_alias(config, "chunk_size", "mamba_chunk_size", DEFAULTS["chunk_size"], minimum=1),
        conv_bias=read_flag(config, "use_conv_bias", "mamba_conv_bias", True),
        proj_bias=config.bool("use_bias", False), dt_min=read_dt_floor(config),
    )


def read_flag(config: ConfigReader, key: str, alias: str, default: bool) -> bool:
    """A boolean `key`, or its older name `alias`; refused when both are given and differ."""
    given = [config.bool(k) if config.value(k, None) is not None else None for k in (key, alias)]
    if None not in given and given[0] != given[1]:
        raise config.refuse(alias, f"it differs from {key} ({given[0]})")
    return next((g for g in given if g is not None), default)


def read_dt_floor(config: ConfigReader) -> float:
    """The lower bound of `time_step_limit` (or its older name `mamba_dt_limit`): dt's clamp (module
    docstring). Its upper bound must be infinite: a finite one is a clamp transformers never applies."""
    key = "time_step_limit" if config.has("time_step_limit") else "mamba_dt_limit"
    for name in ("time_step_limit", "mamba_dt_limit"):
        config.value(name, None)
    limit = config.config.get(key)
    if limit is None:
        return 0.0
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ModelFormatError(f"config field {key} has an impossible value {limit!r} (a pair [low, high])")
    low, high = limit
    if isinstance(low, bool) or not isinstance(low, (int, float)) or not math.isfinite(low) or low < 0:
        raise ModelFormatError(f"config field {key} has an impossible value {limit!r}")
    if not is_infinity(high):
        raise config.refuse(key, "a finite upper bound on dt is not computed (transformers never applies one)")
    return float(low)


def is_infinity(value: Any) -> bool:
    """Whether a JSON value means +infinity: a float (Python's json reads `Infinity`), the string, or the
    `{"__float__": "Infinity"}` transformers' config writer uses for non-finite floats."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    if isinstance(value, str):
        return value in ("Infinity", "inf")
    return isinstance(value, float) and value == math.inf


def read_attention(config: ConfigReader) -> AttentionSpec:
    """The attention layers' GQA, positions unencoded (module docstring)."""
    heads = config.int("num_attention_heads", DEFAULTS["num_attention_heads"])
    head_dim = config.int("head_dim", DEFAULTS["head_dim"])
    if config.int("attention_head_dim", head_dim) != head_dim:  # older configs' name, which transformers does not read
        raise config.refuse("attention_head_dim", f"it differs from head_dim ({head_dim}), which transformers reads")
    return AttentionSpec(heads, config.int("num_key_value_heads", DEFAULTS["num_key_value_heads"]), head_dim, NOPE)


def read_moe(config: ConfigReader) -> MlpSpec:
    """The sparse layers' MLP (module docstring): read whether or not a layer has one."""
    config.expect("moe_latent_size", (None,), default=None)
    config.expect("n_shared_experts", (1,), default=1)
    router = RouterSpec(
        "sigmoid_group_topk", config.int("num_experts_per_tok", DEFAULTS["num_experts_per_tok"]),
        renormalize=config.bool("norm_topk_prob", True), num_groups=config.int("n_group", DEFAULTS["n_group"]),
        topk_groups=config.int("topk_group", DEFAULTS["topk_group"]),
        scale=config.float("routed_scaling_factor", DEFAULTS["routed_scaling_factor"]),
    )
    return MlpSpec(config.int("moe_intermediate_size", DEFAULTS["moe_intermediate_size"]), "moe",
                   read_alias(config, "n_routed_experts", "num_local_experts", DEFAULTS["n_routed_experts"], minimum=1),
                   router, glu=RELU2,
                   shared_width=config.int("moe_shared_expert_intermediate_size",
                                           DEFAULTS["moe_shared_expert_intermediate_size"]))


def layer_kind(layer: LayerSpec) -> str:
    """A layer's `layers_block_type` entry."""
    if layer.attention is not None:
        return "linear_attention" if isinstance(layer.attention, Mamba2Spec) else "full_attention"
    assert layer.mlp is not None, "a layer has a mixer or an MLP"
    return "moe" if layer.mlp.kind == "moe" else "mlp"


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec`."""
    def first(kind: str) -> LayerSpec | None:
        return next((layer for layer in spec.layers if layer_kind(layer) == kind), None)

    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": "nemotron_h", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "layers_block_type": [layer_kind(layer) for layer in spec.layers],
        "layer_norm_epsilon": spec.rms_norm_eps, "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_embeddings, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2",
    }
    if (mamba := first("linear_attention")) is not None:
        m = mamba.attention
        assert isinstance(m, Mamba2Spec)
        config.update({"mamba_num_heads": m.num_heads, "mamba_head_dim": m.head_dim, "ssm_state_size": m.state_size,
                       "n_groups": m.num_groups, "conv_kernel": m.conv_kernel, "chunk_size": m.chunk,
                       "use_conv_bias": m.conv_bias, "use_bias": m.proj_bias, "time_step_limit": [m.dt_min, math.inf]})
    if (full := first("full_attention")) is not None:
        a = full.attention
        assert isinstance(a, AttentionSpec)
        config.update({"num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim})
    if (dense := first("mlp")) is not None and dense.mlp is not None:
        config["intermediate_size"] = dense.mlp.width
    if (sparse := first("moe")) is not None and sparse.mlp is not None and sparse.mlp.router is not None:
        moe, router = sparse.mlp, sparse.mlp.router
        config.update({"n_routed_experts": moe.num_experts, "moe_intermediate_size": moe.width,
                       "moe_shared_expert_intermediate_size": moe.shared_width, "num_experts_per_tok": router.top_k,
                       "norm_topk_prob": router.renormalize, "n_group": router.num_groups,
                       "topk_group": router.topk_groups, "routed_scaling_factor": router.scale})
    return with_special_ids(config, spec)


def tensors(spec: ModelSpec, layer: int) -> dict[str, Choices]:
    """Engine name -> checkpoint layout for every tensor of layer `layer`: its one norm and mixer (or MLP)."""
    ls, h = spec.layers[layer], spec.hidden_size
    p = f"{spec.prefix}layers.{layer}."
    x = p + "mixer."
    if isinstance(ls.attention, Mamba2Spec):
        m = ls.attention
        out = {
            "attn_norm.weight": one(p + "norm.weight", (h,)),
            "attn.w_in.weight": one(x + "in_proj.weight", (m.in_size, h)),
            "attn.conv": one(x + "conv1d.weight", (m.conv_channels, 1, m.conv_kernel)),
            "attn.dt_bias": one(x + "dt_bias", (m.num_heads,)),
            "attn.A_log": one(x + "A_log", (m.num_heads,)),
            "attn.D": one(x + "D", (m.num_heads,)),
            "attn.out_norm.weight": one(x + "norm.weight", (m.inner,)),
            "attn.w_out.weight": one(x + "out_proj.weight", (h, m.inner)),
        }
        if m.conv_bias:
            out["attn.conv_bias"] = one(x + "conv1d.bias", (m.conv_channels,))
        if m.proj_bias:
            out["attn.w_in.bias"] = one(x + "in_proj.bias", (m.in_size,))
            out["attn.w_out.bias"] = one(x + "out_proj.bias", (h,))
        return out
    if isinstance(ls.attention, AttentionSpec):
        a = ls.attention
        return {
            "attn_norm.weight": one(p + "norm.weight", (h,)),
            "attn.wqkv.weight": stacked([x + f"{n}_proj.weight" for n in "qkv"],
                                        [(a.q_size, h), (a.kv_size, h), (a.kv_size, h)]),
            "attn.wo.weight": one(x + "o_proj.weight", (h, a.q_size)),
        }
    mlp = ls.mlp
    assert mlp is not None, "a layer has a mixer or an MLP"
    out = {"mlp_norm.weight": one(p + "norm.weight", (h,))}
    if mlp.kind == "dense":
        out["mlp.w_up.weight"] = one(x + "up_proj.weight", (mlp.width, h))
        out["mlp.w_down.weight"] = one(x + "down_proj.weight", (h, mlp.width))
        return out
    e_count, w = mlp.num_experts, mlp.width
    out["mlp.router.weight"] = one(x + "gate.weight", (e_count, h))
    out["mlp.router.correction_bias"] = one(x + "gate.e_score_correction_bias", (e_count,))
    fused_up = Stacked((x + "experts.up_proj",), ((e_count, w, h),))
    fused_down = Stacked((x + "experts.down_proj",), ((e_count, h, w),))
    for e in range(e_count):  # as published (one tensor per expert) or as transformers 5 holds them (fused)
        out[f"mlp.experts.{e}.w_up.weight"] = (*one(x + f"experts.{e}.up_proj.weight", (w, h)),
                                                 Stacked(fused_up.names, fused_up.shapes, e))
        out[f"mlp.experts.{e}.w_down.weight"] = (*one(x + f"experts.{e}.down_proj.weight", (h, w)),
                                                   Stacked(fused_down.names, fused_down.shapes, e))
    out["mlp.shared.w_up.weight"] = one(x + "shared_experts.up_proj.weight", (mlp.shared_width, h))
    out["mlp.shared.w_down.weight"] = one(x + "shared_experts.down_proj.weight", (h, mlp.shared_width))
    return out


NEMOTRON_H_8B = {  # nvidia/Nemotron-H-8B-Base-8K's shape: 24 Mamba2, 4 attention and 24 MLP layers
    "architectures": [ARCHITECTURE], "model_type": "nemotron_h", "attention_bias": False, "bos_token_id": 1,
    "chunk_size": 128, "conv_kernel": 4, "eos_token_id": 2, "expand": 2, "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", "intermediate_size": 21504,
    "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "mamba_num_heads": 128,
    "mamba_proj_bias": False, "max_position_embeddings": 8192, "mlp_bias": False, "mlp_hidden_act": "relu2",
    "n_groups": 8, "num_attention_heads": 32, "num_hidden_layers": 52, "num_key_value_heads": 8,
    "residual_in_fp32": False, "rms_norm_eps": 1e-05, "sliding_window": None, "ssm_state_size": 128,
    "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_limit": [0.0, math.inf],
    "time_step_max": 0.1, "time_step_min": 0.001, "use_bias": False, "use_conv_bias": True, "vocab_size": 131072,
}

FAMILY = Family("nemotron_h", ARCHITECTURE, read, to_config, tensors=tensors, shapes={"nemotron-h-8b": NEMOTRON_H_8B})
