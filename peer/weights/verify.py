"""A peer serves only the model's weights: its span is hashed against the manifest as it loads.

A copy of a model folder with one tensor altered (say `model.layers.5.mlp.down_proj.weight`
scaled by 1.5) loads, advertises the genuine model id — the id is read from the manifest,
not recomputed — and serves wrong activations. So a peer checks what it loads:

- the manifest first: it must hash to its model id (stages/weights/tensor_table.py
  `check_manifest`), so its table of tensor and chunk hashes cannot be edited to match
  altered weights without the model id changing too (and a peer of another id is not in
  this swarm);
- then every other file a load reads — config.json, the tokenizer files, the chat template,
  the generation config, the weights' index — whole, by size and sha256
  (stages/weights/registry.py `unvouched_files`), before any of them is parsed: a config.json
  with another `rope_theta` beside genuine weights would otherwise load under the genuine model
  id and compute other activations. A file the manifest does not list but a load would read
  (a chat template added after import) is refused too. They are small (a tokenizer is a few
  MB), so they are hashed at every start, not cached;
- then every tensor of the span, in the loading pass: the loader hands each tensor, in the
  dtype it is stored in, to `SpanCheck` (the `check` hook of stages/weights/folder.py)
  before casting it, and its bytes are hashed chunk by chunk (`chunk_bytes`, 1 MiB) against
  the manifest. The bytes come from the disk once; the hash reads them from memory. A
  mismatch raises `WeightsMismatch` naming the tensor, the chunk and the file: the peer
  refuses to serve, and says to re-fetch or re-import the model. A tensor the loader reads
  only part of (a fused checkpoint tensor's rows) is hashed from its file, once.

What is not checked this way, and why: a tensor-shard rank reads only its slices
(stages/shards/sharded.py), so its span's tensors are hashed from the files before it loads
(`verify_files`: a second read of those bytes); an int4 span that takes the Q4_1 blocks of a
fetched model's ``source.gguf`` as they are (stages/weights/gguf_blocks.py) reads a file
the manifest does not cover (it is not a model file), so those matrices are checked only by
the spot checks of the requesters (peer/request/verify.py). A folder without a manifest
has its model id computed from its bytes at start (stages/weights/registry.py): nothing to
check against, nothing to fake either.

Cached verification: hashing a span at every start costs a second per few hundred MB
(sha256, one core). `VerifiedCache` remembers, per weight file, the tensors a complete load
checked, under the file's (size, mtime_ns, inode, device) and the manifest's digest; a later
load of an untouched file — same four numbers, same manifest — skips hashing those
tensors. Any write through the file system changes the mtime; replacing the file changes
the inode. What the cache cannot see is a write to the same inode that keeps the size and
then sets the mtime back (``os.utime``): deliberate tampering by someone who can write the
model folder. Spot checks catch a peer serving such weights (tests/request/test_weight_check_swarm.py
does exactly that). Weights fetched from peers were checked chunk by chunk as they arrived
(peer/weights/fetcher.py): the assembled file is recorded here as it is written, so the
load after a fetch does not hash them again.

The cache lives in the peer's data dir (``verified-weights.json``): one peer's record of
what it checked, written atomically (tmp + rename); unreadable or foreign content is ignored
(everything is hashed again).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from tessera.stages.weights.registry import MANIFEST, checked_manifest, unvouched_files
from tessera.stages.weights.tensor_table import read_header

from tessera.peer.weights.errors import WeightsMismatch

CACHE_FILE = "verified-weights.json"
CACHE_VERSION = 1
READ_BYTES = 1 << 20  # `verify_files` reads this much at a time

Stamp = tuple[int, int, int, int]  # (size, mtime_ns, inode, device): an untouched file keeps all four


def stamp_of(path: Path) -> Stamp | None:
    """The file's (size, mtime_ns, inode, device), following symlinks; None if it is not there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


class VerifiedCache:
    """Per weight file (by resolved path): the stamp and manifest digest a check ran under, and
    the tensors it checked (module docstring). `path` None: a cache that remembers nothing."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("files"), dict):
            return {}
        return data["files"]

    def trusted(self, file: Path, digest: str, stamp: Stamp | None) -> set[str]:
        """The tensors of `file` a complete check covered when it had `stamp`, under `digest`."""
        if stamp is None:
            return set()
        entry = self._read().get(str(Path(file).resolve()))
        if not isinstance(entry, dict) or entry.get("digest") != digest or entry.get("stamp") != list(stamp):
            return set()
        tensors = entry.get("tensors")
        return {t for t in tensors if isinstance(t, str)} if isinstance(tensors, list) else set()

    def record(self, file: Path, digest: str, stamp: Stamp, tensors: Iterable[str]) -> None:
        """Remember that `tensors` of `file` (as it is at `stamp`) match the manifest of `digest`."""
        if self.path is None:
            return
        files = self._read()
        files[str(Path(file).resolve())] = {"stamp": list(stamp), "digest": digest, "tensors": sorted(set(tensors))}
        data = json.dumps({"version": CACHE_VERSION, "files": files}, sort_keys=True).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".verified-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


@dataclass
class CheckStats:
    """What one load's check did: tensors and bytes hashed, and skipped on the cache's word."""

    hashed: int = 0
    hashed_bytes: int = 0
    trusted: int = 0
    trusted_bytes: int = 0
    files: dict[str, set[str]] = field(default_factory=dict)  # file -> tensors checked now


class WeightCheck:
    """A peer's check of its model folder (module docstring): `begin()` one per load."""

    def __init__(self, folder: Path, cache: VerifiedCache) -> None:
        self.folder = Path(folder)
        self.cache = cache
        # raises ModelFormatError when the manifest does not hash to its model id
        self.manifest = checked_manifest(self.folder) if (self.folder / MANIFEST).exists() else None
        if self.manifest is not None:
            self._check_model_files(self.manifest)

    def _check_model_files(self, manifest: dict) -> None:
        """Refuse a folder whose config, tokenizer, chat template, generation config or index
        differ from the manifest (module docstring): one line naming the first such file."""
        faults = unvouched_files(self.folder, manifest)
        if faults:
            name, why = faults[0]
            more = f" (and {len(faults) - 1} more: {', '.join(n for n, _ in faults[1:])})" if len(faults) > 1 else ""
            raise WeightsMismatch(
                f"refusing to serve: {str(self.folder / name)!r} does not match the manifest of model "
                f"{manifest['model_id']}: {why}{more}. The folder was altered or damaged; fetch or import "
                f"the model again (`tessera model fetch` / `tessera model import`); an edit made on purpose "
                f"makes another model: import the edited folder under a new name, and it gets its own model id")

    @staticmethod
    def for_peer(folder: Path, data_dir: Path) -> "WeightCheck":
        return WeightCheck(folder, VerifiedCache(Path(data_dir) / CACHE_FILE))

    @property
    def active(self) -> bool:
        """Whether there is a manifest to check against (a bare folder has none: module docstring)."""
        return self.manifest is not None

    def begin(self) -> "SpanCheck | None":
        """A check for one load (None when there is nothing to check against)."""
        if self.manifest is None:
            return None
        return SpanCheck(self.folder, self.manifest, self.cache)

    def record_fetched(self, file: str, fetched: Iterable[str], stamp_before: Stamp | None) -> None:
        """After the fetcher rewrote `file` adding `fetched` (each chunk checked as it came):
        those tensors, and the ones the file held that the cache vouched for at `stamp_before`
        (the file as it was before the rewrite), are recorded as checked."""
        if self.manifest is None:
            return
        digest = self.manifest["tensors"]["digest"]
        path = self.folder / file
        stamp = stamp_of(path)
        if stamp is None:
            return
        kept = self.cache.trusted(path, digest, stamp_before)
        held = {n for n in read_header(path)[1] if n != "__metadata__"}
        self.cache.record(path, digest, stamp, (kept | set(fetched)) & held)


class SpanCheck:
    """One load's check: call it with each tensor as read (the stages/ `check` hook); `commit()`
    when the load completed. Raises WeightsMismatch on the first tensor that differs."""

    def __init__(self, folder: Path, manifest: dict, cache: VerifiedCache) -> None:
        self.folder = folder
        self.cache = cache
        tensors = manifest["tensors"]
        self.entries: dict[str, dict] = tensors["entries"]
        self.chunk_bytes = int(tensors["chunk_bytes"])
        self.digest = str(tensors["digest"])
        self.model_id = str(manifest["model_id"])
        files = sorted({e["file"] for e in self.entries.values()})
        self.stamps: dict[str, Stamp | None] = {f: stamp_of(folder / f) for f in files}  # as the load began
        self.trusted = {f: cache.trusted(folder / f, self.digest, self.stamps[f]) for f in files}
        self.stats = CheckStats()
        self.done: set[str] = set()  # checked in this load (hashed, or vouched for by the cache)

    def __call__(self, name: str, tensor: torch.Tensor | None) -> None:
        """The loader read `tensor` (None: only a part of it, which it cannot hash: read here)."""
        if name in self.done:
            return  # a fused tensor read row by row: checked once
        if tensor is None:
            self.verify_files([name])
            return
        entry = self._entry(name)
        size = entry["end"] - entry["begin"]
        if self._trusted(name, entry):
            return
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # the stored bytes, little-endian
        if raw.numel() != size:
            raise self._mismatch(name, entry, f"it holds {raw.numel()} bytes, the manifest {size}")
        self._compare(name, entry, memoryview(raw.numpy()))

    def _trusted(self, name: str, entry: dict) -> bool:
        """Whether the cache vouches for `name` (then it counts as checked, unread)."""
        if name not in self.trusted[entry["file"]]:
            return False
        self.stats.trusted += 1
        self.stats.trusted_bytes += entry["end"] - entry["begin"]
        self.done.add(name)
        return True

    def verify_files(self, names: Iterable[str]) -> None:
        """Hash `names` straight from their files (a loader that reads parts, not whole tensors:
        a tensor-shard rank, a fused tensor's rows); the same check, from a read of its own."""
        by_file: dict[str, list[str]] = {}
        for name in sorted(set(names) - self.done):
            by_file.setdefault(self._entry(name)["file"], []).append(name)
        for file, tensors in sorted(by_file.items()):
            path = self.folder / file
            data_at, header = read_header(path)
            with open(path, "rb") as f:
                for name in tensors:
                    entry = self.entries[name]
                    if self._trusted(name, entry):
                        continue
                    info = header.get(name)
                    if not isinstance(info, dict) or "data_offsets" not in info:
                        raise self._mismatch(name, entry, "it is not in the file")
                    begin, end = (int(x) for x in info["data_offsets"])
                    if end - begin != entry["end"] - entry["begin"]:
                        raise self._mismatch(name, entry, f"it holds {end - begin} bytes, the manifest {entry['end'] - entry['begin']}")
                    f.seek(data_at + begin)
                    self._compare(name, entry, memoryview(f.read(end - begin)))

    def _entry(self, name: str) -> dict:
        entry = self.entries.get(name)
        if entry is None:
            raise WeightsMismatch(f"refusing to serve: tensor {name!r} is not in the manifest of model "
                                  f"{self.model_id} ({self.folder})")
        return entry

    def _compare(self, name: str, entry: dict, data: memoryview) -> None:
        chunks = entry["chunks"]
        size = len(data)
        if size != entry["end"] - entry["begin"]:
            raise self._mismatch(name, entry, f"it holds {size} bytes, the manifest {entry['end'] - entry['begin']}")
        for index, want in enumerate(chunks):
            piece = data[index * self.chunk_bytes : min(size, (index + 1) * self.chunk_bytes)]
            if hashlib.sha256(piece).hexdigest() != want:
                raise self._mismatch(name, entry, f"chunk {index + 1} of {len(chunks)} "
                                     f"(bytes {index * self.chunk_bytes}-{index * self.chunk_bytes + len(piece)}) differs")
        self.stats.hashed += 1
        self.stats.hashed_bytes += size
        self.stats.files.setdefault(entry["file"], set()).add(name)
        self.done.add(name)

    def _mismatch(self, name: str, entry: dict, what: str) -> WeightsMismatch:
        return WeightsMismatch(
            f"refusing to serve: tensor {name!r} in {str(self.folder / entry['file'])!r} does not match the "
            f"manifest of model {self.model_id}: {what}. The folder was altered or damaged; fetch or "
            f"import the model again (`tessera model fetch` / `tessera model import`)")

    def commit(self) -> None:
        """The load completed: remember what was checked, for each file still as it was when
        the load began (a file that changed meanwhile is hashed again next time)."""
        for file, checked in sorted(self.stats.files.items()):
            stamp = self.stamps[file]
            if stamp is not None and stamp_of(self.folder / file) == stamp:
                self.cache.record(self.folder / file, self.digest, stamp, self.trusted[file] | checked)

    def summary(self) -> str:
        s = self.stats
        mb = 1 << 20
        return (f"weights checked against the manifest: {s.hashed} tensors hashed ({s.hashed_bytes / mb:.0f} MiB), "
                f"{s.trusted} unchanged since an earlier check ({s.trusted_bytes / mb:.0f} MiB)")


__all__ = ["WeightCheck", "SpanCheck", "VerifiedCache", "CheckStats", "stamp_of", "CACHE_FILE"]
