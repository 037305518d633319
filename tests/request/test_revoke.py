"""Choosing who computes, over real peers: a peer revoked mid-answer, and an allow-list that covers no route.

Four real peer processes, the middle span held twice, so a revoked middle peer has a
replacement. One greedy answer of 64 tokens; after 32, while the next step is on its way
through the chain (as when `POST /admin/revoke` comes in from another task), the requester
revokes the middle peer of its route: the answer must be token for token what
`generate --local` gives, and
the revoked peer's own trace (its sqlite store) must show that it dropped the session and
that no frame of that session reached it afterwards.
"""

from __future__ import annotations

import re
import time

import pytest
import trio
from libp2p.peer.id import ID

from tessera.peer.cli.main import main
from tessera.peer.request.client import Swarm
from tessera.peer.base.errors import UnknownPeer
from tessera.peer.request.policy import BadPeerId
from tessera.protocol.keys import Identity
from tessera.stages.decoding.generate import prompt_ids
from tessera.store.db import PeerStore
from tessera.store.events import Forward, Stamped

from ..swarm_helpers import local_swarm, reference_answer

pytestmark = pytest.mark.slow

PROMPT = "Write a short story about a robot who learns to paint."
TOKENS = 64
SPANS = [(0, 10), (10, 20), (10, 20), (20, 30)]  # two peers hold the middle span
# How long the revoked peer's trace may take to show what it recorded: its writer commits
# every fraction of a second and it advertises every 3 s (node_config.ADVERTISE_INTERVAL).
TRACE_WAIT = 30.0
LIBP2P_LINE = re.compile(r"^\d\d:\d\d:\d\d \w+ libp2p[.:]")


@pytest.fixture(scope="module")
def peers(smol_dir):
    with local_swarm(SPANS) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def expected(local_engine, smol_tokenizer):
    return reference_answer(local_engine, smol_tokenizer, PROMPT, TOKENS)


def peer_id_of(peers, i: int) -> str:
    return peers.addrs[i].split("/p2p/")[1]


def trace_after(peers, i: int, wall: float) -> list[Stamped]:
    """Peer i's whole trace, once it holds an event stamped after `wall` (so that
    everything it recorded before then is on disk: the writer commits in order)."""
    deadline = time.monotonic() + TRACE_WAIT
    while True:
        with PeerStore(peers.base_dir / f"peer{i}" / "tessera.db", readonly=True) as store:
            events = store.events()
        if (events and events[-1].wall > wall) or time.monotonic() > deadline:
            return events
        time.sleep(0.2)


async def test_revoking_the_middle_peer_mid_answer(peers, expected):
    async with Swarm.join(peers.addrs[:1]) as swarm:
        await swarm.wait_for_route(60)
        nobody = ID(Identity.from_seed(b"n" * 32).peer_id).to_base58()
        with pytest.raises(UnknownPeer, match=nobody):
            await swarm.revoke(nobody)
        with pytest.raises(BadPeerId):
            await swarm.revoke("12D3KooWnot-a-peer")
        assert not swarm.policy.restricts  # a bad revocation changes nothing

        ids = prompt_ids(swarm.tokenizer, PROMPT, raw=False)
        info: dict = {}
        tokens: list[int] = []
        revoked = session_id = None
        removed: list[int] = []

        async def revoke_in_flight(session) -> None:
            while not session.current.pending:  # the generator is embedding the token; the step goes next
                await trio.sleep(0)
            removed.append(await swarm.revoke(revoked))

        async with trio.open_nursery() as nursery:
            async for token in swarm.generate_ids(ids, max_new_tokens=TOKENS, info=info):
                tokens.append(token)
                if len(tokens) == TOKENS // 2:
                    (session,) = swarm.active
                    revoked = session.current.hops[1].peer
                    session_id = session.current.session_id.hex()
                    nursery.start_soon(revoke_in_flight, session)
        finished = time.time()
        assert removed == [1]
        assert swarm.policy.deny == {revoked}

    assert tokens == expected
    assert info["failovers"] == 1
    first, last = ([h["peer"] for h in route] for route in (info["routes"][0], info["route"]))
    assert first[1] == revoked and revoked not in last
    assert [(h["start"], h["end"]) for h in info["route"]] == [(0, 10), (10, 20), (20, 30)]

    i = next(k for k in range(len(SPANS)) if peer_id_of(peers, k) == revoked)
    events = trace_after(peers, i, finished)
    mine = [e for e in events if e.event.session == session_id]
    kinds = [e.kind for e in mine]
    assert kinds.count("session_revoked") == 1, kinds  # it confirms: KV cache and keys dropped
    at = kinds.index("session_revoked")
    assert kinds.count("forward") >= TOKENS // 2  # it did compute the first half
    assert "session_close" in kinds[:at]
    assert mine[at:] == mine[-1:], f"frames of the session reached the revoked peer after the revoke: {kinds[at:]}"
    # the replacement computed the rest of the answer
    j = next(k for k in (1, 2) if k != i)
    later = [e for e in trace_after(peers, j, finished) if e.event.session == session_id and isinstance(e.event, Forward)]
    assert len(later) >= TOKENS // 2 - 1


def test_an_allow_list_that_covers_no_route_is_one_clear_error(peers, capsys):
    first = peer_id_of(peers, 0)  # serves [0, 10) only
    status = main(["generate", "Hi", "--join", peers.addrs[0], "--allow", first, "--route-wait", "2",
                   "--max-tokens", "2"])
    # libp2p's own failures (a dial to an address that went away) are folded to one line each
    # (peer/cli/log_setup.py) and may come between ours: the lines here are ours
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not LIBP2P_LINE.match(line)]
    assert status == 1
    reason = "no allowed peer covers layers [10, 30) (peers there are excluded by the requester's policy)"
    assert err[-1] == f"error: no route through the swarm after 2 s: {reason}"
    # before it, the wait's progress lines (once a second) say the same
    assert all(line.startswith("waiting for a route (") and line.endswith(reason) for line in err[:-1]), err
