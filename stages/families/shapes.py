"""Published models' shapes, by name: what `tessera model synth --shape NAME` builds at real size.

Each family module lists its own (`Family.shapes`), collected here. A shape is the model's
published `config.json` (the keys that shape it and every switch it sets), so the family's own
reader (families/catalog.py) turns it into the `ModelSpec` a real checkpoint of that model
would have: the same refusals, the same layers. Left out: `quantization_config` (a synthetic
model holds float weights), `auto_map` (remote-code pointers) and bookkeeping such as
`transformers_version`. `shape_spec` reads one and trims it for a bench: the first `layers`
layers, `experts` experts per sparse layer (each token still picks as many as the model's
router does, up to that count), a `vocab`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import FAMILIES, spec_from_config
from tessera.stages.families.spec.model import ModelSpec

# every family's published shapes (each family module keeps its own: `Family.shapes`)
SHAPES: dict[str, dict[str, Any]] = {name: dict(config) for family in FAMILIES.values()
                                     for name, config in family.shapes.items()}


def shape_spec(name: str, *, layers: int | None = None, experts: int | None = None,
               vocab: int | None = None) -> ModelSpec:
    """The spec of published shape `name`, trimmed as the module docstring says. Raises
    UnsupportedModel for an unknown name or a family the engine does not run,
    ModelFormatError for a trim the shape cannot take."""
    if name not in SHAPES:
        raise UnsupportedModel(f"unknown shape {name!r}: tessera knows {sorted(SHAPES)}")
    spec = spec_from_config(SHAPES[name])
    if layers is not None:
        if not 0 < layers <= spec.num_layers:
            raise ModelFormatError(f"{name} has {spec.num_layers} layers: cannot keep {layers}")
        spec = replace(spec, layers=spec.layers[:layers])
    if experts is not None:
        if experts < 1:
            raise ModelFormatError(f"cannot keep {experts} experts")
        spec = replace(spec, layers=tuple(
            replace(layer, mlp=replace(layer.mlp, num_experts=min(experts, layer.mlp.num_experts), router=replace(
                layer.mlp.router, top_k=min(layer.mlp.router.top_k, experts))))
            if layer.mlp is not None and layer.mlp.kind in ("moe", "dense_and_moe") and layer.mlp.router is not None
            else layer
            for layer in spec.layers))
    if vocab is not None:  # and the per-layer input table's rows with it (Gemma 4)
        spec = replace(spec, vocab_size=vocab, per_layer_vocab=vocab if spec.per_layer_vocab else 0)
    return spec
