"""The Llama block: Llama (`llama`), Mistral (`mistral`), Qwen2 (`qwen2`) and SmolLM.

Every layer alike: pre-norm RMSNorm, rotary grouped-query attention, a SwiGLU MLP. The
three differ in small switches: q/k/v bias for Qwen2, a sliding window on every layer
for Mistral, RoPE scaling for Llama 3, tied embeddings for small models.

Refused (one line naming the key): an activation other than SiLU, an MLP bias, Llama's
`attention_bias` (it biases the output projection as well: what Llama checkpoints do not
ship), Qwen2's sliding window (`use_sliding_window`), `layer_types` other than full
attention, RoPE types other than default / linear / llama3, partial rotary, shipped
quantized weights, and any key the reader does not know (families/config.py).

GGUF: llama.cpp's "llama" files without experts (their q/k rows permuted for its RoPE) and
"qwen2" files. Each can be synthesised from plain sizes (`tessera model synth --arch`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from tessera.stages.families.config import ConfigReader
from tessera.stages.families.family import Family
from tessera.stages.families.gguf import GgufForm, GgufMetadata, biased_attention, llama_block_config
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.rope import RopeSpec

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def llama_spec(
    *,
    family: str = "llama",
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None = None,
    rms_norm_eps: float = 1e-5,
    rope: RopeSpec = RopeSpec(),
    max_position: int = 4096,
    tie_embeddings: bool = False,
    sliding_window: int | None = None,
    bos_token_id: int | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> ModelSpec:
    """A Llama-block model: `num_layers` identical layers (Qwen2's q/k/v carry a bias)."""
    attention = AttentionSpec(num_heads, num_kv_heads, head_dim or hidden_size // num_heads, rope,
                              window=sliding_window, qkv_bias=family == "qwen2")
    layer = LayerSpec(attention, MlpSpec(intermediate_size))
    return ModelSpec(family, vocab_size, hidden_size, (layer,) * num_layers, rms_norm_eps=rms_norm_eps,
                     max_position=max_position, tie_embeddings=tie_embeddings, bos_token_id=bos_token_id,
                     eos_token_ids=eos_token_ids)


def read(config: ConfigReader) -> ModelSpec:
    """A Llama-block model from its config (config.family: llama, mistral or qwen2)."""
    family = config.family
    config.expect("hidden_act", ("silu",), default="silu")
    config.expect("mlp_bias", (False,), default=False)
    if family == "llama":
        config.expect("attention_bias", (False,), default=False)
    else:
        config.value("attention_bias", None)  # Qwen2 always biases q/k/v, Mistral never: whatever this says
    if family == "qwen2":
        config.expect("use_sliding_window", (False,), default=False)
        config.value("sliding_window", None)  # read only with use_sliding_window
        config.value("max_window_layers", None)
    kinds = config.value("layer_types", None)
    if kinds is not None and (not isinstance(kinds, list) or set(kinds) - {"full_attention"}):
        raise config.refuse("layer_types", "only 'full_attention' layers")
    window = config.int("sliding_window", None) if family == "mistral" else None
    heads = config.int("num_attention_heads")
    hidden = config.int("hidden_size")
    return llama_spec(
        family=family,
        vocab_size=config.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=config.int("intermediate_size"),
        num_layers=config.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=config.int("num_key_value_heads", heads),
        head_dim=config.int("head_dim", hidden // heads),
        rms_norm_eps=config.float("rms_norm_eps", 1e-6),
        rope=config.rope(),
        max_position=config.int("max_position_embeddings", 4096),
        tie_embeddings=config.bool("tie_word_embeddings", False),
        sliding_window=window,
        bos_token_id=config.bos_id(),
        eos_token_ids=config.eos_ids(),
    )


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """A Hugging Face style config.json dict that `read` reads back (what synth and convert write)."""
    attention = spec.layers[0].attention
    rope = attention.rope
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[spec.family]],
        "model_type": spec.family,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.layers[0].mlp.width,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": rope.theta,
        "rope_scaling": None if rope.kind == "default" else {"rope_type": rope.kind, **dict(rope.params)},
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if spec.family == "llama":
        config["attention_bias"] = False
    if spec.family == "mistral":
        config["sliding_window"] = attention.window
    if spec.family == "qwen2":
        config["use_sliding_window"] = False
    return with_special_ids(config, spec)


def with_special_ids(config: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """`config` with the spec's bos/eos ids, written as transformers writes them."""
    if spec.bos_token_id is not None:
        config["bos_token_id"] = spec.bos_token_id
    if spec.eos_token_ids:
        eos = list(spec.eos_token_ids)
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def gguf_config(architecture: str) -> Callable[[GgufMetadata], dict[str, Any]]:
    """The config a llama.cpp file of this block describes, for the family of transformers class `architecture`."""
    return lambda meta: {**llama_block_config(meta, architecture), "attention_bias": biased_attention(meta)}


LLAMA_3_8B = {  # meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "use_cache": True, "vocab_size": 128256,
}

LLAMA = Family("llama", ARCHITECTURES["llama"], read, to_config,
               gguf=GgufForm("llama", gguf_config(ARCHITECTURES["llama"]), claims=lambda meta: not meta.experts,
                             permuted_rope=True),
               shapes={"llama-3-8b": LLAMA_3_8B}, from_sizes=partial(llama_spec, family="llama"))
MISTRAL = Family("mistral", ARCHITECTURES["mistral"], read, to_config, from_sizes=partial(llama_spec, family="mistral"))
QWEN2 = Family("qwen2", ARCHITECTURES["qwen2"], read, to_config,
               gguf=GgufForm("qwen2", gguf_config(ARCHITECTURES["qwen2"])), from_sizes=partial(llama_spec, family="qwen2"))
