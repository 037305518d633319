"""Serving the web view over HTTP with hypercorn's trio worker, on the loop of what it shows.

`tessera serve` puts the web view in front of its gateway (peer/cli/serve.py);
`tessera peer --web PORT` runs `serve_node_web` as one of the peer's services
(`NodeParts.services`), so the pages read the peer's objects on the peer's own loop.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from tessera.peer.http.guard import HostRules, OriginGuard
from tessera.peer.http.web.app import WebApp

if TYPE_CHECKING:
    from tessera.peer.node.peer_node import PeerNode


def hypercorn_config(host: str, port: int) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.loglevel = "WARNING"  # hypercorn's errors still reach stderr; the URL line is ours
    return config


async def serve_node_web(node: "PeerNode", *, host: str, port: int, api_key: str | None,
                         rules: HostRules | None = None) -> None:
    """The peer's web view on host:port until cancelled; says its URL through the node's `out`.
    Behind `OriginGuard` (peer/http/guard.py): only this machine's own pages, and the origins
    `rules` allows (--web-allow-origin), may use it."""
    app = WebApp.for_node(node, api_key=api_key)
    guarded = OriginGuard(app, rules or HostRules())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.run)
        binds = await nursery.start(partial(hypercorn_serve, guarded, hypercorn_config(host, port), mode="asgi"))
        for url in binds:
            node.out(f"web view: {url}/{' (API key required)' if api_key else ''}")
