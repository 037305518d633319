"""Fetching a span's weights from several peers at once, every chunk checked.

    fetcher = Fetcher(transport, folder, manifest, out=print)
    await fetcher.fetch_files(peers)                          # config, tokenizer, ...
    await fetcher.fetch_groups(peers, groups_for_span(...), label="layers [0, 15)")

`survey` asks every candidate for its manifest answer: the holders whose model id is
ours, and which groups each holds; a hub the folder came from (`hub.py`) holds every group
and is asked by HTTP ranges for the same chunks, checked the same way. Then `STREAMS_PER_SOURCE` workers per holder pull
chunks from one shared queue — each takes the next chunk its holder has — so a fast
holder serves more and a slow one less, with no plan made up front. A chunk whose
sha256 is not the manifest's bans its sender for the rest of the fetch (the chunk goes
back to the queue for another holder); a holder that times out or resets gets a
strike, and after `MAX_STRIKES` it is dropped too. Verified chunks go to part files
(`parts.py`); when every chunk is in, each safetensors file is rewritten atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import trio

from tessera.protocol.errors import WireError
from tessera.protocol.weights import (
    BUSY, WeightChunk, WeightChunkRequest, WeightManifest, WeightManifestRequest, WeightRefused,
)
from tessera.stages.errors import ModelFormatError
from tessera.stages.weights.tensor_table import check_manifest

from tessera.peer.base.errors import PeerError
from tessera.peer.base.protocols import WEIGHTS_PROTOCOL
from tessera.peer.net.transport import Channel, Transport
from tessera.peer.weights.errors import DiskFull, ManifestRejected, WeightsUnavailable
from tessera.peer.weights.hub import HubMismatch, HubSource
from tessera.peer.weights.parts import PartStore, WriteAt, write_file_atomically
from tessera.peer.weights.verify import WeightCheck, stamp_of

log = logging.getLogger(__name__)

STREAMS_PER_SOURCE = 4  # requests in flight per holder: hides one RTT + one disk read per chunk
# A 1 MiB chunk takes ~8 s at 1 Mbit/s, the slowest uplink we plan for; 30 s bounds a stalled holder.
CHUNK_TIMEOUT = 30.0
# Opening a stream or getting a manifest answer: a dial (a few RTTs) plus, for the
# manifest, up to a few MB of JSON; 15 s is generous on any link that can carry weights.
ASK_TIMEOUT = 15.0
MAX_STRIKES = 3  # timeouts/resets before a holder is dropped for this fetch (a lie bans at once)
# A holder whose upload places are all taken answers "busy" (peer/weights/source.py): the stream
# asks again after BUSY_BACKOFF, doubling, BUSY_TRIES times in a row before it gives that holder
# up (its other streams go on). A place frees when a stream ends or idles out (30 s), or at once
# for a fetcher holding fewer than another: 1 s doubling six times waits out a whole idle timeout.
BUSY_BACKOFF = 1.0
BUSY_TRIES = 6
PROGRESS_INTERVAL = 2.0  # seconds between progress lines on the console
MAX_SMALL_FILE = 256 * (1 << 20)  # a tokenizer.json is a few MB; refused above this before allocating


def is_model_id(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


async def ask_manifest(transport: Transport, peer: str, model: str, *, with_manifest: bool = True,
                       addrs: Sequence[str] = ()) -> WeightManifest:
    """One holder's manifest answer (without the manifest itself unless `with_manifest`), dialling
    `addrs` if not connected. Raises PeerError, WireError, ManifestRejected."""
    with trio.fail_after(ASK_TIMEOUT):
        channel = Channel(await transport.open_stream(peer, WEIGHTS_PROTOCOL, addrs=addrs))
        try:
            await channel.send(WeightManifestRequest(model, with_manifest))
            answer = await channel.receive()
        finally:
            await channel.close()
    if isinstance(answer, WeightRefused):
        raise ManifestRejected(f"peer {peer} has no model {model!r}: {answer.reason}")
    if not isinstance(answer, WeightManifest):
        raise ManifestRejected(f"peer {peer} answered {type(answer).__name__}, not a manifest")
    return answer


def parse_manifest(answer: WeightManifest, *, expected_id: str | None) -> dict:
    """The manifest, checked to hash to its id (and to `expected_id`). Raises ManifestRejected."""
    try:
        manifest = json.loads(answer.manifest)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        check_manifest(manifest, expected_id=expected_id)
    except (ValueError, UnicodeDecodeError, ModelFormatError) as bad:
        raise ManifestRejected(f"manifest rejected: {bad}") from None
    if manifest["model_id"] != answer.model_id:
        raise ManifestRejected(f"manifest is for {manifest['model_id']!r}, the message says {answer.model_id!r}")
    return manifest


async def learn_manifest(transport: Transport, peers: list[str], model: str) -> dict:
    """The manifest of `model` (a name or an id) from the first peer whose answer checks out.

    With an id the manifest must hash to it; with a name we take the first holder's word
    for which model that name means (pass the id to pin it). Raises ManifestRejected.
    """
    reasons = []
    for peer in peers:
        try:
            answer = await ask_manifest(transport, peer, model)
            return parse_manifest(answer, expected_id=model if is_model_id(model) else None)
        except (PeerError, WireError, trio.TooSlowError) as bad:
            reasons.append(f"{peer}: {bad or 'timed out'}")
    raise ManifestRejected(f"no peer gave a valid manifest for {model!r}: " + "; ".join(reasons or ["no peers"]))


@dataclass
class FetchProgress:
    """Bytes of one fetch so far, for the progress line."""

    label: str
    total: int
    started: float
    done: int = 0
    skipped: int = 0  # verified chunks found on disk (a resumed fetch)
    by_peer: dict[str, int] = field(default_factory=dict)

    def reading(self, now: float) -> dict:
        """Where the fetch stands at `now`, as plain data (the TUI's progress bar):
        ``label``, ``done`` and ``total`` bytes, ``skipped`` (already on disk), ``rate``
        (bytes/s over the network), ``eta_s`` (None while no rate is known), ``peers``."""
        rate = (self.done - self.skipped) / max(now - self.started, 1e-9)
        left = self.total - self.done
        return {"label": self.label, "done": self.done, "total": self.total, "skipped": self.skipped,
                "rate": rate, "eta_s": (left / rate if rate > 0 else None) if left else 0.0,
                "peers": len(self.by_peer)}

    def line(self, now: float) -> str:
        """'layers [0, 15): 120.3/270.0 MB (45%), 30.1 MB/s, ETA 5 s, from 2 peers' (or 'from the hub',
        'from the hub and 2 peers')"""
        mb = 1e6
        r = self.reading(now)
        eta = "done" if self.done >= self.total else ("ETA ?" if r["eta_s"] is None else f"ETA {r['eta_s']:.0f} s")
        pct = 100 * self.done / self.total if self.total else 100
        resumed = f", {self.skipped / mb:.1f} MB were already on disk" if self.skipped else ""
        peers = sum(1 for holder in self.by_peer if not holder.startswith("hub:"))  # a peer id has no ':'
        sources = [f"{peers} peer{'s' if peers != 1 else ''}"] if peers or len(self.by_peer) == peers else []
        if peers != len(self.by_peer):
            sources.insert(0, "the hub")
        return (f"fetching {self.label}: {self.done / mb:.1f}/{self.total / mb:.1f} MB ({pct:.0f}%), "
                f"{r['rate'] / mb:.1f} MB/s, {eta}, from {' and '.join(sources)}" + resumed)


class Fetcher:
    """The fetching side of the weights protocol for one model folder (see module docstring)."""

    def __init__(self, transport: Transport | None, folder: Path, manifest: dict, *,
                 out: Callable[[str], None] = lambda line: None,
                 clock: Callable[[], float] = trio.current_time,
                 write_at: WriteAt = os.pwrite, streams_per_source: int = STREAMS_PER_SOURCE,
                 check: WeightCheck | None = None, addrs: Mapping[str, Sequence[str]] = {},
                 hub: HubSource | None = None) -> None:
        self.transport = transport  # None: no swarm to ask (the hub alone)
        self.hub = hub  # one more holder, of every group (hub.py)
        # peers not connected yet (the view's holders of a span): dialled at these when asked
        self.addrs = addrs
        self.check = check  # told of each file rewritten, so the load after a fetch need not hash it again
        self.folder = Path(folder)
        self.manifest = manifest
        self.model_id = str(manifest["model_id"])
        self.entries: dict[str, dict] = manifest["tensors"]["entries"]
        self.out = out
        self.clock = clock
        self.write_at = write_at
        self.streams_per_source = streams_per_source
        self.parts = PartStore(self.folder, manifest, write_at=write_at)
        self.banned: set[str] = set()
        self.strikes: dict[str, int] = {}
        self.fetched_chunks = 0  # chunks that crossed the network (a resumed fetch skips the rest)
        self.last_progress: FetchProgress | None = None

    # -- who holds what ---------------------------------------------------------------------

    async def survey(self, peers: list[str]) -> dict[str, set[str]]:
        """Groups each candidate holds, for those that hold our model (asked in parallel)."""
        holders: dict[str, set[str]] = {}
        transport = self.transport
        if transport is None:
            return holders

        async def ask(peer: str) -> None:
            try:
                answer = await ask_manifest(transport, peer, self.model_id, with_manifest=False,
                                            addrs=self.addrs.get(peer, ()))
            except (PeerError, WireError, trio.TooSlowError) as bad:
                log.debug("weights survey: %s: %s", peer, bad)
                return
            if answer.model_id == self.model_id:
                holders[peer] = set(answer.held)

        async with trio.open_nursery() as nursery:
            for peer in sorted(set(peers) - self.banned - {transport.peer_id}):
                nursery.start_soon(ask, peer)
        return holders

    # -- small files --------------------------------------------------------------------------

    async def fetch_files(self, peers: list[str]) -> None:
        """Every non-weight file of the manifest that is missing or wrong here, each from one
        holder, checked whole (a liar is banned and the next holder asked)."""
        for name, entry in sorted(self.manifest["files"].items()):
            if name.endswith(".safetensors") or await trio.to_thread.run_sync(self._file_ok, name, entry):
                continue
            size = int(entry["bytes"])
            if size > MAX_SMALL_FILE:
                raise WeightsUnavailable(f"file {name!r} claims {size} bytes, over the {MAX_SMALL_FILE}-byte limit")
            for peer in [p for p in peers if p not in self.banned and p != self.transport.peer_id]:
                data = await self._fetch_file_from(peer, name, size)
                if data is None:
                    continue
                if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                    self._ban(peer, f"sent a wrong {name!r}")
                    continue
                await trio.to_thread.run_sync(lambda: write_file_atomically(self.folder, name, data, write_at=self.write_at))
                break
            else:
                raise WeightsUnavailable(f"no peer served a valid {name!r}")

    def _file_ok(self, name: str, entry: dict) -> bool:
        path = self.folder / name
        return path.exists() and path.stat().st_size == entry["bytes"] and \
            hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]

    async def _fetch_file_from(self, peer: str, name: str, size: int) -> bytes | None:
        chunk = int(self.manifest["tensors"]["chunk_bytes"])
        out = bytearray()
        try:
            with trio.fail_after(ASK_TIMEOUT + CHUNK_TIMEOUT * max(1, -(-size // chunk))):
                channel = Channel(await self.transport.open_stream(peer, WEIGHTS_PROTOCOL, addrs=self.addrs.get(peer, ())))
                for index in range(max(1, -(-size // chunk))):
                    await channel.send(WeightChunkRequest(self.model_id, name, index, True))
                    reply = await channel.receive()
                    if not isinstance(reply, WeightChunk) or (reply.name, reply.index) != (name, index):
                        log.debug("%s did not serve %s: %r", peer, name, reply)
                        await channel.close()
                        return None
                    out += reply.data
                    if len(out) > size:
                        break
                await channel.close()
        except (PeerError, WireError, trio.TooSlowError) as bad:
            log.debug("fetching %s from %s failed: %s", name, peer, bad)
            return None
        return bytes(out)

    # -- tensors ------------------------------------------------------------------------------

    async def fetch_groups(self, peers: list[str], groups: set[str], *, label: str) -> FetchProgress:
        """Fetch every tensor of `groups` not yet in the folder; then rewrite the weight files.

        Raises WeightsUnavailable (some chunk has no honest holder left), DiskFull.
        """
        by_file: dict[str, list[str]] = {}
        for name, entry in self.entries.items():
            if entry["group"] in groups:
                by_file.setdefault(entry["file"], []).append(name)
        wanted: list[str] = []
        now_held: list[str] = []
        for file, names in sorted(by_file.items()):
            held = await trio.to_thread.run_sync(self.parts.held, file)
            wanted += sorted(n for n in names if n not in held)
            now_held += [n for n in names if n in held]
        # a kill between the rename and the clean-up leaves part files of tensors now held (one
        # that a wanted tensor of the same bytes shares is kept: its verified chunks count)
        parts_wanted = {self.parts.part_path(n) for n in wanted}
        await trio.to_thread.run_sync(self.parts.discard, [n for n in now_held if self.parts.part_path(n) not in parts_wanted])
        jobs: deque[tuple[str, int]] = deque()
        total = skipped = 0
        for name in wanted:
            done = await trio.to_thread.run_sync(self.parts.verified_chunks, name)
            for index in range(len(self.entries[name]["chunks"])):
                size = self._chunk_size(name, index)
                total += size
                if index in done:
                    skipped += size
                else:
                    jobs.append((name, index))
        progress = FetchProgress(label, total, self.clock(), done=skipped, skipped=skipped)
        self.last_progress = progress
        if jobs:
            holders = await self.survey(peers)
            if self.hub is not None and self.hub.label not in self.banned:
                holders[self.hub.label] = {e["group"] for e in self.entries.values()}
            if not holders:
                asked = set(peers) - ({self.transport.peer_id} if self.transport is not None else set())
                raise WeightsUnavailable(
                    f"no peer serves the weights of {label}: asked {len(asked)} "
                    "(none answered for this model; a peer may run --no-serve-weights)")
            await self._run(jobs, holders, progress)
        for file, names in sorted(by_file.items()):
            new = [n for n in wanted if self.entries[n]["file"] == file]
            if new:
                before = stamp_of(self.folder / file)
                await trio.to_thread.run_sync(self.parts.assemble, file, new)
                if self.check is not None:  # every chunk of `new` matched the manifest as it came
                    await trio.to_thread.run_sync(self.check.record_fetched, file, new, before)
        await trio.to_thread.run_sync(self.parts.discard, wanted)
        self.out(progress.line(self.clock()))
        return progress

    def _chunk_size(self, name: str, index: int) -> int:
        start, end = self.parts.chunk_range(name, index)
        return end - start

    async def _run(self, jobs: deque[tuple[str, int]], holders: dict[str, set[str]], progress: FetchProgress) -> None:
        state = _Queue(jobs)
        fatal: list[BaseException] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report, progress, state)
            for peer, held in sorted(holders.items()):
                for _ in range(self.streams_per_source):
                    state.workers += 1  # counted here, so that `finished` never sees a worker not yet started
                    nursery.start_soon(self._worker, peer, held, state, progress, fatal, nursery.cancel_scope)
            await state.finished()
            nursery.cancel_scope.cancel()
        if fatal:
            raise fatal[0]
        if state.pending:
            name, index = state.pending[0]
            raise WeightsUnavailable(
                f"no honest holder left for chunk {index} of {name!r} ({len(state.pending)} chunks missing; "
                f"banned: {sorted(self.banned) or 'none'})")

    async def _report(self, progress: FetchProgress, state: "_Queue") -> None:
        while True:
            await trio.sleep(PROGRESS_INTERVAL)
            self.out(progress.line(self.clock()))

    async def _worker(self, peer: str, held: set[str], state: "_Queue", progress: FetchProgress,
                      fatal: list[BaseException], scope: trio.CancelScope) -> None:
        channel: Channel | None = None
        busy = 0  # "busy" answers in a row
        try:
            while peer not in self.banned:
                job = state.take(lambda j: self.entries[j[0]]["group"] in held)
                if job is None:
                    if not state.in_flight:
                        return  # nothing left that we could serve, and nothing that may come back
                    await state.wait()
                    continue
                name, index = job
                try:
                    if self.hub is not None and peer == self.hub.label:
                        with trio.fail_after(CHUNK_TIMEOUT * 2):  # the header's ranges first, once a file
                            reply = await self.hub.chunk(self.model_id, name, index)
                    else:
                        reply, channel = await self._ask_peer(peer, channel, name, index)
                except HubMismatch as bad:
                    state.put_back(job)
                    self._ban(peer, str(bad))
                    return
                except (PeerError, WireError, trio.TooSlowError) as bad:
                    state.put_back(job)
                    channel = None
                    self.strikes[peer] = self.strikes.get(peer, 0) + 1
                    log.debug("chunk %s[%d] from %s failed: %s", name, index, peer, bad)
                    if self.strikes[peer] >= MAX_STRIKES:
                        self._ban(peer, f"failed {MAX_STRIKES} times ({bad or 'timed out'})")
                    continue
                if isinstance(reply, WeightRefused) and reply.reason.startswith(BUSY):
                    state.put_back(job)  # for another stream meanwhile
                    await _close_quietly(channel)  # the holder ends a stream it refused
                    channel = None
                    busy += 1
                    if busy > BUSY_TRIES:
                        return  # this holder stays busy for this stream: not a strike, it is not failing
                    await trio.sleep(BUSY_BACKOFF * 2 ** (busy - 1))
                    continue
                if isinstance(reply, WeightRefused):
                    held.discard(self.entries[name]["group"])  # it does not hold that after all
                    state.put_back(job)
                    continue
                busy = 0
                ok = (isinstance(reply, WeightChunk) and (reply.name, reply.index, reply.is_file) == (name, index, False)
                      and await trio.to_thread.run_sync(self._verify_and_store, name, index, reply.data))
                if not ok:
                    state.put_back(job)
                    self._ban(peer, f"sent a corrupt chunk {index} of {name!r}")
                    return
                state.done(job)
                self.fetched_chunks += 1
                size = len(reply.data)
                progress.done += size
                progress.by_peer[peer] = progress.by_peer.get(peer, 0) + size
        except DiskFull as full:
            fatal.append(full)
            scope.cancel()
        finally:
            state.workers -= 1
            state.changed()
            with trio.CancelScope(shield=True):
                await _close_quietly(channel)

    async def _ask_peer(self, peer: str, channel: Channel | None, name: str, index: int) -> tuple[object, Channel]:
        """One chunk request to `peer` on `channel` (opened first when None): (its reply, the channel)."""
        assert self.transport is not None  # peers are holders only when there is a transport (`survey`)
        if channel is None:
            with trio.fail_after(ASK_TIMEOUT):
                channel = Channel(await self.transport.open_stream(peer, WEIGHTS_PROTOCOL, addrs=self.addrs.get(peer, ())))
        with trio.fail_after(CHUNK_TIMEOUT):
            await channel.send(WeightChunkRequest(self.model_id, name, index, False))
            return await channel.receive(), channel

    def _verify_and_store(self, name: str, index: int, data: bytes) -> bool:
        """Check one chunk against the manifest; store it if it matches (in a worker thread)."""
        if len(data) != self._chunk_size(name, index):
            return False
        if hashlib.sha256(data).hexdigest() != self.entries[name]["chunks"][index]:
            return False
        self.parts.write_chunk(name, index, data)
        return True

    def _ban(self, peer: str, why: str) -> None:
        if peer not in self.banned:
            self.banned.add(peer)
            who = f"the hub {peer.removeprefix('hub:')}" if self.hub is not None and peer == self.hub.label else f"peer {peer}"
            self.out(f"weights: banned {who} for this fetch: {why}")


async def _close_quietly(channel: Channel | None) -> None:
    """Close a chunk stream we are done with (within a second; one already gone is fine)."""
    if channel is None:
        return
    with trio.move_on_after(1.0):
        try:
            await channel.close()
        except PeerError:
            pass  # already gone: nothing to close


class _Queue:
    """Chunks to fetch, shared by the workers: pending, in flight, and a wake-up for waiters."""

    def __init__(self, jobs: deque[tuple[str, int]]) -> None:
        self.pending = jobs
        self.in_flight: set[tuple[str, int]] = set()
        self.workers = 0
        self._event = trio.Event()

    def take(self, fits: Callable[[tuple[str, int]], bool]) -> tuple[str, int] | None:
        for i, job in enumerate(self.pending):
            if fits(job):
                del self.pending[i]
                self.in_flight.add(job)
                return job
        return None

    def put_back(self, job: tuple[str, int]) -> None:
        self.in_flight.discard(job)
        self.pending.appendleft(job)
        self.changed()

    def done(self, job: tuple[str, int]) -> None:
        self.in_flight.discard(job)
        self.changed()

    def changed(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()

    async def finished(self) -> None:
        """Until the queue is empty with nothing in flight, or no worker is left."""
        while (self.pending or self.in_flight) and self.workers > 0:
            await self.wait()
