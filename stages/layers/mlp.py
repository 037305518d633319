"""The dense MLP: SwiGLU, down(silu(gate(x)) * up(x)), gate and up as ONE stacked matmul.

Also each expert of a sparse MLP (layers/moe.py). The projections are called as modules, so
that a quantized span can hold `tessera.stages.kernels.quant` linears in their place (same
call, integer weights). `ClampedSwiGLU` is gpt-oss's gated activation (GluSpec), with biased
projections, `ClampedSiLU` DeepSeek-V4's; `Relu2` is Nemotron-H's ungated MLP, down(relu(up(x))^2);
`GeGLU` Gemma's, gelu(gate) * up; `glu_mlp` picks the module an MlpSpec's (or each of its experts') shape needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.spec.mlp import GluSpec, MlpSpec


class SwiGLU(nn.Module):
    """SwiGLU of `width` over a residual stream of `hidden`."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.w_gate_up = nn.Linear(hidden, 2 * width, bias=False)
        self.w_down = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        gate, up = self.w_gate_up.forward(x).split(self.width, dim=-1)  # [T, I] each
        return self.w_down.forward(F.silu(gate).mul_(up))


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert (GluSpec kind "clamped_swiglu"): gate and up from one biased matmul (gate
    rows first: families/tensors.py regroups the checkpoint's interleaved rows), gate clamped above
    at `limit`, up to [-limit, limit], then down((up + 1) * gate * sigmoid(alpha * gate)) + bias,
    in the reference's order of operations."""

    def __init__(self, hidden: int, width: int, glu: GluSpec, *, bias: bool = True) -> None:
        super().__init__()
        assert glu.alpha is not None and glu.limit is not None, "a clamped SwiGLU has alpha and limit"
        self.width, self.alpha, self.limit = width, glu.alpha, glu.limit
        self.w_gate_up = nn.Linear(hidden, 2 * width, bias=bias)
        self.w_down = nn.Linear(width, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        gate, up = self.w_gate_up.forward(x).split(self.width, dim=-1)  # [T, I] each
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.w_down.forward((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class Relu2(nn.Module):
    """Nemotron-H's MLP (GluSpec kind "relu2"): down(relu(up(x))^2), no gate projection."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.w_up = nn.Linear(hidden, width, bias=False)
        self.w_down = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.w_down.forward(torch.square(F.relu(self.w_up.forward(x))))


class ClampedSiLU(SwiGLU):
    """DeepSeek-V4's SwiGLU (GluSpec kind "clamped_silu"): gate clamped above at `limit`, up to
    [-limit, limit], then down(silu(gate) * up), in the reference's order of operations."""

    def __init__(self, hidden: int, width: int, glu: GluSpec) -> None:
        super().__init__(hidden, width)
        assert glu.limit is not None, "a clamped SiLU has a limit"
        self.limit = glu.limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        gate, up = self.w_gate_up.forward(x).split(self.width, dim=-1)  # [T, I] each
        return self.w_down.forward(F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit))


class GeGLU(SwiGLU):
    """Gemma's gated MLP (GluSpec kind "gelu_tanh"): down(gelu(gate) * up), gelu's tanh approximation
    (transformers' `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        gate, up = self.w_gate_up.forward(x).split(self.width, dim=-1)  # [T, I] each
        return self.w_down.forward(F.gelu(gate, approximate="tanh").mul_(up))


def glu_mlp(hidden: int, spec: MlpSpec) -> nn.Module:
    """The SwiGLU module of `spec.width` with `spec.glu` and `spec.bias`: a dense MLP, or one expert
    of a sparse one (UnsupportedModel for a combination without a module here)."""
    if spec.glu.kind == "clamped_swiglu":
        return ClampedSwiGLU(hidden, spec.width, spec.glu, bias=spec.bias)
    if spec.glu.kind == "clamped_silu" and not spec.bias:
        return ClampedSiLU(hidden, spec.width, spec.glu)
    if spec.glu.kind == "silu" and not spec.bias:
        return SwiGLU(hidden, spec.width)
    if spec.glu.kind == "relu2" and not spec.bias:
        return Relu2(hidden, spec.width)
    if spec.glu.kind == "gelu_tanh" and not spec.bias:
        return GeGLU(hidden, spec.width)
    raise UnsupportedModel(f"a {'biased ' if spec.bias else ''}{spec.glu.kind!r} MLP has no module in this engine")
