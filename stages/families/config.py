"""Reading a Hugging Face `config.json`: key by key, and refusing every key nobody read.

A family module reads the keys it computes through a `ConfigReader`; `finish()` then
refuses the first key left over (sorted, so the error is stable) unless it is one of
`IGNORED_KEYS`, which do not change what inference computes. So a model either runs
exactly or is refused with one line naming the key and its value — a new switch in a
future config is never silently dropped:

    reader = ConfigReader(config, "qwen3")
    hidden = reader.int("hidden_size")
    reader.expect("hidden_act", ("silu",), default="silu")   # UnsupportedModel for "gelu"
    ...
    reader.finish()                                           # UnsupportedModel for a key left over

Missing or malformed values are ModelFormatError; values the engine does not compute are
UnsupportedModel. `read_rope` reads RoPE from either form transformers writes.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.spec.rope import RopeSpec

# Keys that do not change the arithmetic of inference, whatever their value.
IGNORED_KEYS = frozenset({
    # what the file is and who wrote it (the family is chosen from `architectures` before reading)
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "tokenizer_class", "tessera_synth_seed",
    # training only: dropout, initialisation, auxiliary losses, Mixtral's router jitter (applied
    # only when training), tensor-parallel pretraining slices (transformers 5 ignores them)
    "initializer_range", "attention_dropout", "hidden_dropout", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "pretraining_tp", "chunk_size_feed_forward",
    # what a forward returns, not what it computes
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id",
    "problem_type", "pad_token_id",
})

_REQUIRED = object()
# The largest count or size a config may give: no model comes near it, and a larger one would
# overflow the sizes torch takes (a config saying hidden_size 1e308 is refused here, not there).
MAX_CONFIG_INT = 2**31 - 1
# Counts the engine builds something per item of before any weight is read (a LayerSpec per
# layer, the tensor names of each expert), bounded far past any published model so that a
# crafted config is refused at once instead of filling memory (`num_hidden_layers: 1e9` held
# 8 GB and never returned; `num_experts: 1e9` 2.6 GB). A folder's own tensors bound them
# tighter (stages/weights/folder.py `check_fits`).
MAX_LAYERS = 1024  # the deepest published decoder has 126 layers (Llama 3.1 405B)
MAX_EXPERTS = 4096  # the most routed experts of a published layer: 512 (Qwen3-Next, Qwen3.5)
COUNT_LIMITS = {
    **dict.fromkeys(("num_hidden_layers", "num_nextn_predict_layers", "num_mtp_layers"), MAX_LAYERS),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), MAX_EXPERTS),
}

# RoPE types we compute, each with the parameters it needs (transformers' modeling_rope_utils names)
ROPE_PARAMETERS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings"}),
}
# ... and those it may leave out (transformers' defaults apply: layers/rope.py). YaRN's
# `mscale`/`mscale_all_dim` also set DeepSeek's softmax scale (layers/mla.py).
ROPE_OPTIONAL: dict[str, frozenset[str]] = {
    "yarn": frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
}
# keys of a RoPE block that name the type and base rather than parameters of the type
ROPE_NAMING_KEYS = ("rope_type", "type", "rope_theta")
DEFAULT_ROPE_THETA = 10000.0  # transformers' `default_theta` when a config names no base


class ConfigReader:
    """One config dict, read key by key for family `family` (see the module docstring)."""

    def __init__(self, config: dict[str, Any], family: str) -> None:
        self.config = config
        self.family = family
        # how the weights ship is read beside the family, by families/shipped.py (catalog.spec_from_config)
        self.read: set[str] = {"quantization_config"}
        self.expect("is_encoder_decoder", (False,), default=False)

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        """The raw value (None counts as absent); ModelFormatError if required and absent."""
        self.read.add(key)
        value = self.config.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ModelFormatError(f"config.json lacks the field {key!r}")
            return default
        return value

    def int(self, key: str, default: Any = _REQUIRED, *, minimum: int = 1) -> Any:
        """An integer >= `minimum` (`default`, possibly None, when absent), written as one (a JSON
        number with a fraction or an exponent, 1e9 or 32.0, is not), and at most its key's
        `COUNT_LIMITS` (else MAX_CONFIG_INT)."""
        value = self.value(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelFormatError(f"config field {key} has an impossible value {value!r} (an integer)")
        limit = COUNT_LIMITS.get(key, MAX_CONFIG_INT)
        if not minimum <= value <= limit:
            raise ModelFormatError(f"config field {key} has an impossible value {value!r} "
                                   f"(from {minimum} to {limit})")
        return value

    def float(self, key: str, default: Any = _REQUIRED) -> float:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ModelFormatError(f"config field {key} has an impossible value {value!r}")
        return float(value)

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.value(key, default)
        if not isinstance(value, bool):
            raise ModelFormatError(f"config field {key} has an impossible value {value!r} (true or false)")
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.value(key, [])
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ModelFormatError(f"config field {key} has an impossible value {value!r} (a list of integers)")
        return tuple(value)

    def expect(self, key: str, allowed: Sequence[Any], *, default: Any) -> Any:
        """The value, refused with UnsupportedModel unless it is one of `allowed` (absent: `default`)."""
        self.read.add(key)
        value = self.config.get(key, default)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise UnsupportedModel(
                f"config {key} {value!r} is not supported for {self.family} (tessera computes {list(allowed)!r})")
        return value

    def refuse(self, key: str, why: str) -> UnsupportedModel:
        """The error for a value this family does not compute (for the caller to raise)."""
        return UnsupportedModel(f"config {key} {self.config.get(key)!r} is not supported for {self.family}: {why}")

    def finish(self) -> None:
        """Raise UnsupportedModel for the first key nobody read and that is not ignorable."""
        for key in sorted(set(self.config) - self.read - IGNORED_KEYS):
            raise UnsupportedModel(
                f"config key {key!r} (value {self.config[key]!r}) is not one tessera knows for {self.family}: "
                "it may change what the model computes")

    def rope(self, *, default_theta: float = DEFAULT_ROPE_THETA) -> RopeSpec:
        """The RoPE block, whichever form it came in (see `read_rope`); `default_theta`: the
        family's base when the config names none (transformers' `default_theta`)."""
        self.expect("partial_rotary_factor", (1, 1.0), default=1.0)
        return self._rope_of(self.config, default_theta)

    def partial_rope(self, *, default_fraction: float, default_theta: float = DEFAULT_ROPE_THETA
                     ) -> tuple[RopeSpec, float]:
        """The RoPE block (as `rope`) and the fraction of each head it turns: the block's
        `partial_rotary_factor`, else the top-level key, else `default_fraction` (the family's, as
        transformers 5 resolves it). ModelFormatError unless 0 < fraction <= 1."""
        self.read.add("partial_rotary_factor")
        where = "rope_scaling" if self.config.get("rope_scaling") else "rope_parameters"
        whole = {k: v for k, v in self.config.items() if k != "partial_rotary_factor"}
        block, fraction = self.config.get(where), None
        if isinstance(block, dict) and block.get("partial_rotary_factor") is not None:
            fraction = block["partial_rotary_factor"]
            whole[where] = {k: v for k, v in block.items() if k != "partial_rotary_factor"}
        if fraction is None:
            fraction = self.config.get("partial_rotary_factor")
        fraction = default_fraction if fraction is None else fraction
        if not _positive(fraction) or fraction > 1:
            raise ModelFormatError(f"config field partial_rotary_factor has an impossible value {fraction!r}")
        return self._rope_of(whole, default_theta), float(fraction)

    def _rope_of(self, config: dict[str, Any], default_theta: float) -> RopeSpec:
        self.read.update({"rope_scaling", "rope_parameters", "rope_theta", "original_max_position_embeddings"})
        theta, scaling = read_rope(config, default_theta=default_theta)
        if scaling is None:
            return RopeSpec("default", theta)
        params = tuple(sorted((k, v) for k, v in scaling.items() if k != "rope_type"))
        return RopeSpec(scaling["rope_type"], theta, params)

    def eos_ids(self) -> tuple[int, ...]:
        eos = self.value("eos_token_id", None)
        ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if any(isinstance(e, bool) or not isinstance(e, int) for e in ids):
            raise ModelFormatError(f"config field eos_token_id has an impossible value {eos!r}")
        return tuple(ids)

    def bos_id(self) -> int | None:
        return self.int("bos_token_id", None, minimum=0)


def read_rope(config: dict[str, Any], *, default_theta: float = DEFAULT_ROPE_THETA
              ) -> tuple[float, dict[str, Any] | None]:
    """(RoPE base, normalised scaling or None) from either form transformers writes.

    Follows transformers 5 (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`):
    the block is `rope_scaling` when that is set, else `rope_parameters`; the base is
    the block's `rope_theta`, else the top-level `rope_theta`, else `default_theta`; the type is
    `rope_type` (or the older `type`), else "default"; llama3's and yarn's
    `original_max_position_embeddings` falls back to the top-level keys. A parameter set to
    null counts as absent.
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
    theta = block.get("rope_theta", config.get("rope_theta", default_theta))
    params = {k: v for k, v in block.items() if k not in ROPE_NAMING_KEYS and v is not None}
    if kind == "yarn" and "truncate" in block and block["truncate"] is None:
        params["truncate"] = False  # transformers tests `if truncate:`, so null does not truncate
    if params.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise UnsupportedModel(f"config {where}.partial_rotary_factor {params['partial_rotary_factor']!r} is not supported (only 1.0)")
    params.pop("partial_rotary_factor", None)
    if kind in ("llama3", "yarn") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings", config.get("max_position_embeddings")
        )
    optional = ROPE_OPTIONAL.get(kind, frozenset())
    unknown = sorted(set(params) - ROPE_PARAMETERS[kind] - optional)
    if unknown:
        raise UnsupportedModel(
            f"config {where}.{unknown[0]} {params[unknown[0]]!r} is not supported with rope_type {kind!r}"
        )
    for key in ("rope_theta", *sorted(ROPE_PARAMETERS[kind])):
        value = theta if key == "rope_theta" else params.get(key)
        if not _positive(value):
            raise ModelFormatError(f"config {where}.{key} has an impossible value {value!r}")
    for key in sorted(optional & set(params)):
        value = params[key]
        if key == "truncate":
            fine = isinstance(value, bool)
        else:  # attention_factor > 0; a beta or an mscale >= 0 (0: the default, as transformers reads it)
            fine = _positive(value) or (key != "attention_factor" and not isinstance(value, bool) and value == 0)
        if not fine:
            raise ModelFormatError(f"config {where}.{key} has an impossible value {value!r}")
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ModelFormatError(
            f"config {where}.high_freq_factor {params['high_freq_factor']!r} must exceed "
            f"low_freq_factor {params['low_freq_factor']!r}"
        )
    scaling = None if kind == "default" else {"rope_type": kind, **{k: params[k] for k in sorted(params)}}
    return float(theta), scaling


def _positive(value: Any) -> bool:
    """A finite number > 0 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
