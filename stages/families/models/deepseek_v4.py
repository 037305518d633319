"""DeepSeek-V4 (`deepseek_v4`): compressed sparse attention, hyper-connections, hash and sqrt-softplus routing.

Every layer's attention is DeepSeek-V4's (families/spec/compressed.py `CompressedAttentionSpec`,
layers/compressed.py): `num_attention_heads` query heads of `head_dim` from a `q_lora_rank`
latent, ONE key-value head whose rows are keys and values, RoPE in interleaved pairs on the
last `qk_rope_head_dim` dims (`partial_rotary_factor` x head_dim), a sink logit per head, a
grouped output projection (`o_groups` groups to `o_lora_rank` each, then to H), a window of
`sliding_window` positions, and per `layer_types`:

    sliding_attention              the window only, turned by the "main" RoPE
    compressed_sparse_attention    + an entry every `compress_rates[...]` positions (overlapping
                                   windows), of which an indexer (`index_n_heads` x
                                   `index_head_dim`) picks each query's `index_topk`
    heavily_compressed_attention   + an entry every `compress_rates[...]` positions, all read

(the compressed layers turned by the "compress" RoPE, base `compress_rope_theta`, YaRN where
the config scales it, with no attention factor). The residual is `hc_mult` streams mixed
around each block by hyper-connections (families/spec/layer.py `HyperSpec`, layers/hyper.py), with
`hc_sinkhorn_iters` and `hc_eps`; the embedding enters every stream and the head mixes them
back before the final norm. So a hop between stages carries hc_mult x hidden_size values a
token, plus the token id (next paragraph): `ModelSpec.hop_width`.

Every layer is sparse (`mlp_layer_types`): `n_routed_experts` experts of
`moe_intermediate_size` and one shared expert of the same width, each a SwiGLU with gate and
up clamped at `swiglu_limit` ("clamped_silu"); the router's scores are sqrt(softplus) (or
sigmoid, `scoring_func`), `num_experts_per_tok` picked by score plus a correction bias
("moe") or read by token id from a fixed table ("hash_moe", the first layers), weighted by
their scores over their sum, times `routed_scaling_factor`. A hash layer reads each row's
token id, which the hop therefore carries (three exact base-256 digits: layers/hop.py).

A key the config leaves out means what transformers' `DeepseekV4Config` defaults to,
including its derivations: `layer_types` from the legacy per-layer `compress_ratios`
(0 / 4 / 128) or, absent both, two heavily compressed layers then alternating; the rates
from the legacy `compress_rate_csa` / `compress_rate_hca`; `mlp_layer_types` from the legacy
`num_hash_layers` (else 3); the rope dims from the legacy `qk_rope_head_dim`; the two RoPEs
from a flat `rope_parameters` / `rope_scaling` (the compress one takes its scaling, the main
one is plain) or as nested under "main" and "compress" (then the top-level `rope_theta` and
`compress_rope_theta` are not read by transformers, nor here).

Refused (one line naming the key): a bias on the attention or the MLP (transformers builds
none whatever the config says), an activation other than SiLU, `scoring_func` softmax (which
transformers cannot run) or any other, `norm_topk_prob` false and `n_shared_experts` other than
1 (transformers normalises and builds one shared expert whatever they say), more than one
key-value head, a layer or MLP type it does not know, a legacy compression ratio other than 0,
4, 128, legacy keys that disagree with the ones they stand for, per-type RoPEs whose rotary
fraction differs from the model's, RoPE types the engine does not compute, shipped quantized
weights (the published FP8 / FP4: read by its weight format), and any key the reader does not
know. Read and ignored: `num_nextn_predict_layers` (its multi-token-prediction layers, `mtp.*`
in the published checkpoint, are not run: `ModelSpec.mtp_layers`).

Checkpoints: transformers' layout (`self_attn.q_a_proj`, fused experts), the published one
(`layers.{i}.attn.wq_a`, `ffn.experts.{e}.w1`, `embed.weight`, `head.weight`, `hc_head_fn`) and
transformers' `save_original_format` mix of both (the published names under `model.`) are
each read (`tensors`, `EDGE_ALIASES`).
"""

from __future__ import annotations

from typing import Any

from tessera.stages.errors import ModelFormatError
from tessera.stages.families.config import ConfigReader, read_rope
from tessera.stages.families.models.deepseek import read_alias, read_mtp_layers
from tessera.stages.families.family import Family
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.spec.compressed import CompressedAttentionSpec
from tessera.stages.families.spec.layer import HyperSpec, LayerSpec
from tessera.stages.families.spec.mlp import GluSpec, MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.rope import RopeSpec
from tessera.stages.families.tensors import Choices, Shape, Stacked, one, stacked

ARCHITECTURES = {"deepseek_v4": "DeepseekV4ForCausalLM"}
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
LEGACY_RATIOS = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' `_COMPRESS_RATIO_TO_LAYER_TYPE`
DEFAULT_RATES = {CSA: 4, HCA: 128}
LEGACY_RATES = {"compress_rate_csa": CSA, "compress_rate_hca": HCA}
MLP_TYPES = ("hash_moe", "moe")
DEFAULT_HASH_LAYERS = 3
SCORING = {"sqrtsoftplus": "sqrtsoftplus_topk", "sigmoid": "sigmoid_group_topk"}
DEFAULT_ROPE_FRACTION = 64 / 512  # qk_rope_head_dim / head_dim of the published models
ROPE_LABELS = ("main", "compress")


def read_layer_types(config: ConfigReader, num_layers: int) -> list[str]:
    """`layer_types`, else the legacy `compress_ratios`, else transformers' default (module docstring)."""
    types, ratios = config.value("layer_types", None), config.value("compress_ratios", None)
    if ratios is not None:
        if not isinstance(ratios, list) or len(ratios) != num_layers:
            raise ModelFormatError(f"config field compress_ratios has an impossible value {ratios!r} ({num_layers} layers)")
        if any(r not in LEGACY_RATIOS or isinstance(r, bool) for r in ratios):
            raise config.refuse("compress_ratios", f"tessera reads the ratios {sorted(LEGACY_RATIOS)}")
        legacy = [LEGACY_RATIOS[r] for r in ratios]
        if types is not None and types != legacy:
            raise config.refuse("compress_ratios", f"it differs from layer_types {types!r}")
        types = legacy
    if types is None:
        types = [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelFormatError(f"config field layer_types has an impossible value {types!r} ({num_layers} layers)")
    if any(t not in LAYER_TYPES for t in types):
        raise config.refuse("layer_types", f"tessera computes the types {list(LAYER_TYPES)}")
    return types


def read_rates(config: ConfigReader) -> dict[str, int]:
    """Positions per compressed entry of each compressed layer type (`compress_rates`, the legacy keys)."""
    rates = config.value("compress_rates", None)
    if rates is None:
        rates = dict(DEFAULT_RATES)
    if not isinstance(rates, dict):
        raise ModelFormatError(f"config field compress_rates has an impossible value {rates!r}")
    if set(rates) - set(DEFAULT_RATES):
        raise config.refuse("compress_rates", f"tessera compresses the layer types {list(DEFAULT_RATES)}")
    rates = {**DEFAULT_RATES, **rates}
    for key, kind in LEGACY_RATES.items():
        legacy = config.int(key, None)
        if legacy is not None:
            rates[kind] = legacy
    for kind, rate in rates.items():
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ModelFormatError(f"config field compress_rates has an impossible value {rate!r} for {kind}")
    return rates


def read_mlp_types(config: ConfigReader, num_layers: int) -> list[str]:
    """`mlp_layer_types`, else the first `num_hash_layers` (legacy; else 3) hash_moe, the rest moe."""
    types = config.value("mlp_layer_types", None)
    hashed = config.int("num_hash_layers", None, minimum=0)
    if types is None:
        n = DEFAULT_HASH_LAYERS if hashed is None else hashed
        types = ["hash_moe"] * min(num_layers, n) + ["moe"] * max(0, num_layers - n)
    elif hashed is not None and types != ["hash_moe"] * min(num_layers, hashed) + ["moe"] * max(0, num_layers - hashed):
        raise config.refuse("num_hash_layers", f"it differs from mlp_layer_types {types!r}")
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelFormatError(f"config field mlp_layer_types has an impossible value {types!r} ({num_layers} layers)")
    if any(t not in MLP_TYPES for t in types):
        raise config.refuse("mlp_layer_types", f"tessera computes the types {list(MLP_TYPES)}")
    return types


def read_rope_dim(config: ConfigReader, head_dim: int) -> tuple[int, float]:
    """(dims RoPE turns, the fraction of head_dim): `partial_rotary_factor`, else the legacy
    `qk_rope_head_dim` / head_dim, else 64 / 512; both given must agree."""
    fraction = config.value("partial_rotary_factor", None)
    legacy = config.int("qk_rope_head_dim", None)
    if fraction is None:
        fraction = legacy / head_dim if legacy is not None else DEFAULT_ROPE_FRACTION
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ModelFormatError(f"config field partial_rotary_factor has an impossible value {fraction!r}")
    turned = int(head_dim * fraction)  # as transformers sizes its rotary tables
    if legacy is not None and legacy != turned:
        raise config.refuse("qk_rope_head_dim", f"it differs from partial_rotary_factor {fraction} x head_dim {head_dim}")
    if turned < 2 or turned % 2:
        raise config.refuse("partial_rotary_factor", f"it turns {turned} dims of {head_dim}: an even number is needed")
    return turned, float(fraction)


def read_ropes(config: ConfigReader, fraction: float) -> dict[str, RopeSpec]:
    """The "main" and "compress" RoPEs, nested or flat (module docstring)."""
    config.read.update({"rope_parameters", "rope_scaling", "rope_theta", "compress_rope_theta"})
    block = config.config.get("rope_scaling") or config.config.get("rope_parameters") or {}
    if not isinstance(block, dict):
        raise ModelFormatError(f"config rope_parameters {block!r} is not a JSON object")
    if isinstance(block.get("main"), dict) and isinstance(block.get("compress"), dict):
        blocks = {label: dict(block[label]) for label in ROPE_LABELS}
    else:
        flat = {k: v for k, v in block.items() if k not in ROPE_LABELS}
        main_theta = config.config.get("rope_theta", flat.get("rope_theta", 10000.0))
        compress = {**flat, "rope_theta": config.config.get("compress_rope_theta", 160000.0),
                    "partial_rotary_factor": fraction}
        compress.setdefault("rope_type", compress.pop("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)  # transformers': V4 does not scale cos and sin
        blocks = {"main": {"rope_type": "default", "rope_theta": main_theta}, "compress": compress}
    ropes = {}
    for label, sub in blocks.items():
        own = sub.pop("partial_rotary_factor", fraction)
        if own != fraction:
            raise config.refuse("rope_parameters", f"its {label} RoPE turns {own} of each head, the model {fraction}")
        theta, scaling = read_rope({"rope_parameters": sub})
        ropes[label] = RopeSpec("default", theta) if scaling is None else RopeSpec(
            scaling["rope_type"], theta, tuple(sorted((k, v) for k, v in scaling.items() if k != "rope_type")))
    return ropes


def read(config: ConfigReader) -> ModelSpec:
    """A DeepSeek-V4 model from its config (module docstring)."""
    config.expect("hidden_act", ("silu",), default="silu")
    config.expect("attention_bias", (False,), default=False)
    config.expect("mlp_bias", (False,), default=False)
    config.expect("num_key_value_heads", (1,), default=1)
    config.expect("n_shared_experts", (1,), default=1)
    config.expect("norm_topk_prob", (True,), default=True)
    scoring = config.expect("scoring_func", tuple(SCORING), default="sqrtsoftplus")
    vocab, hidden = config.int("vocab_size"), config.int("hidden_size")
    num_layers, heads = config.int("num_hidden_layers"), config.int("num_attention_heads")
    head_dim = config.int("head_dim", 512)
    rope_dim, fraction = read_rope_dim(config, head_dim)
    ropes = read_ropes(config, fraction)
    rates = read_rates(config)
    eps = config.float("rms_norm_eps", 1e-6)
    shape = dict(num_heads=heads, head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=config.int("q_lora_rank", 1024),
                 o_groups=config.int("o_groups", 8), o_lora_rank=config.int("o_lora_rank", 1024),
                 window=config.int("sliding_window", 128), norm_eps=eps)
    index = dict(index_heads=config.int("index_n_heads", 64), index_head_dim=config.int("index_head_dim", 128),
                 index_topk=config.int("index_topk", 512))
    attentions = {
        SLIDING: CompressedAttentionSpec(**shape, rope=ropes["main"]),
        CSA: CompressedAttentionSpec(**shape, rope=ropes["compress"], ratio=rates[CSA], **index),
        HCA: CompressedAttentionSpec(**shape, rope=ropes["compress"], ratio=rates[HCA]),
    }
    width = read_alias(config, "moe_intermediate_size", "intermediate_size", 2048, minimum=1)
    experts = read_alias(config, "n_routed_experts", "num_local_experts", 256, minimum=1)
    router = dict(kind=SCORING[scoring], top_k=config.int("num_experts_per_tok", 6), renormalize=True,
                  scale=config.float("routed_scaling_factor", 1.5))
    glu = GluSpec("clamped_silu", limit=config.float("swiglu_limit", 10.0))
    mlps = {kind: MlpSpec(width, "moe", experts, RouterSpec(**router, hash_vocab=vocab if kind == "hash_moe" else 0),
                          shared_width=width, glu=glu) for kind in MLP_TYPES}
    hyper = HyperSpec(config.int("hc_mult", 4), config.int("hc_sinkhorn_iters", 20), config.float("hc_eps", 1e-6))
    layers = tuple(LayerSpec(attentions[a], mlps[m], hyper)
                   for a, m in zip(read_layer_types(config, num_layers), read_mlp_types(config, num_layers)))
    return ModelSpec(
        "deepseek_v4", vocab, hidden, layers, rms_norm_eps=eps,
        max_position=config.int("max_position_embeddings", 1048576),
        tie_embeddings=config.bool("tie_word_embeddings", False), bos_token_id=config.bos_id(),
        eos_token_ids=config.eos_ids(), mtp_layers=read_mtp_layers(config),
    )


def layer_type(attention: CompressedAttentionSpec) -> str:
    return SLIDING if not attention.ratio else CSA if attention.indexed else HCA


def rope_block(rope: RopeSpec, fraction: float) -> dict[str, Any]:
    return {"rope_type": rope.kind, "rope_theta": rope.theta, **dict(rope.params), "partial_rotary_factor": fraction}


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec` (transformers' nested form)."""
    attentions = [layer.attention for layer in spec.layers]
    assert all(isinstance(a, CompressedAttentionSpec) for a in attentions), "every DeepSeek-V4 layer is compressed"
    by_type = {layer_type(a): a for a in attentions}  # type: ignore[arg-type]
    first: CompressedAttentionSpec = attentions[0]  # type: ignore[assignment]
    fraction = first.rope_dim / first.head_dim
    main = by_type[SLIDING].rope if SLIDING in by_type else RopeSpec("default", 10000.0)
    compress = next((by_type[t].rope for t in (CSA, HCA) if t in by_type), RopeSpec("default", 160000.0))
    indexed = by_type.get(CSA)
    mlp = spec.layers[0].mlp
    assert mlp.router is not None and spec.hyper is not None, "every DeepSeek-V4 layer is sparse and hyper-connected"
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES["deepseek_v4"]], "model_type": "deepseek_v4",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": first.num_heads, "num_key_value_heads": 1, "head_dim": first.head_dim,
        "q_lora_rank": first.q_lora_rank, "o_groups": first.o_groups, "o_lora_rank": first.o_lora_rank,
        "sliding_window": first.window, "partial_rotary_factor": fraction,
        "rope_parameters": {"main": rope_block(main, fraction), "compress": rope_block(compress, fraction)},
        "layer_types": [layer_type(a) for a in attentions],  # type: ignore[arg-type]
        "compress_rates": {**DEFAULT_RATES, **{t: by_type[t].ratio for t in (CSA, HCA) if t in by_type}},
        "index_n_heads": indexed.index_heads if indexed else 64,
        "index_head_dim": indexed.index_head_dim if indexed else 128,
        "index_topk": indexed.index_topk if indexed else 512,
        "hc_mult": spec.hyper.streams, "hc_sinkhorn_iters": spec.hyper.sinkhorn_iters, "hc_eps": spec.hyper.eps,
        "mlp_layer_types": ["hash_moe" if layer.mlp.router and layer.mlp.router.hash_vocab else "moe"
                            for layer in spec.layers],
        "moe_intermediate_size": mlp.width, "n_routed_experts": mlp.num_experts, "n_shared_experts": 1,
        "num_experts_per_tok": mlp.router.top_k, "norm_topk_prob": True, "routed_scaling_factor": mlp.router.scale,
        "scoring_func": next(k for k, v in SCORING.items() if v == mlp.router.kind), "swiglu_limit": mlp.glu.limit,
        "hidden_act": "silu", "rms_norm_eps": spec.rms_norm_eps, "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_embeddings, "num_nextn_predict_layers": spec.mtp_layers,
    }
    return with_special_ids(config, spec)


# -- tensors ---------------------------------------------------------------------------------
# Each engine tensor in three layouts: transformers' (`model.layers.{i}.self_attn.q_a_proj`, experts
# fused), DeepSeek's as transformers writes it back (`model.layers.{i}.attn.wq_a`: save_original_format),
# and DeepSeek's as published (`layers.{i}.attn.wq_a`). Of the published layer names, those differing from
# transformers' (the rest differ only by prefix).
PUBLISHED = {  # engine name: (transformers' name under the layer, DeepSeek's under it)
    "attn_norm.weight": ("input_layernorm.weight", "attn_norm.weight"),
    "mlp_norm.weight": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "attn.wq_a.weight": ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    "attn.q_norm.weight": ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    "attn.wq_b.weight": ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    "attn.wkv.weight": ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    "attn.kv_norm.weight": ("self_attn.kv_norm.weight", "attn.norm.weight"),
    "attn.wo_a": ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    "attn.wo_b.weight": ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    "attn.sinks": ("self_attn.sinks", "attn.attn_sink"),
    "attn.compressor.wkv": ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    "attn.compressor.wgate": ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    "attn.compressor.position_bias": ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    "attn.compressor.norm.weight": ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    "attn.indexer.compressor.wkv": ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    "attn.indexer.compressor.wgate": ("self_attn.compressor.indexer.gate_proj.weight",
                                      "attn.indexer.compressor.wgate.weight"),
    "attn.indexer.compressor.position_bias": ("self_attn.compressor.indexer.position_bias",
                                              "attn.indexer.compressor.ape"),
    "attn.indexer.compressor.norm.weight": ("self_attn.compressor.indexer.kv_norm.weight",
                                            "attn.indexer.compressor.norm.weight"),
    "attn.indexer.wq": ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    "attn.indexer.w_heads": ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    "mlp.router.weight": ("mlp.gate.weight", "ffn.gate.weight"),
    "mlp.router.correction_bias": ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    "mlp.router.table": ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    **{f"{block}_hc.{part}": (f"{theirs}_hc.{part}", f"hc_{theirs}_{part}")
       for block, theirs in (("attn", "attn"), ("mlp", "ffn")) for part in ("fn", "base", "scale")},
}
# the tensors outside the layers: transformers' name, then the names DeepSeek's layouts give them
EDGE_ALIASES = {
    "model.embed_tokens.weight": ("embed.weight",),
    "model.norm.weight": ("norm.weight",),
    "lm_head.weight": ("head.weight",),
    "model.hc_head.hc_fn": ("hc_head_fn",),
    "model.hc_head.hc_base": ("hc_head_base",),
    "model.hc_head.hc_scale": ("hc_head_scale",),
}


def layouts(layer: int, ours: str, shape: Shape) -> Choices:
    """An engine tensor of layer `layer` in the three layouts (transformers' first)."""
    theirs, published = PUBLISHED[ours]
    return tuple(Stacked((name,), (shape,)) for name in (
        f"model.layers.{layer}.{theirs}", f"model.layers.{layer}.{published}", f"layers.{layer}.{published}"))


def tensors(spec: ModelSpec, layer: int) -> dict[str, Choices]:
    """Engine name -> checkpoint layouts for every tensor of layer `layer`."""
    ls = spec.layers[layer]
    at, mlp, hyper, h = ls.attention, ls.mlp, ls.hyper, spec.hidden_size
    assert isinstance(at, CompressedAttentionSpec) and mlp.router is not None and hyper is not None
    a, d, n = at.num_heads, at.head_dim, hyper.streams
    shapes: dict[str, Shape] = {
        "attn_norm.weight": (h,),
        "attn.wq_a.weight": (at.q_lora_rank, h), "attn.q_norm.weight": (at.q_lora_rank,),
        "attn.wq_b.weight": (a * d, at.q_lora_rank), "attn.wkv.weight": (d, h), "attn.kv_norm.weight": (d,),
        "attn.wo_a": (at.o_groups * at.o_lora_rank, at.group_width), "attn.wo_b.weight": (h, at.o_groups * at.o_lora_rank),
        "attn.sinks": (a,),
    }
    if at.ratio:
        width = (2 if at.indexed else 1) * d
        shapes.update({"attn.compressor.wkv": (width, h), "attn.compressor.wgate": (width, h),
                       "attn.compressor.position_bias": (at.ratio, width), "attn.compressor.norm.weight": (d,)})
    if at.indexed:
        di = at.index_head_dim
        shapes.update({"attn.indexer.compressor.wkv": (2 * di, h), "attn.indexer.compressor.wgate": (2 * di, h),
                       "attn.indexer.compressor.position_bias": (at.ratio, 2 * di),
                       "attn.indexer.compressor.norm.weight": (di,),
                       "attn.indexer.wq": (at.index_heads * di, at.q_lora_rank),
                       "attn.indexer.w_heads": (at.index_heads, h)})
    shapes["mlp_norm.weight"] = (h,)
    shapes["mlp.router.weight"] = (mlp.num_experts, h)
    if mlp.router.hash_vocab:
        shapes["mlp.router.table"] = (mlp.router.hash_vocab, mlp.router.top_k)
    else:
        shapes["mlp.router.correction_bias"] = (mlp.num_experts,)
    for block in ("attn", "mlp"):
        shapes.update({f"{block}_hc.fn": (hyper.mix_width, n * h), f"{block}_hc.base": (hyper.mix_width,),
                       f"{block}_hc.scale": (3,)})
    out = {ours: layouts(layer, ours, shape) for ours, shape in shapes.items()}
    out.update(expert_layouts(layer, mlp.num_experts, mlp.width, h))
    return out


def expert_layouts(layer: int, experts: int, width: int, h: int) -> dict[str, Choices]:
    """The routed experts (fused in transformers' layout, one tensor each in DeepSeek's: w1 gate, w3 up,
    w2 down) and the shared one."""
    t, i = f"model.layers.{layer}.mlp.", width
    published = (f"model.layers.{layer}.ffn.", f"layers.{layer}.ffn.")
    out: dict[str, Choices] = {}
    for e in range(experts):
        out[f"mlp.experts.{e}.w_gate_up.weight"] = (
            Stacked((t + "experts.gate_up_proj",), ((experts, 2 * i, h),), e),
            *(c for p in published for c in stacked([f"{p}experts.{e}.w1.weight", f"{p}experts.{e}.w3.weight"],
                                                     [(i, h), (i, h)])))
        out[f"mlp.experts.{e}.w_down.weight"] = (
            Stacked((t + "experts.down_proj",), ((experts, h, i),), e),
            *(c for p in published for c in one(f"{p}experts.{e}.w2.weight", (h, i))))
    out["mlp.shared.w_gate_up.weight"] = (
        *stacked([t + "shared_experts.gate_proj.weight", t + "shared_experts.up_proj.weight"], [(i, h), (i, h)]),
        *(c for p in published for c in stacked([p + "shared_experts.w1.weight", p + "shared_experts.w3.weight"],
                                                 [(i, h), (i, h)])))
    out["mlp.shared.w_down.weight"] = (
        *one(t + "shared_experts.down_proj.weight", (h, i)),
        *(c for p in published for c in one(p + "shared_experts.w2.weight", (h, i))))
    return out


FAMILY = Family("deepseek_v4", ARCHITECTURES["deepseek_v4"], read, to_config, tensors=tensors,
                edge_aliases=EDGE_ALIASES)
