"""Serving a model's manifest and weight chunks to peers that fetch them (WEIGHTS_PROTOCOL).

One stream carries any number of requests, answered in order. What a holder serves is
what its folder's safetensors headers list (a peer that fetched only its span serves
only its span), read at the offsets of its own files, whatever layout they have.

Limits: every frame a fetcher sends is no larger than a request (protocol/weights.py
`REQUEST_FRAME_LIMIT`, 1.5 KiB: before, 64 MiB first frames from 8 throwaway identities took
a holder from 670 MB to 2.6 GB of RSS), and a stream holds an upload place while it is open:
`WeightLimits.streams_per_peer` per remote identity (more are refused), `streams_per_address`
per remote IP and `max_streams` in all. Those places are shared by identity with the policy of
the peer's unadmitted streams (peer/net/intake.py, an `Intake` of their own): when the places
of an address, or all of them, are taken, a newcomer takes the place of the oldest stream of
the identity holding the most there, if that identity holds more than the newcomer's own.
Before, the first 32 streams kept their places until they idled out (30 s, or never if they
asked for a byte now and then): 8 throwaway identities held every one and locked fetchers out.
Whoever loses its place, or finds none, is told `WeightRefused("busy: ...")` (protocol/weights.py
`BUSY`: ask again later; the fetcher backs off, it does not count it against the holder); an
eviction ends a stream only between requests, never inside an answer. An optional upload rate
per peer (`rate`, bytes/s; 0 = unlimited) is paced by a token bucket, so a volunteer's uplink
is not eaten by one fetcher. A stream idle for `IDLE_TIMEOUT` is closed. A volunteer who wants
none of this runs `--no-serve-weights` and the protocol is not registered at all.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import trio

from tessera.protocol.errors import WireError
from tessera.protocol.framing import DEFAULT_MAX_FRAME, READ_CHUNK
from tessera.protocol.weights import (
    BUSY, REQUEST_FRAME_LIMIT, WeightChunk, WeightChunkRequest, WeightManifest, WeightManifestRequest, WeightRefused,
)
from tessera.stages.errors import ModelFormatError
from tessera.stages.weights.registry import MANIFEST, read_manifest
from tessera.stages.weights.tensor_table import canonical, read_header

from tessera.peer.base.errors import PeerError
from tessera.peer.base.protocols import WEIGHTS_PROTOCOL
from tessera.peer.net.intake import Intake
from tessera.peer.net.transport import Channel, Stream, Transport

log = logging.getLogger(__name__)

# A fetcher asks for its next chunk as soon as the last one is written (milliseconds);
# one that says nothing for 30 s has stalled or gone, and holds a stream slot.
IDLE_TIMEOUT = 30.0


@dataclass(frozen=True)
class WeightLimits:
    """How much of its uplink a holder gives to fetchers."""

    streams_per_peer: int = 4  # a fetcher opens this many streams per holder (fetcher.STREAMS_PER_SOURCE)
    streams_per_address: int = 8  # two fetchers behind one NAT at their full four each
    max_streams: int = 32
    rate: float = 0.0  # bytes/s per remote peer; 0 = unlimited

    def places(self) -> Intake:
        """The upload places (module docstring): the intake's policy over a pool of their own.
        Its byte budget never binds (each place is charged one read; the requests are tiny)."""
        return Intake(per_identity=self.streams_per_peer, per_address=self.streams_per_address,
                      total=self.max_streams, budget=(self.max_streams + 1) * READ_CHUNK)


class WeightSource:
    """The holder's side of the weights protocol over one model folder."""

    def __init__(self, transport: Transport, folder: Path, *, name: str, limits: WeightLimits = WeightLimits(),
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.folder = Path(folder)
        self.name = name
        self.limits = limits
        self.clock = clock
        manifest = read_manifest(self.folder)
        self.model_id = str(manifest["model_id"])
        self.entries: dict[str, dict] = manifest["tensors"]["entries"]
        self.chunk_bytes = int(manifest["tensors"]["chunk_bytes"])
        self.files: dict[str, dict] = manifest["files"]
        public = {k: manifest[k] for k in ("format", "files", "tensors", "model_id")}  # no local paths
        self.manifest_bytes = canonical(public)
        self._where: dict[str, tuple[Path, int]] = {}
        self.refresh()
        self.places = limits.places()  # who holds an upload place (module docstring)
        self._next_free: dict[str, float] = {}
        self.bytes_served = 0
        self.intake = transport.intake  # its polite refusals (peer/net/intake.py `refuse`)
        transport.set_handler(WEIGHTS_PROTOCOL, self.handle)

    def refresh(self) -> None:
        """Re-read what the folder's weight files hold (after a fetch added tensors)."""
        where: dict[str, tuple[Path, int]] = {}
        for path in sorted(self.folder.glob("*.safetensors")):
            try:
                data_at, header = read_header(path)
            except ModelFormatError as bad:
                log.warning("not serving %s: %s", path, bad)
                continue
            for name, info in header.items():
                entry = self.entries.get(name)
                if entry is None or name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                if end - begin == entry["end"] - entry["begin"]:
                    where[name] = (path, data_at + begin)
        self._where = where

    def held_groups(self) -> tuple[str, ...]:
        groups: dict[str, bool] = {}
        for name, entry in self.entries.items():
            groups[entry["group"]] = groups.get(entry["group"], True) and name in self._where
        return tuple(sorted(g for g, full in groups.items() if full))

    # -- the handler ----------------------------------------------------------------------

    async def handle(self, stream: Stream) -> None:
        remote = stream.remote
        # every frame a fetcher sends is a small request: read with that limit from the first on
        channel = Channel(stream, max_frame=REQUEST_FRAME_LIMIT, max_send=DEFAULT_MAX_FRAME)
        place = self.places.enter(stream)
        if place is None:
            await self.intake.refuse(stream, WeightRefused(f"{BUSY}: every upload place is taken"),
                                     limit=REQUEST_FRAME_LIMIT)
            return
        try:
            while True:
                request = None
                with place.wait_scope(), trio.move_on_after(IDLE_TIMEOUT):  # an eviction ends the wait
                    request = await channel.receive_or_none()
                if place.evicted:
                    await self.intake.refuse(stream, WeightRefused(f"{BUSY}: this upload place went to a fetcher "
                                                                   "holding fewer"), limit=REQUEST_FRAME_LIMIT)
                    return
                if request is None:
                    break  # closed, or idle too long
                await channel.send(await self._answer(request, remote))
            await channel.close()
        except (PeerError, WireError) as bad:
            # garbage or a vanished fetcher: reset so that it does not wait on us, and go on serving others
            log.debug("weights stream from %s ended: %s", remote, bad)
            await channel.reset()
        finally:
            place.release()

    async def _answer(self, request: object, remote: str) -> object:
        if isinstance(request, WeightManifestRequest):
            if request.model not in (self.model_id, self.name):
                return WeightRefused(f"no model {request.model!r} here (this peer holds {self.model_id})")
            return WeightManifest(self.model_id, self.manifest_bytes if request.with_manifest else b"", self.held_groups())
        if not isinstance(request, WeightChunkRequest):
            raise WireError(f"expected a weights request, got {type(request).__name__}")
        if request.model_id != self.model_id:
            return WeightRefused(f"no model {request.model_id!r} here")
        located = self._locate(request)
        if isinstance(located, str):
            return WeightRefused(located)
        path, offset, size = located
        await self._pace(remote, size)
        data = await trio.to_thread.run_sync(_pread, path, offset, size)
        self.bytes_served += len(data)
        return WeightChunk(self.model_id, request.name, request.index, request.is_file, data)

    def _locate(self, request: WeightChunkRequest) -> tuple[Path, int, int] | str:
        """(file, offset, size) of the requested chunk, or why it is not served."""
        if request.is_file:
            entry = self.files.get(request.name)
            if entry is None or request.name.endswith(".safetensors"):
                return f"no file {request.name!r} in the manifest (weights go tensor by tensor)"
            path, base, size = self.folder / request.name, 0, int(entry["bytes"])
        else:
            entry = self.entries.get(request.name)
            if entry is None:
                return f"no tensor {request.name!r} in the manifest"
            if request.name not in self._where:
                self.refresh()  # a fetch of our own may have added it since
            if request.name not in self._where:
                return f"tensor {request.name!r} is not held here"
            (path, base), size = self._where[request.name], entry["end"] - entry["begin"]
        start = request.index * self.chunk_bytes
        if start >= size and not (start == 0 and size == 0):
            return f"{request.name!r} has no chunk {request.index!r} (it is {size} bytes)"
        return path, base + start, min(self.chunk_bytes, size - start)

    async def _pace(self, remote: str, size: int) -> None:
        """Token bucket per remote peer: wait until `size` more bytes fit under the rate."""
        if self.limits.rate <= 0:
            return
        now = self.clock()
        start = max(now, self._next_free.get(remote, now))
        self._next_free[remote] = start + size / self.limits.rate
        await trio.sleep(start - now)


def _pread(path: Path, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def serve_weights(transport: Transport, folder: Path, *, enabled: bool, rate: float) -> WeightSource | None:
    """The peer's weight server over its model folder, or None when the volunteer turned it off
    or the folder has no manifest (a bare Hugging Face folder given by path: nothing to check
    chunks against until `tessera model import` writes one)."""
    if not enabled or not (Path(folder) / MANIFEST).exists():
        return None
    return WeightSource(transport, folder, name=Path(folder).name, limits=WeightLimits(rate=rate))
