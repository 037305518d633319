"""A span's weights on demand, for a requester that must recompute it to settle a dispute.

    spans = OnDemandSpans(folder)                       # the requester's model folder
    stage = await spans.load(transport, 10, 20, holders, budget=1 << 30)

A requester holds the embedding and head of its model, not its layers (a fetched folder is
partial: peer/weights/bootstrap.py REQUESTER_GROUPS). When two holders of a span disagree and
no third peer can break the tie, it recomputes the span itself (peer/request/dispute.py), and
for that it needs the span's tensors — only those layers' — checked exactly as a peer's are:

- the manifest is the requester's own, checked to hash to the model id (the id every peer it
  routes through advertises); a bare folder without one is its own reference: its id was
  computed from its bytes, so there is nothing to check them against, nor to fake;
- before anything is read or fetched, the span's size in float32 (from the manifest's shapes)
  must fit `budget`, else `OverBudget` says both numbers;
- layers the folder holds are loaded from it, each tensor hashed against the manifest as it
  loads (`SpanCheck` with no cache: the requester's folder is not one it served from);
- layers it lacks are fetched from `holders` (the peers whose spans overlap, the two disputing
  ones among them) by the weights protocol into a scratch folder (peer/weights/fetcher.py:
  every chunk checked against the manifest as it arrives; a holder that sends a wrong one is
  dropped from the fetch, so a liar cannot feed the recomputation wrong weights), loaded with
  the same check, and the scratch folder is removed once the span is in memory. Nothing is
  added to the requester's own folder: a dispute is rare (the liar is banned for a day), and
  a requester's disk is not a peer's.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Callable, Mapping, Sequence

from tessera.stages.assembly.stage import load_stage
from tessera.stages.engine.stage import Stage
from tessera.stages.weights.registry import MANIFEST, checked_manifest, held_tensors, save_manifest
from tessera.stages.weights.registry import model_id as registry_id
from tessera.stages.weights.tensor_table import group_of

from tessera.peer.base.threads import in_worker
from tessera.peer.net.transport import Transport
from tessera.peer.weights.errors import OverBudget
from tessera.peer.weights.fetcher import Fetcher
from tessera.peer.weights.verify import SpanCheck, VerifiedCache

FLOAT32_BYTES = 4


def span_tensors(manifest: dict, start: int, end: int) -> dict[str, dict]:
    """The manifest's entries of layers [start, end) (the embedding, head and norm are not a span's)."""
    groups = {f"layer.{i}" for i in range(start, end)}
    return {name: entry for name, entry in manifest["tensors"]["entries"].items()
            if entry.get("group", group_of(name)) in groups}


def float32_bytes(entries: Mapping[str, dict]) -> int:
    """What those tensors take loaded in float32 (an upper bound for formats kept as stored)."""
    return sum(math.prod(int(d) for d in entry["shape"]) * FLOAT32_BYTES for entry in entries.values())


class OnDemandSpans:
    """Spans of the model in `folder`, loaded or fetched as asked (module docstring); the
    requester's `SpanWeights` (peer/request/dispute.py)."""

    def __init__(self, folder: Path, *, label: str = "to settle a dispute",
                 out: Callable[[str], None] = lambda line: None) -> None:
        """`out` hears the fetch's progress lines (the command line prints them). Nothing is read
        until a dispute asks: most answers have none."""
        self.folder = Path(folder)
        self.label = label
        self.out = out
        self.manifest: dict | None = None  # read and checked at the first dispute (None after: a bare folder)
        self._model_id: str | None = None

    def _read(self) -> str:
        """The folder's model id, its manifest checked to hash to it (raises ModelFormatError); a
        bare folder's id is computed from its bytes. Blocking: called in a worker, once."""
        if self._model_id is None:
            if (self.folder / MANIFEST).exists():
                self.manifest = checked_manifest(self.folder)
                self._model_id = str(self.manifest["model_id"])
            else:
                self._model_id = registry_id(self.folder)
        return self._model_id

    async def model_id(self) -> str:
        """The (unquantized) id its weights are: what the disputing peers must advertise for a
        recomputation to judge them. Raises ModelFormatError (a manifest that does not hash to its id)."""
        return await in_worker(self._read)

    async def load(self, transport: Transport, start: int, end: int, holders: Mapping[str, Sequence[str]], *,
                   budget: int) -> Stage:
        """Layers [start, end) in float32, checked (module docstring). Raises OverBudget,
        WeightsUnavailable (no holder serves some chunk), DiskFull, WeightsMismatch, ModelFormatError."""
        await self.model_id()
        if self.manifest is None:  # a bare folder holds every layer, and is its own reference
            return await in_worker(lambda: load_stage(self.folder, start=start, end=end))
        entries = span_tensors(self.manifest, start, end)
        need = float32_bytes(entries)
        if need > budget:
            mib = 1 << 20
            raise OverBudget(f"layers [{start}, {end}) take {need / mib:.0f} MiB in float32, over the "
                             f"{max(budget, 0) / mib:.0f} MiB this requester may spend {self.label}")
        held = await in_worker(lambda: held_tensors(self.folder))
        if set(entries) <= held:
            return await self._load_checked(self.folder, start, end)
        with tempfile.TemporaryDirectory(prefix="tessera-span-") as scratch:
            folder = Path(scratch)
            await in_worker(lambda: self._prepare(folder))
            fetcher = Fetcher(transport, folder, self.manifest, addrs=holders, out=self.out)
            groups = {entry["group"] for entry in entries.values()}
            await fetcher.fetch_groups(list(holders), groups, label=f"layers [{start}, {end}) {self.label}")
            return await self._load_checked(folder, start, end)

    def _prepare(self, scratch: Path) -> None:
        """A scratch model folder: the manifest (partial: weights come as fetched) and links to the
        requester's own small files (config, tokenizer, index), which the loader reads."""
        save_manifest(scratch, {**self.manifest, "partial": True})
        for name in self.manifest["files"]:
            if not name.endswith(".safetensors") and (self.folder / name).exists():
                os.symlink((self.folder / name).resolve(), scratch / name)

    async def _load_checked(self, folder: Path, start: int, end: int) -> Stage:
        check = SpanCheck(folder, self.manifest, VerifiedCache(None))
        return await in_worker(lambda: load_stage(folder, start=start, end=end, check=check))


__all__ = ["OnDemandSpans", "float32_bytes", "span_tensors"]
