"""Where a peer listens unless told, and who can use each of its addresses.

A volunteer's peer is there to be reached by other machines, so by default it listens
on every interface (`DEFAULT_LISTEN`, the wildcard) at libp2p's customary TCP port
4001, or at any free port when 4001 is taken (a second peer on the machine, or
another libp2p program; peers started at the same moment settle it by a claim,
`PortClaim`): `default_listen`. An explicit `--listen` is used as given.

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
import fcntl
import ipaddress
import os
import socket
import tempfile
from pathlib import Path
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
    """Whether a TCP listener could take (host, port) now: nothing listens there.

    Bound with SO_REUSEADDR, as py-libp2p's and hypercorn's listeners are: the TIME-WAIT
    connections a peer that just stopped leaves on its port (for a minute, on Linux) do not
    keep its restart off it — they made a restart take another port, and change the address
    others --join. Bound WITHOUT SO_REUSEPORT on purpose: py-libp2p binds its listeners with
    it, and two such sockets share a port (the kernel then splits incoming connections between
    two peers); this probe's bind fails against any listener, of either kind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def busy_port_error(option: str, host: str, port: int) -> str | None:
    """One line saying that (host, port) is taken, for an HTTP server's --port / --web; None when
    it is free (or 0: any free port). Checked before the server starts, so that a busy port is
    that line rather than a server's stack of errors ending in `Address already in use`."""
    if port == 0 or port_is_free(host, port):
        return None
    return (f"{option} {port}: {host}:{port} is already in use (another `tessera serve` or peer web view, or "
            f"another program); pick another port, or {option} 0 for any free one")


class PortClaim:
    """One peer's claim on a port of this machine, among Tessera peers: `flock(2)` on a file
    named after the port in the temporary directory, held until `release` or the process ends
    (the kernel drops it however the process ends, so a crash leaves no stale claim).

    Why: checking that a port is free and binding it are two steps, and py-libp2p binds with
    SO_REUSEPORT, so two peers started at the same moment (`tessera peer ... &` twice) would
    both see 4001 free and both bind it — the kernel then splits incoming connections between
    them, and a --join reaches whichever it picks. The claim makes the check one atomic step
    among peers; `port_is_free` still covers other programs.
    """

    def __init__(self, fd: int | None) -> None:
        self._fd = fd  # None: no lock held (released, or nothing to claim by)

    @classmethod
    def take(cls, port: int, folder: Path | None = None) -> "PortClaim | None":
        """The claim on `port`, or None while another peer holds it. A claim file this user may
        not open (another user's peer made it) or that is a link claims nothing: `port_is_free`
        alone decides then. Never followed, never written, never re-permissioned: the folder is
        shared, and a planted link must not make a peer touch another file."""
        path = Path(folder or tempfile.gettempdir()) / f"tessera-port-{port}.lock"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError:
            return cls(None)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:  # no locks on this file system: nothing to claim by
            os.close(fd)
            return cls(None)
        return cls(fd)

    @property
    def held(self) -> bool:
        """Whether this claim holds a lock (a claim through an unusable file holds none)."""
        return self._fd is not None

    def release(self) -> None:
        """Give the port up (idempotent). The file stays: removing it would race with the next claim."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock


def default_listen(*, free: Callable[[str, int], bool] = port_is_free,
                   claim: Callable[[int], PortClaim | None] = PortClaim.take,
                   ) -> tuple[list[str], str | None, PortClaim | None]:
    """The listen addresses of a peer given no --listen, a note to print when 4001 was taken,
    and the claim on 4001 to hold while the peer listens there (None: a free port instead).
    """
    held = claim(DEFAULT_PORT)
    if held is None:  # the claim file is locked: a live peer of this machine listens there
        return [ANY_PORT_LISTEN], (f"port {DEFAULT_PORT} is taken by another tessera peer on this machine: "
                                   "a free port instead"), None
    if free("0.0.0.0", DEFAULT_PORT):  # no peer holds it, and nothing listens (a stopped peer's TIME-WAIT does not count)
        return [DEFAULT_LISTEN], None, held
    held.release()
    return [ANY_PORT_LISTEN], (f"port {DEFAULT_PORT} is taken by another program on this machine: "
                               "a free port instead"), None


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


__all__ = ["DEFAULT_PORT", "DEFAULT_LISTEN", "ANY_PORT_LISTEN", "port_is_free", "busy_port_error", "PortClaim", "default_listen", "scope",
           "by_reach", "describe_addrs", "LOOPBACK", "LAN", "PUBLIC", "RELAYED"]
