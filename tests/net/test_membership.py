"""Membership alone (peer/net/membership.py), over a scripted transport and view: the bounds on
inbound and outbound links, the refresh of the sample, avoidance of refusers, probes of lost
neighbours and goodbyes. Every draw is deterministic (the scripted view draws by name)."""

from __future__ import annotations

import random

import trio

from tessera.peer.base.errors import PeerUnreachable
from tessera.peer.net.membership import MAX_INBOUND, OUTBOUND, REFRESH_PERIODS, Membership
from tessera.protocol.records import LINK_ACCEPT, LINK_ASK, LINK_BYE, LINK_NONE, LINK_REFUSE

class ScriptedNet:
    """Both the transport and the view a Membership reads: `peers` are in the view, dials to
    `reachable` ones succeed at once, and `sample` draws the first fitting peer by name."""

    def __init__(self, peers=()) -> None:
        self.peer_id = "me"
        self.seeds: dict = {}
        self.addrs_of = {p: (f"/direct/{p}",) for p in peers}
        self.reachable = set(peers)
        self.up: set[str] = set()
        self.closed: list[str] = []

    def add(self, peer: str) -> None:
        self.addrs_of[peer] = (f"/direct/{peer}",)
        self.reachable.add(peer)

    def connected(self):
        return list(self.up)

    def stream_count(self, peer: str) -> int:
        return 0

    async def connect(self, addr: str) -> str:
        peer = addr.rsplit("/", 1)[-1]
        if peer not in self.reachable:
            raise PeerUnreachable(peer)
        self.up.add(peer)
        return peer

    async def disconnect(self, peer: str) -> None:
        self.up.discard(peer)
        self.closed.append(peer)

    def sample(self, rng, fits):
        return next((p for p in sorted(self.addrs_of) if fits(p)), None)

    def addrs(self, peer: str):
        return self.addrs_of.get(peer, ())

    def grave_to_probe(self, now: float):
        return None


def scripted(net: ScriptedNet, delay: float = 0.0):
    """A Membership over `net` whose link asks answer `answers[peer]` (accept by default)."""
    asks: list[tuple[str, int]] = []
    answers: dict[str, int] = {}
    gone: list[str] = []

    async def link(peer: str, ask: int, timeout: float) -> int:
        asks.append((peer, ask))
        await trio.sleep(delay)
        return LINK_NONE if ask == LINK_BYE else answers.get(peer, LINK_ACCEPT)

    return Membership(net, net, link=link, rng=random.Random(0), report_gone=gone.append), asks, answers, gone


async def tick(membership: Membership) -> None:
    async with trio.open_nursery() as nursery:
        membership.maintain(nursery)


async def test_a_peer_accepts_max_inbound_neighbours_and_refuses_the_next(autojump_clock):
    # The bound on inbound links: exactly MAX_INBOUND asks are accepted; a neighbour asking again
    # is still one neighbour.
    membership, *_ = scripted(ScriptedNet())
    assert {membership.answer(f"in{i}", LINK_ASK) for i in range(MAX_INBOUND)} == {LINK_ACCEPT}
    assert membership.answer("one-more", LINK_ASK) == LINK_REFUSE
    assert membership.answer("in0", LINK_ASK) == LINK_ACCEPT
    assert len(membership.inbound) == MAX_INBOUND


async def test_asks_in_flight_count_towards_the_outbound_bound(autojump_clock):
    # A tick that comes while the last tick's asks are unanswered asks no more peers: else a slow
    # swarm's asks would pile up beyond OUTBOUND.
    net = ScriptedNet([f"p{i:02}" for i in range(3 * OUTBOUND)])
    membership, asks, _, _ = scripted(net, delay=10.0)
    async with trio.open_nursery() as nursery:
        membership.maintain(nursery)
        await trio.sleep(1.0)
        membership.maintain(nursery)
    assert len(asks) == OUTBOUND and len(membership.outbound) == OUTBOUND


async def test_every_refresh_period_the_oldest_outbound_neighbour_is_replaced_and_its_link_closed(autojump_clock):
    # The sample keeps changing (REFRESH_PERIODS): the neighbour linked first is told goodbye,
    # its connection is closed at the next tick, and another peer is drawn in its place.
    net = ScriptedNet()
    membership, asks, _, _ = scripted(net)
    for i in range(OUTBOUND):  # one new peer a tick: p00 is linked first
        net.add(f"p{i:02}")
        await tick(membership)
        await trio.sleep(1.0)
    assert len(membership.outbound) == OUTBOUND
    while membership.ticks < REFRESH_PERIODS - 1:
        await tick(membership)
    assert LINK_BYE not in [ask for _, ask in asks]
    await tick(membership)
    assert [peer for peer, ask in asks if ask == LINK_BYE] == ["p00"] and "p00" not in membership.outbound
    net.add("a-spare")  # drawn first by name
    await tick(membership)
    assert "p00" in net.closed and "a-spare" in membership.outbound


async def test_a_peer_that_refused_is_asked_again_at_once_when_its_addresses_change(autojump_clock):
    # A refusal keeps a peer undrawn for REFUSED_BACKOFF at the addresses it then advertised; a
    # peer behind NAT that now lists its relayed address is asked at once.
    net = ScriptedNet(["p"])
    membership, asks, answers, _ = scripted(net)
    answers["p"] = LINK_REFUSE
    await tick(membership)
    answers["p"] = LINK_ACCEPT
    await tick(membership)
    assert asks == [("p", LINK_ASK)]  # avoided
    net.addrs_of["p"] = ("/relayed/p",)
    await tick(membership)
    assert asks == [("p", LINK_ASK)] * 2 and "p" in membership.outbound


async def test_a_lost_neighbour_whose_probe_is_refused_is_not_reported_gone(autojump_clock):
    # A refusal is an answer: the peer is alive (only full), so no departure is spread for it.
    net = ScriptedNet(["p"])
    membership, asks, answers, gone = scripted(net)
    await tick(membership)
    assert "p" in membership.outbound
    net.up.discard("p")  # the connection dropped without a goodbye
    answers["p"] = LINK_REFUSE
    await tick(membership)
    assert asks == [("p", LINK_ASK)] * 2 and gone == [] and "p" not in membership.outbound


async def test_a_goodbye_from_a_peer_we_also_chose_leaves_our_link_watched(autojump_clock):
    # Both chose each other; its refresh drops us (LINK_BYE), but the link stays ours: if its
    # connection is then lost, it is probed and, silent, reported gone.
    net = ScriptedNet(["p"])
    membership, _, _, gone = scripted(net)
    await tick(membership)
    assert membership.answer("p", LINK_ASK) == LINK_ACCEPT
    assert membership.answer("p", LINK_BYE) == LINK_NONE
    net.up.discard("p")
    net.reachable.discard("p")
    await tick(membership)
    assert gone == ["p"]
