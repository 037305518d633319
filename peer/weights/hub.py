"""A model hub as one more holder of a model's weights: a span's tensors by HTTP ranges.

A folder fetched in part from a Hugging Face hub (`tessera model fetch ORG/NAME --layers A:B`,
peer/cli/model_span.py) records in its manifest's `source` where it came from: the hub's
address, the repository and the commit. Every fetch of tensors into such a folder (the first,
and each later one when the peer's span moves: bootstrap.py `ensure_span`) then counts the hub
as one more holder beside the swarm's peers, holding every group: the fetcher's workers ask it
for the same 1 MiB chunks they ask peers for (`HubSource.chunk` answers with the protocol's own
messages), and every chunk is checked against the manifest before it is written, as a peer's
is. A chunk that does not match — a corrupt mirror, or a manifest that is not of this
repository — drops the hub for that fetch, and the chunk is fetched from a peer if one holds it.

A chunk of tensor T is one ranged GET of its bytes in T's file: at `data_at + T.begin + i *
chunk_bytes`, where `data_at` (8 + the length of the file's safetensors header) is read once
per file with two small ranged GETs. The header read then is held to the manifest's table for
that file — the same tensors, dtypes, shapes and offsets, nothing more — so a manifest that
does not describe the hub's file is refused before a byte of its weights is asked for.

Requests go through `huggingface_hub`'s HTTP session (its proxies; the user's token, for gated
repositories), blocking, in worker threads. `manifest_matches_hub` is the check of a manifest
taken from the swarm against the hub's listing (pure).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Mapping

import trio

from tessera.protocol.weights import WeightChunk, WeightRefused
from tessera.stages.weights.tensor_table import MAX_HEADER_BYTES

from tessera.peer.weights.errors import WeightsError

# One range of at most a chunk (1 MiB): ~8 s at 1 Mbit/s, the slowest link we plan for, as a
# peer's chunk (fetcher.CHUNK_TIMEOUT); a hub answers far faster, or has stalled.
HUB_TIMEOUT = 30.0


class HubError(WeightsError):
    """The hub did not answer a range as a hub does (an HTTP error, no range support, a short
    body, a timeout): a strike against it, as a peer's reset is."""


class HubMismatch(WeightsError):
    """A file on the hub is not the one the manifest describes (its header differs): the hub is
    dropped for this fetch, as a peer that sent a corrupt chunk is."""


@dataclass(frozen=True)
class HubRepo:
    """A repository at one commit on one hub: where a partial folder's weights come from."""

    endpoint: str
    repo: str
    commit: str

    @staticmethod
    def from_source(source: object) -> "HubRepo | None":
        """The hub a folder's manifest `source` names (a hub fetch writes hub, revision and endpoint), or None."""
        if not isinstance(source, Mapping):
            return None
        endpoint, repo, commit = (source.get(key) for key in ("endpoint", "hub", "revision"))
        if not all(isinstance(value, str) and value for value in (endpoint, repo, commit)):
            return None
        return HubRepo(str(endpoint), str(repo), str(commit))

    def source(self) -> dict[str, str]:
        return {"hub": self.repo, "revision": self.commit, "endpoint": self.endpoint}

    @property
    def label(self) -> str:
        """How the fetcher names this holder (a peer id never contains ':')."""
        return f"hub:{self.repo}@{self.commit[:12]}"

    def url(self, path: str) -> str:
        from huggingface_hub import hf_hub_url  # the hub client: imported where a hub is used

        return hf_hub_url(self.repo, path, revision=self.commit, endpoint=self.endpoint)


def fetch_range(repo: HubRepo, path: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of `path` (blocking: call it in a worker thread). Raises HubError."""
    from huggingface_hub.utils import build_hf_headers, get_session

    want = end - start
    where = f"{repo.label} {path} bytes [{start}, {end})"
    try:
        headers = build_hf_headers(headers={"Range": f"bytes={start}-{end - 1}"})
        with get_session().stream("GET", repo.url(path), headers=headers, follow_redirects=True,
                                  timeout=HUB_TIMEOUT) as response:
            if response.status_code != 206:  # a 200 would be the whole file: not read
                raise HubError(f"{where}: HTTP {response.status_code}, not the range asked for")
            data = bytearray()
            for piece in response.iter_bytes():
                data += piece
                if len(data) > want:
                    break
    except HubError:
        raise
    except Exception as bad:  # the HTTP client's errors (transport, timeout, TLS) share no base class we import
        raise HubError(f"{where}: {type(bad).__name__}: {bad}") from None
    if len(data) != want:
        raise HubError(f"{where}: {len(data)} bytes came")
    return bytes(data)


class HubSource:
    """The hub as a holder of every tensor of `manifest` (module docstring)."""

    def __init__(self, repo: HubRepo, manifest: dict) -> None:
        self.repo = repo
        self.label = repo.label
        self.entries: dict[str, dict] = manifest["tensors"]["entries"]
        self.chunk_bytes = int(manifest["tensors"]["chunk_bytes"])
        self._data_at: dict[str, int] = {}
        self._reading: dict[str, trio.Lock] = {}

    async def chunk(self, model_id: str, name: str, index: int) -> WeightChunk | WeightRefused:
        """Chunk `index` of tensor `name`, as a holder answers (unchecked: the fetcher checks it).
        Raises HubError, HubMismatch."""
        entry = self.entries.get(name)
        if entry is None:
            return WeightRefused(f"no tensor {name!r} in the manifest")
        size = int(entry["end"]) - int(entry["begin"])
        start = index * self.chunk_bytes
        if start >= size and not (start == 0 and size == 0):
            return WeightRefused(f"{name!r} has no chunk {index!r} (it is {size} bytes)")
        data_at = await self._layout(entry["file"])
        at = data_at + int(entry["begin"]) + start
        data = await self._get(entry["file"], at, at + min(self.chunk_bytes, size - start))
        return WeightChunk(model_id, name, index, False, data)

    async def _get(self, path: str, start: int, end: int) -> bytes:
        if end == start:
            return b""
        return await trio.to_thread.run_sync(fetch_range, self.repo, path, start, end, abandon_on_cancel=True)

    async def _layout(self, path: str) -> int:
        """Where `path`'s data section starts, its header checked against the manifest (once a file)."""
        if path in self._data_at:
            return self._data_at[path]
        async with self._reading.setdefault(path, trio.Lock()):
            if path not in self._data_at:
                (length,) = struct.unpack("<Q", await self._get(path, 0, 8))
                if length > MAX_HEADER_BYTES:
                    raise HubMismatch(f"{self.label} {path} claims a {length}-byte safetensors header "
                                      f"(limit {MAX_HEADER_BYTES})")
                header = await self._get(path, 8, 8 + length)
                self._check_header(path, header)
                self._data_at[path] = 8 + length
        return self._data_at[path]

    def _check_header(self, path: str, raw: bytes) -> None:
        try:
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise ValueError("not a JSON object")
            held = {name: (info["dtype"], [int(d) for d in info["shape"]], [int(x) for x in info["data_offsets"]])
                    for name, info in header.items() if name != "__metadata__"}
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as bad:
            raise HubMismatch(f"{self.label} {path} has no readable safetensors header: {bad}") from None
        listed = {name: (e["dtype"], list(e["shape"]), [int(e["begin"]), int(e["end"])])
                  for name, e in self.entries.items() if e["file"] == path}
        if held != listed:
            differ = sorted(n for n in held.keys() | listed.keys() if held.get(n) != listed.get(n))
            raise HubMismatch(f"{self.label} {path} is not the file the manifest describes: tensor "
                              f"{differ[0]!r} is {held.get(differ[0])!r} there, {listed.get(differ[0])!r} "
                              f"in the manifest ({len(differ)} differ)")


def manifest_matches_hub(manifest: dict, hub_files: Mapping[str, tuple[str, int]]) -> list[str]:
    """Why `manifest` (taken from the swarm, checked to hash to its id) is not of the repository
    whose files a peer would run are `hub_files` ({name: (sha256, bytes)}, the weight files'
    from the hub's listing, the small files' as downloaded and checked): empty when it is. The
    files' sha256s are bound into the model id, so what is left unchecked here is the table's
    chunk hashes of tensors this machine never fetches (and the layout of files it never reads
    from the hub: `HubSource` checks a file's header before it reads from it)."""
    files = manifest["files"]
    faults = [f"{name}: the repository has it, the swarm's manifest does not" for name in sorted(set(hub_files) - set(files))]
    faults += [f"{name}: the swarm's manifest lists it, the repository has no such file"
               for name in sorted(set(files) - set(hub_files))]
    for name in sorted(set(files) & set(hub_files)):
        sha256, size = hub_files[name]
        if files[name].get("sha256") != sha256 or int(files[name].get("bytes", -1)) != size:
            faults.append(f"{name}: its sha256 or size differs from the repository's")
    return faults
