"""The bounds on streams not admitted yet (peer/net/intake.py), as a policy: who gets a place.

Per identity, per address and in all, and a budget of bytes charged as frames announce their
length; a full bound makes the heaviest identity give way to a lighter newcomer, and turns
away only a newcomer whose own identity is the heaviest. Checked rule by rule, and on random
arrival orders (hypothesis): whatever the order, no bound is ever exceeded, and a newcomer
of an identity holding nothing always gets in while some other identity holds two or more.
The same intake in front of a real stage server is tests/serve/test_intake.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.peer.net.intake import Intake, NoRoom, address_of
from tessera.protocol.framing import MAX_PREFIX_BYTES, READ_CHUNK


@dataclass
class S:
    """A stream as the intake reads it."""

    remote: str
    remote_addr: str | None = None


def at(ip: str) -> str:
    return f"/ip4/{ip}/tcp/4001"


def test_one_identity_gets_at_most_its_share():
    intake = Intake(per_identity=3, total=10)
    held = [intake.enter(S("a")) for _ in range(3)]
    assert all(held) and intake.enter(S("a")) is None and intake.refused == 1
    assert intake.enter(S("b")) is not None  # others are not held up
    held[0].release()
    assert intake.enter(S("a")) is not None  # a released place is free again


def test_a_full_intake_makes_the_heaviest_identity_give_way_to_a_lighter_newcomer():
    intake = Intake(per_identity=8, total=6)
    attacker = [intake.enter(S("x")) for _ in range(5)]
    other = intake.enter(S("y"))
    honest = intake.enter(S("h"))  # full: x holds 5, h nothing
    assert honest is not None and attacker[0].evicted and attacker[0].scope.cancel_called
    assert not any(t.evicted for t in attacker[1:]) and not other.evicted  # the oldest of the heaviest only
    assert intake.snapshot()["streams"] == 6 and intake.evicted == 1
    # a newcomer of the heaviest identity itself is turned away, not let in by evicting its own
    assert intake.enter(S("x")) is None
    # equals do not evict each other: each of three identities holding two
    even = Intake(total=6)
    for remote in "abc":
        even.enter(S(remote))
        even.enter(S(remote))
    assert even.enter(S("a")) is None and even.enter(S("d")) is not None  # d holds none: it gets in


def test_the_per_address_bound_shares_an_address_among_its_identities():
    intake = Intake(per_identity=8, per_address=4, total=100)
    for i in range(4):
        assert intake.enter(S("x", at("203.0.113.5"))) is not None
    newcomer = intake.enter(S("y", at("203.0.113.5")))  # same address, lighter identity
    assert newcomer is not None and intake.per_ip["203.0.113.5"] == 4
    assert intake.enter(S("z", at("198.51.100.7"))) is not None  # another address is not held up
    # loopback (this machine) and relayed streams (no address) are not counted per address
    assert address_of(S("x", at("127.0.0.1"))) is None and address_of(S("x", "/p2p-circuit")) is None
    assert address_of(S("x", "/ip6/::1/tcp/1")) is None and address_of(S("x", "/ip6/2001:db8::1/tcp/1")) == "2001:db8::1"


def test_the_budget_is_charged_as_frames_announce_their_length():
    budget = 6 * READ_CHUNK
    intake = Intake(budget=budget)
    a = intake.enter(S("a"))
    assert intake.bytes == READ_CHUNK  # a place costs its first read
    a.charge(2 * READ_CHUNK)
    assert a.charged == intake.bytes == 3 * READ_CHUNK + MAX_PREFIX_BYTES
    a.charge(10)  # the next frame replaces the last one's charge
    assert intake.bytes == READ_CHUNK + 10 + MAX_PREFIX_BYTES
    a.charge(4 * READ_CHUNK)
    b = intake.enter(S("b"))
    # b's frame does not fit: a (heavier) gives way
    b.charge(3 * READ_CHUNK)
    assert a.evicted and intake.bytes == b.charged
    # a frame that cannot fit even alone is refused, and charges nothing
    with pytest.raises(NoRoom):
        b.charge(budget)
    assert not b.evicted and intake.bytes == b.charged
    b.release()
    assert intake.bytes == 0 and not intake.tickets and not intake.held and not intake.streams


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.sampled_from(["1.1.1.1", "2.2.2.2", None]),
                          st.integers(0, 4 * READ_CHUNK), st.booleans()), min_size=1, max_size=120))
def test_no_bound_is_ever_exceeded_and_an_empty_identity_always_finds_room(arrivals):
    intake = Intake(per_identity=5, per_address=9, total=16, budget=24 * READ_CHUNK)
    for remote, ip, frame, leave in arrivals:
        heavier = max(intake.streams.values(), default=0)
        fresh = intake.streams[remote] == 0
        ticket = intake.enter(S(remote, at(ip) if ip else None))
        if ticket is not None:
            try:
                ticket.charge(frame)
            except NoRoom:
                pass
            if leave:
                ticket.release()
        elif fresh and ip is None:
            assert heavier <= 1  # only when nobody holds two or more is an empty identity turned away
        live = list(intake.tickets.values())
        assert len(live) <= 16 and intake.bytes <= 24 * READ_CHUNK
        assert intake.bytes == sum(t.charged for t in live)
        assert all(n <= 5 for n in intake.streams.values())
        assert all(n <= 9 for n in intake.per_ip.values())
        assert not any(t.evicted or t.released for t in live)
