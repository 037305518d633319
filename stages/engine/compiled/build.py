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


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """The row buckets worth compiling when stacked steps hold at most `max_rows` rows (a peer's
    --batch-rows): those of ROW_BUCKETS up to it (1 always)."""
    return tuple(b for b in ROW_BUCKETS if b <= max(1, max_rows))


def compile_decode(stage: Stage, mode: str = "auto", *, say: Callable[[str], None] | None = None,
                   buckets: Sequence[int] = ROW_BUCKETS, whole: bool = False) -> CompilePlan:
    """Compile `stage`'s decode steps as `mode` asks (modes.py); returns what it chose and why.
    `whole`: a stage holding the whole model (the local engine) also gets its one-token step from
    token id to next token id as one graph (`Stage.next_token`), where the backend has one.
    Raises CompileChoiceError for a mode this device cannot run."""
    plan = plan_compile(mode, stage.device.type, quantized=stage.quant.active)
    stage.decode = None
    if plan.backend is not None and not stage.hop.plain:
        # the compiled steps take and give [T, H]: a hop of several streams (token ids, per-layer inputs)
        # decodes eagerly
        width = stage.spec.hop_width(stage.start)
        return CompilePlan(None, f"{stage.spec.family} steps carry {width} values a token into layer {stage.start}, "
                                 f"not {stage.spec.hidden_size}: serving eagerly")
    if plan.backend is None or stage.end == stage.start and stage.head is None:
        return plan
    runner = GraphDecode(stage, buckets=buckets, say=say) if plan.backend == CUDA_GRAPHS else \
        InductorDecode(stage, buckets=buckets, say=say, whole=whole)
    runner.compile()
    if not runner.compiled:
        return CompilePlan(None, f"{plan.backend} failed for every layer kind: serving eagerly")
    stage.decode = runner
    return plan
