"""Where a peer listens by default, and what it says about each address (issue 34, item 2)."""

from __future__ import annotations

import socket
import subprocess
import sys

from tessera.peer.net.addresses import (
    ANY_PORT_LISTEN, DEFAULT_LISTEN, DEFAULT_PORT, LAN, LOOPBACK, PUBLIC, RELAYED, PortClaim, default_listen,
    describe_addrs, port_is_free, scope,
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


def test_every_interface_at_4001_or_a_free_port_when_it_is_taken(tmp_path):
    listen, note, claim = default_listen(free=lambda host, port: True, claim=lambda port: PortClaim.take(port, tmp_path))
    assert (listen, note) == ([DEFAULT_LISTEN], None) and claim is not None and claim.held
    claim.release()
    assert not claim.held
    listen, note, claim = default_listen(free=lambda host, port: False, claim=lambda port: PortClaim.take(port, tmp_path))
    assert listen == [ANY_PORT_LISTEN] and "4001 is taken" in note and claim is None
    assert PortClaim.take(DEFAULT_PORT, tmp_path) is not None  # the claim of a port not taken was given back
    with socket.socket() as taken:  # a listener (without SO_REUSEPORT) holds a port: the probe sees it
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        assert not port_is_free("0.0.0.0", taken.getsockname()[1])
    assert DEFAULT_LISTEN == "/ip4/0.0.0.0/tcp/4001"


def test_two_peers_started_at_once_do_not_both_take_4001(tmp_path):
    # py-libp2p binds with SO_REUSEPORT: both would bind 4001 and split its connections. The
    # first peer's claim holds until it lets go; the second, meanwhile, takes a free port.
    claim_here = lambda port: PortClaim.take(port, tmp_path)  # noqa: E731
    first, _, first_claim = default_listen(free=lambda host, port: True, claim=claim_here)
    second, note, second_claim = default_listen(free=lambda host, port: True, claim=claim_here)
    assert first == [DEFAULT_LISTEN] and first_claim is not None
    assert second == [ANY_PORT_LISTEN] and second_claim is None and "4001 is taken" in note
    first_claim.release()
    first_claim.release()  # idempotent
    third, _, third_claim = default_listen(free=lambda host, port: True, claim=claim_here)
    assert third == [DEFAULT_LISTEN] and third_claim is not None
    third_claim.release()


def test_a_claim_ends_with_the_process_that_held_it(tmp_path):
    # flock: the kernel drops it when the holder exits, however it exits (no stale claim)
    code = ("import sys; from pathlib import Path; from tessera.peer.net.addresses import PortClaim; "
            "c = PortClaim.take(4001, Path(sys.argv[1])); print(c is not None, flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        assert PortClaim.take(4001, tmp_path) is None  # held by another process
    finally:
        holder.kill()
        holder.wait()
    mine = PortClaim.take(4001, tmp_path)
    assert mine is not None
    mine.release()


def test_a_planted_link_in_place_of_the_claim_file_is_not_followed(tmp_path):
    # the claim file lives in a shared folder: a link there must not make a peer open (or lock)
    # another file; the peer then claims nothing and only `port_is_free` decides
    target = tmp_path / "someone-elses-file"
    target.write_text("keep")
    mode = target.stat().st_mode
    (tmp_path / f"tessera-port-{DEFAULT_PORT}.lock").symlink_to(target)
    claim = PortClaim.take(DEFAULT_PORT, tmp_path)
    assert claim is not None and not claim.held
    claim.release()
    assert target.read_text() == "keep" and target.stat().st_mode == mode
    assert PortClaim.take(DEFAULT_PORT, tmp_path).held is False  # no lock was taken through the link


def time_wait_on(port: int) -> None:
    """Leave a TIME-WAIT connection on `port` (and nothing listening): what a peer that just
    stopped leaves behind, for a minute on Linux, after it closed its connections first."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the listening side closes first: its end of the connection waits in TIME-WAIT
        client.recv(1)
        client.close()


def test_a_stopped_peers_time_wait_does_not_take_its_port(tmp_path):
    """Issue 46, item 2: restarted within a minute, a peer found 4001 "taken" while nothing
    listened (a TIME-WAIT socket), and took another port: the address others --join changed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    time_wait_on(port)
    with socket.socket() as strict:  # the kernel does keep the port: a bind without SO_REUSEADDR fails
        try:
            strict.bind(("0.0.0.0", port))
            kept = False
        except OSError:
            kept = True
    assert kept, "no TIME-WAIT to test against"
    assert port_is_free("0.0.0.0", port) and port_is_free("127.0.0.1", port)
    with socket.socket() as taken:  # a listener still takes it
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        assert not port_is_free("127.0.0.1", port) and not port_is_free("0.0.0.0", port)


def test_the_note_says_whether_a_peer_or_another_program_holds_4001(tmp_path):
    held = PortClaim.take(DEFAULT_PORT, tmp_path)  # a live peer's claim
    listen, note, claim = default_listen(free=lambda host, port: True, claim=lambda port: PortClaim.take(port, tmp_path))
    assert listen == [ANY_PORT_LISTEN] and claim is None
    assert note == "port 4001 is taken by another tessera peer on this machine: a free port instead"
    held.release()
    listen, note, claim = default_listen(free=lambda host, port: False, claim=lambda port: PortClaim.take(port, tmp_path))
    assert note == "port 4001 is taken by another program on this machine: a free port instead"


def test_a_busy_http_port_is_one_line():
    from tessera.peer.net.addresses import busy_port_error

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = busy_port_error("--port", "127.0.0.1", port)
        assert line == (f"--port {port}: 127.0.0.1:{port} is already in use (another `tessera serve` or peer web "
                        "view, or another program); pick another port, or --port 0 for any free one")
    assert busy_port_error("--port", "127.0.0.1", port) is None  # free again
    assert busy_port_error("--web", "127.0.0.1", 0) is None  # any free port
