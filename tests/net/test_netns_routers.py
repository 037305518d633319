"""The NAT routers of `tests/netns.py` do what their variant promises, with SYNs that cross.

A hole punch is a TCP simultaneous open through two NATs: each side's SYN leaves its
router (opening a mapping) while the other side's SYN is on its way. Whether the punch
works then depends only on what a router does with an inbound SYN that matches a mapping.
On veth links the two SYNs cross only by luck of timing, so here the crossing is made
certain: r2 drops everything from the WAN (in the raw table, before conntrack sees it)
while A dials, so A's SYN is "still on the wire" when B's leaves; then r2 lets traffic
through again and A's retransmissions arrive.
"""

from __future__ import annotations

import sys
import time

import pytest

from .. import netns

SKIP = netns.skip_reason()
A_PORT, B_PORT = 4001, 4002
# Dial from a fixed local port (as libp2p's port reuse does) and print the outcome.
DIAL = """
import socket, sys
src, port, dst, dport = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((src, port))
s.settimeout(8)
try:
    s.connect((dst, dport))
    s.sendall(b"hello from " + src.encode())
    s.shutdown(socket.SHUT_WR)
    print("connected", s.recv(64).decode(), flush=True)
except OSError as e:
    print("failed", type(e).__name__, flush=True)
"""


@pytest.mark.netns
@pytest.mark.parametrize("variant", netns.VARIANTS)
def test_a_simultaneous_open_gets_through_drop_routers_and_never_reject_ones(variant, tmp_path) -> None:
    if SKIP:
        pytest.skip(SKIP)
    r1_wan, r2_wan = netns.HOMES["a"][1], netns.HOMES["b"][1]
    hold = ["-t", "raw", "-I", "PREROUTING", "-i", "wan", "-j", "DROP"]
    with netns.nat_topology(variant) as topo:
        topo.run_in("r2", "iptables", *hold)
        logs = {home: tmp_path / f"{home}.log" for home in ("a", "b")}
        topo.spawn("a", [sys.executable, "-c", DIAL, topo.ip("a"), str(A_PORT), r2_wan, str(B_PORT)],
                   log_path=str(logs["a"]))
        time.sleep(0.3)  # A's SYN has left r1 (the mapping is open) and died at r2
        topo.spawn("b", [sys.executable, "-c", DIAL, topo.ip("b"), str(B_PORT), r1_wan, str(A_PORT)],
                   log_path=str(logs["b"]))
        time.sleep(0.3)  # B's SYN crossed: it reached r1 while A's dial is still open
        topo.run_in("r2", "iptables", *[("-D" if arg == "-I" else arg) for arg in hold])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(log.read_text().strip() for log in logs.values()):
            time.sleep(0.1)
        outcome = {home: log.read_text().strip() for home, log in logs.items()}
    if variant == "drop":
        assert outcome == {"a": f"connected hello from {topo.ip('b')}", "b": f"connected hello from {topo.ip('a')}"}
    else:
        assert outcome == {"a": "failed ConnectionRefusedError", "b": "failed ConnectionRefusedError"}, outcome
