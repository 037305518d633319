"""Qwen3-Next (`qwen3_next`), Qwen3.5 (`qwen3_5`) and Qwen3.5-MoE (`qwen3_5_moe`): the hybrids.

Layers mix two token mixers by `layer_types` (by default three "linear_attention" layers, then
one "full_attention", every `full_attention_interval` = 4):

- Gated DeltaNet linear attention (families/spec/recurrent.py `GatedDeltaNetSpec`): `linear_num_key_heads`
  and `linear_num_value_heads` heads of `linear_key_head_dim` / `linear_value_head_dim`, a causal
  convolution of `linear_conv_kernel_dim`; its session state is a fixed matrix per value head and
  a convolution window (`RecurrentStateSpec`), whatever the context. Qwen3-Next projects q, k,
  v, z and b, a through two matrices grouped per key head; Qwen3.5 through four, each whole.
- Gated full attention: Qwen3's attention (per-head q/k RMSNorm, `attention_bias`) whose query
  projection also gives each head a gate (`AttentionSpec.output_gate`), RoPE over the first
  `partial_rotary_factor` (default 0.25) of each `head_dim` (default 256).

Every RMSNorm but the DeltaNet's output norm is zero-centred: it scales by 1 + w
(`ModelSpec.norm_offset`). MLPs: Qwen3-Next's are sparse where Qwen3-MoE's are
(`mlp_only_layers`, `decoder_sparse_step`; dense of `intermediate_size` elsewhere): a softmax
router over `num_experts` taking `num_experts_per_tok`, renormalised when `norm_topk_prob`,
plus one shared expert of `shared_expert_intermediate_size` weighted by sigmoid(x · w)
(`MlpSpec.shared_gate`). Qwen3.5's are dense (`intermediate_size`); Qwen3.5-MoE's are all
sparse, renormalised always, with the gated shared expert.

Qwen3.5 ships as a multimodal checkpoint (`Qwen3_5ForConditionalGeneration`: a `text_config`
and a `vision_config`; the text model's tensors under "model.language_model."): its text model
is read and run, and the vision tower is not (read and ignored: `vision_config` and the image
and video token ids; a request that carries an image is refused where requests are read,
peer/http). A text-only checkpoint (`Qwen3_5ForCausalLM`, what transformers saves for a
`Qwen3_5TextConfig`) reads the same. M-RoPE (`mrope_section`, `mrope_interleaved` in the RoPE
block) turns each section by its own position id (time, height, width); for text all three
are the token's position, so it is plain RoPE.

Multi-token-prediction layers (`mtp_num_hidden_layers`, tensors under "mtp."): not run by a span;
`--speculate mtp` drafts with them where the head runs (families/mtp.py). Read and ignored:
`mtp_use_dedicated_embeddings` (a checkpoint with MTP tensors of its own beyond those families/mtp.py
names is refused where they are loaded, stages/assembly/mtp.py). Qwen3-Next's are not read at all
(its config does not count them).
Refused (one line naming the key): an activation other than SiLU, `layer_types` other than the
two kinds, `attn_output_gate` false (transformers gates whatever it says), sliding windows,
RoPE types other than default / linear / llama3 / yarn, shipped quantized weights (the
published FP8: not mapped for these layers yet), any key the reader does not know.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.config import ConfigReader
from tessera.stages.families.family import Family
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.mtp import qwen3_5_mtp
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.recurrent import GatedDeltaNetSpec
from tessera.stages.families.spec.rope import RopeSpec
from tessera.stages.families.tensors import ExpertNames

ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
# the text-only classes of the multimodal families (what transformers saves for a text config)
TEXT_ARCHITECTURES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LAYER_KINDS = ("linear_attention", "full_attention")
PARTIAL_ROTARY = 0.25  # the configs' default partial_rotary_factor
HEAD_DIM = 256
FULL_EVERY = 4  # full_attention_interval's default
ZERO_CENTRED = 1.0  # ModelSpec.norm_offset: the norms scale by 1 + w
TEXT_PREFIX, MULTIMODAL_PREFIX = "model.", "model.language_model."
# a multimodal config's keys about its other towers: read and ignored (the text model runs alone)
VISION_KEYS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# Qwen3-Next's MoE defaults (Qwen3NextConfig): what a config that leaves a key out means
NEXT_MOE_DEFAULTS = dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                shared_expert_intermediate_size=512)
QWEN3_5_MOE_DEFAULTS = dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                   shared_expert_intermediate_size=512)


def read_qwen3_next(config: ConfigReader) -> ModelSpec:
    return read_text(config, "qwen3_next", TEXT_PREFIX)


def read_qwen3_5(config: ConfigReader) -> ModelSpec:
    return read_multimodal(config, "qwen3_5")


def read_qwen3_5_moe(config: ConfigReader) -> ModelSpec:
    return read_multimodal(config, "qwen3_5_moe")


def read_multimodal(config: ConfigReader, family: str) -> ModelSpec:
    """A Qwen3.5 model: the text model of a multimodal config (its `text_config`), or a text-only one."""
    if not config.has("text_config"):
        return read_text(config, family, TEXT_PREFIX)
    if config.has("quantization_config"):
        raise shipped_refusal(family)
    text = config.value("text_config")
    if not isinstance(text, dict):
        raise ModelFormatError(f"config text_config {text!r} is not a JSON object")
    for key in VISION_KEYS:  # the vision tower is not run (module docstring)
        config.value(key, None)
    tied = config.bool("tie_word_embeddings", False)  # the head's, as transformers ties it: the top level's
    bos, eos = config.bos_id(), config.eos_ids()  # a multimodal config may name them here instead
    inner = ConfigReader(text, family)
    spec = read_text(inner, family, MULTIMODAL_PREFIX)
    inner.finish()
    if text.get("tie_word_embeddings") is not None and text["tie_word_embeddings"] != tied:
        raise config.refuse("tie_word_embeddings", f"it differs from text_config's ({text['tie_word_embeddings']!r})")
    return replace(spec, tie_embeddings=tied, bos_token_id=spec.bos_token_id if spec.bos_token_id is not None else bos,
                   eos_token_ids=spec.eos_token_ids or eos)


def shipped_refusal(family: str) -> UnsupportedModel:
    return UnsupportedModel(f"{family} weights that ship quantized are not read yet (the published FP8 blocks of "
                            "its linear-attention projections): use a float checkpoint")


def read_text(config: ConfigReader, family: str, prefix: str) -> ModelSpec:
    """The decoder of any of the three families from its (text) config (module docstring)."""
    if config.has("quantization_config"):
        raise shipped_refusal(family)
    config.expect("hidden_act", ("silu",), default="silu")
    config.expect("attn_output_gate", (True,), default=True)
    config.expect("use_sliding_window", (False,), default=False)
    config.value("max_window_layers", None)  # no sliding windows (above): it selects none
    if config.value("sliding_window", None) is not None:
        raise config.refuse("sliding_window", "these families attend to every position")
    num_layers, hidden = config.int("num_hidden_layers"), config.int("hidden_size")
    kinds = layer_kinds(config, num_layers)
    attention = read_attention(config)
    deltanet = GatedDeltaNetSpec(
        config.int("linear_num_key_heads", 16), config.int("linear_num_value_heads", 32),
        config.int("linear_key_head_dim", 128), config.int("linear_value_head_dim", 128),
        config.int("linear_conv_kernel_dim", 4), layout="grouped" if family == "qwen3_next" else "split",
    )
    mlps = read_mlps(config, family, num_layers)
    layers = tuple(LayerSpec(attention if kind == "full_attention" else deltanet, mlp) for kind, mlp in zip(kinds, mlps))
    mtp = config.int("mtp_num_hidden_layers", 0, minimum=0) if family != "qwen3_next" else 0
    if family != "qwen3_next":
        config.value("mtp_use_dedicated_embeddings", None)  # read and ignored (module docstring)
    return ModelSpec(
        family, config.int("vocab_size"), hidden, layers, rms_norm_eps=config.float("rms_norm_eps", 1e-6),
        max_position=config.int("max_position_embeddings", 32768),
        tie_embeddings=config.bool("tie_word_embeddings", False), bos_token_id=config.bos_id(),
        eos_token_ids=config.eos_ids(), mtp_layers=mtp, norm_offset=ZERO_CENTRED, prefix=prefix,
    )


def layer_kinds(config: ConfigReader, num_layers: int) -> list[str]:
    """`layer_types`, or transformers' default: full attention every `full_attention_interval` layers."""
    every = config.int("full_attention_interval", FULL_EVERY)
    kinds = config.value("layer_types", None)
    if kinds is None:
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(kind not in LAYER_KINDS for kind in kinds):
        raise config.refuse("layer_types", f"one of {LAYER_KINDS} per layer ({num_layers})")
    return kinds


def read_attention(config: ConfigReader) -> AttentionSpec:
    """The gated full attention (module docstring)."""
    strip_mrope(config)
    heads = config.int("num_attention_heads")
    head_dim = config.int("head_dim", HEAD_DIM)
    rope, fraction = config.partial_rope(default_fraction=PARTIAL_ROTARY)
    turned = int(head_dim * fraction)  # as transformers sizes the rotary tables
    if turned % 2 or turned == 0:
        raise config.refuse("partial_rotary_factor", f"it turns {turned} dims of {head_dim}: not a positive even number")
    bias = config.bool("attention_bias", False)
    return AttentionSpec(heads, config.int("num_key_value_heads", 2), head_dim, rope, qkv_bias=bias, o_bias=bias,
                         qk_norm=True, rotary_dim=None if turned == head_dim else turned, output_gate=True)


def strip_mrope(config: ConfigReader) -> None:
    """Take M-RoPE's keys out of the RoPE block (for text they change nothing: module docstring),
    checked to be well formed."""
    for where in ("rope_parameters", "rope_scaling"):
        block = config.config.get(where)
        if not isinstance(block, dict) or not {"mrope_section", "mrope_interleaved"} & set(block):
            continue
        section, interleaved = block.get("mrope_section"), block.get("mrope_interleaved", False)
        if section is not None and (not isinstance(section, list) or len(section) != 3
                                    or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in section)):
            raise ModelFormatError(f"config {where}.mrope_section has an impossible value {section!r}")
        if not isinstance(interleaved, bool):
            raise ModelFormatError(f"config {where}.mrope_interleaved has an impossible value {interleaved!r}")
        cleaned = {k: v for k, v in block.items() if k not in ("mrope_section", "mrope_interleaved")}
        config.config = {**config.config, where: cleaned}


def read_mlps(config: ConfigReader, family: str, num_layers: int) -> list[MlpSpec]:
    """Each layer's MLP (module docstring)."""
    if family == "qwen3_5":
        return [MlpSpec(config.int("intermediate_size"))] * num_layers
    defaults = NEXT_MOE_DEFAULTS if family == "qwen3_next" else QWEN3_5_MOE_DEFAULTS
    experts = config.int("num_experts", defaults["num_experts"], minimum=0)
    if family == "qwen3_next":
        renormalize = config.bool("norm_topk_prob", True)
        dense_only = set(config.int_list("mlp_only_layers"))
        step = config.int("decoder_sparse_step", 1)
        dense = MlpSpec(config.int("intermediate_size", 5632))
    else:
        if experts == 0:
            raise config.refuse("num_experts", "every layer of qwen3_5_moe is sparse")
        renormalize, dense_only, step, dense = True, set(), 1, None
    if experts == 0:
        for key in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            config.value(key, None)
        assert dense is not None
        return [dense] * num_layers
    router = RouterSpec("softmax_topk", config.int("num_experts_per_tok", defaults["num_experts_per_tok"]), renormalize)
    sparse = MlpSpec(config.int("moe_intermediate_size", defaults["moe_intermediate_size"]), "moe", experts, router,
                     shared_width=config.int("shared_expert_intermediate_size",
                                             defaults["shared_expert_intermediate_size"]), shared_gate=True)
    return [sparse if i not in dense_only and (i + 1) % step == 0 else dense  # type: ignore[misc]
            for i in range(num_layers)]


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that the family's reader reads back into `spec` (multimodal when the spec's
    tensors lie under the multimodal prefix: synth then writes a checkpoint laid out so)."""
    full = next(layer.attention for layer in spec.layers if isinstance(layer.attention, AttentionSpec))
    linear = next((layer.attention for layer in spec.layers if isinstance(layer.attention, GatedDeltaNetSpec)), None)
    if linear is None:
        linear = GatedDeltaNetSpec(16, 32, 128, 128, 4)
    rope: RopeSpec = full.rope
    text: dict[str, Any] = {
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": full.num_heads, "num_key_value_heads": full.num_kv_heads, "head_dim": full.head_dim,
        "attention_bias": full.qkv_bias, "hidden_act": "silu", "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_type": rope.kind, "rope_theta": rope.theta, **dict(rope.params),
                            "partial_rotary_factor": full.rope_dim / full.head_dim},
        "max_position_embeddings": spec.max_position, "tie_word_embeddings": spec.tie_embeddings,
        "layer_types": ["full_attention" if isinstance(layer.attention, AttentionSpec) else "linear_attention"
                        for layer in spec.layers],
        "linear_num_key_heads": linear.num_key_heads, "linear_num_value_heads": linear.num_value_heads,
        "linear_key_head_dim": linear.key_dim, "linear_value_head_dim": linear.value_dim,
        "linear_conv_kernel_dim": linear.conv_kernel,
    }
    sparse = [layer.mlp for layer in spec.layers if layer.mlp.kind == "moe"]
    dense = [layer.mlp for layer in spec.layers if layer.mlp.kind == "dense"]
    if spec.family == "qwen3_5":
        text["intermediate_size"] = dense[0].width
    else:
        moe = sparse[0] if sparse else None
        text["num_experts"] = moe.num_experts if moe is not None else 0
        if moe is not None and moe.router is not None:
            text.update({"num_experts_per_tok": moe.router.top_k, "moe_intermediate_size": moe.width,
                         "shared_expert_intermediate_size": moe.shared_width})
        if spec.family == "qwen3_next":
            text.update({"intermediate_size": dense[0].width if dense else 5632,
                         "norm_topk_prob": moe.router.renormalize if moe is not None and moe.router else True,
                         "decoder_sparse_step": 1,
                         "mlp_only_layers": [i for i, layer in enumerate(spec.layers) if layer.mlp.kind == "dense"]
                         if moe is not None else []})
    if spec.family != "qwen3_next" and spec.mtp_layers:
        text["mtp_num_hidden_layers"] = spec.mtp_layers
    text = with_special_ids(text, spec)
    if spec.family == "qwen3_next":
        return {"architectures": [ARCHITECTURES["qwen3_next"]], "model_type": "qwen3_next", **text}
    if spec.prefix == TEXT_PREFIX:
        return {"architectures": [TEXT_ARCHITECTURES[spec.family]], "model_type": TEXT_MODEL_TYPES[spec.family], **text}
    return {"architectures": [ARCHITECTURES[spec.family]], "model_type": spec.family,
            "text_config": {"model_type": TEXT_MODEL_TYPES[spec.family], **text},
            "tie_word_embeddings": spec.tie_embeddings}



# the shared expert is `mlp.shared_expert` (one), weighted by `mlp.shared_expert_gate`
EXPERTS = ExpertNames(shared="shared_expert")

QWEN3_NEXT_80B_A3B = {  # Qwen/Qwen3-Next-80B-A3B-Instruct (3 Gated DeltaNet layers to 1 gated full one)
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
    "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": False,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

QWEN3_NEXT = Family("qwen3_next", ARCHITECTURES["qwen3_next"], read_qwen3_next, to_config, EXPERTS,
                    shapes={"qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B})
QWEN3_5 = Family("qwen3_5", ARCHITECTURES["qwen3_5"], read_qwen3_5, to_config, EXPERTS,
                 also=(TEXT_ARCHITECTURES["qwen3_5"],), mtp=qwen3_5_mtp)
QWEN3_5_MOE = Family("qwen3_5_moe", ARCHITECTURES["qwen3_5_moe"], read_qwen3_5_moe, to_config, EXPERTS,
                     also=(TEXT_ARCHITECTURES["qwen3_5_moe"],), mtp=qwen3_5_mtp)
