"""Fault injection — for tests and demos: a peer that returns wrong activations on purpose.

    tessera peer ... --misbehave perturb:0.01    # 1% of steps get noise of 2% of each row's RMS
    tessera peer ... --misbehave wrong-weights   # one weight matrix of the span is off by ~1%

Both are far above the honest difference between two float32 peers (~1e-5,
see protocol/fingerprint.py) and small enough not to break the text at once:
exactly the kind of fault that spot checks exist to catch.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

from tessera.stages.engine.stage import Stage

from tessera.peer.base.errors import ConfigError

PERTURB_SCALE = 0.02  # noise std, relative to each row's RMS
WRONG_WEIGHT_SCALE = 0.01  # relative std of the noise added to one weight matrix


def parse(spec: str) -> tuple[str, float]:
    """'perturb:P' or 'wrong-weights' -> (mode, probability). Raises ConfigError."""
    if spec == "wrong-weights":
        return "wrong-weights", 1.0
    if spec.startswith("perturb:"):
        try:
            p = float(spec.split(":", 1)[1])
        except ValueError:
            p = -1.0
        if 0.0 < p <= 1.0:
            return "perturb", p
    raise ConfigError(f"--misbehave wants perturb:P (0 < P <= 1) or wrong-weights, got {spec!r}")


def perturber(probability: float, seed: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """Adds noise of PERTURB_SCALE x row RMS to a fraction `probability` of steps."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)

    def tamper(output: torch.Tensor) -> torch.Tensor:
        if rng.random() >= probability:
            return output
        rms = output.float().pow(2).mean(-1, keepdim=True).sqrt()
        noise = torch.randn(output.shape, generator=gen) * PERTURB_SCALE * rms
        return (output.float() + noise).to(output.dtype)

    return tamper


def corrupt_weights(stage: Stage, seed: int = 0) -> str:
    """Perturb the first block's MLP down projection; returns what was changed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        down = stage.blocks[0].mlp.w_down
        # a quantized span's matrix is integers: perturb its float scales instead (stages/kernels/quant.py)
        weight = next(t for t in (getattr(down, name, None) for name in ("weight", "scales", "scales_and_zeros"))
                      if t is not None and t.is_floating_point())
        weight.add_(torch.randn(weight.shape, generator=gen).to(weight.dtype) * WRONG_WEIGHT_SCALE * weight.abs().mean())
    return f"layer {stage.start} mlp.down_proj"
