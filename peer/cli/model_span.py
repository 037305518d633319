"""`tessera model fetch ORG/NAME --layers A:B`: only the files of the span a peer will serve.

Every large model ships as many safetensors shards. A volunteer that will hold layers 20-29 of
a 60-layer model needs the config, the tokenizer files, the index and its span's tensors (with
the embedding for the first span, the head and final norm for the last, as a peer fetching from
peers takes them: stages/weights/tensor_table.py `groups_for_span`; `--requester` adds the
embedding, head and norm a requester computes with), not the rest.

What a partial fetch trusts, and what it checks:

- **The hub**, for what the repository holds at the commit it resolved: its listing gives every
  weight file's sha256 (git-LFS) and size; the small files (config, tokenizer, chat template,
  index) are downloaded whole and checked against their git hash.
- **The manifest** cannot come from the hub: the model id hashes every tensor's 1 MiB chunks,
  so a machine that downloads only some shards cannot compute it. It comes
  - *from the swarm* (`--join ADDR`), asked for by `--id` (then it must hash to that id) or by
    the name it is registered under (the first peer's word says which id the name means, as for
    a peer fetching its span from the swarm); checked to hash to its own id, and to list exactly
    the repository's files with the hub's sha256 and size for each (the small files' as
    downloaded): peer/weights/hub.py `manifest_matches_hub`. What stays on the swarm's word is
    the chunk table of the tensors this machine never downloads; it is bound into the id, so a
    peer told another table gets another id and chains with no honest peer (`--id` pins it);
  - or, with no swarm to ask, *computed here* (the first volunteer of a model): every weight
    file is downloaded once, checked against the hub's sha256 and hashed one file at a time
    (`table_of_file`, what `model import` computes for the whole folder: the same id), and the
    files the span does not need are deleted as soon as they are hashed: the whole model's
    bandwidth once, the span's disk.
- **The span's tensors** come from the hub by HTTP ranges of exactly their bytes (peer/weights/
  hub.py) — and from the `--join` peers that hold them, all at once — in 1 MiB chunks, each
  checked against the manifest before it is written, into the part files a fetch from peers uses
  (resumed after an interruption, assembled atomically: peer/weights/parts.py). A chunk that does
  not match drops its source (a tampered mirror; a manifest not of this repository is refused
  already at the file's header).

The folder is a partial one, as a fetch from peers makes (its manifest marked partial, naming
the hub and commit): `tessera peer --model NAME --layers A:B` loads it and checks its span as any
other (peer/weights/verify.py), and a peer whose span moves later fetches the new layers from the
swarm and the hub alike (peer/weights/bootstrap.py `ensure_span`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Callable

import trio

from tessera.stages.errors import StageError
from tessera.stages.families.catalog import spec_from_file
from tessera.stages.weights import registry
from tessera.stages.weights.tensor_table import CHUNK_BYTES, groups_for_span, table_of_file

from tessera.peer.net.transport import Transport
from tessera.peer.weights.bootstrap import REQUESTER_GROUPS, dial_join, throwaway_host
from tessera.peer.weights.errors import ManifestRejected, WeightsError
from tessera.peer.weights.fetcher import Fetcher, learn_manifest
from tessera.peer.weights.hub import HubRepo, HubSource, manifest_matches_hub
from tessera.peer.cli.model_files import FetchError, HubListing, Progress, list_hub

MARKER = ".span-fetch.json"  # a span fetch under way: which repository and commit (written first)
TABLES = ".hub-tables"  # tensor tables of weight files hashed and deleted by a run that computes the manifest


def git_blob_sha1(data: bytes) -> str:
    """The hub's id of a small (non-LFS) file: git's blob hash."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def span_groups(layers: tuple[int, int] | None, requester: bool, *, num_layers: int, tied: bool) -> set[str]:
    """The tensor groups a fetch of `layers` (and, with `requester`, a requester's part) needs."""
    groups: set[str] = set()
    if layers is not None:
        start, end = layers
        if not 0 <= start <= end <= num_layers:
            raise FetchError(f"--layers {start}:{end} is outside the model's {num_layers} layers")
        groups |= groups_for_span(start, end, num_layers, tied=tied)
    if requester:
        groups |= REQUESTER_GROUPS
    return groups


def describe(layers: tuple[int, int] | None, requester: bool) -> str:
    parts = [f"layers [{layers[0]}, {layers[1]})"] if layers is not None else []
    return " and ".join(parts + (["a requester's embedding and head"] if requester else []))


def fetch_hub_span(name: str, *, layers: tuple[int, int] | None, requester: bool = False, join: list[str] = (),
                   model_id: str | None = None, register_as: str | None = None, swarm_key: bytes | None = None,
                   progress: Progress | None = None, log: Callable[[str], None] = print,
                   open_transport: Callable[[bytes | None], AbstractAsyncContextManager[Transport]] = throwaway_host,
                   ) -> Path:
    """Fetch the files of `layers` (and a requester's part) of `ORG/NAME[@REVISION]` into a partial
    folder registered as NAME (or `register_as`); the manifest from the `join` peers, else computed
    here (module docstring). Returns the folder. Raises FetchError, ManifestRejected, WeightsError,
    ModelFormatError / UnsupportedModel (a model tessera cannot run: before any weights come)."""
    return trio.run(lambda: fetch_span(name, layers=layers, requester=requester, join=join, model_id=model_id,
                                       register_as=register_as, swarm_key=swarm_key, progress=progress, log=log,
                                       open_transport=open_transport))


async def fetch_span(name: str, *, layers: tuple[int, int] | None, requester: bool = False, join: list[str] = (),
                     model_id: str | None = None, register_as: str | None = None, swarm_key: bytes | None = None,
                     progress: Progress | None = None, log: Callable[[str], None] = print,
                     open_transport: Callable[[bytes | None], AbstractAsyncContextManager[Transport]] = throwaway_host,
                     ) -> Path:
    """`fetch_hub_span` in a trio run of the caller's (the hub's HTTP runs in worker threads)."""
    listing = await trio.to_thread.run_sync(list_hub, name)
    register_as = register_as or listing.repo.split("/")[1]
    folder = registry.models_root() / register_as
    if _claim_folder(folder, listing, register_as):
        log(f"{register_as}: already whole at {folder} ({listing.where}); nothing to fetch")
        return folder
    files = await trio.to_thread.run_sync(_fetch_small_files, listing, folder, log)
    spec = spec_from_file(folder / "config.json")
    groups = span_groups(layers, requester, num_layers=spec.num_layers, tied=spec.tie_embeddings)
    label = describe(layers, requester)
    hub = HubRepo(listing.endpoint, listing.repo, listing.commit)
    # a folder resumed, or fetched before for another span, keeps the manifest it was checked with
    manifest = registry.read_manifest(folder) if (folder / registry.MANIFEST).exists() else None
    if join:
        failed: Exception | None = None
        async with open_transport(swarm_key) as transport:
            try:
                peers = await dial_join(transport, join, log)
                if manifest is None:
                    manifest = await learn_manifest(transport, peers, model_id or register_as)
                    _check_swarm_manifest(manifest, files, listing, log)
                    _save(folder, manifest, hub, listing, how="swarm", partial=True)
                _pinned(manifest, model_id, listing)
                await Fetcher(transport, folder, manifest, out=log, hub=HubSource(hub, manifest)).fetch_groups(
                    peers, groups, label=label)
            except (WeightsError, StageError) as bad:
                failed = bad  # raised below, alone: not inside the transport's nursery's exception group
        if failed is not None:
            raise failed
    else:
        if manifest is None:
            manifest = await trio.to_thread.run_sync(_computed_manifest, listing, folder, files, groups, hub,
                                                     progress, log)
        _pinned(manifest, model_id, listing)
        await Fetcher(None, folder, manifest, out=log, hub=HubSource(hub, manifest)).fetch_groups(
            [], groups, label=label)
    shutil.rmtree(folder / TABLES, ignore_errors=True)
    (folder / MARKER).unlink(missing_ok=True)
    held = sorted(p.name for p in folder.glob("*.safetensors"))
    log(f"{register_as}: {label} of {listing.where}, in {len(held)} of {len(listing.weights())} weight files; "
        f"model id {manifest['model_id']}")
    return folder


def _check_swarm_manifest(manifest: dict, files: dict[str, tuple[str, int]], listing: HubListing,
                          log: Callable[[str], None]) -> None:
    faults = manifest_matches_hub(manifest, files)
    if faults:
        raise ManifestRejected(f"the swarm's model {manifest['model_id']} is not {listing.where}: {faults[0]}"
                               + (f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""))
    log(f"{listing.repo}: model id {manifest['model_id']} (the swarm's manifest, checked against the hub's files)")


def _claim_folder(folder: Path, listing: HubListing, name: str) -> bool:
    """Make `folder` this fetch's, or say why it cannot be: True when it already holds the whole
    repository at this commit (nothing to do). A folder of this repository and commit, partial or
    being fetched, is resumed; anything else there is refused, not overwritten."""
    ours = {"hub": listing.repo, "revision": listing.commit}
    if (folder / registry.MANIFEST).exists():
        manifest = registry.read_manifest(folder)
        source = manifest.get("source") or {}
        if {k: source.get(k) for k in ours} == ours:
            return not manifest.get("partial")
        what = f"model id {manifest.get('model_id')}, {'part of ' if manifest.get('partial') else ''}" + (
            f"{source['hub']}@{str(source.get('revision'))[:12]}" if source.get("hub") else "not from this repository")
        raise FetchError(f"{name!r} is registered already ({what}); give --name to register this span under "
                         f"another name, or remove {folder}")
    if folder.exists():
        try:
            marker = json.loads((folder / MARKER).read_text())
        except (OSError, ValueError):
            marker = None
        if marker != ours:
            raise FetchError(f"{folder} exists and is not a fetch of {listing.where}; give --name, or remove it")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text(json.dumps(ours))
    return False


def _fetch_small_files(listing: HubListing, folder: Path, log: Callable[[str], None]) -> dict[str, tuple[str, int]]:
    """Download the config first (a model tessera cannot run is refused before anything else), then
    the tokenizer, chat template and index; each checked against the hub's hash. Returns every file
    a peer runs as {name: (sha256, bytes)}: the small files' as downloaded, the weights' as listed."""
    from huggingface_hub import hf_hub_download

    files: dict[str, tuple[str, int]] = {}
    for path in sorted(listing.small_files(), key=lambda p: p != "config.json"):
        entry = listing.files[path]
        try:
            local = Path(hf_hub_download(listing.repo, path, revision=listing.commit, local_dir=folder,
                                         endpoint=listing.endpoint))
        except Exception as error:  # the hub client's errors share no base class
            raise FetchError(f"downloading {path} of {listing.where} failed (the same command resumes): "
                             f"{type(error).__name__}: {error}") from None
        data = local.read_bytes()
        sha256 = hashlib.sha256(data).hexdigest()
        if (entry.lfs.sha256 if entry.lfs else git_blob_sha1(data)) != (sha256 if entry.lfs else entry.blob_id):
            local.unlink()
            raise FetchError(f"{path} of {listing.where} does not match the hub's hash; run the command again")
        files[path] = (sha256, len(data))
        if path == "config.json":
            spec_from_file(local)  # raises UnsupportedModel / ModelFormatError
    for path in listing.weights():
        entry = listing.files[path]
        if entry.lfs is None:
            raise FetchError(f"{path} of {listing.where} is not stored in git-LFS: the hub lists no sha256 for it")
        files[path] = (entry.lfs.sha256, int(entry.size))
    log(f"{listing.repo}: config and tokenizer files verified ({len(listing.small_files())} files)")
    return files


def _computed_manifest(listing: HubListing, folder: Path, files: dict[str, tuple[str, int]], groups: set[str],
                       hub: HubRepo, progress: Progress | None, log: Callable[[str], None]) -> dict:
    """The manifest, computed from every weight file downloaded once (module docstring); the files
    holding none of `groups` are deleted once hashed. A rerun reuses the tables of files it deleted."""
    from huggingface_hub import hf_hub_download

    weights = listing.weights()
    log(f"{listing.repo}: no swarm to take the manifest from (--join): hashing all {len(weights)} weight files "
        f"({sum(files[w][1] for w in weights) / 1e6:.1f} MB), keeping those of {describe_groups(groups)}")
    entries: dict[str, dict] = {}
    (folder / TABLES).mkdir(exist_ok=True)
    for n, path in enumerate(weights):
        sha256, size = files[path]
        cached = folder / TABLES / f"{path}.json"
        table = _cached_table(cached, sha256)
        if table is None:
            try:
                local = Path(hf_hub_download(listing.repo, path, revision=listing.commit, local_dir=folder,
                                             endpoint=listing.endpoint))
            except Exception as error:  # as above
                raise FetchError(f"downloading {path} of {listing.where} failed (the same command resumes): "
                                 f"{type(error).__name__}: {error}") from None
            if local.stat().st_size != size or registry.sha256_file(local) != sha256:
                local.unlink()
                raise FetchError(f"{path} of {listing.where} does not match the hub's sha256; run the command again")
            table = table_of_file(local, path, chunk_bytes=CHUNK_BYTES)
            cached.write_text(json.dumps({"sha256": sha256, "entries": table}))
            if not any(e["group"] in groups for e in table.values()):
                local.unlink()
        entries.update(table)
        if progress:
            progress(n + 1, len(weights), "hashing weight files")
    manifest = registry.manifest_of({p: {"sha256": s, "bytes": b} for p, (s, b) in files.items()}, entries, {})
    partial = any(not (folder / w).exists() for w in weights)
    _save(folder, manifest, hub, listing, how="computed", partial=partial)
    return registry.read_manifest(folder)


def _pinned(manifest: dict, model_id: str | None, listing: HubListing) -> None:
    if model_id is not None and manifest["model_id"] != model_id:
        raise ManifestRejected(f"{listing.where} is model id {manifest['model_id']} here, not the {model_id} asked for")


def _cached_table(path: Path, sha256: str) -> dict | None:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or cached.get("sha256") != sha256 or not isinstance(cached.get("entries"), dict):
        return None
    return cached["entries"]


def describe_groups(groups: set[str]) -> str:
    layers = sorted(int(g.removeprefix("layer.")) for g in groups if g.startswith("layer."))
    edges = sorted(g for g in groups if not g.startswith("layer.") and g != "other")
    span = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
    return span + (f" and {', '.join(edges)}" if edges else "")


def _save(folder: Path, manifest: dict, hub: HubRepo, listing: HubListing, *, how: str, partial: bool) -> None:
    """Write the manifest into the folder (partial unless every weight file is there whole), naming
    the hub and commit it was checked against, and how it was had ("swarm", "computed")."""
    public = {k: manifest[k] for k in ("format", "files", "tensors", "model_id")}
    source = {**hub.source(), "files": listing.wanted, "manifest": how}
    registry.save_manifest(folder, {**public, "source": source, **({"partial": True} if partial else {})})
