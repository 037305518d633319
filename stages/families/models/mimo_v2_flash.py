"""MiMo-V2-Flash (`mimo_v2_flash`): sliding-window and global attention mixed by `layer_types`, sinks
in the sliding layers, a sigmoid-routed MoE, and multi-token-prediction layers read but not run.

Attention (transformers' `MiMoV2FlashAttention`): `num_attention_heads` query heads of `head_dim`
(192) for q and k, values of `v_head_dim` (128: `AttentionSpec.value_dim`) multiplied by
`attention_value_scale` (0.707) before they are cached (`value_scale`); scores scaled by
head_dim^-1/2; RoPE (half-split) on the first int(head_dim x `partial_rotary_factor`) dims of each
head (0.334: 64 of 192), with each layer kind's own base. Global ("full_attention") layers have
`num_key_value_heads` key/value heads; sliding ones twice as many, attend within
`sliding_window` positions (the query's own included) and have a learned sink logit per head
(gpt-oss's). By default layer 0 and every sixth layer are global, the rest sliding.

MLPs (`mlp_layer_types`, by default the first layer dense, the rest sparse): dense SwiGLU of
`intermediate_size`; sparse: `n_routed_experts` SwiGLU experts of `moe_intermediate_size` chosen
by DeepSeek-V3's sigmoid router (correction bias, `n_group`/`topk_group`, `norm_topk_prob`,
`routed_scaling_factor`), no shared experts.

The published config (XiaomiMiMo/MiMo-V2-Flash) also carries the keys of its own code, which
transformers does not read: `hybrid_layer_pattern` (1 = sliding), `moe_layer_freq`,
`swa_num_attention_heads`, `swa_num_key_value_heads`, `swa_head_dim`, `swa_v_head_dim`,
`rope_theta`, `swa_rope_theta`, `add_swa_attention_sink_bias`, `add_full_attention_sink_bias`,
`layernorm_epsilon`, `scoring_func`, `topk_method`, `n_shared_experts`, `sliding_window_size`
(transformers: the window is that + 1, the query included), `attention_chunk_size`. Each is
read and must say what transformers computes; a value that says otherwise is refused in one
line naming it (transformers would silently compute something else than that code did).

Multi-token prediction: `num_nextn_predict_layers` (3 published) MTP blocks under
`model.mtp.layers.{i}.`: `ModelSpec.mtp_layers`; a folder's `model.mtp.` tensors are accepted and
not run (transformers ignores them too), left for a drafter to read by name.

Tensors: as transformers names them, the sinks also as published (`self_attn.attention_sink_bias`),
the experts one tensor each (published) or fused; the router `mlp.gate.weight` and its
`mlp.gate.e_score_correction_bias`.

Refused (one line naming the key): an activation other than SiLU, layer kinds other than the two,
RoPE types other than default, shared experts, a router scored otherwise, any key unknown.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from tessera.stages.errors import ModelFormatError
from tessera.stages.families import tensors
from tessera.stages.families.config import ConfigReader
from tessera.stages.families.models.deepseek import read_alias
from tessera.stages.families.family import Family
from tessera.stages.families.layer_types import FULL, SLIDING, read_layer_types, rope_blocks
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.rope import RopeSpec
from tessera.stages.families.tensors import Choices, one

ARCHITECTURE = "MiMoV2FlashForCausalLM"
PARTIAL_ROTARY = 0.334  # MiMoV2FlashConfig's default partial_rotary_factor
DEFAULT_ROPE = {FULL: {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": PARTIAL_ROTARY},
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": PARTIAL_ROTARY}}
DEFAULT_WINDOW = 129  # MiMoV2FlashConfig.sliding_window
MTP_PREFIX = "model.mtp."  # where a checkpoint keeps its MTP blocks (read, not run)


def default_kind(i: int) -> str:
    """MiMoV2FlashConfig's default: global attention at layer 0 and every sixth layer."""
    return FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING


def read(config: ConfigReader) -> ModelSpec:
    """A MiMo-V2-Flash model from its config (module docstring)."""
    config.expect("hidden_act", ("silu",), default="silu")
    num_layers, hidden = config.int("num_hidden_layers", 48), config.int("hidden_size", 4096)
    kinds = read_layer_types(config, num_layers, default_kind)
    agree(config, "hybrid_layer_pattern", [int(kind == SLIDING) for kind in kinds])
    heads, kv = config.int("num_attention_heads", 64), config.int("num_key_value_heads", 4)
    head_dim, v_dim = config.int("head_dim", 192), config.int("v_head_dim", 128)
    for key, value in (("swa_num_attention_heads", heads), ("swa_num_key_value_heads", 2 * kv),
                       ("swa_head_dim", head_dim), ("swa_v_head_dim", v_dim)):
        agree(config, key, value)
    window = config.int("sliding_window", DEFAULT_WINDOW)
    size = config.int("sliding_window_size", None)
    if size is not None:  # MiMoV2FlashConfig: the reference attends to that many before the query
        window = size + 1
    agree(config, "attention_chunk_size", window - 1)
    ropes = read_ropes(config, kinds, head_dim)
    # an explicit null is 1.0 (transformers: `attention_value_scale if not None else 1.0`); absent, its 0.707
    null = "attention_value_scale" in config.config and config.config["attention_value_scale"] is None
    value_scale = config.value("attention_value_scale", 1.0 if null else 0.707)
    if isinstance(value_scale, bool) or not isinstance(value_scale, (int, float)) or not 0 < value_scale < math.inf:
        raise ModelFormatError(f"config field attention_value_scale has an impossible value {value_scale!r}")
    agree(config, "add_swa_attention_sink_bias", True)
    agree(config, "add_full_attention_sink_bias", False)
    bias = config.bool("attention_bias", False)
    full = AttentionSpec(heads, kv, head_dim, ropes[FULL][0] if FULL in ropes else RopeSpec(), qkv_bias=bias,
                         rotary_dim=ropes[FULL][1] if FULL in ropes else None, value_dim=v_dim,
                         value_scale=float(value_scale))
    sliding = replace(full, num_kv_heads=2 * kv, window=window, sinks=True,
                      rope=ropes[SLIDING][0] if SLIDING in ropes else RopeSpec(),
                      rotary_dim=ropes[SLIDING][1] if SLIDING in ropes else None)
    mlps = read_mlps(config, num_layers)
    eps = config.float("rms_norm_eps", 1e-5)
    agree(config, "layernorm_epsilon", eps)
    return ModelSpec(
        "mimo_v2_flash", config.int("vocab_size", 152576), hidden,
        tuple(LayerSpec(sliding if kind == SLIDING else full, mlp) for kind, mlp in zip(kinds, mlps)),
        rms_norm_eps=eps, max_position=config.int("max_position_embeddings", 131072),
        tie_embeddings=config.bool("tie_word_embeddings", False), bos_token_id=config.bos_id(),
        eos_token_ids=config.eos_ids(), mtp_layers=config.int("num_nextn_predict_layers", 0, minimum=0),
    )


def agree(config: ConfigReader, key: str, computed: Any) -> None:
    """A key transformers does not read (the published config's own): absent, or saying what is computed."""
    value = config.value(key, None)
    if value is not None and (value != computed or isinstance(value, bool) != isinstance(computed, bool)):
        raise config.refuse(key, f"transformers computes {computed!r} here")


def read_ropes(config: ConfigReader, kinds: list[str], head_dim: int) -> dict[str, tuple[RopeSpec, int | None]]:
    """Each layer kind's RoPE and the dims it turns (None: all), from its block (module docstring)."""
    out, fractions = {}, {}
    for kind, block in rope_blocks(config, kinds, DEFAULT_ROPE).items():
        if block.get("rope_type", "default") != "default":
            raise config.refuse("rope_parameters", f"{kind}'s rope_type {block['rope_type']!r}: only default is computed")
        unknown = sorted(set(block) - {"rope_type", "rope_theta", "partial_rotary_factor"})
        if unknown:
            raise config.refuse("rope_parameters", f"{kind}'s {unknown[0]!r} is not computed")
        theta, fraction = block.get("rope_theta"), block.get("partial_rotary_factor", PARTIAL_ROTARY)
        for name, value in (("rope_theta", theta), ("partial_rotary_factor", fraction)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ModelFormatError(f"config rope_parameters.{kind}.{name} has an impossible value {value!r}")
        dims = int(head_dim * fraction)
        if dims < 2 or dims % 2 or dims > head_dim:
            raise ModelFormatError(f"config rope_parameters.{kind}.partial_rotary_factor {fraction!r} turns {dims} "
                                   f"of {head_dim} dims (an even number from 2 is needed)")
        out[kind] = (RopeSpec("default", float(theta)), None if dims == head_dim else dims)
        fractions[kind] = fraction
    # the published config's own keys for the same (transformers reads only rope_parameters)
    for kind, theta_key in ((FULL, "rope_theta"), (SLIDING, "swa_rope_theta")):
        if kind in out:
            agree(config, theta_key, out[kind][0].theta)
    if len(set(fractions.values())) == 1:
        agree(config, "partial_rotary_factor", next(iter(fractions.values())))
    elif config.has("partial_rotary_factor"):
        raise config.refuse("partial_rotary_factor", "the layer kinds' RoPE blocks turn different fractions")
    return out


def read_mlps(config: ConfigReader, num_layers: int) -> list[MlpSpec]:
    """Each layer's MLP (`mlp_layer_types`: "dense" or "sparse"; by default the first dense)."""
    config.expect("scoring_func", ("sigmoid",), default="sigmoid")
    config.expect("topk_method", ("noaux_tc",), default="noaux_tc")
    config.expect("moe_router_dtype", ("float32",), default="float32")  # transformers keeps the router in float32
    if config.int("n_shared_experts", 0, minimum=0):
        raise config.refuse("n_shared_experts", "MiMo-V2-Flash's MoE has no shared experts")
    kinds = config.value("mlp_layer_types", None)
    if kinds is None:
        kinds = ["dense"] + ["sparse"] * (num_layers - 1)
    if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ModelFormatError(f"config field mlp_layer_types has an impossible value {kinds!r} "
                               f"(\"dense\" or \"sparse\" per layer: {num_layers})")
    agree(config, "moe_layer_freq", [int(kind == "sparse") for kind in kinds])
    dense = MlpSpec(config.int("intermediate_size", 16384))
    router = RouterSpec(
        "sigmoid_group_topk", config.int("num_experts_per_tok", 8), renormalize=config.bool("norm_topk_prob", True),
        num_groups=config.int("n_group", 1), topk_groups=config.int("topk_group", 1),
        scale=config.float("routed_scaling_factor", 1.0),  # the published null is 1.0 (transformers)
    )
    experts = read_alias(config, "n_routed_experts", "num_local_experts", 256, minimum=1)
    sparse = MlpSpec(config.int("moe_intermediate_size", 2048), "moe", experts, router)
    return [sparse if kind == "sparse" else dense for kind in kinds]


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec`."""
    kinds = [SLIDING if layer.attention.window is not None else FULL for layer in spec.layers]
    full = next((l.attention for l in spec.layers if l.attention.window is None), None)
    sliding = next((l.attention for l in spec.layers if l.attention.window is not None), None)
    some = full or sliding
    assert isinstance(some, AttentionSpec)
    ropes = {}
    for kind, at in ((FULL, full), (SLIDING, sliding)):
        if at is not None:
            ropes[kind] = {"rope_type": "default", "rope_theta": at.rope.theta,
                           "partial_rotary_factor": at.rope_dim / at.head_dim}
    sparse = next((l.mlp for l in spec.layers if l.mlp.kind == "moe"), None)
    dense = next((l.mlp for l in spec.layers if l.mlp.kind == "dense"), None)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": "mimo_v2_flash", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers, "hidden_act": "silu",
        "num_attention_heads": some.num_heads,
        "num_key_value_heads": full.num_kv_heads if full is not None else some.num_kv_heads // 2,
        "head_dim": some.head_dim, "v_head_dim": some.value_width, "attention_value_scale": some.value_scale,
        "attention_bias": some.qkv_bias, "layer_types": kinds, "rope_parameters": ropes,
        "sliding_window": sliding.window if sliding is not None else DEFAULT_WINDOW,
        "mlp_layer_types": ["sparse" if l.mlp.kind == "moe" else "dense" for l in spec.layers],
        "intermediate_size": dense.width if dense is not None else 16384,
        "rms_norm_eps": spec.rms_norm_eps, "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_embeddings, "num_nextn_predict_layers": spec.mtp_layers,
    }
    if sparse is not None:
        assert sparse.router is not None
        config.update({"moe_intermediate_size": sparse.width, "n_routed_experts": sparse.num_experts,
                       "num_experts_per_tok": sparse.router.top_k, "norm_topk_prob": sparse.router.renormalize,
                       "n_group": sparse.router.num_groups, "topk_group": sparse.router.topk_groups,
                       "routed_scaling_factor": sparse.router.scale})
    return with_special_ids(config, spec)


def layer_tensors(spec: ModelSpec, layer: int) -> dict[str, Choices]:
    """Engine name -> checkpoint layouts of layer `layer` (module docstring): every family's, and the
    sliding layers' sinks under either name."""
    out = tensors.layer_tensors(spec, layer)
    at = spec.layers[layer].attention
    if at.sinks:
        p = f"model.layers.{layer}.self_attn."
        out["attn.sinks"] = (*one(p + "sinks", (at.num_heads,)), *one(p + "attention_sink_bias", (at.num_heads,)))
    return out


# XiaomiMiMo/MiMo-V2-Flash (its config's own keys as published: each says what transformers computes)
MIMO_V2_FLASH = {
    "architectures": [ARCHITECTURE], "model_type": "mimo_v2_flash", "vocab_size": 152576, "hidden_size": 4096,
    "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192,
    "v_head_dim": 128, "swa_num_attention_heads": 64, "swa_num_key_value_heads": 8, "swa_head_dim": 192,
    "swa_v_head_dim": 128, "rope_theta": 5_000_000.0, "swa_rope_theta": 10_000.0, "partial_rotary_factor": 0.334,
    "attention_value_scale": 0.707, "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
    "sliding_window": 128, "sliding_window_size": 128, "attention_chunk_size": 128,
    "hybrid_layer_pattern": [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(48)],
    "moe_layer_freq": [0] + [1] * 47, "intermediate_size": 16384, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": None, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": None,
    "num_nextn_predict_layers": 3, "max_position_embeddings": 262144, "layernorm_epsilon": 1e-5,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 151645,
}

FAMILY = Family("mimo_v2_flash", ARCHITECTURE, read, to_config, tensors=layer_tensors,
                shapes={"mimo-v2-flash": MIMO_V2_FLASH}, not_run=lambda spec: (MTP_PREFIX,) if spec.mtp_layers else ())
