"""Where models live on disk, and how we know a folder is intact.

Models live in ``~/.cache/tessera/models/NAME/`` (``$TESSERA_MODELS`` or
``$XDG_CACHE_HOME/tessera/models`` move it). Every folder carries a
``manifest.json`` with the sha256 and size of each file; the **model id** is a
hash of config.json's content and the weight files' hashes, so two peers chain
together only when they run the identical model.

An imported Hugging Face folder is linked, not copied: its files are symlinked
into the registry folder and the manifest records their hashes at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from tessera.stages.errors import ModelFormatError

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
CHUNK = 1 << 20

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


def write_manifest(folder: Path, *, source: dict | None = None, progress: Progress | None = None) -> dict:
    """Hash every model file in `folder` and write manifest.json; return it."""
    names = model_files(folder)
    files = {}
    for n, name in enumerate(names):
        path = folder / name
        files[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        if progress:
            progress(n + 1, len(names), f"hashing {name}")
    manifest = {"files": files, "model_id": compute_model_id(folder, files), "source": source or {}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def compute_model_id(folder: Path, files: dict[str, dict]) -> str:
    """Hash of config.json's canonical content and the weight files' hashes."""
    config = json.loads((folder / "config.json").read_text())
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in sorted(files):
        if name.endswith(WEIGHT_SUFFIXES):
            digest.update(f"{name}:{files[name]['sha256']}".encode())
    return digest.hexdigest()[:32]


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{str(folder)!r} has no {MANIFEST}; re-import or re-fetch it") from None
    except json.JSONDecodeError as bad:
        raise ModelFormatError(f"{str(path)!r} is not valid JSON: {bad}") from None
    if not isinstance(manifest.get("files"), dict):
        raise ModelFormatError(f"{str(path)!r} lists no files")
    return manifest


def verify(folder: Path, *, progress: Progress | None = None) -> list[str]:
    """Names of files whose size or sha256 differs from the manifest (empty = intact)."""
    manifest = read_manifest(folder)
    bad = []
    items = sorted(manifest["files"].items())
    for n, (name, entry) in enumerate(items):
        path = folder / name
        if not path.exists() or path.stat().st_size != entry.get("bytes"):
            bad.append(name)
        elif sha256_file(path) != entry.get("sha256"):
            bad.append(name)
        if progress:
            progress(n + 1, len(items), f"checking {name}")
    return bad


def model_id(folder: Path) -> str:
    """The model id recorded in the folder's manifest (written on the fly for a bare folder)."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        files = {n: {"sha256": sha256_file(folder / n)} for n in model_files(folder)}
        return compute_model_id(folder, files)
    return str(read_manifest(folder)["model_id"])


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
