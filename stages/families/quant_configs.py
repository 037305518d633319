"""The `quantization_config`s of NVFP4 and INT4 checkpoints, read as data: ModelOpt's and compressed-tensors'.

families/shipped.py `read_shipped` hands these two `quant_method`s here and builds its ShippedFormat
from what they return. Every key is read (`Fields`); any key or value that changes what the stored
numbers mean and that tessera does not compute is refused with one line naming it, so that a
checkpoint we cannot compute exactly is never loaded as if we could.

- "modelopt" (NVIDIA ModelOpt's NVFP4 export): `quant_algo` "NVFP4", `group_size` 16; the modules left
  in float as `exclude_modules` (fnmatch patterns) or `ignore` (compressed-tensors style); in either
  of ModelOpt's two forms: the keys at the top, or under `quantization` (its hf_quant_config.json).
  A `config_groups` entry, which newer exports also write, must say the same (4-bit float weights in
  groups of 16). KV-cache quantization is refused.
- "compressed-tensors" (llm-compressor's): one scheme for every group in `config_groups`, its
  `format` "nvfp4-pack-quantized" (4-bit float weights, groups of 16, a global scale) or
  "pack-quantized" (4-bit integer weights, `strategy` group or channel, symmetric or with a zero
  point); `targets` "Linear" (every linear module) or module names and "re:" patterns; `ignore` the
  same; `quantization_status` "compressed" (the stored form, not a fake-quantized float model).

Activations: an NVFP4 checkpoint is made for 4-bit activations (a dynamic scale per 16 under a
stored global input scale): the input scales are read with the weights and not applied — a span
computes its weights' dequantized model with float activations, as it does for fp8's dynamic
activation scheme. Integer (W4A8) or static per-tensor activation schemes are refused.

Patterns end up as regular expressions in transformers' `should_convert_module` form (shipped.py
`_matches`): an exact name escaped, "re:X" as X, an fnmatch pattern translated.
"""

from __future__ import annotations

import fnmatch
import json
import re
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel

NVFP4_GROUP = 16
CT_NVFP4 = "nvfp4-pack-quantized"
CT_INT4 = "pack-quantized"
CT_FORMATS = (CT_NVFP4, CT_INT4)
INT4_GROUPS = (32, 64, 128, 256)
MAX_PATTERNS = 4096  # entries of an ignore or targets list (Kimi K2's ignore list names ~1000 modules)
MAX_PATTERN_LENGTH = 512
LINEAR = "Linear"  # a compressed-tensors target naming every linear module by its class


class Fields:
    """The keys of one quantization_config, read one at a time; `finish` refuses any left over."""

    def __init__(self, raw: dict[str, Any], method: str, where: str = "quantization_config") -> None:
        self.raw, self.method, self.where, self.read = raw, method, where, {"quant_method"}

    def take(self, key: str, default: Any) -> Any:
        self.read.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def expect(self, key: str, allowed: tuple[Any, ...], default: Any) -> Any:
        value = self.take(key, default)
        if value not in allowed or not any(type(value) is type(a) for a in allowed):  # 1 is not True
            raise UnsupportedModel(f"config {self.where}.{key} {value!r} is not supported for "
                                   f"{self.method} (tessera computes {list(allowed)!r})")
        return value

    def ignore(self, *keys: str) -> None:
        """Keys that describe how the checkpoint was made, not what its numbers mean."""
        self.read.update(keys)

    def finish(self) -> None:
        for key in sorted(set(self.raw) - self.read):
            raise UnsupportedModel(f"config {self.where}.{key} (value {json.dumps(self.raw[key])[:80]}) is not "
                                   f"one tessera knows for {self.method}: it may change what the weights mean")


def pattern_list(value: Any, where: str) -> list[str]:
    """A list of module names or patterns (ModelFormatError otherwise)."""
    if not isinstance(value, list) or len(value) > MAX_PATTERNS or not all(
            isinstance(p, str) and 0 < len(p) <= MAX_PATTERN_LENGTH for p in value):
        raise ModelFormatError(f"config {where} {str(value)[:80]} is not a list of module names")
    return value


def ct_regex(pattern: str) -> str:
    """A compressed-tensors target or ignore entry as a regular expression: "re:X" is X, a name itself."""
    return pattern[3:] if pattern.startswith("re:") else re.escape(pattern) + "$"


def fnmatch_regex(pattern: str) -> str:
    """A ModelOpt exclude pattern ("*.mlp.gate", "lm_head") as a regular expression."""
    return fnmatch.translate(pattern)


def check_regex(pattern: str, where: str) -> str:
    try:
        re.compile(pattern)
    except re.error as bad:
        raise ModelFormatError(f"config {where} pattern {pattern!r} is not a regular expression: {bad}") from None
    return pattern


def _group_args(args: Any, where: str, method: str) -> Fields:
    if not isinstance(args, dict):
        raise ModelFormatError(f"config {where} {str(args)[:80]} is not a JSON object")
    fields = Fields(args, method, where)
    fields.read.discard("quant_method")
    fields.ignore("observer", "observer_kwargs")  # how the scales were chosen, not what they mean
    return fields


def read_nvfp4_weights(args: Any, where: str, method: str) -> None:
    """A group's `weights`: 4-bit floats in groups of 16, one e4m3 scale each, a global scale."""
    fields = _group_args(args, where, method)
    fields.expect("num_bits", (4,), None)
    fields.expect("type", ("float",), None)
    fields.expect("group_size", (NVFP4_GROUP,), None)
    fields.expect("strategy", ("tensor_group",), "tensor_group")
    fields.expect("symmetric", (True,), True)
    fields.expect("dynamic", (False,), False)
    fields.expect("scale_dtype", ("torch.float8_e4m3fn", "float8_e4m3fn"), "torch.float8_e4m3fn")
    fields.take("zp_dtype", None)  # symmetric: no zero point is stored
    fields.expect("actorder", (False,), False)
    fields.expect("block_structure", ("none",), "none")
    fields.finish()


def read_nvfp4_activations(args: Any, where: str, method: str) -> bool:
    """A group's `input_activations` of an NVFP4 checkpoint: none (W4A16), or NVFP4's own dynamic
    4-bit scheme (read, not applied: module docstring). True when the checkpoint stores input scales."""
    if args is None:
        return False
    fields = _group_args(args, where, method)
    fields.expect("num_bits", (4,), None)
    fields.expect("type", ("float",), None)
    fields.expect("group_size", (NVFP4_GROUP,), None)
    fields.expect("strategy", ("tensor_group",), "tensor_group")
    fields.expect("symmetric", (True,), True)
    fields.expect("dynamic", ("local", False), "local")
    fields.take("scale_dtype", None)
    fields.take("zp_dtype", None)
    fields.expect("actorder", (False,), False)
    fields.expect("block_structure", ("none",), "none")
    fields.finish()
    return True


# a scale_dtype a config may name -> the safetensors dtype of the scales it means
SCALE_DTYPES = {"torch.bfloat16": "BF16", "bfloat16": "BF16", "torch.float16": "F16", "float16": "F16",
                "torch.float32": "F32", "float32": "F32"}


def read_int4_weights(args: Any, where: str, method: str) -> tuple[int, bool, str]:
    """A pack-quantized group's `weights`: 4-bit integers, a scale per group of `group_size` inputs (or per
    row: `strategy` channel, returned as group 0), symmetric or with a zero point, the scales' dtype
    (safetensors' name; "" when the config leaves it to the model's dtype). -> (group, symmetric, dtype)."""
    fields = _group_args(args, where, method)
    fields.expect("num_bits", (4,), None)
    fields.expect("type", ("int",), None)
    strategy = fields.expect("strategy", ("group", "channel"), "group")
    group = fields.take("group_size", None)
    if strategy == "group":
        group = fields.expect("group_size", INT4_GROUPS, None)
    elif group not in (None, -1):
        raise UnsupportedModel(f"config {where}.group_size {group!r} is not supported with strategy 'channel'")
    symmetric = fields.expect("symmetric", (True, False), True)
    fields.expect("dynamic", (False,), False)
    fields.expect("actorder", (False,), False)  # GPTQ's reordered groups ship a g_idx tensor: not computed
    fields.expect("block_structure", ("none",), "none")
    scale_dtype = fields.take("scale_dtype", None)
    if scale_dtype is not None and scale_dtype not in SCALE_DTYPES:
        raise UnsupportedModel(f"config {where}.scale_dtype {scale_dtype!r} is not supported for {method} "
                               f"(tessera reads {sorted(set(SCALE_DTYPES.values()))} scales)")
    fields.take("zp_dtype", None)  # zero points ship packed in int32 whatever it says
    fields.finish()
    return (group if strategy == "group" else 0), symmetric, SCALE_DTYPES.get(scale_dtype, "")


def read_modelopt(raw: dict[str, Any]) -> dict[str, Any]:
    """A "modelopt" quantization_config -> ShippedFormat keyword arguments (module docstring)."""
    fields = Fields(raw, "modelopt")
    nested = fields.take("quantization", None)  # hf_quant_config.json's form, copied into config.json
    if nested is not None:
        if not isinstance(nested, dict):
            raise ModelFormatError(f"config quantization_config.quantization {str(nested)[:80]} is not a JSON object")
        inner = Fields(nested, "modelopt", "quantization_config.quantization")
        inner.read.discard("quant_method")
        out = _modelopt_keys(inner)
        inner.finish()
        fields.ignore("producer")
        fields.finish()
        return out
    out = _modelopt_keys(fields)
    fields.finish()
    return out


def _modelopt_keys(fields: Fields) -> dict[str, Any]:
    fields.expect("quant_algo", ("NVFP4",), None)
    fields.expect("group_size", (NVFP4_GROUP,), NVFP4_GROUP)
    fields.expect("kv_cache_quant_algo", ("none",), "none")
    fields.ignore("producer")
    exclude = [check_regex(fnmatch_regex(p), "exclude_modules")
               for p in pattern_list(fields.take("exclude_modules", []), f"{fields.where}.exclude_modules")]
    exclude += [check_regex(ct_regex(p), "ignore") for p in pattern_list(fields.take("ignore", []), f"{fields.where}.ignore")]
    activations = True  # ModelOpt's NVFP4 exports are W4A4: every quantized linear has an input_scale
    groups = fields.take("config_groups", None)
    if groups is not None:
        activations = any([_nvfp4_group(g, name, "modelopt") for name, g in _groups(groups, fields.where)])
    return {"method": "nvfp4", "layout": "modelopt", "not_converted": tuple(exclude), "group": NVFP4_GROUP,
            "activation_scales": activations}


def _groups(groups: Any, where: str) -> list[tuple[str, Any]]:
    if not isinstance(groups, dict) or not groups or len(groups) > MAX_PATTERNS:
        raise ModelFormatError(f"config {where}.config_groups {str(groups)[:80]} is not a map of groups")
    return sorted(groups.items())


def _nvfp4_group(group: Any, name: str, method: str) -> bool:
    where = f"quantization_config.config_groups.{name}"
    if not isinstance(group, dict):
        raise ModelFormatError(f"config {where} is not a JSON object")
    fields = Fields(group, method, where)
    fields.read.discard("quant_method")
    read_nvfp4_weights(fields.take("weights", None), f"{where}.weights", method)
    activations = read_nvfp4_activations(fields.take("input_activations", None), f"{where}.input_activations", method)
    _no_output(fields)
    fields.take("targets", None)
    fields.expect("format", (CT_NVFP4,), CT_NVFP4)
    fields.finish()
    return activations


def _no_output(fields: Fields) -> None:
    if fields.take("output_activations", None) is not None:
        raise UnsupportedModel(f"config {fields.where}.output_activations is not supported for {fields.method} "
                               "(tessera computes float outputs)")


def read_compressed_tensors(raw: dict[str, Any]) -> dict[str, Any]:
    """A "compressed-tensors" quantization_config -> ShippedFormat keyword arguments (module docstring)."""
    fields = Fields(raw, "compressed-tensors")
    fmt = fields.expect("format", CT_FORMATS, None)
    fields.expect("quantization_status", ("compressed",), None)
    fields.expect("kv_cache_scheme", ("none",), "none")
    for key in ("sparsity_config", "transform_config", "moe_sparsity_config"):
        if fields.take(key, {}) not in ({}, None):
            raise UnsupportedModel(f"config quantization_config.{key} is not supported for compressed-tensors "
                                   "(tessera computes dense quantized weights)")
    fields.ignore("global_compression_ratio", "version", "provider")
    ignore = [check_regex(ct_regex(p), "ignore") for p in pattern_list(fields.take("ignore", []), "quantization_config.ignore")]
    schemes, targets = set(), []
    for name, group in _groups(fields.take("config_groups", None), "quantization_config"):
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise ModelFormatError(f"config {where} is not a JSON object")
        g = Fields(group, "compressed-tensors", where)
        g.read.discard("quant_method")
        g.expect("format", (fmt,), fmt)
        if fmt == CT_NVFP4:
            read_nvfp4_weights(g.take("weights", None), f"{where}.weights", "compressed-tensors")
            activations = read_nvfp4_activations(g.take("input_activations", None), f"{where}.input_activations",
                                                 "compressed-tensors")
            schemes.add(("nvfp4", NVFP4_GROUP, True, activations, ""))
        else:
            group_size, symmetric, scale_dtype = read_int4_weights(g.take("weights", None), f"{where}.weights",
                                                                   "compressed-tensors")
            if g.take("input_activations", None) is not None:
                raise UnsupportedModel(f"config {where}.input_activations is not supported for pack-quantized "
                                       "(tessera computes 4-bit weights with float activations: W4A16)")
            schemes.add(("int4", group_size, symmetric, False, scale_dtype))
        _no_output(g)
        for target in pattern_list(g.take("targets", [LINEAR]), f"{where}.targets"):
            targets.append(None if target == LINEAR else check_regex(ct_regex(target), "targets"))
        g.finish()
    if len(schemes) > 1:
        raise UnsupportedModel(f"config quantization_config.config_groups mix {len(schemes)} schemes: tessera computes "
                               "one scheme for every quantized matrix")
    fields.finish()
    method, group, symmetric, activations, scale_dtype = schemes.pop()
    return {"method": method, "layout": "compressed-tensors", "not_converted": tuple(ignore), "group": group,
            "symmetric": symmetric, "activation_scales": activations, "scale_dtype": scale_dtype,
            "targets": () if None in targets else tuple(targets)}


def modelopt_config(not_converted: tuple[str, ...]) -> dict[str, Any]:
    """The modelopt quantization_config that reads back into these settings."""
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NVFP4_GROUP,
            "ignore": [f"re:{p}" for p in not_converted]}


def compressed_tensors_config(method: str, group: int, symmetric: bool, activations: bool, scale_dtype: str,
                              not_converted: tuple[str, ...], targets: tuple[str, ...]) -> dict[str, Any]:
    """The compressed-tensors quantization_config that reads back into these settings."""
    if method == "nvfp4":
        fmt = CT_NVFP4
        weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_GROUP,
                   "symmetric": True, "dynamic": False}
        inputs = {**weights, "dynamic": "local"} if activations else None
    else:
        fmt = CT_INT4
        weights = {"num_bits": 4, "type": "int", "strategy": "group" if group else "channel",
                   "group_size": group or None, "symmetric": symmetric, "dynamic": False,
                   "scale_dtype": next((k for k, v in SCALE_DTYPES.items() if v == scale_dtype), None)}
        inputs = None
    group_0 = {"targets": [f"re:{t}" for t in targets] or [LINEAR], "weights": weights, "input_activations": inputs,
               "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group_0}, "ignore": [f"re:{p}" for p in not_converted]}
