"""What `--compile` means on which device: a pure choice, made before anything is compiled.

    auto         CPU float spans: torch.compile (inductor); CUDA: CUDA graphs; else eager
    off          every step eager
    inductor     torch.compile on any device (CPU needs a C++ compiler; CUDA needs triton)
    cuda-graphs  CUDA only: the span's decode steps captured and replayed

A quantized span (`--quant int8|int4`) on a CPU runs eagerly under auto: its linears are torch's
integer kernels and chunked dequantization (stages/kernels/quant.py), which inductor would only
wrap. A span that ships quantized (fp8, MXFP4, GGUF blocks) is compiled as a float one is: its
matrices have fused forms (stages/engine/compiled/forms.py), except the GGUF k-quants, whose
layer kinds decode eagerly and say so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

COMPILE_MODES = ("auto", "off", "inductor", "cuda-graphs")
# a peer's --compile default. TESSERA_COMPILE sets it for every peer a process starts: the test
# suite's peers are many and short-lived, and set it to off.
DEFAULT_COMPILE = os.environ.get("TESSERA_COMPILE", "auto")
INDUCTOR = "inductor"
CUDA_GRAPHS = "cuda-graphs"


class CompileChoiceError(ValueError):
    """A --compile mode that is unknown, or that this device cannot run."""


@dataclass(frozen=True)
class CompilePlan:
    """backend: "inductor", "cuda-graphs" or None (eager); reason: why, in a few words (printed once)."""

    backend: str | None
    reason: str


def plan_compile(mode: str, device_type: str, *, quantized: bool = False) -> CompilePlan:
    """The backend `mode` picks for a span on `device_type` ("cpu", "cuda", "mps"). Raises
    CompileChoiceError for an unknown mode, or cuda-graphs off CUDA."""
    if mode not in COMPILE_MODES:
        raise CompileChoiceError(f"--compile {mode!r} is not one of {COMPILE_MODES}")
    if mode == "off":
        return CompilePlan(None, "--compile off")
    if mode == CUDA_GRAPHS:
        if device_type != "cuda":
            raise CompileChoiceError(f"--compile cuda-graphs needs a CUDA device, this span is on {device_type}")
        return CompilePlan(CUDA_GRAPHS, "asked for")
    if mode == INDUCTOR:
        return CompilePlan(INDUCTOR, "asked for")
    if device_type == "cuda":
        return CompilePlan(CUDA_GRAPHS, "auto on CUDA")
    if device_type == "cpu" and quantized:
        return CompilePlan(None, "auto: a quantized span runs torch's integer kernels eagerly")
    if device_type == "cpu":
        return CompilePlan(INDUCTOR, "auto on CPU")
    return CompilePlan(None, f"auto: no compiled step for {device_type}")
