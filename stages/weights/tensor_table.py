"""Content-addressed weights: every tensor of a model's safetensors files, hashed in chunks.

The manifest (`stages/weights/registry.py`) holds this table under "tensors":

    {"chunk_bytes": 1048576,
     "entries": {"model.layers.3.mlp.up_proj.weight":
                    {"file": "model.safetensors", "group": "layer.3", "dtype": "F32",
                     "shape": [1536, 576], "begin": 96469504, "end": 100008448,
                     "sha256": "…", "chunks": ["…", "…", "…", "…"]}, …},
     "digest": "<sha256 of the canonical JSON of entries and chunk_bytes>"}

`begin`/`end` are the tensor's byte range in the data section of its file (as the
safetensors header gives it); `chunks` are the sha256s of its bytes cut every
`chunk_bytes` (the last chunk shorter), so one wrong chunk from one sender is caught
alone, and `sha256` covers the whole tensor. `group` says what a span needs: "layer.N"
for layer N, "embed" for the embedding, "head" for lm_head, "norm" for the final norm,
"vision" for a multimodal checkpoint's vision tower and "mtp" for Qwen-style multi-token-prediction
layers (neither run by a span, so never fetched by a peer; a requester drafting with the MTP layers,
`--speculate mtp`, fetches them), "other" for anything else.

The **model id** (`model_id_of`) hashes every listed file's sha256 *and* this table's
digest, and nothing else: so a folder holding only some layers (fetched from peers)
checks its manifest against the id without the files it lacks, and every chunk it
fetches against the manifest. `source.gguf` (kept beside a conversion for the
reference tests) is not a model file and is not in the id.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

from tessera.stages.errors import ModelFormatError
from tessera.stages.families.tensors import PER_LAYER_TENSORS

CHUNK_BYTES = 1 << 20
"""1 MiB: a chunk is one request on the wire; a 70B model has ~140k of them (a ~10 MB manifest)."""

MAX_HEADER_BYTES = 100 * (1 << 20)
"""safetensors' own limit on a header; refused before it is read."""

MANIFEST_FORMAT = 2
"""1: whole-file hashes only (upgraded on read); 2: plus the tensor table, bound into the id."""

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

# a causal LM's decoder lies under "model."; a multimodal checkpoint's text model under
# "model.language_model."; Nemotron-H's under "backbone.", whose embedding and final norm are named
# otherwise (families/spec/model.py ModelSpec.prefix, families/tensors.py EDGE_NAMES); DeepSeek-V4's published
# checkpoint names its layers and edges with no prefix (`layers.3.attn.wq_a.weight`, `embed.weight`). Gemma 4's
# per-layer input table, projection and norm go with the embedding: the requester computes every layer's
# per-layer inputs with them
_LAYER = re.compile(r"^(?:model\.(?:language_model\.)?|backbone\.)?layers\.(\d+)\.")
_MODEL_EDGES = {"embed_tokens.weight": "embed", "norm.weight": "norm",
                **dict.fromkeys(PER_LAYER_TENSORS.values(), "embed")}
_EDGES = {"model.": _MODEL_EDGES, "model.language_model.": _MODEL_EDGES,
          "backbone.": {"embeddings.weight": "embed", "norm_f.weight": "norm"}}
_BARE_EDGES = {"embed.weight": "embed", "norm.weight": "norm", "head.weight": "head"}
# the head's hyper-connection (DeepSeek-V4), which the stage holding the head reads
_HEAD_MIX = ("model.hc_head.", "hc_head_")
# a multimodal checkpoint's towers and their projections (Qwen3.5's; Gemma 4's vision and audio), MTP layers
# (Qwen's "mtp.", MiMo-V2-Flash's "model.mtp."): what no span fetches
TOWERS = ("model.visual.", "model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
MTP = ("mtp.", "model.mtp.")


def group_of(name: str) -> str:
    """Which part of the model a tensor belongs to (what a span asks for)."""
    if m := _LAYER.match(name):
        return f"layer.{int(m.group(1))}"
    if name == "lm_head.weight" or name.startswith(_HEAD_MIX):
        return "head"
    if name in _BARE_EDGES:
        return _BARE_EDGES[name]
    if name.startswith(TOWERS + MTP):  # a vision or audio tower, MTP layers: not run by any span (yet)
        return "vision" if name.startswith(TOWERS) else "mtp"
    for prefix, edges in _EDGES.items():
        if name.startswith(prefix) and name[len(prefix):] in edges:
            return edges[name[len(prefix):]]
    return "other"


def groups_for_span(start: int, end: int, num_layers: int, *, tied: bool) -> set[str]:
    """The groups a peer serving layers [start, end) needs on disk.

    A peer needs only its layers: the requester holds the embedding and head. We fetch
    "embed" for the first span and "head"/"norm" (plus "embed" when tied) for the last as
    well, so a peer at an end can also serve those to a requester without files.
    """
    groups = {f"layer.{i}" for i in range(start, end)} | {"other"}
    if start == 0:
        groups.add("embed")
    if end == num_layers:
        groups |= {"head", "norm"} | ({"embed"} if tied else set())
    return groups


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, header dict) of a safetensors file; raises ModelFormatError."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise ModelFormatError(f"{str(path)!r} is too short to be a safetensors file")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise ModelFormatError(f"{str(path)!r} claims a {n!r}-byte header (limit {MAX_HEADER_BYTES})")
            raw = f.read(n)
    except OSError as bad:
        raise ModelFormatError(f"cannot read {str(path)!r}: {bad}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise ModelFormatError(f"{str(path)!r} has a corrupt safetensors header: {bad}") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{str(path)!r} has a safetensors header that is not a JSON object")
    return 8 + n, header


def table_of_file(path: Path, name: str, *, chunk_bytes: int = CHUNK_BYTES) -> dict[str, dict]:
    """Entries for every tensor of one safetensors file, hashing its bytes (one pass, in chunks)."""
    data_at, header = read_header(path)
    entries: dict[str, dict] = {}
    with open(path, "rb") as f:
        for tensor, info in sorted(header.items()):
            if tensor == "__metadata__":
                continue
            try:
                begin, end = (int(x) for x in info["data_offsets"])
                dtype, shape = str(info["dtype"]), [int(x) for x in info["shape"]]
            except (KeyError, TypeError, ValueError) as bad:
                raise ModelFormatError(f"{str(path)!r}: tensor {tensor!r} has a bad header entry: {bad}") from None
            f.seek(data_at + begin)
            whole, chunks, left = hashlib.sha256(), [], end - begin
            while left > 0:
                piece = f.read(min(chunk_bytes, left))
                if not piece:
                    raise ModelFormatError(f"{str(path)!r} ends inside tensor {tensor!r}")
                whole.update(piece)
                chunks.append(hashlib.sha256(piece).hexdigest())
                left -= len(piece)
            entries[tensor] = {"file": name, "group": group_of(tensor), "dtype": dtype, "shape": shape,
                               "begin": begin, "end": end, "sha256": whole.hexdigest(), "chunks": chunks}
    return entries


def canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def table_digest(entries: dict[str, dict], chunk_bytes: int) -> str:
    return hashlib.sha256(canonical({"chunk_bytes": chunk_bytes, "entries": entries})).hexdigest()


def build_table(folder: Path, weight_files: list[str], *, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """The "tensors" section for the weight files of `folder`."""
    entries: dict[str, dict] = {}
    for name in sorted(weight_files):
        entries.update(table_of_file(folder / name, name, chunk_bytes=chunk_bytes))
    return {"chunk_bytes": chunk_bytes, "entries": entries, "digest": table_digest(entries, chunk_bytes)}


def model_id_of(files: dict[str, dict], tensors: dict) -> str:
    """The model id: every model file's sha256 and the tensor table's digest (format 2)."""
    bound = {"format": MANIFEST_FORMAT, "files": {n: e["sha256"] for n, e in sorted(files.items())},
             "tensors": tensors["digest"]}
    return hashlib.sha256(b"tessera/model-id/2\n" + canonical(bound)).hexdigest()[:32]


def check_manifest(manifest: dict, *, expected_id: str | None = None) -> None:
    """Raise ModelFormatError unless the manifest is well formed and hashes to its model id
    (and to `expected_id`, when given): what a fetcher does with a manifest from a stranger."""
    try:
        files, tensors = manifest["files"], manifest["tensors"]
        chunk_bytes, entries = int(tensors["chunk_bytes"]), tensors["entries"]
        if not (isinstance(files, dict) and isinstance(entries, dict)):
            raise TypeError("files/entries are not objects")
        if not 1 <= chunk_bytes <= 64 * (1 << 20):
            raise ValueError(f"chunk_bytes {chunk_bytes!r} is outside [1, 64 MiB]")
        for name, e in entries.items():
            size = int(e["end"]) - int(e["begin"])
            want = max(1, -(-size // chunk_bytes)) if size else 0
            if size < 0 or len(e["chunks"]) != want or e["dtype"] not in DTYPE_BYTES:
                raise ValueError(f"tensor {name!r}: {size!r} bytes with {len(e['chunks'])!r} chunks, dtype {e['dtype']!r}")
            numel = 1
            for d in e["shape"]:
                numel *= int(d)
            if numel * DTYPE_BYTES[e["dtype"]] != size:
                raise ValueError(f"tensor {name!r}: shape {e['shape']!r} of {e['dtype']} is not {size!r} bytes")
            if e["group"] != group_of(name) or e["file"] not in files:
                raise ValueError(f"tensor {name!r}: group {e['group']!r} / file {e['file']!r} do not fit")
        for name, e in files.items():
            if not isinstance(e.get("sha256"), str) or int(e.get("bytes", -1)) < 0:
                raise ValueError(f"file {name!r}: entry {e!r} lacks sha256/bytes")
    except (KeyError, TypeError, ValueError, AttributeError) as bad:
        raise ModelFormatError(f"manifest is malformed: {bad}") from None
    if table_digest(entries, chunk_bytes) != tensors.get("digest"):
        raise ModelFormatError("manifest's tensor table does not match its digest")
    got = model_id_of(files, tensors)
    if manifest.get("model_id") != got:
        raise ModelFormatError(f"manifest says model id {manifest.get('model_id')!r} but hashes to {got!r}")
    if expected_id is not None and got != expected_id:
        raise ModelFormatError(f"manifest is for model id {got!r}, not the {expected_id!r} asked for")
