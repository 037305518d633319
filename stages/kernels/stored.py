"""The linear module of one checkpoint matrix from its stored tensors, by the form it ships in.

A shipped model's spec (families/shipped.py `ShippedFormat`) says each matrix's form: fp8
blocks (kernels/fp8.py), MXFP4 (kernels/mxfp4.py), a GGUF block type (kernels/ggml_linear.py)
or a float kept in its shipped dtype (kernels/linear.py `FloatLinear`). `stored_linear` builds
the module from the stored tensors, however they were had: read from a folder
(stages/weights/formats/load.py) or encoded from floats (kernels/encode.py).
"""

from __future__ import annotations

import torch

from tessera.stages.families.shipped import GGML_TYPES, ShippedFormat
from tessera.stages.kernels.fp8 import Fp8BlockLinear, check_codes
from tessera.stages.kernels.ggml_linear import GgmlLinear
from tessera.stages.kernels.linear import FloatLinear, ShippedLinear
from tessera.stages.kernels.mxfp4 import Mxfp4Linear


def stored_linear(shipped: ShippedFormat, name: str, stored: dict[str, torch.Tensor], *, cols: int) -> ShippedLinear:
    """The linear module (no bias) of checkpoint matrix `name` from its stored tensors (by stored
    name: families/shipped.py `stored_tensors`), `cols` its inputs. Raises ModelFormatError (fp8 NaN codes)."""
    form = shipped.form_of(name)
    if form == "fp8":
        codes, scale_inv = stored[name], stored[name + "_scale_inv"]
        check_codes(codes, name)
        return Fp8BlockLinear(codes, scale_inv.float(), shipped.block, None)
    if form == "mxfp4":
        return Mxfp4Linear(stored[name + "_blocks"], stored[name + "_scales"], None)
    if form == "float" or GGML_TYPES[form].is_float:
        return FloatLinear(stored[name], None)
    return GgmlLinear(stored[name], GGML_TYPES[form], cols, None)
