"""What a requester holds of the model it asks for: `RequesterModel`.

A requester serves no layers; it needs the model's shape (`ModelSpec`), the id its peers
advertise (tagged with the quantization they serve), and — when it turns hidden states into
text itself — the embedding and head (a `Stage` of no layers) and the tokenizer. `load` reads
them from a model folder; a simulation builds one with no head (peer/sim/requester.py).
Kept apart from `Swarm` (peer/request/client.py): loading weights is not talking to a swarm.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tessera.stages.weights import registry
from tessera.stages.kernels.quant import NO_QUANT, Quant, model_tag
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.engine.compiled.build import compile_decode
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.stages.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequesterModel:
    """What a requester knows of the model: its shape, its advertised id, and (when it
    generates text) the embedding + head and the tokenizer."""

    spec: ModelSpec
    model_id: str  # the id peers advertise (tagged with the quantization they serve)
    head: Stage | None = None  # embedding and head; None: hidden states come from elsewhere (a simulation)
    tokenizer: Tokenizer | None = None

    @staticmethod
    def load(folder: Path, quant: Quant = NO_QUANT, *, compile: str = "off") -> "RequesterModel":
        """The model in `folder`: its embedding and head (a few hundred MB for a small model) and tokenizer;
        `compile` (--compile) compiles the head's few-row steps (stages/engine/compiled/)."""
        head = load_stage(folder, start=0, end=0, embed=True, head=True)
        compile_decode(head, compile)
        return RequesterModel(head.spec, model_tag(registry.model_id(folder), quant), head,
                              Tokenizer.from_folder(folder))
