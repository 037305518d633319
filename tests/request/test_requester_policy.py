"""The requester's policy (allow / deny / prefer) as a pure function of a view, and its parsing."""

from __future__ import annotations

import pytest
from libp2p.peer.id import ID

from tessera.peer.base.errors import ConfigError
from tessera.peer.http.requests import ApiError, parse_chat
from tessera.peer.request.policy import (
    PREFER_FACTOR, BadPeerId, RequesterPolicy, check_peer_id, explain_gaps, read_peer_ids,
)
from tessera.peer.plan.routing import route
from tessera.peer.plan.view import PeerInfo, SwarmView
from tessera.protocol.keys import Identity

REQ = "requester"


def pid(name: str) -> str:
    """A real (deterministic) peer id per name."""
    return ID(Identity.from_seed(name.encode().ljust(32, b".")).peer_id).to_base58()


A, B, C, D = (pid(n) for n in "abcd")


def peer(peer_id: str, start: int, end: int, throughput: float = 100.0) -> PeerInfo:
    return PeerInfo(peer_id, "m", start, end, throughput)


def example() -> SwarmView:
    """The module docstring's example: a [0, 4), b [0, 2), c [2, 4), 10 ms a layer each."""
    return SwarmView.of(4, [peer(A, 0, 4), peer(B, 0, 2), peer(C, 2, 4)])


def chain(view: SwarmView, policy: RequesterPolicy, **kw) -> tuple[str, ...]:
    return route(policy.apply(view), source=REQ, **kw).peer_ids


def test_the_worked_example():
    view = example()
    assert chain(view, RequesterPolicy()) == (A,)
    assert route(view, source=REQ).cost_ms == pytest.approx(240.0)
    assert chain(view, RequesterPolicy(prefer=frozenset({B, C}))) == (B, C)
    assert chain(view, RequesterPolicy(allow=frozenset({A, B}))) == (A,)
    assert not route(RequesterPolicy(allow=frozenset({B})).apply(view), source=REQ).ok


def test_deny_drops_peers_and_wins_over_allow_and_prefer():
    view = example()
    assert chain(view, RequesterPolicy(deny=frozenset({A}))) == (B, C)
    assert chain(view, RequesterPolicy(allow=frozenset({A, B, C}), deny=frozenset({A}))) == (B, C)
    assert chain(view, RequesterPolicy(prefer=frozenset({A}), deny=frozenset({A}))) == (B, C)


def test_prefer_uses_preferred_peers_where_they_cover_and_others_only_where_they_do_not():
    # d [0, 2) is preferred; only a and c hold [2, 4). Without the preference one hop over a wins.
    view = SwarmView.of(4, [peer(A, 0, 4), peer(C, 2, 4), peer(D, 0, 2, throughput=50.0)])
    assert chain(view, RequesterPolicy()) == (A,)
    hops = route(RequesterPolicy(prefer=frozenset({D})).apply(view), source=REQ).hops
    assert [(h.peer_id, h.start, h.end) for h in hops][0] == (D, 0, 2)
    assert hops[-1].end == 4 and hops[-1].peer_id in (A, C)


def test_apply_is_pure_and_leaves_an_unrestricted_view_alone():
    view = example()
    policy = RequesterPolicy(allow=frozenset({B, C}), prefer=frozenset({B}))
    first, second = policy.apply(view), policy.apply(view)
    assert first == second and [p.peer_id for p in first.peers] == sorted([B, C])
    assert first.get(C).throughput == pytest.approx(100.0 / PREFER_FACTOR)
    assert first.get(B).throughput == 100.0
    assert view == example()  # the snapshot is not touched
    assert RequesterPolicy().apply(view) is view
    me = PeerInfo(REQ, "m", 0, 0, 0.0, rtt_ms={A: 1.0})
    assert policy.apply(view.replace(me), keep=(REQ,)).get(REQ) == me  # the requester's own RTTs stay


def test_explain_gaps_tells_a_hole_in_the_swarm_from_peers_the_policy_excludes():
    view = SwarmView.of(6, [peer(A, 0, 2), peer(B, 2, 4)])  # nobody holds [4, 6)
    missing, why = explain_gaps(view, RequesterPolicy(allow=frozenset({A})))
    assert missing == [(2, 4), (4, 6)]
    assert "no peer at all covers layers [4, 6)" in why
    assert "no allowed peer covers layers [2, 4)" in why
    missing, why = explain_gaps(view, RequesterPolicy())
    assert missing == [(4, 6)] and "allowed" not in why


def test_narrowed_can_only_take_peers_away():
    gateway = RequesterPolicy(allow=frozenset({A, B, C}), deny=frozenset({D}))
    request = RequesterPolicy(allow=frozenset({B, C, D}), deny=frozenset({C}), prefer=frozenset({B}))
    both = gateway.narrowed(request)
    assert both.allow == {B, C} and both.deny == {C, D} and both.prefer == {B}
    assert [x for x in (A, B, C, D) if both.admits(x)] == [B]
    assert RequesterPolicy(deny=frozenset({A})).narrowed(RequesterPolicy(allow=frozenset({A}))).admits(A) is False
    assert gateway.narrowed(None) is gateway
    assert gateway.denying(A).admits(A) is False and gateway.admits(A)


@pytest.mark.parametrize("bad", ["", "nonsense", A[:12], A + "x", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"])
def test_a_bad_peer_id_is_one_clear_error(bad):
    with pytest.raises(BadPeerId, match="allow"):
        RequesterPolicy(allow=frozenset({A, bad}))
    with pytest.raises(BadPeerId, match="not a full peer id|expected a peer id"):
        check_peer_id(bad)


def test_a_string_instead_of_a_collection_is_refused():
    with pytest.raises(BadPeerId, match="collection"):
        RequesterPolicy(deny=A)  # type: ignore[arg-type]


def test_read_peer_ids_from_arguments_and_files(tmp_path):
    listing = tmp_path / "trusted.txt"
    listing.write_text(f"# my machines\n{A}\n\n{B}   # the laptop\n")
    assert read_peer_ids([f"@{listing}", C], option="--allow") == {A, B, C}
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{A}\nnot-an-id\n")
    with pytest.raises(BadPeerId, match=r"--deny @.*bad.txt line 2: 'not-an-id'"):
        read_peer_ids([f"@{bad}"], option="--deny")
    with pytest.raises(ConfigError, match="cannot read"):
        read_peer_ids([f"@{tmp_path / 'missing.txt'}"], option="--prefer")


# -- the HTTP extension field ----------------------------------------------------------


def chat(**extra) -> dict:
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], **extra}


def test_http_extension_field_becomes_the_request_policy():
    request = parse_chat(chat(tessera={"allow": [A, B], "deny": [C], "prefer": [B]}))
    assert request.policy == RequesterPolicy(allow=frozenset({A, B}), deny=frozenset({C}), prefer=frozenset({B}))
    assert parse_chat(chat()).policy is None
    assert parse_chat(chat(tessera={"deny": [C]})).policy.allow is None


@pytest.mark.parametrize("field, param", [
    ({"allow": [A, "nope"]}, "tessera.allow[1]"),
    ({"deny": A}, "tessera.deny"),
    ({"alow": [A]}, "tessera.alow"),
    ([A], "tessera"),
])
def test_http_extension_field_errors_name_the_field(field, param):
    with pytest.raises(ApiError) as caught:
        parse_chat(chat(tessera=field))
    assert caught.value.status == 400 and caught.value.param == param
