"""The linear module of one checkpoint matrix from its stored tensors, by the form it ships in.

A shipped model's spec (families/shipped.py `ShippedFormat`) says each matrix's form: fp8
blocks (kernels/fp8.py), MXFP4 (kernels/mxfp4.py; DeepSeek-V4's FP4 experts too), NVFP4
(kernels/nvfp4.py), compressed-tensors' INT4 (kernels/int4_packed.py), a GGUF block type
(kernels/ggml/linear.py) or a float kept in its shipped dtype (kernels/linear.py `FloatLinear`). `stored_linear` builds
the module from the stored tensors, however they were had: read from a folder
(stages/weights/formats/load.py) or encoded from floats (kernels/encode.py).
"""

from __future__ import annotations

import torch

from tessera.stages.families.shipped import GGML_TYPES, ShippedFormat
from tessera.stages.kernels.fp8 import Fp8BlockLinear, check_codes
from tessera.stages.kernels.ggml.linear import GgmlLinear
from tessera.stages.kernels.int4_packed import PackedInt4Linear
from tessera.stages.kernels.linear import FloatLinear, ShippedLinear
from tessera.stages.kernels.mxfp4 import Mxfp4Linear
from tessera.stages.kernels.nvfp4 import Nvfp4Linear


def stored_linear(shipped: ShippedFormat, name: str, stored: dict[str, torch.Tensor], *, cols: int) -> ShippedLinear:
    """The linear module (no bias) of checkpoint matrix `name` from its stored tensors (by stored
    name: families/shipped.py `stored_tensors`), `cols` its inputs. Raises ModelFormatError (fp8 NaN codes)."""
    form = shipped.form_of(name)
    if form == "fp8":
        codes, scale_inv = stored[name], stored[name + "_scale_inv"]
        check_codes(codes, name)
        # ue8m0 scales kept as their bytes (placement counts them so), widened where they are used
        return Fp8BlockLinear(codes, scale_inv if scale_inv.dtype == torch.float8_e8m0fnu else scale_inv.float(),
                              shipped.block, None)
    if form == "mxfp4":
        return Mxfp4Linear(stored[name + "_blocks"], stored[name + "_scales"], None)
    parts = list(stored.values())  # in families/shipped.py `stored_tensors`' order
    if form == "fp4":  # DeepSeek-V4's experts: e2m1 pairs and an e8m0 exponent per 32, MXFP4's numbers
        codes, exponents = parts
        return Mxfp4Linear(codes.view(torch.uint8).reshape(codes.shape[0], -1, 16), exponents.view(torch.uint8), None)
    if form == "nvfp4":
        codes, scales, global_scale, *input_scale = parts
        check_codes(scales, name + " scales")
        if shipped.layout == "modelopt":  # weight_scale_2 multiplies: its inverse divides, as compressed-tensors reads it
            global_scale = 1 / global_scale.float()
        return Nvfp4Linear(codes, scales, global_scale, None, input_scale[0] if input_scale else None)
    if form == "int4":
        packed, scales, shape, *zero_points = parts
        return PackedInt4Linear(packed, scales, zero_points[0] if zero_points else None, None, shape)
    if form == "float" or GGML_TYPES[form].is_float:
        return FloatLinear(stored[name], None)
    return GgmlLinear(stored[name], GGML_TYPES[form], cols, None)
