"""Where models live on disk, and how we know a folder is intact.

Models live in ``~/.cache/tessera/models/NAME/`` (``$TESSERA_MODELS`` or
``$XDG_CACHE_HOME/tessera/models`` move it). Every folder carries a
``manifest.json`` with the sha256 and size of each file and a table of every
tensor, hashed in chunks (`stages/weights/tensor_table.py`); the **model id** is a hash of
the files' hashes and that table, so two peers chain together only when they run
the identical model, and a peer fetching only some layers from others can check
every chunk it receives. An older manifest (files only) is upgraded the first
time it is read: the table is computed and the file replaced atomically (its
model id changes once, everywhere alike, since it is computed from the content).

A folder fetched from peers, or in part from a hub, holds only some tensors: its manifest is
the model's own, marked ``"partial": true``, and `verify` then checks the tensors present.

An imported Hugging Face folder is linked, not copied: its files are symlinked
into the registry folder and the manifest records their hashes at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from tessera.stages.errors import ModelFormatError
from tessera.stages.weights.tensor_table import (
    CHUNK_BYTES, MANIFEST_FORMAT, build_table, check_manifest, model_id_of, read_header, table_digest, table_of_file,
)

MANIFEST = "manifest.json"
WEIGHT_SUFFIXES = (".safetensors",)
MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "model.safetensors.index.json",
)
CHUNK = 1 << 20  # read size when hashing whole files

Progress = Callable[[int, int, str], None]


def models_root() -> Path:
    if os.environ.get("TESSERA_MODELS"):
        return Path(os.environ["TESSERA_MODELS"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tessera" / "models"


def resolve(name_or_path: str | Path) -> Path:
    """A registered model's folder, or a folder path given directly (raises ModelFormatError)."""
    path = Path(name_or_path).expanduser()
    if (path / "config.json").exists():
        return path
    registered = models_root() / str(name_or_path)
    if (registered / "config.json").exists():
        return registered
    raise ModelFormatError(
        f"no model {str(name_or_path)!r}: not a folder with config.json, and not registered in "
        f"{str(models_root())!r} (try `tessera model fetch smollm2-135m` or `tessera model import PATH`)"
    )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_files(folder: Path) -> list[str]:
    """The files of a model folder that the manifest covers, sorted."""
    names = [p.name for p in folder.iterdir() if p.name in MODEL_FILES or p.suffix in WEIGHT_SUFFIXES]
    return sorted(names)


def write_manifest(folder: Path, *, source: dict | None = None, progress: Progress | None = None,
                   chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Hash every model file in `folder` and write manifest.json; return it (`chunk_bytes`:
    how finely tensors are hashed; tests use small chunks to have many of them)."""
    names = model_files(folder)
    files = {}
    for n, name in enumerate(names):
        path = folder / name
        files[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        if progress:
            progress(n + 1, len(names), f"hashing {name}")
    manifest = _with_table(folder, files, source or {}, chunk_bytes=chunk_bytes)
    save_manifest(folder, manifest)
    return manifest


def _with_table(folder: Path, files: dict[str, dict], source: dict, *, chunk_bytes: int = CHUNK_BYTES) -> dict:
    tensors = build_table(folder, [n for n in files if n.endswith(WEIGHT_SUFFIXES)], chunk_bytes=chunk_bytes)
    return manifest_of(files, tensors["entries"], source, chunk_bytes=chunk_bytes)


def manifest_of(files: dict[str, dict], entries: dict[str, dict], source: dict, *,
                chunk_bytes: int = CHUNK_BYTES) -> dict:
    """The manifest of a model whose files have these hashes and whose tensors these table entries
    (`table_of_file`'s, every weight file's together), however they were computed: from a folder
    holding every file (`write_manifest`), or one weight file at a time by a fetch that keeps only
    some of them (peer/cli/model_span.py). The same files give the same id either way."""
    tensors = {"chunk_bytes": chunk_bytes, "entries": entries, "digest": table_digest(entries, chunk_bytes)}
    return {"format": MANIFEST_FORMAT, "files": files, "tensors": tensors,
            "model_id": model_id_of(files, tensors), "source": source}


def save_manifest(folder: Path, manifest: dict) -> None:
    """Write manifest.json atomically (tmp + fsync + rename): readers see the old or the new one."""
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".manifest-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / MANIFEST)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def compute_model_id(folder: Path, files: dict[str, dict]) -> str:
    """The model id of `folder`'s weights with these file hashes (hashes the tensors)."""
    return model_id_of(files, build_table(Path(folder), [n for n in files if n.endswith(WEIGHT_SUFFIXES)]))


def read_manifest(folder: Path) -> dict:
    """The folder's manifest, upgraded in place first if it predates the tensor table."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{str(folder)!r} has no {MANIFEST}; re-import or re-fetch it") from None
    except json.JSONDecodeError as bad:
        raise ModelFormatError(f"{str(path)!r} is not valid JSON: {bad}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ModelFormatError(f"{str(path)!r} lists no files")
    if manifest.get("format") != MANIFEST_FORMAT or "tensors" not in manifest:
        manifest = _upgrade(folder, manifest)
    return manifest


def _upgrade(folder: Path, old: dict) -> dict:
    """Add the tensor table to a format-1 manifest (the files' recorded hashes are kept)."""
    files = {n: {"sha256": e["sha256"], "bytes": e["bytes"]} for n, e in old["files"].items()}
    manifest = _with_table(folder, files, old.get("source") or {})
    save_manifest(folder, manifest)
    return manifest


def verify(folder: Path, *, progress: Progress | None = None) -> list[str]:
    """Names of files whose size or sha256 differs from the manifest (empty = intact).

    In a partial folder (fetched from peers) a weight file holds only some tensors:
    each tensor it holds must match the table; the others are simply not there.
    """
    manifest = read_manifest(folder)
    bad = []
    items = sorted(manifest["files"].items())
    for n, (name, entry) in enumerate(items):
        path = folder / name
        if manifest.get("partial") and name.endswith(WEIGHT_SUFFIXES):
            if path.exists() and not partial_file_intact(folder, name, manifest):
                bad.append(name)
        elif not path.exists() or path.stat().st_size != entry.get("bytes"):
            if not (manifest.get("partial") and not path.exists()):
                bad.append(name)
        elif sha256_file(path) != entry.get("sha256"):
            bad.append(name)
        if progress:
            progress(n + 1, len(items), f"checking {name}")
    return bad


def unvouched_files(folder: Path, manifest: dict) -> list[tuple[str, str]]:
    """The files a load reads besides the weights — config, tokenizer, chat template,
    generation config, the weights' index (`MODEL_FILES`) — that `manifest` does not vouch for,
    each with why: its size or sha256 differs from its entry, the manifest lists it and it is
    not there, or it is there and the manifest does not list it (a chat template added after
    import would be read as the model's). Empty: every such file is the one the model id
    names. The weights are checked tensor by tensor as they load (peer/weights/verify.py)."""
    files = manifest["files"]
    faults = []
    for name in sorted(set(files) | {n for n in MODEL_FILES if (folder / n).exists()}):
        if name.endswith(WEIGHT_SUFFIXES):
            continue
        path, entry = folder / name, files.get(name)
        if entry is None:
            faults.append((name, "the manifest does not list it"))
        elif not path.exists():
            faults.append((name, "the manifest lists it and it is missing"))
        elif (size := path.stat().st_size) != entry.get("bytes"):
            faults.append((name, f"it holds {size} bytes, the manifest {entry.get('bytes')}"))
        elif sha256_file(path) != entry.get("sha256"):
            faults.append((name, "its sha256 differs"))
    return faults


def partial_file_intact(folder: Path, name: str, manifest: dict) -> bool:
    """Every tensor in a partial weight file is in the table with the same bytes."""
    try:
        held = table_of_file(folder / name, name, chunk_bytes=manifest["tensors"]["chunk_bytes"])
    except ModelFormatError:
        return False
    table = manifest["tensors"]["entries"]
    return all(name_ in table and table[name_]["sha256"] == e["sha256"] for name_, e in held.items())


def held_tensors(folder: Path) -> set[str]:
    """Names of the tensors present in the folder's weight files (headers only)."""
    names: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        names |= {n for n in read_header(path)[1] if n != "__metadata__"}
    return names


def model_id(folder: Path) -> str:
    """The model id recorded in the folder's manifest (computed on the fly for a bare folder)."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        files = {n: {"sha256": sha256_file(folder / n)} for n in model_files(folder)}
        return compute_model_id(folder, files)
    return str(read_manifest(folder)["model_id"])


def checked_manifest(folder: Path, *, expected_id: str | None = None) -> dict:
    """The folder's manifest, checked to hash to its model id (and to `expected_id`)."""
    manifest = read_manifest(folder)
    check_manifest(manifest, expected_id=expected_id)
    return manifest


def link_folder(source: Path, target: Path) -> None:
    """Register an existing Hugging Face folder by symlinking its model files into `target`."""
    source = source.resolve()
    if not (source / "config.json").exists():
        raise ModelFormatError(f"{str(source)!r} has no config.json")
    if not any(p.suffix in WEIGHT_SUFFIXES for p in source.iterdir()):
        raise ModelFormatError(f"{str(source)!r} holds no *.safetensors weights")
    target.mkdir(parents=True, exist_ok=True)
    for name in model_files(source):
        link = target / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(source / name)
