"""The peer's thread as the TUI sees it (tui/bridge.py): what the last snapshot says once the
peer's loop has ended. A stand-in node, so that the publisher can be made due at every
checkpoint (tests/tui/test_tui.py drives a real peer, where the race showed only now and then)."""

from __future__ import annotations

import trio

from tessera.tui import bridge
from tessera.tui.bridge import PeerHandle
from tessera.tui.render import state_word


class LeavingNode:
    """Serves for a few scheduler turns, then leaves: its state is "leaving" when `run` returns."""

    def __init__(self) -> None:
        self.state = "serving"
        self.out = print
        self.ready = trio.Event()  # set when it serves its span (the handle's `ready` follows it)

    async def run(self) -> None:
        self.ready.set()
        for _ in range(5):
            await trio.lowlevel.checkpoint()
        self.state = "leaving"


def live_snapshot(node: LeavingNode) -> dict:
    return {"phase": "serving", "state": node.state, "paused": False, "span": [0, 10]}


def test_a_peer_that_left_says_left_even_when_a_snapshot_was_due_as_it_stopped(monkeypatch):
    monkeypatch.setattr(bridge, "read_snapshot", live_snapshot)
    handle = PeerHandle(LeavingNode(), snapshot_interval=0)  # the publisher is due at every checkpoint
    handle.start()
    assert handle.finished.wait(30), "the peer's thread did not end"
    assert handle.error is None
    last = handle.latest()
    assert last["phase"] == "stopped" and state_word(last) == "left", last
