"""A simulated volunteer's model folder: the layers it has on disk, and what fetching the
rest costs (the `Weights` part of peer/node/parts.py).

A plan without a disk (`PeerPlan.disk` None) holds the whole model, as every volunteer
did before weights travelled peer to peer: any span loads at once. A plan with one holds
those layer ranges only (``()``: an empty folder); a claim beyond them first downloads
the missing layers at the peer's link speed (`PeerPlan.bandwidth`), and keeps them.
What it holds goes into its record, so placement can prefer holders after churn.
"""

from __future__ import annotations

from typing import Callable, Mapping

import trio

from tessera.peer.net.transport import Transport
from tessera.peer.plan.view import layers_held, merge_spans


class SimDisk:
    """Layer ranges on a simulated disk, and downloads at one link speed (see module docstring)."""

    def __init__(self, num_layers: int, layer_bytes: int, bandwidth: float,
                 held: tuple[tuple[int, int], ...] | None = None) -> None:
        self.layer_bytes = layer_bytes
        self.bandwidth = bandwidth
        self.held = merge_spans(held) if held is not None else ((0, num_layers),)

    def serve(self, transport: Transport) -> None:
        pass  # uploads cost the holder nothing here: the fetcher's link is the one modelled

    async def ensure(self, transport: Transport, span: tuple[int, int], out: Callable[[str], None], *,
                     holders: Callable[[], Mapping[str, tuple[str, ...]]] = dict) -> None:
        missing = (span[1] - span[0]) - layers_held(self.held, *span)
        if missing > 0:
            await trio.sleep(missing * self.layer_bytes / self.bandwidth)
            self.held = merge_spans([*self.held, span])

    def held_layers(self) -> tuple[tuple[int, int], ...]:
        return self.held

    def fetching(self) -> dict | None:
        return None
