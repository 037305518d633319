"""Model hyper-parameters: `ModelSpec`, read from a Hugging Face `config.json`.

Only the Llama family is supported — Llama, Mistral, Qwen2 and SmolLM — which all
share one block: pre-norm RMSNorm, rotary attention with grouped KV heads, and a
SwiGLU MLP. They differ in small switches (q/k/v bias for Qwen2, a sliding window
for Mistral, RoPE scaling for Llama 3, tied embeddings for small models), and
those switches are the fields below.

`from_config` reads both forms `transformers` writes: the older top-level
`rope_theta` / `rope_scaling` keys, and the `rope_parameters` block of
transformers 5. Any setting the engine does not implement (another RoPE type,
per-layer attention kinds, an MLP or output-projection bias, quantised weights,
another activation) is refused with `UnsupportedModel` naming the key and its
value: a model either runs exactly or does not load.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel

# architectures we can run, by the name `config.json` gives them
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

# RoPE types we compute, each with the parameters it needs (transformers' modeling_rope_utils names)
ROPE_PARAMETERS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
}
# keys of a RoPE block that name the type and base rather than parameters of the type
ROPE_NAMING_KEYS = ("rope_type", "type", "rope_theta")
DEFAULT_ROPE_THETA = 10000.0  # transformers' `default_theta` when a config names no base


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a model's shape.

    architecture:      "llama" | "mistral" | "qwen2".
    vocab_size:        rows of the embedding matrix.
    hidden_size:       width of the residual stream (H).
    intermediate_size: width of the MLP (I).
    num_layers:        decoder blocks (L).
    num_heads:         query heads (A); num_kv_heads (K) key/value heads, A % K == 0.
    head_dim:          per-head width (D), usually H / A.
    rms_norm_eps:      epsilon inside every RMSNorm.
    rope_theta:        RoPE base frequency.
    rope_scaling:      None (plain RoPE) or {"rope_type": "linear" | "llama3", and its parameters},
                       normalised by `read_rope` from whichever form the config used.
    max_position:      the longest context the model was trained for.
    tie_embeddings:    the head reuses the embedding matrix.
    attention_bias:    q/k/v projections carry a bias (Qwen2).
    sliding_window:    attend only to the last W positions (Mistral), or None.
    bos_token_id, eos_token_ids: special ids from the config.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        checks = [
            (self.architecture in ARCHITECTURES.values(), "architecture", self.architecture),
            (self.num_layers > 0, "num_hidden_layers", self.num_layers),
            (self.hidden_size > 0, "hidden_size", self.hidden_size),
            (self.num_heads > 0 and self.num_kv_heads > 0, "num_attention_heads", self.num_heads),
            (self.num_heads % self.num_kv_heads == 0, "num_key_value_heads", self.num_kv_heads),
            (self.head_dim > 0 and self.head_dim % 2 == 0, "head_dim", self.head_dim),
            (self.vocab_size > 0, "vocab_size", self.vocab_size),
        ]
        for ok, name, value in checks:
            if not ok:
                raise ModelFormatError(f"config field {name} has an impossible value {value!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_param_count(self) -> int:
        """Parameters in one decoder block."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        bias = (self.q_size + 2 * self.kv_size) if self.attention_bias else 0
        return attn + bias + 3 * h * i + 2 * h

    def layer_bytes(self, itemsize: int = 4) -> int:
        return self.layer_param_count() * itemsize

    def kv_bytes_per_token(self, num_layers: int, itemsize: int = 4) -> int:
        return 2 * num_layers * self.kv_size * itemsize

    def to_config(self) -> dict[str, Any]:
        """A Hugging Face style config.json dict that `from_config` reads back."""
        arch = next(k for k, v in ARCHITECTURES.items() if v == self.architecture)
        config: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.architecture == "llama":
            config["attention_bias"] = self.attention_bias
        if self.architecture == "mistral":
            config["sliding_window"] = self.sliding_window
        if self.architecture == "qwen2":
            config["use_sliding_window"] = False
        if self.bos_token_id is not None:
            config["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            eos = list(self.eos_token_ids)
            config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        return config

    @staticmethod
    def from_config(config: dict[str, Any]) -> "ModelSpec":
        """Read a Hugging Face config dict.

        Raises UnsupportedModel for an architecture outside the Llama family and
        ModelFormatError for a missing or impossible field.
        """
        archs = config.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModel(
                f"unknown architecture {archs!r}: tessera runs {sorted(ARCHITECTURES)}"
            )
        refuse_unsupported_settings(config, arch)
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            eos = config.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            window = config.get("sliding_window") if arch == "mistral" else None
            rope_theta, rope_scaling = read_rope(config)
            return ModelSpec(
                architecture=arch,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position=int(config.get("max_position_embeddings", 4096)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                # Qwen2 always biases q/k/v; Llama's attention_bias (which would also bias o_proj)
                # is refused above; Mistral has no bias whatever the config says
                attention_bias=arch == "qwen2",
                sliding_window=int(window) if window else None,
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as missing:
            raise ModelFormatError(f"config.json lacks the field {missing.args[0]!r}") from None
        except (TypeError, ValueError) as bad:
            raise ModelFormatError(f"config.json has a malformed field: {bad}") from None

    @staticmethod
    def from_file(path: Path) -> "ModelSpec":
        """Read `config.json` (raises ModelFormatError if it is missing or not JSON)."""
        try:
            config = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ModelFormatError(f"no config.json at {str(path)!r}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as bad:
            raise ModelFormatError(f"{str(path)!r} is not valid JSON: {bad}") from None
        if not isinstance(config, dict):
            raise ModelFormatError(f"{str(path)!r} does not hold a JSON object")
        return ModelSpec.from_config(config)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def refuse_unsupported_settings(config: dict[str, Any], arch: str) -> None:
    """Raise UnsupportedModel naming the first setting `config` asks for that the engine lacks.

    Settings that do not change the arithmetic of inference (dropout, initializer
    range, `use_cache`, `pretraining_tp` which transformers 5 ignores) are not looked at.
    """
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"config hidden_act {act!r} is not supported (only 'silu')")
    if config.get("mlp_bias"):
        raise UnsupportedModel(f"config mlp_bias {config['mlp_bias']!r} is not supported (MLP without bias only)")
    if arch == "llama" and config.get("attention_bias"):
        # Llama's attention_bias biases o_proj as well as q/k/v; the engine has no o_proj bias
        raise UnsupportedModel(f"config attention_bias {config['attention_bias']!r} is not supported for Llama")
    if config.get("quantization_config"):
        method = config["quantization_config"]
        method = method.get("quant_method", method) if isinstance(method, dict) else method
        raise UnsupportedModel(f"config quantization_config {method!r} is not supported (float weights only)")
    if arch == "qwen2" and config.get("use_sliding_window"):
        raise UnsupportedModel(f"config use_sliding_window {config['use_sliding_window']!r} is not supported for Qwen2")
    kinds = config.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or set(kinds) - {"full_attention"}):
        raise UnsupportedModel(f"config layer_types {kinds!r} is not supported (only 'full_attention' layers)")
    partial = config.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise UnsupportedModel(f"config partial_rotary_factor {partial!r} is not supported (only 1.0)")


def read_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(RoPE base, normalised scaling or None) from either form transformers writes.

    Follows transformers 5 (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`):
    the block is `rope_scaling` when that is set, else `rope_parameters`; the base is
    the block's `rope_theta`, else the top-level `rope_theta`, else 10000; the type is
    `rope_type` (or the older `type`), else "default"; llama3's
    `original_max_position_embeddings` falls back to the top-level keys.
    Raises UnsupportedModel for a RoPE type or parameter the engine does not compute,
    ModelFormatError for a missing or impossible value.
    """
    where = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    block = config.get(where) or {}
    if not isinstance(block, dict):
        raise ModelFormatError(f"config {where} {block!r} is not a JSON object")
    if any(isinstance(v, dict) for v in block.values()):
        raise UnsupportedModel(f"config {where} {block!r} differs per layer type; only one RoPE for all layers is supported")
    kind = block.get("rope_type", block.get("type", "default"))
    if "rope_type" in block and "type" in block and block["type"] != block["rope_type"]:
        raise ModelFormatError(f"config {where} names two RoPE types: {block['rope_type']!r} and {block['type']!r}")
    if kind not in ROPE_PARAMETERS:
        raise UnsupportedModel(
            f"config {where}.rope_type {kind!r} is not supported (tessera computes {sorted(ROPE_PARAMETERS)})"
        )
    theta = block.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA))
    params = {k: v for k, v in block.items() if k not in ROPE_NAMING_KEYS}
    if params.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise UnsupportedModel(f"config {where}.partial_rotary_factor {params['partial_rotary_factor']!r} is not supported (only 1.0)")
    params.pop("partial_rotary_factor", None)
    if kind == "llama3" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings", config.get("max_position_embeddings")
        )
    unknown = sorted(set(params) - ROPE_PARAMETERS[kind])
    if unknown:
        raise UnsupportedModel(
            f"config {where}.{unknown[0]} {params[unknown[0]]!r} is not supported with rope_type {kind!r}"
        )
    for key in ("rope_theta", *sorted(ROPE_PARAMETERS[kind])):
        value = theta if key == "rope_theta" else params.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ModelFormatError(f"config {where}.{key} has an impossible value {value!r}")
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ModelFormatError(
            f"config {where}.high_freq_factor {params['high_freq_factor']!r} must exceed "
            f"low_freq_factor {params['low_freq_factor']!r}"
        )
    scaling = None if kind == "default" else {"rope_type": kind, **{k: params[k] for k in sorted(params)}}
    return float(theta), scaling
