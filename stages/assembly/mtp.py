"""A model's first multi-token-prediction module from its folder: only the MTP tensors are read.

The module (families/mtp.py) is read where the head runs, beside the Stage that holds the
embedding, final norm and head (a requester's: `RequesterModel.head`), which it shares. Its block
is read as a decoder layer of `MtpSpec.blocks` (float, or as a shipped checkpoint stores it, as
`load_stage` reads any layer), its ends (enorm, hnorm, the projection, the output norm) dense.
Every tensor the checkpoint keeps under the module's names is read, or is a copy of the model's
own (DeepSeek's embedding and head, skipped), or belongs to a later module (drafting chains the
first); any other is refused in one line, so that a checkpoint whose MTP module carries more than
we compute (dedicated embeddings, say) is not drafted with half-read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.stages.assembly.blocks import float_block, shipped_block
from tessera.stages.engine.mtp import MtpStage
from tessera.stages.engine.stage import Stage
from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import mtp_of, tensors_of_layer
from tessera.stages.families.mtp import QWEN_PREFIX, MtpSpec
from tessera.stages.layers.mtp import MtpEnds
from tessera.stages.layers.norm import offset_norms
from tessera.stages.weights.folder import TensorCheck, WeightFolder
from tessera.stages.weights.formats.load import dense_tensor


def load_mtp(folder: Path, head: Stage, *, device: torch.device | str | None = None,
             dtype: torch.dtype | None = None, check: TensorCheck | None = None) -> MtpStage:
    """The first MTP module of the model in `folder`, on `head`'s device and dtype unless given, over
    `head`'s embedding, final norm and head. Raises UnsupportedModel (a model with no MTP layers, a
    family whose are not run, a tensor of the module not read here), ModelFormatError (the folder
    lacks the module's tensors, or one is misshapen), and whatever `check` raises."""
    weights = WeightFolder(folder, check=check)
    spec = weights.spec
    mtp = mtp_of(spec)
    check_mtp_tensors(weights, mtp)
    device = head.device if device is None else torch.device(device)
    dtype = head.dtype if dtype is None else dtype
    blocks = weights.reading_as(mtp.blocks)
    if spec.shipped is not None:
        block = shipped_block(blocks, mtp.layer, dtype=dtype, device=device)
    else:
        block = float_block(blocks, mtp.layer, dtype=dtype, device=device)
    offset_norms(block, spec.norm_offset)
    stage = Stage(mtp.blocks, mtp.layer, [block], device=device, dtype=dtype)
    with torch.device("meta"):
        ends = MtpEnds(spec.hidden_size, spec.rms_norm_eps, hidden_first=mtp.hidden_first)
    shapes = mtp.tensors()
    read = ({name: dense_tensor(weights, name, shape, dtype) for name, shape in shapes.items()}
            if spec.shipped is not None else weights.read(shapes, dtype))
    ends.load_state_dict({"embed_norm.weight": read[mtp.embed_norm], "hidden_norm.weight": read[mtp.hidden_norm],
                          "proj.weight": read[mtp.proj], "out_norm.weight": read[mtp.out_norm]},
                         assign=True, strict=True)
    ends = ends.to(device).requires_grad_(False)
    offset_norms(ends, spec.norm_offset)
    return MtpStage(mtp, ends, stage, head)


def check_mtp_tensors(weights: WeightFolder, mtp: MtpSpec) -> None:
    """ModelFormatError when the folder holds no MTP module (a config that counts one, tensors that
    transformers' `save_pretrained` never writes); UnsupportedModel for a tensor under the module's
    names that is not read here (module docstring)."""
    spec = weights.spec
    if not weights.has(mtp.proj) and not weights.has(mtp.proj + "_scale_inv"):
        raise ModelFormatError(
            f"{str(weights.folder)!r} holds no tensors of the model's {spec.mtp_layers} MTP layer(s) "
            f"({mtp.proj!r} is missing), which --speculate mtp drafts with")
    known = {name for choices in tensors_of_layer(mtp.blocks, mtp.layer).values()
             for source in choices for name in source.names}
    known |= set(mtp.tensors()) | set(mtp.copies)
    later = (mtp.prefixes[1:] if mtp.layout == "nextn"
             else tuple(f"{QWEN_PREFIX}layers.{k}." for k in range(1, spec.mtp_layers)))
    unread = sorted(name for name in weights.names()
                    if name.startswith(mtp.prefixes) and not name.startswith(later) and stored_as(name) not in known)
    if unread:
        raise UnsupportedModel(f"tensor {unread[0]!r} of the MTP module is not one tessera computes "
                               f"({len(unread)} such in all): --speculate mtp would draft without it")


def stored_as(name: str) -> str:
    """The tensor a stored one is part of: "x.weight_scale_inv" (an fp8 matrix's scales) -> "x.weight"."""
    at = name.rfind(".weight")
    return name[: at + len(".weight")] if at >= 0 else name
