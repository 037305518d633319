"""DeepSeek-V3 (`deepseek_v3`): multi-head latent attention, and a sigmoid-routed MoE with shared experts.

Every layer's attention is MLA (families/spec/mla.py's `MlaSpec`): queries low-rank through
`q_lora_rank` (one projection when it is null), keys and values expanded from a
`kv_lora_rank` latent, plus one `qk_rope_head_dim` rope key shared by the heads;
`qk_nope_head_dim` and `v_head_dim` per head. RoPE (YaRN in the published models, whose
`mscale_all_dim` also corrects the softmax scale) turns the rope dims, in DeepSeek's
interleaved pairs unless `rope_interleave` is false.

Layers from `first_k_dense_replace` on are sparse: `n_routed_experts` SwiGLU experts of
`moe_intermediate_size`, a sigmoid router with a correction bias choosing
`num_experts_per_tok` within the best `topk_group` of `n_group` expert groups, weights
renormalised when `norm_topk_prob` and times `routed_scaling_factor`, plus `n_shared_experts`
shared experts (one SwiGLU of n x `moe_intermediate_size`); the first layers are dense
SwiGLU of `intermediate_size`. GLM-4.5 (families/models/glm.py) shares this MoE.

A key the config leaves out means what transformers' `DeepseekV3Config` defaults to (the
published model's value). Refused (one line naming the key): an activation other than SiLU;
`scoring_func` other than sigmoid, `topk_method` other than noaux_tc (DeepSeek-V2's softmax
routers), `moe_layer_freq` other than 1; RoPE types other than default / linear / llama3 /
yarn; partial rotary; shipped quantized weights (the published FP8); any key the reader does
not know. Read and ignored: `num_nextn_predict_layers` (multi-token-prediction modules,
which transformers does not run either: `ModelSpec.mtp_layers`), `head_dim` and
`qk_head_dim` (transformers derives them from the rope and nope dims whatever they say),
`num_key_value_heads` (MLA expands a key and a value for every head: transformers' SDPA path
runs whatever this says, and the published configs set it to `num_attention_heads`),
`aux_loss_alpha` and `seq_aux` (training losses), `ep_size` (the expert-parallel layout of
its own serving code) and `auto_map` (that code's location: it computes what transformers does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.stages.families.config import ConfigReader
from tessera.stages.families.family import Family
from tessera.stages.families.models.llama import with_special_ids
from tessera.stages.families.mtp import deepseek_mtp
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mla import MlaSpec
from tessera.stages.families.spec.mlp import MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM"}
IGNORED = ("head_dim", "qk_head_dim", "num_key_value_heads", "aux_loss_alpha", "seq_aux", "ep_size", "auto_map")


@dataclass(frozen=True)
class MoeDefaults:
    """A family's transformers defaults for the keys of its sigmoid-routed MoE."""

    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    first_k_dense_replace: int


DEEPSEEK_V3_MOE = MoeDefaults(18432, 2048, 256, 8, 1, 2.5, 8, 4, 3)


def read_alias(config: ConfigReader, key: str, alias: str, default: int, *, minimum: int) -> int:
    """`key`, or what transformers also accepts for it (`alias`); refused when both differ."""
    value, other = config.int(key, None, minimum=minimum), config.int(alias, None, minimum=minimum)
    if value is not None and other is not None and value != other:
        raise config.refuse(alias, f"it differs from {key} ({value})")
    return value if value is not None else (other if other is not None else default)


def read_sigmoid_moe(config: ConfigReader, num_layers: int, defaults: MoeDefaults) -> tuple[MlpSpec, ...]:
    """The MLP of each layer: dense before `first_k_dense_replace`, sparse from there (module docstring)."""
    dense, sparse = read_sigmoid_moe_kinds(config, defaults)
    first_sparse = config.int("first_k_dense_replace", defaults.first_k_dense_replace, minimum=0)
    return tuple(dense if i < first_sparse else sparse for i in range(num_layers))


def read_sigmoid_moe_kinds(config: ConfigReader, defaults: MoeDefaults) -> tuple[MlpSpec, MlpSpec]:
    """The dense MLP and the sparse one (which layers take which is the family's to read)."""
    config.expect("hidden_act", ("silu",), default="silu")
    dense = MlpSpec(config.int("intermediate_size", defaults.intermediate_size))
    width = config.int("moe_intermediate_size", defaults.moe_intermediate_size)
    router = RouterSpec(
        "sigmoid_group_topk", config.int("num_experts_per_tok", defaults.num_experts_per_tok),
        renormalize=config.bool("norm_topk_prob", True),
        num_groups=config.int("n_group", defaults.n_group), topk_groups=config.int("topk_group", defaults.topk_group),
        scale=config.float("routed_scaling_factor", defaults.routed_scaling_factor),
    )
    experts = read_alias(config, "n_routed_experts", "num_local_experts", defaults.n_routed_experts, minimum=1)
    shared = config.int("n_shared_experts", defaults.n_shared_experts, minimum=0)
    return dense, MlpSpec(width, "moe", experts, router, shared_width=shared * width)


def read_mtp_layers(config: ConfigReader) -> int:
    return read_alias(config, "num_nextn_predict_layers", "num_mtp_layers", 1, minimum=0)


def read(config: ConfigReader) -> ModelSpec:
    """A DeepSeek-V3 model from its config (module docstring)."""
    config.expect("scoring_func", ("sigmoid",), default="sigmoid")
    config.expect("topk_method", ("noaux_tc",), default="noaux_tc")
    config.expect("moe_layer_freq", (1,), default=1)
    for key in IGNORED:
        config.value(key, None)
    num_layers, heads = config.int("num_hidden_layers"), config.int("num_attention_heads")
    explicit_null = "q_lora_rank" in config.config and config.config["q_lora_rank"] is None
    q_lora_rank = config.value("q_lora_rank", None) if explicit_null else config.int("q_lora_rank", 1536)
    attention = MlaSpec(
        heads, config.int("kv_lora_rank", 512), config.int("qk_nope_head_dim", 128),
        config.int("qk_rope_head_dim", 64), config.int("v_head_dim", 128), q_lora_rank=q_lora_rank,
        rope=config.rope(), rope_interleave=config.bool("rope_interleave", True),
        bias=config.bool("attention_bias", False),
    )
    mlps = read_sigmoid_moe(config, num_layers, DEEPSEEK_V3_MOE)
    return ModelSpec(
        "deepseek_v3", config.int("vocab_size"), config.int("hidden_size"),
        tuple(LayerSpec(attention, mlp) for mlp in mlps),
        rms_norm_eps=config.float("rms_norm_eps", 1e-6), max_position=config.int("max_position_embeddings", 4096),
        tie_embeddings=config.bool("tie_word_embeddings", False),
        bos_token_id=config.bos_id(), eos_token_ids=config.eos_ids(), mtp_layers=read_mtp_layers(config),
    )


def moe_config(spec: ModelSpec, defaults: MoeDefaults) -> dict[str, Any]:
    """The MoE keys of `spec` as `read_sigmoid_moe` reads them (defaults where no layer shows one)."""
    sparse = [i for i, layer in enumerate(spec.layers) if layer.mlp.kind == "moe"]
    dense = [layer.mlp for layer in spec.layers if layer.mlp.kind == "dense"]
    config: dict[str, Any] = {
        "hidden_act": "silu", "first_k_dense_replace": sparse[0] if sparse else spec.num_layers,
        "intermediate_size": dense[0].width if dense else defaults.intermediate_size,
        "num_nextn_predict_layers": spec.mtp_layers,
    }
    if sparse:
        mlp = spec.layers[sparse[0]].mlp
        assert mlp.router is not None and mlp.shared_width % mlp.width == 0, "shared experts are n experts wide"
        config.update({
            "moe_intermediate_size": mlp.width, "n_routed_experts": mlp.num_experts,
            "num_experts_per_tok": mlp.router.top_k, "n_shared_experts": mlp.shared_width // mlp.width,
            "routed_scaling_factor": mlp.router.scale, "n_group": mlp.router.num_groups,
            "topk_group": mlp.router.topk_groups, "norm_topk_prob": mlp.router.renormalize,
        })
    return config


def rope_config(spec: ModelSpec) -> dict[str, Any]:
    rope = spec.layers[0].attention.rope
    return {"rope_parameters": {"rope_type": rope.kind, "rope_theta": rope.theta, **dict(rope.params)}}


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A config.json dict that `read` reads back into `spec`."""
    attention = spec.layers[0].attention
    assert isinstance(attention, MlaSpec), "every DeepSeek-V3 layer is MLA"
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES["deepseek_v3"]], "model_type": "deepseek_v3",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_heads,
        "q_lora_rank": attention.q_lora_rank, "kv_lora_rank": attention.kv_lora_rank,
        "qk_nope_head_dim": attention.qk_nope_head_dim, "qk_rope_head_dim": attention.qk_rope_head_dim,
        "v_head_dim": attention.v_head_dim, "rope_interleave": attention.rope_interleave,
        "attention_bias": attention.bias, **rope_config(spec), "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position, "tie_word_embeddings": spec.tie_embeddings,
        **moe_config(spec, DEEPSEEK_V3_MOE),
    }
    return with_special_ids(config, spec)


DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 (ships as FP8 blocks; float here)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280,
}

FAMILY = Family("deepseek_v3", ARCHITECTURES["deepseek_v3"], read, to_config,
                shapes={"deepseek-v3": DEEPSEEK_V3}, mtp=deepseek_mtp)
