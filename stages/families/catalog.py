"""The families tessera runs, one row each, and the one door from a config.json to a `ModelSpec`.

A family is chosen by the config's `architectures` (as transformers chooses the model
class), else its `model_type`; its reader turns the config into a `ModelSpec`
(families/spec/model.py) and every key left unread is refused (families/config.py).

Adding a family on existing operators touches two files:

1. a module in families/ (as minimax_m2.py): `read(ConfigReader) -> ModelSpec`, which reads
   every key it computes and refuses every value it does not in one line (`expect`,
   `refuse`); `to_config(ModelSpec) -> dict`, which `read` reads back into the same spec;
   and `FAMILY = Family(...)` (families/family.py) naming its transformers class and, where
   they apply, its checkpoints' expert names (`ExpertNames`) or its own layer `tensors`
   mapping, its GGUF form (families/gguf.py `GgufForm`: llama.cpp's architecture name and
   the config its metadata describes), its published shapes for `tessera model synth
   --shape`, and `from_sizes` for `--arch`;
2. its row in `FAMILIES` below;

and its rows in tests/stages/families/rows.py (a transformers config builder and the knobs
there), which the conformance suite (test_conformance.py) runs like every other family's:
logits and greedy against transformers, stacked and chunked sessions, a split span, rollback,
the spec round trip, the refusals, and a real swarm for one row. A family needing a new
operator first gets the operator's kind (families/spec/) and module (stages/layers/).
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.models import (
    deepseek, deepseek_v4, gemma4, glm, glm5, gpt_oss, kimi_linear, llama, mimo_v2_flash, minimax_m2, mixtral, nemotron_h,
    qwen3, qwen3_next,
)
from tessera.stages.families.config import ConfigReader
from tessera.stages.families.family import Family
from tessera.stages.families.gguf import GgufMetadata
from tessera.stages.families.mtp import MtpSpec
from tessera.stages.families.shipped import read_shipped
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.tensors import (
    Choices, Shape, edge_tensors, embedding_name, layer_tensors, matrix_paths,
)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.LLAMA,
    llama.MISTRAL,
    llama.QWEN2,
    qwen3.QWEN3,
    qwen3.QWEN3_MOE,
    mixtral.FAMILY,
    deepseek.FAMILY,
    deepseek_v4.FAMILY,
    glm.FAMILY,
    glm5.FAMILY,
    gpt_oss.FAMILY,
    minimax_m2.FAMILY,
    qwen3_next.QWEN3_NEXT,
    qwen3_next.QWEN3_5,
    qwen3_next.QWEN3_5_MOE,
    kimi_linear.FAMILY,
    nemotron_h.FAMILY,
    mimo_v2_flash.FAMILY,
    gemma4.FAMILY,
)}
BY_ARCHITECTURE = {name: f for f in FAMILIES.values() for name in (f.architecture, *f.also)}


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


def gguf_family(meta: GgufMetadata) -> Family:
    """The family a GGUF file's metadata describes (UnsupportedModel naming its architecture for any other)."""
    found = [f for f in FAMILIES.values() if f.gguf is not None and f.gguf.architecture == meta.architecture]
    claimed = next((f for f in found if f.gguf is not None and f.gguf.claims(meta)), None)
    if claimed is None:
        known = sorted({f.gguf.architecture for f in FAMILIES.values() if f.gguf is not None})
        raise UnsupportedModel(f"GGUF architecture {meta.architecture!r} is not supported ({known})")
    return claimed


def families_from_sizes() -> tuple[str, ...]:
    """The families `tessera model synth --arch` builds from plain sizes."""
    return tuple(name for name, f in FAMILIES.items() if f.from_sizes is not None)


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


def mtp_of(spec: ModelSpec) -> MtpSpec:
    """The model's first multi-token-prediction module (families/mtp.py), or UnsupportedModel in one line
    for a model that has none or whose family's are not run."""
    if spec.mtp_layers == 0:
        raise UnsupportedModel(f"this {spec.family} model has no multi-token-prediction (MTP) layers "
                               "(its config counts none): --speculate mtp drafts with them")
    family = FAMILIES[spec.family]
    if family.mtp is None:
        raise UnsupportedModel(f"drafting with the MTP layers of {spec.family} is not supported "
                               f"(families with it: {sorted(n for n, f in FAMILIES.items() if f.mtp)})")
    return family.mtp(spec)


def edge_names(spec: ModelSpec, name: str) -> tuple[str, ...]:
    """The names a checkpoint may give edge tensor `name` (families/tensors.py `edge_tensors`): it, then
    its family's aliases (`Family.edge_aliases`)."""
    return (name, *FAMILIES[spec.family].edge_aliases.get(name, ()))


@lru_cache(maxsize=256)
def layer_matrices(spec: ModelSpec, layer: int) -> tuple[str, ...]:
    """The paths of layer `layer`'s weight matrices ("attn.wqkv", "mlp.experts.3.w_down"...:
    families/tensors.py `matrix_paths`): what quantization stores as integers."""
    return matrix_paths(tensors_of_layer(spec, layer))


def model_tensors(spec: ModelSpec) -> dict[str, Shape]:
    """Every checkpoint tensor of the model in its published layout (each engine tensor's first
    choice), with its shape: what synth writes and what a folder is first checked against."""
    edges = edge_tensors(spec)
    shapes = {embedding_name(spec): edges.pop(embedding_name(spec))}
    for layer in range(spec.num_layers):
        for choices in tensors_of_layer(spec, layer).values():
            shapes.update(zip(choices[0].names, choices[0].shapes))
    return {**shapes, **edges}  # in the order synth draws random weights: embedding, layers, norm, head
