"""Gemma 4 (`gemma4`: the text model of its multimodal checkpoints, or a `gemma4_text` one): sliding-window
and global layers mixed by `layer_types`, per-layer inputs, KV-shared layers, and a MoE beside a dense MLP.

Every layer (transformers' `Gemma4TextDecoderLayer`): Gemma's norms after each half as well as
before (`LayerSpec.sandwich`); a GeGLU MLP (`gelu_pytorch_tanh`) of `intermediate_size`; then,
where `hidden_size_per_layer_input` (P) is set, the layer's per-layer input (layers/per_layer.py),
then a learned layer scalar. The embedding is scaled by sqrt(H); the logits are softcapped by
`final_logit_softcapping`; the head is tied by default.

Attention: q, k, v each RMSNormed per head (v without a weight), scores scaled by 1, no bias
unless `attention_bias` (q, k, v and o then). Sliding layers: `num_key_value_heads` of `head_dim`
within `sliding_window`, default RoPE (theta 1e4). Global ("full_attention") layers: heads of
`global_head_dim` (512), "proportional" RoPE over the whole head (theta 1e6, the first quarter of
each half turned); with `attention_k_eq_v`, `num_global_key_value_heads` key heads and no value
projection: the values are the keys' projection, before their norm and RoPE. transformers writes
a saved config's global head dims (and heads) as `per_layer_config` {layer: {head_dim,
num_key_value_heads}}; the published configs name `global_head_dim` and
`num_global_key_value_heads`; both are read.

KV sharing (`num_kv_shared_layers`, n): the last n layers project only queries and attend over the
keys and values of the last earlier layer of their kind (`AttentionSpec.kv_source`); with
`use_double_wide_mlp` their MLPs are twice as wide. A span never parts a shared layer from the
layer it reads (`ModelSpec.span_starts`): for E2B (35 layers, the last 20 shared, reading layers
13 and 14) spans start at layers 0..13.

MoE (`enable_moe_block`): beside the dense MLP, `num_experts` GeGLU experts of
`moe_intermediate_size`, top `top_k_experts`, each branch between its own norms, the router
reading the residual stream (MLP kind "dense_and_moe", router "normed_softmax_topk").

Published checkpoints (google/gemma-4-*: `PUBLISHED` below) are multimodal
(`Gemma4ForConditionalGeneration`): their text model runs from the `text_config`, its tensors under
"model.language_model."; the vision and audio towers are not run (their configs and token ids
are read and ignored, their tensors accepted and never read: `not_run`), and a request carrying
an image or audio is refused where requests are read (peer/http/requests.py `refuse_media`). A
text-only checkpoint (`Gemma4ForCausalLM`, what transformers saves for a `Gemma4TextConfig`)
reads the same, its tensors under "model.".

Refused (one line naming the key): an activation other than gelu_pytorch_tanh, layer kinds other
than the two, a last layer that is not global (transformers forces it global), RoPE types other
than default (sliding) and proportional or default (global), bidirectional attention ("all"),
`per_layer_config` entries other than head_dim and num_key_value_heads, per-layer input tables of
another vocabulary, shipped quantized weights, any key the reader does not know.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.config import ConfigReader, read_rope
from tessera.stages.families.family import Family
from tessera.stages.families.layer_types import FULL, SLIDING, read_layer_types, rope_blocks
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import GluSpec, MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.rope import RopeSpec
from tessera.stages.families.tensors import Choices, Shape, Stacked, one, stacked

TEXT, MULTIMODAL = "gemma4_text", "gemma4"  # the text config's model_type; the family's (the published one's)
ARCHITECTURES = {TEXT: "Gemma4ForCausalLM", MULTIMODAL: "Gemma4ForConditionalGeneration"}
TEXT_PREFIX, MULTIMODAL_PREFIX = "model.", "model.language_model."
# a multimodal config's keys about its other towers: read and ignored (the text model runs alone)
TOWER_KEYS = ("vision_config", "audio_config", "boi_token_id", "eoi_token_id", "image_token_id", "video_token_id",
              "boa_token_id", "eoa_token_index", "eoa_token_id", "audio_token_id", "vision_soft_tokens_per_image")
# where a multimodal checkpoint keeps its towers and their projections into the text model (not run)
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
GELU = GluSpec("gelu_tanh")
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
PATTERN = 6  # Gemma4TextConfig's default: five sliding layers, then a global one


def read(config: ConfigReader) -> ModelSpec:
    """A Gemma 4 model: the text model of a multimodal config (its `text_config`), or a text-only one."""
    if not config.has("text_config"):
        return read_text(config, TEXT_PREFIX)
    if config.has("quantization_config"):
        raise UnsupportedModel("gemma4 weights that ship quantized are not read yet: use a float checkpoint")
    text = config.value("text_config")
    if not isinstance(text, dict):
        raise ModelFormatError(f"config text_config {text!r} is not a JSON object")
    for key in TOWER_KEYS:  # the towers are not run (module docstring)
        config.value(key, None)
    tied = config.bool("tie_word_embeddings", True)  # the head's, as transformers ties it: the top level's
    bos, eos = config.bos_id(), config.eos_ids()  # a multimodal config may name them here instead
    inner = ConfigReader(text, MULTIMODAL)
    spec = read_text(inner, MULTIMODAL_PREFIX)
    inner.finish()
    if text.get("tie_word_embeddings") is not None and text["tie_word_embeddings"] != tied:
        raise config.refuse("tie_word_embeddings", f"it differs from text_config's ({text['tie_word_embeddings']!r})")
    # generation stops at the top level's ids too (transformers' generate reads them: the published
    # [1, 106] adds <end_of_turn> to the text model's <eos>)
    return replace(spec, tie_embeddings=tied, bos_token_id=spec.bos_token_id if spec.bos_token_id is not None else bos,
                   eos_token_ids=tuple(dict.fromkeys(spec.eos_token_ids + eos)))


def read_text(config: ConfigReader, prefix: str) -> ModelSpec:
    """The decoder from a (text) config (module docstring), its tensors under `prefix`."""
    if config.has("quantization_config"):
        raise UnsupportedModel("gemma4 weights that ship quantized are not read yet: use a float checkpoint")
    config.expect("hidden_activation", ("gelu_pytorch_tanh",), default="gelu_pytorch_tanh")
    config.expect("use_bidirectional_attention", (None, "vision"), default=None)  # "vision": only image tokens
    config.value("expert_intermediate_size", None)  # an unused key some configs carry (null)
    if config.has("expert_intermediate_size"):
        raise config.refuse("expert_intermediate_size", "Gemma 4's experts are moe_intermediate_size wide")
    num_layers, hidden = config.int("num_hidden_layers", 30), config.int("hidden_size", 2304)
    kinds = read_layer_types(config, num_layers, lambda i: FULL if (i + 1) % PATTERN == 0 else SLIDING)
    if kinds[-1] != FULL:
        raise config.refuse("layer_types", "the last layer must be full_attention (transformers forces it so)")
    heads, bias = config.int("num_attention_heads", 8), config.bool("attention_bias", False)
    k_eq_v = config.bool("attention_k_eq_v", False)
    head_dims, kv_heads = global_shapes(config, kinds, config.int("head_dim", 256),
                                        config.int("num_key_value_heads", 4), k_eq_v)
    ropes = read_ropes(config, kinds, head_dims)
    window = config.int("sliding_window", 512)
    base = AttentionSpec(heads, kv_heads[SLIDING], head_dims[SLIDING], ropes[SLIDING], qkv_bias=bias, o_bias=bias,
                         qk_norm=True, scale=1.0, v_norm=True)
    attentions = {SLIDING: replace(base, window=window),
                  FULL: replace(base, num_kv_heads=kv_heads[FULL], head_dim=head_dims[FULL], rope=ropes[FULL],
                                k_eq_v=k_eq_v)}
    shared = config.int("num_kv_shared_layers", 0, minimum=0)
    sources = kv_sources(kinds, shared)
    mlp, wide = read_mlp(config), config.bool("use_double_wide_mlp", False)
    per_layer, per_layer_vocab = read_per_layer(config, config.int("vocab_size", 262_144))
    layers = []
    for i, kind in enumerate(kinds):
        attention, layer_mlp = attentions[kind], mlp
        if i in sources:
            attention = replace(attention, kv_source=sources[i], k_eq_v=False)
            layer_mlp = replace(mlp, **({"shared_width": 2 * mlp.shared_width} if mlp.kind == "dense_and_moe"
                                        else {"width": 2 * mlp.width})) if wide else mlp
        layers.append(LayerSpec(attention, layer_mlp, sandwich=True, per_layer_input=per_layer, scalar=True))
    return ModelSpec(
        MULTIMODAL, config.int("vocab_size", 262_144), hidden, tuple(layers),
        rms_norm_eps=config.float("rms_norm_eps", 1e-6), max_position=config.int("max_position_embeddings", 131_072),
        tie_embeddings=config.bool("tie_word_embeddings", True), bos_token_id=config.bos_id(),
        eos_token_ids=config.eos_ids(), embed_scale=math.sqrt(hidden),
        logit_softcap=config.float("final_logit_softcapping", None), per_layer_vocab=per_layer_vocab, prefix=prefix,
    )


def global_shapes(config: ConfigReader, kinds: list[str], head_dim: int, kv_heads: int, k_eq_v: bool
                  ) -> tuple[dict[str, int], dict[str, int]]:
    """Each layer kind's head dim and key/value heads: the sliding layers' from `head_dim` and
    `num_key_value_heads`; the global layers' from `per_layer_config` where the config has one (what
    transformers saves), else from `global_head_dim` (512) and, with `attention_k_eq_v`,
    `num_global_key_value_heads` (as Gemma4TextConfig derives them)."""
    glob_dim, glob_heads = config.int("global_head_dim", None), config.int("num_global_key_value_heads", None)
    overrides = config.value("per_layer_config", None)
    if overrides is None:
        return ({SLIDING: head_dim, FULL: 512 if glob_dim is None else glob_dim},
                {SLIDING: kv_heads, FULL: glob_heads if k_eq_v and glob_heads is not None else kv_heads})
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
        raise ModelFormatError(f"config field per_layer_config has an impossible value {overrides!r}")
    per_layer: dict[int, dict[str, Any]] = {}
    for key, values in overrides.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < len(kinds)):
            raise ModelFormatError(f"config field per_layer_config has an impossible layer {key!r}")
        unknown = sorted(set(values) - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise config.refuse("per_layer_config", f"layer {key}'s {unknown[0]!r} is not computed per layer")
        per_layer[int(key)] = values
    dims: dict[str, int] = {}
    heads: dict[str, int] = {}
    for i, kind in enumerate(kinds):
        layer = per_layer.get(i, {})
        dim, kv = layer.get("head_dim", head_dim), layer.get("num_key_value_heads", kv_heads)
        for name, value in (("head_dim", dim), ("num_key_value_heads", kv)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelFormatError(f"config per_layer_config's {name} has an impossible value {value!r}")
        if dims.setdefault(kind, dim) != dim or heads.setdefault(kind, kv) != kv:
            raise config.refuse("per_layer_config", f"the {kind} layers differ in shape (transformers needs one per kind)")
    # what transformers ignores beside a per_layer_config (it pops global_head_dim): must not say otherwise
    for key, value, kind_value in (("global_head_dim", glob_dim, dims.get(FULL)),
                                   ("num_global_key_value_heads", glob_heads if k_eq_v else None, heads.get(FULL))):
        if value is not None and value != kind_value:
            raise config.refuse(key, f"per_layer_config gives the global layers {kind_value}")
    return dims, heads


def read_ropes(config: ConfigReader, kinds: list[str], head_dims: dict[str, int]) -> dict[str, RopeSpec]:
    """Each layer kind's RoPE: default on the sliding layers; proportional (or default) on the global
    ones, over each kind's whole head (its frequencies over the head dim, as transformers computes them)."""
    ropes: dict[str, RopeSpec] = {}
    for kind, block in rope_blocks(config, kinds, DEFAULT_ROPE).items():
        kind_name = block.get("rope_type", "default")
        if kind_name == "proportional":
            unknown = sorted(set(block) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"})
            if unknown:
                raise config.refuse("rope_parameters", f"{kind}'s {unknown[0]!r} is not computed")
            params = {k: block[k] for k in ("partial_rotary_factor", "factor") if block.get(k) is not None}
            for name, value in (("rope_theta", block.get("rope_theta")), *params.items()):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                    raise ModelFormatError(f"config rope_parameters.{kind}.{name} has an impossible value {value!r}")
            if params.get("partial_rotary_factor", 1.0) > 1:
                raise ModelFormatError(f"config rope_parameters.{kind}.partial_rotary_factor has an impossible value "
                                       f"{params['partial_rotary_factor']!r}")
            params.setdefault("partial_rotary_factor", 1.0)
            ropes[kind] = RopeSpec("proportional", float(block["rope_theta"]),
                                   tuple(sorted((k, float(v)) for k, v in params.items())))
        elif kind_name == "default":
            theta, scaling = read_rope({"rope_parameters": block})
            assert scaling is None
            ropes[kind] = RopeSpec("default", theta)
        else:
            raise config.refuse("rope_parameters", f"{kind}'s rope_type {kind_name!r}: default or proportional only")
    return {kind: ropes.get(kind, RopeSpec()) for kind in (SLIDING, FULL)}


def kv_sources(kinds: list[str], shared: int) -> dict[int, int]:
    """Layer -> the layer whose keys and values it attends over: each of the last `shared` layers reads
    the last earlier layer of its kind (transformers' `kv_sharing_modes`)."""
    first = len(kinds) - shared
    if shared and first < 1:
        raise ModelFormatError(f"config field num_kv_shared_layers has an impossible value {shared!r} "
                               f"(no layer of {len(kinds)} would compute keys and values)")
    last = {kind: i for i, kind in enumerate(kinds[:first])}
    missing = sorted(set(kinds[first:]) - set(last))
    if missing:
        raise ModelFormatError(f"config field num_kv_shared_layers {shared!r}: no earlier {missing[0]} layer "
                               "computes the keys and values the shared ones would read")
    return {i: last[kinds[i]] for i in range(first, len(kinds))}


def read_mlp(config: ConfigReader) -> MlpSpec:
    """The dense GeGLU, or (`enable_moe_block`) it beside the experts (module docstring)."""
    width = config.int("intermediate_size", 9216)
    if not config.bool("enable_moe_block", False):
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            config.value(key, None)
            if config.has(key):
                raise config.refuse(key, "enable_moe_block is false: no layer has experts")
        return MlpSpec(width, glu=GELU)
    experts, top_k = config.int("num_experts"), config.int("top_k_experts")
    router = RouterSpec("normed_softmax_topk", top_k)
    return MlpSpec(config.int("moe_intermediate_size"), "dense_and_moe", experts, router, shared_width=width, glu=GELU)


def read_per_layer(config: ConfigReader, vocab: int) -> tuple[int, int]:
    """(P, the per-layer table's rows): `hidden_size_per_layer_input` (default 256; 0 or null: none) and
    `vocab_size_per_layer_input`, which must be the vocabulary's (transformers looks every id up in it)."""
    null = "hidden_size_per_layer_input" in config.config and config.config["hidden_size_per_layer_input"] is None
    width = config.int("hidden_size_per_layer_input", 0 if null else 256, minimum=0)
    rows = config.int("vocab_size_per_layer_input", 262_144)
    if width and rows != vocab:
        raise config.refuse("vocab_size_per_layer_input", f"it differs from vocab_size ({vocab}): ids past it fail")
    return width, rows if width else 0


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec`: the text model's, or (its tensors under the
    multimodal prefix) a multimodal one around it, without towers."""
    kinds = [SLIDING if layer.attention.window is not None else FULL for layer in spec.layers]
    own = [layer for layer in spec.layers if layer.attention.kv_source is None]
    sliding = next((l for l in own if l.attention.window is not None), None)
    full = next(l for l in own if l.attention.window is None)
    first = (sliding or full).attention
    shared = sum(layer.attention.kv_source is not None for layer in spec.layers)
    mlp = full.mlp
    last = spec.layers[-1].mlp
    ropes = {}
    for kind, layer in ((SLIDING, sliding), (FULL, full)):
        if layer is not None:
            rope = layer.attention.rope
            ropes[kind] = {"rope_type": rope.kind, "rope_theta": rope.theta, **dict(rope.params)}
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[TEXT]], "model_type": TEXT, "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": first.num_heads, "num_key_value_heads": first.num_kv_heads, "head_dim": first.head_dim,
        "global_head_dim": full.attention.head_dim, "attention_k_eq_v": full.attention.k_eq_v,
        "num_global_key_value_heads": full.attention.num_kv_heads if full.attention.k_eq_v else None,
        "attention_bias": first.qkv_bias, "sliding_window": sliding.attention.window if sliding is not None else 512,
        "layer_types": kinds, "rope_parameters": ropes, "hidden_activation": "gelu_pytorch_tanh",
        "intermediate_size": mlp.shared_width if mlp.kind == "dense_and_moe" else mlp.width,
        "num_kv_shared_layers": shared, "use_double_wide_mlp": last != mlp and shared > 0,
        "hidden_size_per_layer_input": spec.per_layer_width, "vocab_size_per_layer_input": spec.per_layer_vocab or None,
        "final_logit_softcapping": spec.logit_softcap, "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position, "tie_word_embeddings": spec.tie_embeddings,
        "enable_moe_block": mlp.kind == "dense_and_moe",
    }
    if mlp.kind == "dense_and_moe":
        assert mlp.router is not None
        config.update({"num_experts": mlp.num_experts, "top_k_experts": mlp.router.top_k,
                       "moe_intermediate_size": mlp.width})
    config = with_special_ids({k: v for k, v in config.items() if v is not None}, spec)
    if spec.prefix == TEXT_PREFIX:
        return config
    text = {k: v for k, v in config.items() if k != "architectures"}
    return {"architectures": [ARCHITECTURES[MULTIMODAL]], "model_type": MULTIMODAL, "text_config": text,
            "tie_word_embeddings": spec.tie_embeddings}


def layer_tensors(spec: ModelSpec, layer: int) -> dict[str, Choices]:
    """Engine name -> checkpoint layout of every tensor of layer `layer` (transformers' names)."""
    ls, h = spec.layers[layer], spec.hidden_size
    at, mlp = ls.attention, ls.mlp
    p = f"{spec.prefix}layers.{layer}."
    a = p + "self_attn."
    names = [a + "q_proj", a + "k_proj", a + "v_proj"][: 1 if at.kv_source is not None else 2 if at.k_eq_v else 3]
    shapes: list[Shape] = [(at.q_size,), (at.kv_size,), (at.v_size,)][: len(names)]
    out: dict[str, Choices] = {
        "attn_norm.weight": one(p + "input_layernorm.weight", (h,)),
        "attn.wqkv.weight": stacked([n + ".weight" for n in names], [(*s, h) for s in shapes]),
        "attn.wo.weight": one(a + "o_proj.weight", (h, at.num_heads * at.value_width)),
        "attn.q_norm.weight": one(a + "q_norm.weight", (at.head_dim,)),
        "attn_out_norm.weight": one(p + "post_attention_layernorm.weight", (h,)),
    }
    if at.kv_source is None:
        out["attn.k_norm.weight"] = one(a + "k_norm.weight", (at.head_dim,))
    if at.qkv_bias:
        out["attn.wqkv.bias"] = stacked([n + ".bias" for n in names], list(shapes))
        out["attn.wo.bias"] = one(a + "o_proj.bias", (h,))
    dense = "mlp.dense." if mlp.kind == "dense_and_moe" else "mlp."
    width = mlp.shared_width if mlp.kind == "dense_and_moe" else mlp.width
    out[dense + "w_gate_up.weight"] = stacked([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                                              [(width, h), (width, h)])
    out[dense + "w_down.weight"] = one(p + "mlp.down_proj.weight", (h, width))
    if mlp.kind == "dense_and_moe":
        e, i = mlp.num_experts, mlp.width
        out.update({
            "mlp.norm.weight": one(p + "pre_feedforward_layernorm.weight", (h,)),
            "mlp.dense_out_norm.weight": one(p + "post_feedforward_layernorm_1.weight", (h,)),
            "mlp.router.weight": one(p + "router.proj.weight", (e, h)),
            "mlp.router.scale": one(p + "router.scale", (h,)),
            "mlp.router.expert_scale": one(p + "router.per_expert_scale", (e,)),
            "mlp.experts_norm.weight": one(p + "pre_feedforward_layernorm_2.weight", (h,)),
            "mlp.experts_out_norm.weight": one(p + "post_feedforward_layernorm_2.weight", (h,)),
        })
        for x in range(e):  # fused as published: gate rows, then up rows; [out, in]
            out[f"mlp.experts.{x}.w_gate_up.weight"] = (Stacked((p + "experts.gate_up_proj",), ((e, 2 * i, h),), x),)
            out[f"mlp.experts.{x}.w_down.weight"] = (Stacked((p + "experts.down_proj",), ((e, h, i),), x),)
    else:
        out["mlp_norm.weight"] = one(p + "pre_feedforward_layernorm.weight", (h,))
    out["mlp_out_norm.weight"] = one(p + "post_feedforward_layernorm.weight", (h,))
    if ls.per_layer_input:
        q = ls.per_layer_input
        out["per_layer.w_gate.weight"] = one(p + "per_layer_input_gate.weight", (q, h))
        out["per_layer.w_proj.weight"] = one(p + "per_layer_projection.weight", (h, q))
        out["per_layer.norm.weight"] = one(p + "post_per_layer_input_norm.weight", (h,))
    out["scalar"] = one(p + "layer_scalar", (1,))
    return out


def not_run(spec: ModelSpec) -> tuple[str, ...]:
    """What a checkpoint may hold that is not run: a KV-shared layer's key and value projections and
    norms (transformers' `_keys_to_ignore_on_load_unexpected`: the layer reads another's keys), and a
    multimodal checkpoint's towers."""
    shared = tuple(f"{spec.prefix}layers.{i}.self_attn.{name}" for i, layer in enumerate(spec.layers)
                   if layer.attention.kv_source is not None for name in ("k_proj.", "v_proj.", "k_norm.", "v_norm."))
    return shared + (TOWERS if spec.prefix == MULTIMODAL_PREFIX else ())


def published(layers: int, pattern: int, **text: Any) -> dict[str, Any]:
    """A published checkpoint's config (google/gemma-4-*: a Gemma4ForConditionalGeneration), its text model
    of `layers` layers, every `pattern`-th global, and its vision tower's config (not run)."""
    kinds = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    return {
        "architectures": [ARCHITECTURES[MULTIMODAL]], "model_type": MULTIMODAL, "tie_word_embeddings": True,
        "eos_token_id": [1, 106], "boi_token_id": 255_999, "eoi_token_id": 258_882, "image_token_id": 258_880,
        "video_token_id": 258_884, "audio_token_id": 258_881,
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 768, "num_hidden_layers": 16},
        "text_config": {
            "model_type": TEXT, "num_hidden_layers": layers, "layer_types": kinds, "vocab_size": 262_144,
            "head_dim": 256, "global_head_dim": 512, "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "rope_parameters": DEFAULT_ROPE, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, **text,
        },
    }


PUBLISHED = {
    "gemma-4-e2b": published(35, 5, hidden_size=1536, intermediate_size=6144, num_attention_heads=8,
                             num_key_value_heads=1, sliding_window=512, num_kv_shared_layers=20,
                             use_double_wide_mlp=True, hidden_size_per_layer_input=256,
                             vocab_size_per_layer_input=262_144, max_position_embeddings=131_072),
    "gemma-4-e4b": published(42, 6, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                             num_key_value_heads=2, sliding_window=512, num_kv_shared_layers=18,
                             hidden_size_per_layer_input=256, vocab_size_per_layer_input=262_144,
                             max_position_embeddings=131_072),
    "gemma-4-26b-a4b": published(30, 6, hidden_size=2816, intermediate_size=2112, num_attention_heads=16,
                                 num_key_value_heads=8, num_global_key_value_heads=2, attention_k_eq_v=True,
                                 sliding_window=1024, hidden_size_per_layer_input=0, enable_moe_block=True,
                                 num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                                 max_position_embeddings=262_144),
    "gemma-4-31b": published(60, 6, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                             num_key_value_heads=16, num_global_key_value_heads=4, attention_k_eq_v=True,
                             sliding_window=1024, hidden_size_per_layer_input=0, max_position_embeddings=262_144),
}

FAMILY = Family(MULTIMODAL, ARCHITECTURES[MULTIMODAL], read, to_config, tensors=layer_tensors, shapes=PUBLISHED,
                not_run=not_run, also=(ARCHITECTURES[TEXT],))
