"""The join loop's diagnosis (peer/net/join.py), under trio's MockClock with a scripted `try_one`."""

from __future__ import annotations

import pytest
import trio

from tessera.peer.base.errors import PeerError
from tessera.peer.net.join import JoinFailed, join_swarm

ADDR = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWK99VoVxNE7XzyBwXEzW7xhK7Gpv85r9F3V3fyKSUKPH5"
OTHER_MODEL = "different model: it serves model id abc, ours is def"


@pytest.mark.parametrize("later", ["refused", "silent"])
async def test_a_peer_of_another_model_is_named_in_the_exit_line(later, autojump_clock):
    """A peer of another model answers once, then would drop us (or stop answering before the join
    time runs out): the line, and the exit, name the different model, not the swarm key.
    (Before: the last round's failure was read as a handshake refused, "wrong or missing swarm key?".)
    Its answer is final (issue 46): the peer stops trying at once instead of asking for a minute."""
    calls = 0

    async def try_one(addr: str) -> str | None:
        nonlocal calls
        calls += 1
        if calls == 1:
            return OTHER_MODEL
        if later == "refused":
            raise PeerError("connection reset")
        await trio.sleep_forever()

    lines: list[str] = []
    with pytest.raises(JoinFailed) as failed:
        await join_swarm([ADDR], try_one, timeout=20.0, allow_alone=False, swarm_key_given=False, out=lines.append)
    assert calls == 1 and len(lines) == 1 and lines[0].endswith("; giving up"), lines
    assert all("different model" in line for line in lines), lines
    assert "different model" in str(failed.value) and "swarm key" not in str(failed.value), failed.value
