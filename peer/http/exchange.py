"""HTTP over ASGI, as the gateway needs it: read a bounded body, answer JSON or Server-Sent Events,
and notice a client that goes away.

ASGI tells an app that its client left only through `receive()` returning
`http.disconnect`; writing to a closed connection raises nothing (hypercorn
drops the bytes). So a long answer runs beside `watch_disconnect`, which
cancels it when that message comes.
"""

from __future__ import annotations

import json
from typing import Awaitable, Callable, Sequence

import trio

from tessera.peer.http.defaults import BODY_TIMEOUT
from tessera.peer.http.requests import ApiError

MAX_BODY_BYTES = 4 << 20  # a request body past this is refused (413) before it is parsed

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class ClientGone(Exception):
    """The client disconnected before its request was read."""


class Exchange:
    """One HTTP request/response over ASGI."""

    def __init__(self, scope: dict, receive: Receive, send: Send, *, body_timeout: float = BODY_TIMEOUT) -> None:
        self.scope, self.receive, self.send = scope, receive, send
        self.body_timeout = body_timeout
        self.started = False  # response headers sent
        self.finished = False  # the last body part is being or has been sent
        self.disconnected = False
        self.extra_headers: list[tuple[bytes, bytes]] = []  # on every response (CORS)

    def header(self, name: bytes) -> str | None:
        for key, value in self.scope.get("headers", []):
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    async def body(self) -> bytes:
        """The request body, whole. Raises ApiError: 413 past MAX_BODY_BYTES (announced or
        sent), 408 when it does not arrive within `body_timeout` seconds, 400 for a bad
        content-length; ClientGone when the client leaves."""
        announced = self.header(b"content-length")
        if announced is not None:
            if not announced.strip().isdigit():
                raise ApiError(400, f"the content-length header must be a number of bytes, got {announced!r}")
            if int(announced) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body ({int(announced)} bytes announced) exceeds {MAX_BODY_BYTES} bytes")
        with trio.move_on_after(self.body_timeout):
            return await self._read_body()
        raise ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s", code="request_timeout")

    async def _read_body(self) -> bytes:
        chunks, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def start(self, status: int, headers: list) -> None:
        self.started = True
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [*headers, *self.extra_headers]})

    async def write(self, data: bytes, *, more: bool = True) -> None:
        # Set before sending: the server reports the stream closed (http.disconnect) while
        # the last part is being sent, and that is no client going away.
        self.finished = self.finished or not more
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def json(self, status: int, obj: dict, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        await self.start(status, [*JSON_HEADERS, *headers])
        await self.write(json.dumps(obj).encode(), more=False)

    async def event(self, obj: dict | str, *, name: str | None = None) -> None:
        """One Server-Sent Event: `data: <json>` (or a literal such as [DONE]), after `event: <name>`
        when named (Anthropic's and the Responses API's streams name every event)."""
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        head = f"event: {name}\n" if name else ""
        await self.write(f"{head}data: {data}\n\n".encode())

    async def watch_disconnect(self, scope: trio.CancelScope) -> None:
        """Cancel `scope` when the client goes away (the body has been read already)."""
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        if not self.finished:
            scope.cancel()
