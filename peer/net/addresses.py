"""Where a peer listens unless told, and who can use each of its addresses.

A volunteer's peer is there to be reached by other machines, so by default it listens
on every interface (`DEFAULT_LISTEN`, the wildcard) at libp2p's customary TCP port
4001, or at any free port when 4001 is taken (a second peer on the machine, or
another libp2p program): `default_listen`. An explicit `--listen` is used as given.

What it prints for others to join says, per address, who can use it (`scope`):

    /ip4/127.0.0.1/...        loopback   this machine only
    /ip4/192.168.1.7/...      LAN        this machine's network (a private range, RFC 1918,
                                         CGNAT 100.64/10, link-local, IPv6 ULA)
    /ip4/203.0.113.5/...      public     anyone, if no firewall is in the way
    .../p2p-circuit/...       relayed    anyone, through a relay (peer/net/nat/)

    describe_addrs(addrs)  ->  ["listening on /ip4/192.168.1.7/tcp/4001/p2p/12D3KooW...  (LAN: ...)",
                                "  also /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...  (loopback: ...)"]

The first line keeps the form `listening on ADDR` (scripts and tests read the address
after it); the best address for others comes first: public, then LAN, then loopback.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import Callable, Sequence

# libp2p's customary TCP port (Kubo/IPFS and most libp2p swarms): what a volunteer opens
# or forwards on a router, and what a --join address most often names.
DEFAULT_PORT = 4001
DEFAULT_LISTEN = f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}"
ANY_PORT_LISTEN = "/ip4/0.0.0.0/tcp/0"

LOOPBACK, LAN, PUBLIC, RELAYED = "loopback", "LAN", "public", "relayed"
SCOPE_WORDS = {
    PUBLIC: "public: others on the internet can --join it, unless a firewall is in the way",
    LAN: "LAN: others on this network can --join it",
    RELAYED: "relayed: others reach it through a relay",
    LOOPBACK: "loopback: this machine only",
}
ORDER = (PUBLIC, LAN, RELAYED, LOOPBACK)  # best for others first


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP listener could take (host, port) now.

    Bound without SO_REUSEPORT on purpose: py-libp2p binds its listeners with it, and
    two such sockets share a port (the kernel then splits incoming connections between
    two peers). A plain bind fails against either kind of listener."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def default_listen(*, free: Callable[[str, int], bool] = port_is_free) -> tuple[list[str], str | None]:
    """The listen addresses of a peer given no --listen, and a note to print when 4001 was taken.

    The check and the bind are two steps: two peers started in the same millisecond may
    both see 4001 free. The second bind then shares the port (SO_REUSEPORT, see
    `port_is_free`) — which is why a peer is started after the one it joins has printed
    its address, as every example does.
    """
    if free("0.0.0.0", DEFAULT_PORT):
        return [DEFAULT_LISTEN], None
    return [ANY_PORT_LISTEN], f"port {DEFAULT_PORT} is taken (another peer on this machine?): a free port instead"


def scope(addr: str) -> str:
    """Who can use a multiaddr: LOOPBACK, LAN, PUBLIC or RELAYED (see the module docstring)."""
    if "/p2p-circuit" in addr:
        return RELAYED
    parts = addr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return PUBLIC  # a DNS name: whoever can resolve it
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return PUBLIC
    if ip.is_loopback or ip.is_unspecified:
        return LOOPBACK
    if ip.is_private or ip.is_link_local or ip in ipaddress.ip_network("100.64.0.0/10"):
        return LAN
    return PUBLIC


def by_reach(addrs: Sequence[str]) -> list[str]:
    """`addrs` with the ones most machines can use first (stable within a scope)."""
    return sorted(dict.fromkeys(addrs), key=lambda a: ORDER.index(scope(a)))


def describe_addrs(addrs: Sequence[str]) -> list[str]:
    """The lines a peer prints when it listens: the best address for others first (see module docstring)."""
    ordered = by_reach(addrs)
    if not ordered:
        return ["listening (no address yet)"]
    lines = [f"listening on {ordered[0]}  ({SCOPE_WORDS[scope(ordered[0])]})"]
    lines += [f"  also {a}  ({SCOPE_WORDS[scope(a)]})" for a in ordered[1:]]
    if all(scope(a) == LOOPBACK for a in ordered):
        lines.append(f"  only peers on this machine can join; to accept others: --listen {DEFAULT_LISTEN}")
    return lines


__all__ = ["DEFAULT_PORT", "DEFAULT_LISTEN", "ANY_PORT_LISTEN", "port_is_free", "default_listen", "scope",
           "by_reach", "describe_addrs", "LOOPBACK", "LAN", "PUBLIC", "RELAYED"]
