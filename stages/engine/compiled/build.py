"""Attach a compiled decode step to a loaded Stage: `compile_decode(stage, mode)`.

Called once per span load (a peer: right after its weights are in, before it serves; the
local engine and the benchmarks: after `load_stage`). What runs eagerly, and why, is said
through `say`, once; a span whose every compile failed serves eagerly.
"""

from __future__ import annotations

from typing import Callable, Sequence

from tessera.stages.engine.compiled.cuda_graphs import GraphDecode
from tessera.stages.engine.compiled.inductor import ROW_BUCKETS, InductorDecode
from tessera.stages.engine.compiled.modes import CUDA_GRAPHS, CompilePlan, plan_compile
from tessera.stages.engine.stage import Stage
from tessera.stages.families.spec.model import ModelSpec


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """The row buckets worth compiling when stacked steps hold at most `max_rows` rows (a peer's
    --batch-rows): those of ROW_BUCKETS up to it (1 always)."""
    return tuple(b for b in ROW_BUCKETS if b <= max(1, max_rows))


def eager_only(spec: ModelSpec) -> str | None:
    """What of `spec` no compiled decode step computes (its stages then decode eagerly), or None. The
    compiled steps take and give [T, H] and hand a layer its own store: a hop of more than the
    residual (DeepSeek-V4's streams and token ids, Gemma 4's per-layer inputs: ModelSpec.hop_width)
    and layers reading another layer's keys and values (Gemma 4) are not among what they compute,
    nor softcapped logits (the compiled head's are plain)."""
    if spec.streams > 1 or spec.hop_id_digits:
        return f"hop of {spec.hop_width(0)} values a token ({spec.streams} residual streams and token ids)"
    if spec.per_layer_width:
        return "per-layer inputs"
    if any(getattr(layer.attention, "kv_source", None) is not None for layer in spec.layers):
        return "layers reading another layer's keys and values"
    if spec.logit_softcap is not None:
        return "softcapped logits"
    return None


def compile_decode(stage: Stage, mode: str = "auto", *, say: Callable[[str], None] | None = None,
                   buckets: Sequence[int] = ROW_BUCKETS, whole: bool = False) -> CompilePlan:
    """Compile `stage`'s decode steps as `mode` asks (modes.py); returns what it chose and why.
    `whole`: a stage holding the whole model (the local engine) also gets its one-token step from
    token id to next token id as one graph (`Stage.next_token`), where the backend has one.
    Raises CompileChoiceError for a mode this device cannot run."""
    plan = plan_compile(mode, stage.device.type, quantized=stage.quant.active)
    stage.decode = None
    if plan.backend is not None and (why := eager_only(stage.spec)) is not None:
        return CompilePlan(None, f"this model decodes eagerly: no compiled step for its {why} yet")
    if plan.backend is None or stage.end == stage.start and stage.head is None:
        return plan
    runner = GraphDecode(stage, buckets=buckets, say=say) if plan.backend == CUDA_GRAPHS else \
        InductorDecode(stage, buckets=buckets, say=say, whole=whole)
    runner.compile()
    if not runner.compiled:
        return CompilePlan(None, f"{plan.backend} failed for every layer kind: serving eagerly")
    stage.decode = runner
    return plan
