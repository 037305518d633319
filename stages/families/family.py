"""What a family module declares about itself: one `Family` per `model_type`.

A family module (llama.py, qwen3.py, ..., minimax_m2.py) reads its config into a `ModelSpec`
and says everything else the engine needs to know of it here, so that nothing outside its
module names it: the transformers class its configs name, the config writer, how its
checkpoints name a layer's tensors (`ExpertNames`, or a whole `tensors` mapping), how
llama.cpp's GGUF files describe it (`GgufForm`: stages/families/gguf.py), the published
shapes `tessera model synth --shape` builds, and whether `tessera model synth --arch` can
build it from plain sizes. families/catalog.py lists the families, one row each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tessera.stages.families.config import ConfigReader
from tessera.stages.families.gguf import GgufForm
from tessera.stages.families.mtp import MtpSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.tensors import QWEN_EXPERTS, Choices, ExpertNames

# A Llama-block model from plain sizes (`tessera model synth --arch`): vocab_size, hidden_size,
# intermediate_size, num_layers, num_heads, num_kv_heads, and the optional keywords of
# families/models/llama.py `llama_spec` (tie_embeddings, max_position, eos_token_ids ...).
FromSizes = Callable[..., ModelSpec]


@dataclass(frozen=True)
class Family:
    """One `model_type` (module docstring).

    name:         the config's `model_type` (and `ModelSpec.family`).
    architecture: the transformers class a config's `architectures` names for it.
    read:         config (through a ConfigReader that refuses every key left unread) -> ModelSpec.
    to_config:    ModelSpec -> the config.json dict `read` reads back into it.
    experts:      how its published checkpoints name a sparse MLP's tensors.
    tensors:      engine name -> checkpoint layouts for every tensor of a layer, where the
                  family lays them out otherwise than families/tensors.py `layer_tensors`.
    gguf:         how a llama.cpp GGUF file describes this family (None: not read from GGUF).
    shapes:       published configs by name (what `tessera model synth --shape NAME` builds).
    from_sizes:   a spec of this family from plain sizes (`tessera model synth --arch`), or None.
    also:         other transformers classes its configs may name (a multimodal family's text-only
                  class: Qwen3.5's `Qwen3_5ForCausalLM` beside `Qwen3_5ForConditionalGeneration`).
    mtp:          its checkpoints' first multi-token-prediction module (families/mtp.py: the layout and
                  the block) for a spec with `mtp_layers`, or None where drafting with them is not run.
    edge_aliases: other names its checkpoints give the tensors outside the layers (families/tensors.py
                  `edge_tensors` names them as transformers does): a folder holding an alias instead
                  is read under it (DeepSeek-V4's published `embed.weight`, `head.weight`).
    not_run:      the prefixes of checkpoint tensors a folder of a model of this spec may hold that
                  are not run (MiMo-V2-Flash's multi-token-prediction blocks, "model.mtp."; Gemma 4's
                  key and value projections of its KV-shared layers): accepted, never read (a
                  drafter may read the MTP blocks by name).
    """

    name: str
    architecture: str
    read: Callable[[ConfigReader], ModelSpec]
    to_config: Callable[[ModelSpec], dict[str, Any]]
    experts: ExpertNames = QWEN_EXPERTS
    tensors: Callable[[ModelSpec, int], dict[str, Choices]] | None = None
    gguf: GgufForm | None = None
    shapes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    from_sizes: FromSizes | None = None
    also: tuple[str, ...] = ()
    mtp: Callable[[ModelSpec], MtpSpec] | None = None
    edge_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    not_run: Callable[[ModelSpec], tuple[str, ...]] = lambda spec: ()
