"""Joining a swarm: try every `--join` address, say why each attempt failed, back off, give up.

A peer told to join that reaches nobody used to warn once and serve a one-peer swarm
forever; that hides the usual mistakes (a dead address, a wrong or missing swarm
key, a peer of another model). `join_swarm` retries with doubling back-off until
one address answers and gossips with us, printing ONE line per failed attempt with
the reason, and raises `JoinFailed` when the join time runs out (the CLI exits
non-zero) unless the peer was told it may serve alone.

Every command that takes --join (`peer`, `generate`, `serve`, `swarm status`) says the same
thing about the same address, from here:

  before dialling (`check_join_addrs`, a ConfigError naming the fault, exit status 1):
  not a multiaddr    "127.0.0.1:4001": an address looks like /ip4/…/tcp/4001/p2p/12D3KooW…;
  no /p2p/ part      "/ip4/127.0.0.1/tcp/4001": the peer id is missing (libp2p needs it to
                     authenticate the peer; it is the end of what the peer prints);
  after a failed dial (`why_unreachable`):
  handshake refused  TCP answers but the libp2p handshake never completes: with a
                     private-network key the two sides cannot even agree on
                     encryption, so "wrong or missing swarm key?" is the likely cause;
  different model    the peer answers, but its advertisement names another model id
                     (peer/net/other_model.py: which model, and the --model to pass; the same
                     words from a requester, a gateway and `swarm status`). An answer is
                     final: when every address gave one, the peer stops trying at once.

An address that answered once with a reason (a different model) keeps that reason when a
later attempt at it fails without one (cut by the join time, or refused: a peer of another
model may drop us after the first exchange): the exit line then names what was learnt,
not a guess about the swarm key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Iterator, Sequence

import multiaddr
import trio

from tessera.peer.base.errors import ConfigError, PeerError

JOIN_TIMEOUT = 60.0  # default --join-timeout: a peer that restarts beside us is up well within a minute
RETRY_FIRST = 1.0  # first back-off: a peer started at the same moment is listening within seconds
RETRY_MAX = 10.0  # back-off cap: the dial itself already waits up to 10 s (libp2p_transport.DIAL_TIMEOUT)
TCP_PROBE_TIMEOUT = 3.0  # a TCP connect on a live address answers in one round trip; 3 s covers slow links


class JoinFailed(PeerError):
    """No `--join` address was reached within the join time."""


@dataclass(frozen=True)
class Attempt:
    """One failed try at one address: what it was and why it failed."""

    addr: str
    reason: str


def backoff(first: float = RETRY_FIRST, cap: float = RETRY_MAX) -> Iterator[float]:
    """Waits between rounds of attempts: first, 2 first, 4 first, ... never above cap."""
    delay = first
    while True:
        yield delay
        delay = min(cap, delay * 2)


def tcp_endpoint(addr: str) -> tuple[str, int] | None:
    """(host, port) of an /ip4, /ip6 or /dns… + /tcp multiaddr; None for anything else."""
    try:
        parts = multiaddr.Multiaddr(addr).items()
    except (ValueError, multiaddr.exceptions.Error):
        return None
    host = next((v for p, v in parts if p.name in ("ip4", "ip6", "dns", "dns4", "dns6")), None)
    port = next((v for p, v in parts if p.name == "tcp"), None)
    return (str(host), int(port)) if host is not None and port is not None else None


async def tcp_answers(addr: str) -> bool:
    """Whether something accepts a TCP connection at `addr` (closed at once)."""
    endpoint = tcp_endpoint(addr)
    if endpoint is None:
        return False
    with trio.move_on_after(TCP_PROBE_TIMEOUT):
        try:
            stream = await trio.open_tcp_stream(*endpoint)
        except OSError:
            return False
        await stream.aclose()
        return True
    return False


EXAMPLE_ADDR = "/ip4/192.0.2.7/tcp/4001/p2p/12D3KooW…"


def join_addr_fault(addr: str) -> str | None:
    """What is wrong with `addr` as a --join address, before any dial; None when it may be dialled."""
    try:
        parts = multiaddr.Multiaddr(addr).items()
    except (ValueError, TypeError, multiaddr.exceptions.Error):
        return (f"{addr!r} is not a multiaddr: a peer's address looks like {EXAMPLE_ADDR}, as the peer "
                "prints it (\"listening on …\")")
    names = [p.name for p, _ in parts]
    if "p2p" not in names:
        return (f"{addr!r} has no /p2p/ part: add the peer's id, as the peer prints its address "
                f"(\"listening on {addr.rstrip('/')}/p2p/12D3KooW…\")")
    if names[-1] != "p2p" and "p2p-circuit" not in names:
        return f"{addr!r} goes on after its /p2p/ part: a peer's address ends with its id ({EXAMPLE_ADDR})"
    if tcp_endpoint(addr) is None and "p2p-circuit" not in names:
        return f"{addr!r} names no /tcp/ port: a peer's address looks like {EXAMPLE_ADDR}"
    return None


def check_join_addrs(addrs: Sequence[str]) -> None:
    """Raise ConfigError naming the first --join address that cannot be one (`join_addr_fault`)."""
    for addr in addrs:
        fault = join_addr_fault(addr)
        if fault is not None:
            raise ConfigError(f"--join {fault}")


async def why_unreachable(addr: str, swarm_key_given: bool) -> str:
    """Why a dial of `addr` failed, as far as can be told from outside: nothing listens at its
    host and port, or something does but does not complete a libp2p handshake with us."""
    if await tcp_answers(addr):
        return handshake_reason(swarm_key_given)
    endpoint = tcp_endpoint(addr)
    where = f"{endpoint[0]}:{endpoint[1]}" if endpoint else "this address"
    return f"unreachable: nothing listens at {where} (is the peer running, and the address right?)"


def handshake_reason(swarm_key_given: bool) -> str:
    key = "our --swarm-key differs from the swarm's" if swarm_key_given else "the swarm may need --swarm-key"
    return f"handshake refused (the address answers TCP, but not libp2p with us): wrong or missing swarm key? ({key})"


async def join_swarm(
    addrs: Sequence[str],
    try_one: Callable[[str], Awaitable[str | None]],
    *,
    timeout: float,
    allow_alone: bool,
    swarm_key_given: bool,
    out: Callable[[str], None],
    delays: Iterator[float] | None = None,
) -> bool:
    """Try `addrs` until one joins; True when one did, False when serving alone is allowed.

    `try_one(addr)` connects and gossips; it returns None on success or a reason
    ("different model ...") and raises PeerError when the address cannot be reached.
    Raises JoinFailed when `timeout` seconds pass without a join and not `allow_alone`.
    """
    delays = delays or backoff()
    deadline = trio.current_time() + timeout
    last: list[Attempt] = []
    learnt: dict[str, str] = {}  # address -> the reason it gave when it answered (e.g. a different model)
    n = 0
    while True:
        n += 1
        last = []
        for addr in addrs:
            remaining = deadline - trio.current_time()
            reason: str | None = "no answer within the join time"
            answered = False
            with trio.move_on_after(max(0.0, remaining)):
                try:
                    reason = await try_one(addr)
                    answered = True
                except PeerError:
                    reason = "unreachable"
                if reason is None:
                    return True
            if answered and not reason.startswith("unreachable"):
                learnt[addr] = reason
            elif addr in learnt:
                reason = learnt[addr]  # it answered before: what it said then is the reason
            elif not answered:
                reason = await why_unreachable(addr, swarm_key_given)
            last.append(Attempt(addr, reason))
        wait = next(delays)
        left = deadline - trio.current_time()
        if all(addr in learnt for addr in addrs):
            left = 0.0  # every address answered, with a reason (another model): asking again changes nothing
        for attempt in last:
            then = f"retrying in {min(wait, left):.0f} s" if left > 0 else "giving up"
            out(f"join attempt {n}: cannot join {attempt.addr}: {attempt.reason}; {then}")
        if left <= 0:
            break
        await trio.sleep(min(wait, left))
    answered = all(addr in learnt for addr in addrs)  # each gave a reason, final (another model)
    if allow_alone:
        out(f"join: {'no address serves our model' if answered else f'nobody reached in {timeout:g} s'}; "
            "serving alone as a new swarm (--allow-alone)")
        return False
    reasons = "; ".join(f"{a.addr}: {a.reason}" for a in last)
    if answered:
        raise JoinFailed(f"could not join any --join address ({reasons}); or pass --allow-alone to start a new swarm")
    raise JoinFailed(
        f"could not join any --join address within {timeout:g} s ({reasons}); "
        "fix the address or key, raise --join-timeout, or pass --allow-alone to start a new swarm"
    )
