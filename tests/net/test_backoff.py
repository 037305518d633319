"""The one keyed back-off/ban object (peer/base/backoff.py), and its owner keeping strikes across answers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tessera.store.trace import NullTracer

from tessera.peer.base.backoff import Backoff
from tessera.peer.request.policy import RequesterPolicy
from tessera.peer.request.ports import BAN_BASE, BAN_CAP
from tessera.peer.request.repair import ResilientSession


def test_a_failure_bans_for_base_then_doubles_up_to_the_cap() -> None:
    bans = Backoff(base=30.0, cap=100.0)
    assert bans.register_failure("p", now=0.0) == 30.0
    assert bans.is_banned("p", 29.9) and not bans.is_banned("p", 30.0)
    assert bans.register_failure("p", now=40.0) == 60.0
    assert bans.until("p") == 100.0
    assert bans.register_failure("p", now=200.0) == 100.0  # 120 capped
    assert bans.strikes("p") == 3
    assert not bans.is_banned("q", 0.0) and bans.until("q") == 0.0


def test_strikes_are_kept_however_long_ago_the_last_failure() -> None:
    """No success forgets them (Backoff keeps no such call): the third failure bans for 4 x base."""
    bans = Backoff(base=10.0, cap=1000.0)
    bans.register_failure("p", now=0.0)
    bans.register_failure("p", now=20.0)
    assert bans.is_banned("p", 30.0)  # the second ban (20 s from t=20) runs
    assert bans.register_failure("p", now=10_000.0) == 40.0


def test_a_fixed_length_ban_counts_a_strike_and_ban_until_never_shortens() -> None:
    bans = Backoff(base=30.0, cap=3600.0)
    assert bans.register_failure("p", now=0.0, seconds=10.0) == 10.0
    assert bans.register_failure("p", now=50.0) == 60.0  # the refusal was strike one
    bans.ban_until("p", 20.0)
    assert bans.until("p") == 110.0
    bans.ban_until("p", 500.0)
    assert bans.until("p") == 500.0 and bans.strikes("p") == 2
    assert list(bans.banned(499.0)) == ["p"] and list(bans.banned(500.0)) == []


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="base"):
        Backoff(base=0.0, cap=10.0)
    with pytest.raises(ValueError, match="cap"):
        Backoff(base=20.0, cap=10.0)


class _Swarm:
    """What ResilientSession.ban uses of the swarm client: its policy, bans, clock and tracer."""

    def __init__(self) -> None:
        self.now = 0.0
        self.policy = RequesterPolicy()
        self.bans = Backoff(BAN_BASE, BAN_CAP)
        self.clock = lambda: self.now
        self.ctx = SimpleNamespace(tracer=NullTracer())


def test_strikes_survive_from_one_answer_to_the_next() -> None:
    swarm = _Swarm()
    first = ResilientSession(swarm, max_length=64, route_wait=1.0)
    first.ban("p", "step timed out")
    assert swarm.bans.until("p") == BAN_BASE
    swarm.now = 1000.0  # the ban is long over; a new answer meets the same peer failing again
    second = ResilientSession(swarm, max_length=64, route_wait=1.0)
    second.ban("p", "step timed out")
    assert swarm.bans.until("p") == 1000.0 + 2 * BAN_BASE
    assert swarm.bans.strikes("p") == 2
