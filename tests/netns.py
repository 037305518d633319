"""A small Internet in network namespaces: a public network and home networks behind NATs.

    pub  (bridge br0, 203.0.113.1/24: the bootstrap/relay peer and the requester)
     |-- r1  wan 203.0.113.11  |  lan 192.0.2.1/26      -- a  192.0.2.2      (peer A)
     |-- r2  wan 203.0.113.12  |  lan 198.51.100.1/26   -- b  198.51.100.2   (peer B)
     |-- r3  wan 203.0.113.13  |  lan 192.0.2.65/26     -- c  192.0.2.66     (bench only)
     '-- r4  wan 203.0.113.14  |  lan 198.51.100.65/26  -- d  198.51.100.66  (bench only)

Every address is in a documentation range (RFC 5737) and exists only inside these
namespaces. Each router masquerades its LAN behind its WAN address (Linux keeps the
source port when it is free, as most home routers do). Two router variants, chosen
per home network:

- ``drop``: an unsolicited inbound SYN to the router is dropped silently (conntrack
  NEW on the WAN side -> DROP), as most home routers do. A TCP simultaneous open
  from both sides gets through: each side's outgoing SYN opens the mapping the
  other side's SYN then matches.
- ``reject``: every inbound SYN from the WAN is answered with a RST, as a NAT whose
  firewall forbids inbound TCP opens does. An unsolicited SYN gets the router's own
  RST (nothing listens there); a SYN that matches a mapping (the other half of a
  simultaneous open) is refused in FORWARD. Without that second rule the variant is
  a race: when the two SYNs cross on the wire, each matches the mapping the other
  side's SYN just opened, and a punch sometimes succeeded (seen once in CI).

The routers route everything else to pub, which does not forward: a packet for
another network's private address vanishes (no ICMP), as on the Internet.

Needs root, `ip` (iproute2) and `iptables`; `skip_reason()` says why not when it
cannot run. `NatTopology.close()` kills every process it started and deletes every
namespace, and the context manager calls it whatever happens inside.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

VARIANTS = ("drop", "reject")

PUB_IP = "203.0.113.1"
# home network -> (its router, the router's WAN address, LAN prefix length, router LAN address, host address)
HOMES = {
    "a": ("r1", "203.0.113.11", 26, "192.0.2.1", "192.0.2.2"),
    "b": ("r2", "203.0.113.12", 26, "198.51.100.1", "198.51.100.2"),
    "c": ("r3", "203.0.113.13", 26, "192.0.2.65", "192.0.2.66"),
    "d": ("r4", "203.0.113.14", 26, "198.51.100.65", "198.51.100.66"),
}
STOP_GRACE = 10.0  # seconds a process gets after SIGTERM before SIGKILL


def skip_reason() -> str | None:
    """Why the topology cannot be built here, or None if it can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "NAT tests build network namespaces and need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"NAT tests need `{tool}` (apt-get install -y iproute2 iptables)"
    probe = f"tsprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    try:
        rule = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L", "-n"],
                              capture_output=True, text=True)
        if rule.returncode != 0:
            return f"iptables does not work inside a namespace here: {rule.stderr.strip()[:200]}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


@dataclass
class NatTopology:
    """The namespaces of one topology and the processes started in them.

    routers: home network ("a".."d") -> its router's variant ("drop" or "reject").
    """

    routers: dict[str, str]
    prefix: str = field(default_factory=lambda: f"tn{uuid.uuid4().hex[:6]}")
    procs: list[subprocess.Popen] = field(default_factory=list)
    built: list[str] = field(default_factory=list)

    @property
    def variant(self) -> str:
        """The routers' variant when they all share one (else "mixed")."""
        kinds = set(self.routers.values())
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def ns(self, role: str) -> str:
        """The namespace name of a role: pub, a home network (a..d) or its router (r1..r4)."""
        return f"{self.prefix}-{role}"

    def ip(self, role: str) -> str:
        """The address a process in `role` (pub or a home network) listens on."""
        return PUB_IP if role == "pub" else HOMES[role][4]

    def build(self) -> None:
        for home, variant in self.routers.items():
            if home not in HOMES or variant not in VARIANTS:
                raise ValueError(f"routers maps {sorted(HOMES)} to {VARIANTS}, got {home!r}: {variant!r}")
        roles = ["pub"] + [r for home in self.routers for r in (HOMES[home][0], home)]
        for role in roles:
            _sh("ip", "netns", "add", self.ns(role))
            self.built.append(self.ns(role))
            self.run_in(role, "ip", "link", "set", "lo", "up")
        pub = self.ns("pub")
        self.run_in("pub", "ip", "link", "add", "br0", "type", "bridge")
        self.run_in("pub", "ip", "addr", "add", f"{PUB_IP}/24", "dev", "br0")
        self.run_in("pub", "ip", "link", "set", "br0", "up")
        self.run_in("pub", "sysctl", "-qw", "net.ipv4.ip_forward=0")
        for home, variant in self.routers.items():
            router, wan, prefix, gateway, host_ip = HOMES[home]
            # veth pairs created straight into their namespaces: no names in the root namespace.
            _sh("ip", "link", "add", "wan", "netns", self.ns(router), "type", "veth", "peer", "name", router, "netns", pub)
            self.run_in("pub", "ip", "link", "set", router, "master", "br0", "up")
            self.run_in(router, "ip", "addr", "add", f"{wan}/24", "dev", "wan")
            self.run_in(router, "ip", "link", "set", "wan", "up")
            self.run_in(router, "ip", "route", "add", "default", "via", PUB_IP)
            _sh("ip", "link", "add", "lan", "netns", self.ns(router), "type", "veth", "peer", "name", "eth0",
                "netns", self.ns(home))
            self.run_in(router, "ip", "addr", "add", f"{gateway}/{prefix}", "dev", "lan")
            self.run_in(router, "ip", "link", "set", "lan", "up")
            self.run_in(home, "ip", "addr", "add", f"{host_ip}/{prefix}", "dev", "eth0")
            self.run_in(home, "ip", "link", "set", "eth0", "up")
            self.run_in(home, "ip", "route", "add", "default", "via", gateway)
            self.run_in(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self.run_in(router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
            if variant == "drop":
                self.run_in(router, "iptables", "-A", "INPUT", "-i", "wan", "-p", "tcp",
                            "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")
            else:
                self.run_in(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-p", "tcp", "--syn",
                            "-j", "REJECT", "--reject-with", "tcp-reset")

    def run_in(self, role: str, *argv: str) -> None:
        _sh("ip", "netns", "exec", self.ns(role), *argv)

    def spawn(self, role: str, argv: Sequence[str], *, log_path: str, env: dict | None = None) -> subprocess.Popen:
        """Start `argv` inside a namespace, output to `log_path`; it is stopped by `close`."""
        cmd = ["ip", "netns", "exec", self.ns(role), *argv]
        log = open(log_path, "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def output(self, role: str, argv: Sequence[str], *, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run `argv` inside a namespace to completion (raises subprocess.TimeoutExpired)."""
        return subprocess.run(["ip", "netns", "exec", self.ns(role), *argv], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})})

    def stop(self, proc: subprocess.Popen, timeout: float = STOP_GRACE) -> None:
        """SIGTERM (a peer leaves gracefully), then SIGKILL after `timeout`."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def close(self) -> None:
        """Stop what was started, then delete the namespaces (safe to call twice)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()
        for name in reversed(self.built):
            # Anything still inside (a stray child of ours) would keep the namespace alive.
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.built.clear()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def nat_topology(variant: str | dict[str, str]) -> Iterator[NatTopology]:
    """Build a topology — homes a and b behind routers of one `variant`, or a {home: variant}
    map — and tear it down on the way out, whatever happened inside.

    A SIGTERM meanwhile (a CI timeout, `kill`) becomes a KeyboardInterrupt, so that this
    teardown still runs: the peers run in their own sessions and would outlive us.
    """
    routers = {"a": variant, "b": variant} if isinstance(variant, str) else dict(variant)
    topo = NatTopology(routers)
    previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
    try:
        topo.build()
        yield topo
    finally:
        try:
            topo.close()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
