"""Where a peer listens by default, and what it says about each address (issue 34, item 2)."""

from __future__ import annotations

import socket

from tessera.peer.net.addresses import (
    ANY_PORT_LISTEN, DEFAULT_LISTEN, LAN, LOOPBACK, PUBLIC, RELAYED, default_listen, describe_addrs, port_is_free,
    scope,
)

ID = "12D3KooWLdc6XuAzhCZ7VyqEHqMpDxgDCB3fmzYbKSN3RSpS6m6E"


def test_each_address_is_labelled_with_who_can_use_it():
    assert scope(f"/ip4/127.0.0.1/tcp/4001/p2p/{ID}") == LOOPBACK
    assert scope("/ip6/::1/tcp/4001") == LOOPBACK
    for lan in ("/ip4/192.168.1.7/tcp/4001", "/ip4/10.0.0.5/tcp/1", "/ip4/172.17.0.2/tcp/1", "/ip4/100.80.1.1/tcp/1",
                "/ip4/169.254.3.4/tcp/1", "/ip6/fd00::1/tcp/1"):
        assert scope(lan) == LAN, lan
    assert scope("/ip4/8.8.8.8/tcp/4001") == PUBLIC
    assert scope(f"/ip4/8.8.8.8/tcp/4001/p2p/{ID}/p2p-circuit/p2p/{ID}") == RELAYED


def test_the_first_line_names_the_address_most_machines_can_use():
    lines = describe_addrs([f"/ip4/127.0.0.1/tcp/4001/p2p/{ID}", f"/ip4/192.168.1.7/tcp/4001/p2p/{ID}"])
    assert lines[0] == f"listening on /ip4/192.168.1.7/tcp/4001/p2p/{ID}  (LAN: others on this network can --join it)"
    assert lines[1] == f"  also /ip4/127.0.0.1/tcp/4001/p2p/{ID}  (loopback: this machine only)"
    alone = describe_addrs([f"/ip4/127.0.0.1/tcp/5555/p2p/{ID}"])
    assert alone[0].startswith(f"listening on /ip4/127.0.0.1/tcp/5555/p2p/{ID}  (loopback")
    assert "only peers on this machine can join" in alone[-1] and DEFAULT_LISTEN in alone[-1]


def test_every_interface_at_4001_or_a_free_port_when_it_is_taken():
    assert default_listen(free=lambda host, port: True) == ([DEFAULT_LISTEN], None)
    listen, note = default_listen(free=lambda host, port: False)
    assert listen == [ANY_PORT_LISTEN] and "4001 is taken" in note
    with socket.socket() as taken:  # a listener (without SO_REUSEPORT) holds a port: the probe sees it
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        assert not port_is_free("0.0.0.0", taken.getsockname()[1])
    assert DEFAULT_LISTEN == "/ip4/0.0.0.0/tcp/4001"
