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
can also hand those to a requester without files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import trio

from tessera.stages.registry import MANIFEST, read_manifest, save_manifest
from tessera.stages.spec import ModelSpec
from tessera.stages.tensor_table import groups_for_span

from tessera.peer.net.transport import Transport
from tessera.peer.weights.fetcher import Fetcher, FetchProgress, learn_manifest


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
    return bool(read_manifest(folder).get("partial"))


async def ensure_span(transport: Transport, folder: Path, span: tuple[int, int], peers: list[str], *,
                      out: Callable[[str], None] = lambda line: None,
                      on_fetched: Callable[[], None] = lambda: None) -> FetchProgress | None:
    """Make sure `folder` holds layers [start, end) (fetching from `peers` what it lacks).

    None for a full folder. Raises WeightsUnavailable, DiskFull.
    """
    manifest = read_manifest(folder)
    if not manifest.get("partial"):
        return None
    spec = ModelSpec.from_file(folder / "config.json")
    groups = groups_for_span(span[0], span[1], spec.num_layers, tied=spec.tie_embeddings)
    fetcher = Fetcher(transport, folder, manifest, out=out)
    progress = await fetcher.fetch_groups(peers, groups, label=f"layers [{span[0]}, {span[1]})")
    on_fetched()
    return progress
