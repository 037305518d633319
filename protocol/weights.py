"""Messages of the weights protocol: a model's manifest and its bytes, chunk by chunk.

    fetcher                                   holder
      | -- WeightManifestRequest(model) ---->  |   a name ("smollm2-135m") or a model id
      | <- WeightManifest(model_id, manifest, held)
      | -- WeightChunkRequest(id, name, i) ->  |   any number, one at a time on a stream
      | <- WeightChunk(id, name, i, data) ---  |   (or WeightRefused, then the stream closes)

The manifest travels as its canonical JSON (`stages/weights/tensor_table.py`): the fetcher
checks that it hashes to the model id before trusting a byte of it, and every chunk
against the sha256 the manifest lists. `name` is a tensor name, or a small file's
name (config.json, tokenizer.json, ...) when `is_file` is set.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.protocol.codec import message
from tessera.protocol.schema import INT64_MAX, wire

MODEL_ID_LEN = 64
"""A model id (32 hex) with a quantization tag, or a model name, fits in 64 characters."""

MAX_NAME_LEN = 256
"""Longest tensor or file name we accept (Hugging Face names are well under 100)."""

MAX_MANIFEST_BYTES = 48 * (1 << 20)
"""A manifest of a ~300B-parameter model at 1 MiB chunks (~600k chunk hashes) fits; the
frame limit (64 MiB) is the hard ceiling."""

MAX_CHUNK_BYTES = 4 * (1 << 20)
"""No chunk on the wire is larger (the manifest's chunk_bytes is 1 MiB)."""

MAX_GROUPS = 4096
"""Groups a holder lists: one per layer, plus embed/head/norm/other."""

REQUEST_FRAME_LIMIT = 1536
"""Largest frame a holder reads from a fetcher: every frame a fetcher sends is a request, and a
WeightChunkRequest at its limits (a 64-character model id and a 256-character name, each of
4-byte characters) is 1,345 bytes encoded; a WeightManifestRequest 304."""


@message("weights-manifest-req")
@dataclass(frozen=True)
class WeightManifestRequest:
    """Fetcher -> holder: your manifest, please.

    Attributes:
        model: a model name as the holder registered it, or a model id (32 hex).
        with_manifest: False to learn only what the holder holds (a fetcher surveying
            holders already has the manifest; a big model's is megabytes).
    """

    model: str = wire(max_len=MODEL_ID_LEN)
    with_manifest: bool = True


@message("weights-manifest")
@dataclass(frozen=True)
class WeightManifest:
    """Holder -> fetcher: the model's manifest and which parts of it this holder can serve.

    Attributes:
        model_id: the id the manifest must hash to.
        manifest: the manifest's canonical JSON (files and tensor table; no local paths),
            or empty when not asked for.
        held: the groups ("layer.3", "embed", "head", "norm", "other") whose every tensor
            the holder has on disk; files are always held.
    """

    model_id: str = wire(max_len=MODEL_ID_LEN)
    manifest: bytes = wire(max_len=MAX_MANIFEST_BYTES)
    held: tuple[str, ...] = wire(max_items=MAX_GROUPS, max_len=32)


@message("weights-chunk-req")
@dataclass(frozen=True)
class WeightChunkRequest:
    """Fetcher -> holder: chunk `index` of a tensor (or of a small file).

    Attributes:
        model_id: the model the chunk belongs to.
        name: the tensor's (or file's) name.
        index: which chunk: bytes [index * chunk_bytes, (index + 1) * chunk_bytes) of it.
        is_file: `name` is a file of the folder, not a tensor.
    """

    model_id: str = wire(max_len=MODEL_ID_LEN)
    name: str = wire(max_len=MAX_NAME_LEN)
    index: int = wire(min=0, max=INT64_MAX)
    is_file: bool = False


@message("weights-chunk")
@dataclass(frozen=True)
class WeightChunk:
    """Holder -> fetcher: one chunk's bytes (checked by the fetcher against the manifest).

    Attributes:
        model_id, name, index, is_file: as in the request.
        data: the chunk's bytes.
    """

    model_id: str = wire(max_len=MODEL_ID_LEN)
    name: str = wire(max_len=MAX_NAME_LEN)
    index: int = wire(min=0, max=INT64_MAX)
    is_file: bool
    data: bytes = wire(max_len=MAX_CHUNK_BYTES)


BUSY = "busy"
"""How a `WeightRefused` reason starts when the refusal is only for now (every upload place is
taken, or this stream's place went to a fetcher holding fewer): ask again later. Any other
refusal (not held, unknown name) stands for that request."""


@message("weights-refused")
@dataclass(frozen=True)
class WeightRefused:
    """Holder -> fetcher: not served (unknown model or name, not held, too busy).

    Attributes:
        reason: why, for the fetcher's log; starting with `BUSY` when it is only for now.
    """

    reason: str = wire(max_len=512)
