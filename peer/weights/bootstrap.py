"""A model this machine has never seen: its folder, from the swarm, one span at a time.

    folder = await bootstrap_model(transport, [holder], "smollm2-135m", models_root())
    ...choose a span...
    await ensure_span(transport, folder, (0, 15), transport.connected(), out=print)

`bootstrap_model` learns the manifest (checked against the model id when one is given),
writes it into ``ROOT/NAME/`` marked ``"partial": true`` and fetches the small files
(config, tokenizer, chat template), so the folder resolves and its `ModelSpec` reads
like any other. `ensure_span` is what the peer calls before loading a span: in a full
folder it does nothing; in a partial one it fetches the span's tensors (plus the
embedding for the first span and the head and norm for the last, so a peer at an end
can also hand those to a requester without files). A partial folder fetched from a hub
(`tessera model fetch ORG/NAME --layers A:B`) names the hub in its manifest's source, and
every such fetch asks the hub too, as one more holder (`hub.py`).
"""

from __future__ import annotations

import os
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Callable, Mapping, Sequence

import trio

from tessera.stages.errors import ModelFormatError
from tessera.stages.weights.registry import MANIFEST, held_tensors, models_root, read_manifest, resolve, save_manifest
from tessera.stages.families.catalog import spec_from_file
from tessera.stages.weights.tensor_table import groups_for_span

from tessera.peer.base.errors import PeerError
from tessera.peer.plan.view import merge_spans
from tessera.peer.net.libp2p import open_libp2p_transport
from tessera.peer.net.transport import Transport
from tessera.peer.weights.errors import WeightsUnavailable
from tessera.peer.weights.fetcher import Fetcher, FetchProgress, learn_manifest
from tessera.peer.weights.hub import HubRepo, HubSource
from tessera.peer.weights.source import WeightSource, serve_weights
from tessera.peer.weights.verify import WeightCheck


async def bootstrap_model(transport: Transport, peers: list[str], model: str, root: Path, *,
                          out: Callable[[str], None] = lambda line: None) -> Path:
    """Create (or complete) ``root/model`` from the swarm: manifest and small files.

    Raises ManifestRejected, WeightsUnavailable, DiskFull.
    """
    manifest = await learn_manifest(transport, peers, model)
    folder = Path(root) / model
    await trio.to_thread.run_sync(lambda: folder.mkdir(parents=True, exist_ok=True))
    if not (folder / MANIFEST).exists() or read_manifest(folder)["model_id"] != manifest["model_id"]:
        save_manifest(folder, {**manifest, "partial": True, "source": {"swarm": list(peers)[:4]}})
    out(f"model {model!r} is {manifest['model_id']}: fetching its files from the swarm into {folder}")
    await Fetcher(transport, folder, manifest, out=out).fetch_files(peers)
    return folder


def is_partial(folder: Path) -> bool:
    """Whether `folder` is one a fetch filled only in part (its manifest says so): a full
    folder, or a bare one without a manifest, has nothing to fetch."""
    return (folder / MANIFEST).exists() and bool(read_manifest(folder).get("partial"))


async def ensure_span(transport: Transport, folder: Path, span: tuple[int, int], peers: list[str], *,
                      out: Callable[[str], None] = lambda line: None,
                      on_fetcher: Callable[[Fetcher], None] = lambda fetcher: None,
                      check: WeightCheck | None = None,
                      addrs: Mapping[str, Sequence[str]] = {}) -> FetchProgress | None:
    """Make sure `folder` holds layers [start, end) (fetching from `peers` what it lacks).

    None for a full folder (or a bare one, without a manifest: only fetching writes partial
    folders, always with one). `on_fetcher` is handed the fetcher before it starts (its
    `last_progress` is the live progress); `check` (the peer's) records what was fetched as
    checked (peer/weights/verify.py); `addrs` dials peers not connected. Raises WeightsUnavailable, DiskFull.
    """
    if not is_partial(folder):
        return None
    manifest = read_manifest(folder)
    spec = spec_from_file(folder / "config.json")
    groups = groups_for_span(span[0], span[1], spec.num_layers, tied=spec.tie_embeddings)
    fetcher = Fetcher(transport, folder, manifest, out=out, check=check, addrs=addrs, hub=hub_of(manifest))
    on_fetcher(fetcher)
    return await fetcher.fetch_groups(peers, groups, label=f"layers [{span[0]}, {span[1]})")


# Reaching a --join address to learn the manifest: one dial (TCP + Noise + yamux, a few
# RTTs), as peer/net/join.py allows for one attempt.
DIAL_TIMEOUT = 15.0


REQUESTER_GROUPS = frozenset({"embed", "head", "norm"})
"""What a requester computes itself: the embedding, and the final norm and head."""


def hub_of(manifest: dict) -> HubSource | None:
    """The hub a partial folder was fetched from, as a holder of its manifest's tensors (None: none)."""
    repo = HubRepo.from_source(manifest.get("source"))
    return HubSource(repo, manifest) if repo is not None else None


async def dial_join(transport: Transport, join: list[str], out: Callable[[str], None]) -> list[str]:
    """The peer ids of the --join addresses reached (one dial each). Raises WeightsUnavailable: none."""
    peers: list[str] = []
    for addr in join:
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                peers.append(await transport.connect(addr))
        except (PeerError, trio.TooSlowError) as bad:
            out(f"could not reach {addr} for the model's weights: {bad or 'timed out'}")
    if not peers:
        raise WeightsUnavailable(f"no --join peer reached to fetch the model from ({', '.join(join)})")
    return peers


def _lacks(folder: Path, groups: frozenset[str]) -> bool:
    """Whether a partial folder misses some tensor of `groups` (headers only)."""
    if not groups or not (folder / MANIFEST).exists():
        return False  # a bare folder (no manifest) is never partial
    manifest = read_manifest(folder)
    if not manifest.get("partial"):
        return False
    wanted = {n for n, e in manifest["tensors"]["entries"].items() if e["group"] in groups}
    return not wanted <= held_tensors(folder)


def throwaway_host(swarm_key: bytes | None) -> AbstractAsyncContextManager[Transport]:
    """A short-lived libp2p host with a fresh identity, to reach --join peers for a model's files."""
    return open_libp2p_transport(os.urandom(32), swarm_key=swarm_key, relay=False)


async def ensure_model(model: str, join: list[str], *, swarm_key: bytes | None,
                       groups: frozenset[str] = frozenset(), out: Callable[[str], None] = lambda line: None,
                       open_transport: Callable[[bytes | None], AbstractAsyncContextManager[Transport]] = throwaway_host,
                       ) -> Path:
    """The local folder of `model`, set up from the --join peers if it is missing (manifest
    and small files), with the tensors of `groups` fetched if it lacks them (a requester
    asks for `REQUESTER_GROUPS`; a peer fetches its span later, in `ensure_span`). The
    peers are reached over a short-lived libp2p host of our own with a throwaway identity
    (`open_transport`: tests pass the in-memory network's).

    Raises ModelFormatError (no folder and no --join), WeightsError.
    """
    try:
        folder: Path | None = resolve(model)
        if not _lacks(folder, groups):
            return folder
    except ModelFormatError:
        if not join:
            raise
        folder = None
        out(f"no model {model!r} in {models_root()}: fetching it from the swarm")
    if folder is not None and not join and (hub := hub_of(read_manifest(folder))) is not None:
        # a folder fetched in part from a hub, and no swarm to ask: the hub alone
        await Fetcher(None, folder, read_manifest(folder), out=out, hub=hub).fetch_groups(
            [], set(groups), label="embedding and head")
        return folder
    async with open_transport(swarm_key) as transport:
        peers = await dial_join(transport, join, out)
        if folder is None:
            folder = await bootstrap_model(transport, peers, model, models_root(), out=out)
        if _lacks(folder, groups):
            manifest = read_manifest(folder)
            fetcher = Fetcher(transport, folder, manifest, out=out, hub=hub_of(manifest))
            await fetcher.fetch_groups(peers, set(groups), label="embedding and head")
    return folder


def resolve_or_fetch(model: str, join: list[str], *, swarm_key: bytes | None,
                     out: Callable[[str], None] = print) -> Path:
    """`ensure_model` for a peer, from synchronous code (no trio run is started when the
    folder is here)."""
    try:
        return resolve(model)
    except ModelFormatError:
        if not join:
            raise
    return trio.run(lambda: ensure_model(model, join, swarm_key=swarm_key, out=out))


class FolderWeights:
    """A volunteer's weights over its model folder (node/parts.py `Weights`): the chunk server
    for the swarm (unless the volunteer turned it off), the fetch of a claimed span the
    folder lacks — at the first claim and at every later move — and what it holds, for the
    record (re-claims after churn prefer peers that hold the layers on disk)."""

    def __init__(self, folder: Path, *, serve: bool, upload_rate: float, check: WeightCheck | None = None) -> None:
        self.folder = Path(folder)
        self.check = check  # the peer's weight check: told what a fetch verified (peer/weights/verify.py)
        self.serve_enabled = serve
        self.upload_rate = upload_rate
        self.source: WeightSource | None = None
        self._fetcher: Fetcher | None = None
        self._held: tuple[tuple[int, int], ...] | None = None  # read from the headers once, then after each fetch

    def serve(self, transport: Transport) -> None:
        self.source = serve_weights(transport, self.folder, enabled=self.serve_enabled, rate=self.upload_rate)

    async def ensure(self, transport: Transport, span: tuple[int, int], out: Callable[[str], None], *,
                     holders: Callable[[], Mapping[str, tuple[str, ...]]] = dict) -> None:
        if not is_partial(self.folder):
            return  # a full folder (or a bare one) has nothing to fetch: the view is not read
        # A peer that just joined is connected to the one --join address that answered and to
        # whoever membership dialled since; the view names every holder, and the fetch asks them
        # all (dialling those not connected at their addresses), so it draws on every one.
        found = holders()
        peers = sorted(set(transport.connected()) | set(found))
        try:
            fetched = await ensure_span(transport, self.folder, span, peers, out=out, addrs=found,
                                        on_fetcher=self._watch, check=self.check)
        finally:
            self._fetcher = None
        if fetched is not None:  # the folder holds more now: say so, and serve it
            self._held = None
            if self.source is not None:
                self.source.refresh()

    def _watch(self, fetcher: Fetcher) -> None:
        self._fetcher = fetcher

    def held_layers(self) -> tuple[tuple[int, int], ...]:
        if self._held is None:
            self._held = held_layers(self.folder)
        return self._held

    def fetching(self) -> dict | None:
        fetcher = self._fetcher
        if fetcher is None or fetcher.last_progress is None:
            return None
        return fetcher.last_progress.reading(fetcher.clock())


def held_layers(folder: Path) -> tuple[tuple[int, int], ...]:
    """The layer ranges whose every tensor is in the folder's weight files: all layers for a
    whole folder (or a bare one, without a manifest), the fetched spans for a partial one."""
    spec = spec_from_file(folder / "config.json")
    if not is_partial(folder):
        return ((0, spec.num_layers),) if spec.num_layers else ()
    entries = read_manifest(folder)["tensors"]["entries"]
    present = held_tensors(folder)
    complete = [True] * spec.num_layers
    for name, entry in entries.items():
        group = entry["group"]
        layer = int(group.removeprefix("layer.")) if group.startswith("layer.") else -1
        if 0 <= layer < spec.num_layers and name not in present:
            complete[layer] = False
    return merge_spans((i, i + 1) for i, whole in enumerate(complete) if whole)
