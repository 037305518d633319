"""GLM-5 (`glm_moe_dsa`): MLA with DeepSeek sparse attention, and DeepSeek-V3's MoE.

Every layer's attention is DSA (families/spec/mla.py's `DsaSpec`, layers/dsa.py): DeepSeek-V3's
MLA (low-rank q through `q_lora_rank`, a `kv_lora_rank` latent, one `qk_rope_head_dim` rope
key, RoPE always in interleaved pairs) over the `index_topk` positions an indexer of
`index_n_heads` heads of `index_head_dim` picks per query. `indexer_types` says per layer
whether it runs its own indexer ("full") or reuses the selection of the last one before it
("shared"); a config without it gets transformers' derivation (`index_topk_pattern`, else
`index_topk_freq` / `index_skip_topk_offset`).

The MLP is DeepSeek-V3's (families/models/deepseek.py), dense or sparse per `mlp_layer_types`
(else dense before `first_k_dense_replace`), as transformers' `GlmMoeDsaConfig` reads them.

A key the config leaves out means what `GlmMoeDsaConfig` defaults to. Refused (one line naming
the key): a first layer that reuses a selection (there is none to reuse), an indexer type other
than full / shared, a layer type other than indexed_attention, `mlp_bias` (transformers builds
no MLP bias whatever it says), an activation other than SiLU, RoPE types other than default /
linear / llama3 / yarn, partial rotary, shipped quantized weights, any key the reader does not
know. Read and ignored: `head_dim` and `qk_head_dim` (derived from the rope and nope dims),
`num_key_value_heads` (MLA expands a key and a value for every head), and
`num_nextn_predict_layers` (MTP modules, not run: `ModelSpec.mtp_layers`).
"""

from __future__ import annotations

from typing import Any

from tessera.stages.errors import ModelFormatError
from tessera.stages.families.config import ConfigReader
from tessera.stages.families.family import Family
from tessera.stages.families.models.deepseek import MoeDefaults, moe_config, read_mtp_layers, read_sigmoid_moe_kinds, rope_config
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.mtp import deepseek_mtp
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mla import DsaSpec, MlaSpec
from tessera.stages.families.spec.model import ModelSpec

ARCHITECTURES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM"}
GLM5_MOE = MoeDefaults(12288, 2048, 256, 8, 1, 2.5, 1, 1, 3)
IGNORED = ("head_dim", "qk_head_dim", "num_key_value_heads")
INDEXER_TYPES = ("full", "shared")


def indexer_types(config: ConfigReader, num_layers: int) -> list[str]:
    """Each layer's indexer type: `indexer_types`, else as `GlmMoeDsaConfig` derives it."""
    pattern = config.value("index_topk_pattern", None)
    freq = config.int("index_topk_freq", 1)
    offset = config.int("index_skip_topk_offset", 2, minimum=0)
    types = config.value("indexer_types", None)
    if types is None and pattern is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelFormatError(f"config field indexer_types has an impossible value {types!r} ({num_layers} layers)")
    if any(t not in INDEXER_TYPES for t in types):
        raise config.refuse("indexer_types", f"tessera computes the types {list(INDEXER_TYPES)}")
    if types and types[0] == "shared":
        raise config.refuse("indexer_types", "layer 0 reuses a selection, but no layer before it makes one")
    return types


def mlp_types(config: ConfigReader, num_layers: int, first_sparse: int) -> list[str]:
    types = config.value("mlp_layer_types", None)
    if types is None:
        return ["dense" if i < first_sparse else "sparse" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
        raise ModelFormatError(f"config field mlp_layer_types has an impossible value {types!r}")
    return types


def read(config: ConfigReader) -> ModelSpec:
    """A GLM-5 model from its config (module docstring)."""
    for key in IGNORED:
        config.value(key, None)
    config.expect("mlp_bias", (False,), default=False)
    num_layers, heads = config.int("num_hidden_layers"), config.int("num_attention_heads")
    layer_types = config.value("layer_types", None)
    if layer_types is not None and layer_types != ["indexed_attention"] * num_layers:
        raise config.refuse("layer_types", "every layer of this family is indexed_attention")
    if "q_lora_rank" in config.config and config.config["q_lora_rank"] is None:  # DeepSeek-V3's plain q: no indexer query
        raise ModelFormatError("config field q_lora_rank has an impossible value None (the indexer reads its latent)")
    mla = MlaSpec(
        heads, config.int("kv_lora_rank", 512), config.int("qk_nope_head_dim", 192),
        config.int("qk_rope_head_dim", 64), config.int("v_head_dim", 256), q_lora_rank=config.int("q_lora_rank", 2048),
        rope=config.rope(), rope_interleave=True, bias=config.bool("attention_bias", False),
    )
    index = dict(index_heads=config.int("index_n_heads", 32), index_head_dim=config.int("index_head_dim", 128),
                 index_topk=config.int("index_topk", 2048))
    attentions = [DsaSpec(mla, **index, shared=t == "shared") for t in indexer_types(config, num_layers)]
    dense, sparse = read_sigmoid_moe_kinds(config, GLM5_MOE)
    first_sparse = config.int("first_k_dense_replace", GLM5_MOE.first_k_dense_replace, minimum=0)
    mlps = [dense if t == "dense" else sparse for t in mlp_types(config, num_layers, first_sparse)]
    return ModelSpec(
        "glm_moe_dsa", config.int("vocab_size"), config.int("hidden_size"),
        tuple(LayerSpec(a, m) for a, m in zip(attentions, mlps)),
        rms_norm_eps=config.float("rms_norm_eps", 1e-5), max_position=config.int("max_position_embeddings", 202752),
        tie_embeddings=config.bool("tie_word_embeddings", False),
        bos_token_id=config.bos_id(), eos_token_ids=config.eos_ids(), mtp_layers=read_mtp_layers(config),
    )


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec`."""
    attention = spec.layers[0].attention
    assert isinstance(attention, DsaSpec), "every GLM-5 layer is DSA"
    mla = attention.mla
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES["glm_moe_dsa"]], "model_type": "glm_moe_dsa",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": mla.num_heads, "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "attention_bias": mla.bias,
        "index_n_heads": attention.index_heads, "index_head_dim": attention.index_head_dim,
        "index_topk": attention.index_topk,
        "indexer_types": ["shared" if getattr(layer.attention, "shared", False) else "full" for layer in spec.layers],
        "mlp_layer_types": ["sparse" if layer.mlp.kind == "moe" else "dense" for layer in spec.layers],
        **rope_config(spec), "rms_norm_eps": spec.rms_norm_eps, "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_embeddings, **moe_config(spec, GLM5_MOE),
    }
    return with_special_ids(config, spec)


GLM_5 = {  # zai-org/GLM-5, as transformers' GlmMoeDsaConfig defaults to it (ships bf16 and FP8; float here)
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 12288, "kv_lora_rank": 512,
    "max_position_embeddings": 202752, "moe_intermediate_size": 2048, "n_group": 1, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 78, "num_key_value_heads": 64, "num_nextn_predict_layers": 1, "q_lora_rank": 2048,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False, "topk_group": 1, "use_cache": True, "v_head_dim": 256, "vocab_size": 154880,
}

FAMILY = Family("glm_moe_dsa", ARCHITECTURES["glm_moe_dsa"], read, to_config, shapes={"glm-5": GLM_5},
                mtp=deepseek_mtp)
