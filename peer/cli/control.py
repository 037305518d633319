"""`tessera peer --control-stdin`: operator commands as lines on standard input.

The TUI drives a running peer through `tui/bridge.py`; a peer without the TUI (a
service, a script, a test) gets the same commands here, one per line:

    memory GB     offer GB of memory (as the TUI's `m` key: a new span if it changes)
    drain         take no new sessions; running ones finish
    pause         hold all compute, take no new sessions
    resume        serve again

Each command runs to its end before the next is read, and prints one line
("ok: ..." or "error: ..."). End of input leaves the peer running. Lines are short
and typed by the operator's own process: a line longer than MAX_LINE is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import trio

from tessera.peer.base.errors import PeerError

if TYPE_CHECKING:
    from tessera.peer.node.peer_node import PeerNode

MAX_LINE = 256  # a command and a number; anything longer is not a command


async def run_command(node: "PeerNode", line: str) -> str:
    """Carry out one command line; the reply line."""
    words = line.split()
    if not words:
        return ""
    verb, args = words[0].lower(), words[1:]
    if verb == "memory" and len(args) == 1:
        try:
            gb = float(args[0])
        except ValueError:
            return f"error: memory wants GB as a number, got {args[0]!r}"
        if not 0 < gb < 1 << 20:
            return f"error: memory {gb!r} GB is out of range"
        await node.set_memory_offered(gb)
        return f"ok: offering {gb:g} GB; serving [{node.span[0]}, {node.span[1]})" if node.span else "ok"
    if verb in ("drain", "pause", "resume") and not args:
        await getattr(node, verb)()
        return f"ok: {verb}"
    return f"error: unknown command {line[:64]!r} (memory GB, drain, pause, resume)"


async def serve_stdin(node: "PeerNode", out: Callable[[str], None]) -> None:
    """Read commands from standard input until it ends (see the module docstring)."""
    await node.ready.wait()
    stdin = trio.lowlevel.FdStream(0)
    buffer = b""
    while True:
        chunk = await stdin.receive_some(4096)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            raw, buffer = buffer.split(b"\n", 1)
            line = raw.decode("utf-8", "replace").strip()
            try:
                reply = await run_command(node, line) if len(raw) <= MAX_LINE else "error: line too long"
            except PeerError as error:
                reply = f"error: {error}"
            if reply:
                out(reply)
        if len(buffer) > MAX_LINE:
            out("error: line too long")
            buffer = b""
