"""FP8 block-scaled matrices as DeepSeek-V3, GLM and Qwen3 "-FP8" folders ship them.

A weight is float8_e4m3fn codes q [N, K] and `weight_scale_inv` s, one float32 per block of
bn x bk (128 x 128 as published) [ceil(N/bn), ceil(K/bk)]:

    w[r, c] = q[r, c] * s[r // bn, c // bk]          (`fp8_dense`: the reference, in float32)

On a CPU, torch's own float8 -> float32 conversion is a scalar loop (measured here: 30x a
float32 matmul of the same matrix), so a span widens the codes through float16 instead: an
e4m3 byte's low seven bits shifted left by 7, its sign to bit 15, ARE the float16 of
q * 2^-8 — subnormals included (e4m3's subnormal m/8 * 2^-6 lands on float16's normal or
subnormal range exactly) — and float16 -> float32 is a vector instruction (F16C). The 2^8
goes into the scales. The scales then multiply the activations, not the weight:
rows [r0, r0 + bn) share one scale per column block, so y[:, r] = (x * s_row) . q[r] with
s_row[c] = s[r // bn, c // bk]: a [T, K] product per 128 rows instead of a pass over the
weight (the int8 path's "scale the output" in block form). Each step is exact except the
order of float32 rounding in the sum, well inside the float32 tolerance the tests state.
e4m3's NaN (0x7F, 0xFF) would widen to a number; a checkpoint holding one is refused at load.

Under torch.compile a code becomes a number by a shift, a mask and a bit cast (`e4m3_values`):
the byte, read through its int8 view and widened to int32 (sign-extended), shifted left by 20
puts its four exponent and three mantissa bits where float32's low exponent bits and top
mantissa bits are, and its sign (repeated by the widening) at bit 31; masked to those eight bits
they read, as float32, the code's value times 2^-120 — an e4m3 subnormal m/8 2^-6 lands on the
float32 subnormal (m << 20) 2^-149, the same value times 2^-120 — and one multiplication by 2^120
(exact: a power of two, every result normal) gives the value. (A CPU that flushed subnormal
inputs to zero would lose e4m3's subnormals: tests/stages/formats/test_shipped_compiled.py checks
all 254 finite codes through the compiled form.) Measured on the AMD EPYC box, one thread, a
2816 x 1024 matrix's compiled one-row product: 0.22 ms, against 0.48 ms when a code was rebuilt
by integer arithmetic (the integer (8 + m) << e, negated by a select, converted), 0.42 ms for a
bit cast with the sign applied by a select, and 0.30 ms for float32's own product (the matrix in
cache). A 256-entry table, gathered, is exact too but runs a gather a lane.
The one-row product (`fused_rows`) sums each 128-input block of a row's codes times the inputs
first (the row's bytes and the inputs both contiguous: one vectorised reduction), then multiplies
each block's sum by its scale and sums over the blocks; only the order of float32 summation
differs from the dequantized weight's product. `fused_weight` (several rows: a chunked matmul)
is those values times the scales, `fp8_dense`'s.

On a CUDA device of compute capability 9.0 (H100/H200), `torch.nn.functional.scaled_mm` with
1x128 activation blocks and the checkpoint's 128x128 weight blocks multiplies the codes as they
are (activations quantized per 128 inputs of a row, dynamically, as the checkpoints' own
`activation_scheme` says). NOT TESTED ON HARDWARE here (no GPU lent to this project's CI);
it checks itself once per matrix shape against the dequantized weight and falls back to the
dequantize-then-matmul path if torch refuses it or disagrees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.stages.errors import ModelFormatError
from tessera.stages.kernels.chunked import SCRATCH
from tessera.stages.kernels.linear import ShippedLinear

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_NAN_BITS = 0x7F  # e4m3fn's NaN: every exponent and mantissa bit set (either sign)
F16_OF_CODE = -16512  # int16 0xBF80: keeps the sign (bit 15) and the seven bits shifted to 13..7
CODE_SCALE = 256.0  # the float16 trick reads q * 2^-8
# `e4m3_values`: an e4m3 byte shifted left 20, its sign at bit 31 (int32 0x87F00000, signed), reads as
# float32 its value times 2^-120 (127 - 7, float32's exponent bias less e4m3's)
E4M3_BITS_SHIFT = 20
E4M3_BITS_MASK = 0x87F00000 - (1 << 32)
E4M3_BITS_SCALE = 2.0 ** 120
SCALED_MM_BLOCK = 128  # torch's blockwise fp8 scaling: 1x128 activations, 128x128 weights
SCALED_MM_CAPABILITY = (9, 0)  # SM90: where torch implements that recipe
SELF_CHECK_TOLERANCE = 0.05  # relative, of the largest output: fp8 activations lose ~3 bits of 8


def fp8_dense(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 weight [N, K] of fp8 `codes` [N, K] and their block scales (torch's own conversion)."""
    rows, cols = codes.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return codes.float() * s


def check_codes(codes: torch.Tensor, name: str) -> None:
    """Raise ModelFormatError if `codes` hold e4m3's NaN (a weight no checkpoint ships)."""
    if bool(((codes.view(torch.uint8) & 0x7F) == FP8_NAN_BITS).any()):
        raise ModelFormatError(f"tensor {name!r} holds float8 NaN codes")


def e4m3_values(b: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes as int32 read from their int8 view (sign-extended) -> their float32 values, exactly, by
    a shift, a mask, a bit cast and a multiplication by a power of two (module docstring)."""
    return ((b << E4M3_BITS_SHIFT) & E4M3_BITS_MASK).view(torch.float32) * E4M3_BITS_SCALE


def widen_codes(codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """q * 2^-8 in float32 for fp8 codes [r, K], into `out` [r, K] (module docstring)."""
    bits = SCRATCH.take(codes.numel(), torch.int16).view(codes.shape)
    bits.copy_(codes.view(torch.int8))  # sign-extended: bit 15 is the sign
    bits.bitwise_left_shift_(7).bitwise_and_(F16_OF_CODE)
    return out.copy_(bits.view(torch.float16))


class Fp8BlockLinear(ShippedLinear):
    """y = x W^T for W the fp8 `codes` [N, K] times block scales `scale_inv` (module docstring)."""

    def __init__(self, codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.block = block
        self.register_buffer("weight", codes)  # float8_e4m3fn [N, K], as shipped
        self.register_buffer("scale_inv", scale_inv)  # float32 [ceil(N/bn), ceil(K/bk)]
        self.register_buffer("bias", bias)
        self._kernel_ok: bool | None = None  # scaled_mm checked on this matrix (None: not yet)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] -> [T, N], without the bias."""
        if rows.device.type == "cpu":
            return self._blocks_on_cpu(rows.float()).to(rows.dtype)
        if self._takes_scaled_mm(rows):
            return self._scaled_mm(rows)
        return super().matmul(rows)

    def _blocks_on_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 -> [T, N]: per band of bn rows, the codes widened into scratch and the
        activations scaled by that band's column-block scales."""
        bn, bk = self.block
        n, k = self.out_features, self.in_features
        out = x.new_empty(x.shape[0], n)
        # a band's scales over the columns, times 2^8 (exact: a power of two) [N/bn, K]
        scales = (self.scale_inv.float() * CODE_SCALE).repeat_interleave(bk, 1)[:, :k]
        xs = torch.empty_like(x)
        for band, lo in enumerate(range(0, n, bn)):
            hi = min(n, lo + bn)
            w = widen_codes(self.weight[lo:hi], SCRATCH.take((hi - lo) * k, torch.float32).view(hi - lo, k))
            torch.mul(x, scales[band], out=xs)  # [T, K]
            torch.matmul(xs, w.T, out=out[:, lo:hi])  # [T, hi - lo]
        return out

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        bn, bk = self.block
        w = widen_codes(self.weight[lo:hi], out)
        bands = torch.arange(lo, hi, device=w.device) // bn
        scales = (self.scale_inv.float()[bands] * CODE_SCALE).repeat_interleave(bk, 1)[:, : self.in_features]
        return w.mul_(scales)

    def dequantized(self) -> torch.Tensor:
        return fp8_dense(self.weight.cpu(), self.scale_inv.cpu(), self.block)

    def fused_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.weight.view(torch.int8), self.scale_inv.float()

    def fused_weight(self, code_bytes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        q = e4m3_values(code_bytes.to(torch.int32))
        (bn, bk), n, k = self.block, self.out_features, self.in_features
        return q * scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]

    def fused_rows(self, x: torch.Tensor, code_bytes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """x [R, K] -> [R, N]: per row, each column block's codes times the inputs summed, then times the
        block's scale, summed over the blocks (module docstring); a last narrower block summed alone."""
        (bn, bk), n, k = self.block, self.out_features, self.in_features
        whole = k - k % bk
        q = e4m3_values(code_bytes.to(torch.int32))  # [N, K]
        sums = []  # [R, N, blocks] each
        if whole:
            xs = x[:, :whole].reshape(x.shape[0], 1, whole // bk, bk)
            sums.append((xs * q[:, :whole].reshape(n, whole // bk, bk)).sum(-1))
        if k > whole:
            sums.append((x[:, None, whole:] * q[:, whole:]).sum(-1, keepdim=True))
        dots = sums[0] if len(sums) == 1 else torch.cat(sums, dim=-1)
        return (dots * scale_inv.repeat_interleave(bn, 0)[:n]).sum(-1)

    # -- torch's fp8 kernel on SM90 (NOT TESTED ON HARDWARE: see the module docstring) ----------

    def _takes_scaled_mm(self, rows: torch.Tensor) -> bool:
        if self._kernel_ok is False or rows.device.type != "cuda" or not hasattr(F, "scaled_mm"):
            return False
        if self.block != (SCALED_MM_BLOCK, SCALED_MM_BLOCK) or self.in_features % SCALED_MM_BLOCK \
                or self.out_features % SCALED_MM_BLOCK:
            return False
        if torch.cuda.get_device_capability(rows.device) != SCALED_MM_CAPABILITY:
            return False
        if self._kernel_ok is None:
            self._kernel_ok = self._check_kernel(rows)
        return self._kernel_ok

    def _scaled_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] (bf16/fp16) -> [T, N]: the activations quantized per 1x128 block (dynamic), the
        codes and the checkpoint's 128x128 scales as they are."""
        t, k = rows.shape
        pad = -t % 4  # the kernel wants the rows in fours (as the published callers pad them)
        x = F.pad(rows, (0, 0, 0, pad)) if pad else rows
        groups = x.float().view(x.shape[0], k // SCALED_MM_BLOCK, SCALED_MM_BLOCK)
        amax = groups.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny)  # [T, K/128]
        x_scale = amax / FP8_MAX
        x_codes = (groups / x_scale[..., None]).to(torch.float8_e4m3fn).view(x.shape[0], k)
        x_scale = x_scale.t().contiguous().t()  # 1x128 scales are read outer-dim-major
        y = F.scaled_mm(x_codes, self.weight.t(), x_scale, F.ScalingType.BlockWise1x128,
                        self.scale_inv.float().t(), F.ScalingType.BlockWise128x128, output_dtype=rows.dtype)
        return y[:t]

    def _check_kernel(self, rows: torch.Tensor) -> bool:
        """Whether scaled_mm runs here and agrees with the dequantized weight on this input."""
        try:
            got = self._scaled_mm(rows).float()
        except (RuntimeError, NotImplementedError, ValueError):
            return False
        want = rows.float() @ self.dequantized_on(rows.device).T
        return bool((got - want).abs().max() <= SELF_CHECK_TOLERANCE * want.abs().max().clamp(min=1e-6))

    def dequantized_on(self, device: torch.device) -> torch.Tensor:
        return fp8_dense(self.weight.to(device), self.scale_inv.to(device), self.block)
