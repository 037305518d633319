"""The families tessera runs, and the one door from a config.json to a `ModelSpec`.

A family is chosen by the config's `architectures` (as transformers chooses the model
class), else its `model_type`; its reader turns the config into a `ModelSpec`
(families/spec.py) and every key left unread is refused (families/config.py).

Adding a family on existing operators is a reader and a line here: a module with
`read(ConfigReader) -> ModelSpec` (expanding the config into its LayerSpecs) and
`to_config(ModelSpec) -> dict` (what synth writes; `read(to_config(spec)) == spec` is
tested for every family), and an `ExpertNames` if its experts are named otherwise (or, for
tensors laid out otherwise, its own `tensors` mapping: gpt-oss's).
A family needing a new operator first gets the operator's kind (families/spec.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families import deepseek, glm, glm5, gpt_oss, llama, mixtral, qwen3
from tessera.stages.families.config import ConfigReader
from tessera.stages.families.shipped import read_shipped
from tessera.stages.families.spec import ModelSpec
from tessera.stages.families.tensors import (
    MIXTRAL_EXPERTS, QWEN_EXPERTS, Choices, ExpertNames, Shape, edge_tensors, layer_tensors, matrix_paths,
)


@dataclass(frozen=True)
class Family:
    """One `model_type`: its architecture name, how its config is read and written, and how
    its checkpoints name experts (or, with `tensors`, name every tensor of a layer)."""

    name: str
    architecture: str
    read: Callable[[ConfigReader], ModelSpec]
    to_config: Callable[[ModelSpec], dict[str, Any]]
    experts: ExpertNames = QWEN_EXPERTS
    tensors: Callable[[ModelSpec, int], dict[str, Choices]] | None = None


FAMILIES = {f.name: f for f in (
    Family("llama", llama.ARCHITECTURES["llama"], llama.read, llama.to_config),
    Family("mistral", llama.ARCHITECTURES["mistral"], llama.read, llama.to_config),
    Family("qwen2", llama.ARCHITECTURES["qwen2"], llama.read, llama.to_config),
    Family("qwen3", qwen3.ARCHITECTURES["qwen3"], qwen3.read_qwen3, qwen3.to_config),
    Family("qwen3_moe", qwen3.ARCHITECTURES["qwen3_moe"], qwen3.read_qwen3_moe, qwen3.to_config),
    Family("mixtral", mixtral.ARCHITECTURES["mixtral"], mixtral.read, mixtral.to_config, MIXTRAL_EXPERTS),
    Family("deepseek_v3", deepseek.ARCHITECTURES["deepseek_v3"], deepseek.read, deepseek.to_config),
    Family("glm4_moe", glm.ARCHITECTURES["glm4_moe"], glm.read, glm.to_config),
    Family("glm_moe_dsa", glm5.ARCHITECTURES["glm_moe_dsa"], glm5.read, glm5.to_config),
    Family("gpt_oss", gpt_oss.ARCHITECTURES["gpt_oss"], gpt_oss.read, gpt_oss.to_config,
           tensors=gpt_oss.layer_tensors),
)}
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}


def family_of(config: dict[str, Any]) -> Family:
    """The family a config names (raises UnsupportedModel for any other)."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelFormatError(f"config architectures {archs!r} is not a list")
    found = next((BY_ARCHITECTURE[a] for a in archs if a in BY_ARCHITECTURE), None)
    if found is None and not archs and config.get("model_type") in FAMILIES:
        found = FAMILIES[config["model_type"]]
    if found is None:
        raise UnsupportedModel(f"unknown architecture {archs or config.get('model_type')!r}: tessera runs "
                               f"{sorted(BY_ARCHITECTURE)}")
    return found


def spec_from_config(config: dict[str, Any]) -> ModelSpec:
    """Read a Hugging Face config dict. Raises UnsupportedModel for a family, a setting or a key
    the engine does not compute, ModelFormatError for a missing or impossible field."""
    if not isinstance(config, dict):
        raise ModelFormatError("config.json does not hold a JSON object")
    family = family_of(config)
    shipped = read_shipped(config)  # fp8 / mxfp4 / GGUF blocks as they ship; any other form refused here
    reader = ConfigReader(config, family.name)
    spec = family.read(reader)
    reader.finish()
    return replace(spec, shipped=shipped) if shipped is not None else spec


def spec_from_file(path: Path) -> ModelSpec:
    """Read `config.json` (raises ModelFormatError if it is missing or not JSON)."""
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"no config.json at {str(path)!r}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise ModelFormatError(f"{str(path)!r} is not valid JSON: {bad}") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{str(path)!r} does not hold a JSON object")
    return spec_from_config(config)


def to_config(spec: ModelSpec) -> dict[str, Any]:
    """The config.json dict of `spec` (its family's form, with its `quantization_config` when shipped quantized)."""
    config = FAMILIES[spec.family].to_config(spec)
    if spec.shipped is not None:
        config["quantization_config"] = spec.shipped.to_config()
        config["dtype"] = spec.shipped.float_dtype  # what its float tensors are stored in
    return config


def tensors_of_layer(spec: ModelSpec, layer: int) -> dict[str, Choices]:
    """Engine name -> checkpoint layouts for every tensor of layer `layer` (families/tensors.py)."""
    family = FAMILIES[spec.family]
    return family.tensors(spec, layer) if family.tensors else layer_tensors(spec, layer, family.experts)


@lru_cache(maxsize=256)
def layer_matrices(spec: ModelSpec, layer: int) -> tuple[str, ...]:
    """The paths of layer `layer`'s weight matrices ("attn.wqkv", "mlp.experts.3.w_down"...:
    families/tensors.py `matrix_paths`): what quantization stores as integers."""
    return matrix_paths(tensors_of_layer(spec, layer))


def model_tensors(spec: ModelSpec) -> dict[str, Shape]:
    """Every checkpoint tensor of the model in its published layout (each engine tensor's first
    choice), with its shape: what synth writes and what a folder is first checked against."""
    edges = edge_tensors(spec)
    shapes = {"model.embed_tokens.weight": edges.pop("model.embed_tokens.weight")}
    for layer in range(spec.num_layers):
        for choices in tensors_of_layer(spec, layer).values():
            shapes.update(zip(choices[0].names, choices[0].shapes))
    return {**shapes, **edges}  # in the order synth draws random weights: embedding, layers, norm, head
