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


def test_another_models_swarm_is_named_with_what_to_pass():
    """Issue 46, item 4: which model the peers serve, and the --model (or --quant) to pass."""
    from tessera.peer.net.other_model import other_model_reason

    theirs, ours = "d67de6887289b57b" + "0" * 16, "52174c24beeba6f6" + "0" * 16
    named = other_model_reason([theirs, theirs], ours, "smollm2-135m", {theirs: "tiny"})
    assert named.startswith("the peers there serve another model: model id d67de6887289b57b… (2 peers); "
                            "pass --model tiny. This one is --model smollm2-135m (model id 52174c24beeba6f6…).")
    assert "chat template included" in named
    unknown = other_model_reason([theirs], ours, "smollm2-135m", {})
    assert "(1 peer); it is not registered here (`tessera model list`)" in unknown
    assert other_model_reason([ours + "+int4g32"], ours, "smol", {}) == (
        "the peers there serve smol quantized as int4g32 (1 peer), not as asked: pass --quant int4 --quant-group 32 "
        "(or --accept-mixed)")
    assert other_model_reason([ours], ours + "+int8", "smol", {}, requester=False) == (
        "the peers there serve smol unquantized (1 peer), not as asked: pass --quant none")


async def test_a_join_that_only_hears_another_model_stops_at_once_but_keeps_trying_the_silent(autojump_clock):
    """One address answers with another model (final), another does not answer yet: keep trying."""
    silent = "/ip4/127.0.0.1/tcp/2/p2p/12D3KooWK99VoVxNE7XzyBwXEzW7xhK7Gpv85r9F3V3fyKSUKPH5"
    tries: list[str] = []

    async def try_one(addr: str) -> str | None:
        tries.append(addr)
        if addr == ADDR:
            return OTHER_MODEL
        raise PeerError("unreachable")

    lines: list[str] = []
    with pytest.raises(JoinFailed):
        await join_swarm([ADDR, silent], try_one, timeout=20.0, allow_alone=False, swarm_key_given=False,
                         out=lines.append)
    assert tries.count(silent) >= 3  # retried until the join time ran out
