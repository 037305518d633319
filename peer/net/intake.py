"""What a peer holds for streams it has not admitted yet: one bound for every protocol together.

Any identity (an Ed25519 key costs nothing) from any address may open a stream on any
protocol a peer serves, and until that stream is admitted — a session once admitted, a link
once placed, a weights stream once within the holder's limits; a ping, a gossip exchange, a
report or a dial-back for as long as it lasts — the peer holds the frame it is reading for a
stranger. Two attacks showed what that costs when only the session and link protocols were
bounded (issues 43 and 45):

- 64 MiB first frames on `/tessera/weights/1.0.0` from 8 throwaway identities took a peer from
  670 MB to 2.6 GB of RSS; ping, gossip and reports took 64 MiB frames too;
- 9 identities keeping 16 session streams each open, sending a byte a second, filled the 128
  unadmitted places before any proof of work was read — and every honest stream after them was
  reset unread, which its requester counted as a `dropped` strike against the honest peer.

So every handler enters its stream here first (`Intake.enter`) and reads with its protocol's
own first-frame limit (the constants beside each protocol's messages: protocol/admission.py,
protocol/records.py, protocol/attest.py, protocol/weights.py, peer/net/nat/). The intake bounds,
in this order:

1. **per identity**: `PER_IDENTITY` unadmitted streams of one remote peer id, all protocols;
2. **per address**: `PER_ADDRESS` of one remote IP, whatever identities it shows (a relayed or
   dedicated stream, whose address is not known here, and loopback — this machine's own
   processes, which could exhaust it by other means anyway — are not counted per address);
3. **in all**: `TOTAL` streams, and `BUDGET` bytes of frames being read. A stream is charged
   `READ_CHUNK` (its first read) on arrival, then, once a frame's length prefix is read and
   before its body is (`Channel(on_frame=ticket.charge)`), that frame's length: what its
   buffer will hold. The budget is charged by what arrives, not by each protocol's largest
   frame, so a hundred small gossip turns cost what they are.

A full bound does not shut the door on whoever comes next. Room is shared by identity: a
newcomer (or a frame that does not fit) takes the place of the oldest stream of the identity
holding the most in the full scope — streams for the counts, bytes for the budget; the address
for rule 2, everyone for rule 3 — as long as that identity holds strictly more than the
newcomer's own. So a crowd of identities can hold the places only until an identity with fewer
comes; an honest requester's one stream evicts an attacker's sixteenth. Only a newcomer whose
own identity is the largest is turned away.

Whoever loses its place is told so in its protocol's words where it has them: a session's open
gets `ErrorMsg(BUSY, retry_after)`, a refusal that its requester never counts as a strike
(docs/pages/failures.md), sent politely (`refuse`: the answer, a half-close, and a short wait for
the remote to read it and close, so that no reset overtakes it); protocols without a refusal
message are reset. So is a session open past REFUSING polite refusals at once: its requester
tells that reset from a drop — an open ended unanswered is a skip the first time, and a strike
only when it repeats before the peer answers an open (peer/base/backoff.py `Bans.unanswered_open`).
"""

from __future__ import annotations

import ipaddress
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol

import trio

from tessera.protocol.codec import encode
from tessera.protocol.framing import MAX_PREFIX_BYTES, READ_CHUNK, encode_frame

from tessera.peer.base.errors import PeerError

PER_IDENTITY = 16
"""Unadmitted streams of one remote peer id: a previous hop sets up one link per session it
carries here (up to a peer's 16 sessions at once), a requester one session stream each."""

PER_ADDRESS = 32
"""Unadmitted streams of one remote IP: two such identities behind one NAT."""

TOTAL = 128
"""Unadmitted streams in all: what a busy peer sees of honest opens and links at once, many times over."""

BUDGET = 32 * (1 << 20)
"""Bytes of frames being read by unadmitted streams, every protocol together: the largest valid
gossip frame (protocol/records.py GOSSIP_FRAME_LIMIT, 6 MiB) five times, or every one of the
TOTAL streams' first reads (8 MiB) with room to spare; what an attack can make a peer hold is this
plus its network stack's per-stream buffers (bench/preadmission.py measures it)."""

REFUSAL_LINGER = 2.0
"""Seconds a refused stream is given to read its answer and close before it is reset: one round
trip and the remote's reaction, over a relayed intercontinental link."""

REFUSING = 64
"""Refusals waiting politely at once (each holds a task and one read); past it, streams are reset."""

RETRY_AFTER = 1.0
"""What a session open refused for lack of room is told to wait: unadmitted streams are admitted or
given up within a round trip or two (an open's first frame), or evicted by the next newcomer."""


class NoRoom(PeerError):
    """A frame did not fit the unadmitted streams' budget, even after heavier identities made room."""


class Stream(Protocol):
    """What the intake reads of a stream (peer/net/transport.py `Stream`)."""

    remote: str

    async def read(self, max_bytes: int) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...

    async def reset(self) -> None: ...


def address_of(stream: object) -> str | None:
    """The IP a stream comes from, for the per-address bound (module docstring, rule 2): None
    over a relay or a dedicated connection (not known here) and for loopback."""
    addr = getattr(stream, "remote_addr", None)
    if not isinstance(addr, str) or not addr.startswith(("/ip4/", "/ip6/")):
        return None
    host = addr.split("/")[2]
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        return None
    return host


@dataclass(eq=False)
class Ticket:
    """One unadmitted stream's place: its charge, and the scope its handler reads in (cancelled
    when it is evicted). `with ticket:` runs the pre-admission part; `release()` admits it."""

    intake: "Intake"
    remote: str
    address: str | None
    order: int
    charged: int = READ_CHUNK
    evicted: bool = False
    released: bool = False
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def __enter__(self) -> "Ticket":
        self.scope.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        try:
            return bool(self.scope.__exit__(*exc))
        finally:
            self.release()

    def charge(self, frame_bytes: int) -> None:
        """The stream is about to buffer a frame of `frame_bytes` (Channel's `on_frame`): it is
        charged that (and its prefix and one read past it) instead of its last frame. Raises
        NoRoom when that does not fit even after heavier identities gave way."""
        if self.released:
            return
        self.intake._recharge(self, frame_bytes + MAX_PREFIX_BYTES + READ_CHUNK)

    def wait_scope(self) -> trio.CancelScope:
        """A fresh scope for one wait of a handler that keeps its place while it serves (a pool of
        places of its own, such as the weights server's: peer/weights/source.py): cancelled when
        the place is evicted (at once if it already was), so that an eviction ends a wait for
        the next request and never cuts an answer being sent."""
        self.scope = trio.CancelScope()
        if self.evicted:
            self.scope.cancel()
        return self.scope

    def release(self) -> None:
        """Admitted, refused or ended: the place and the charge are freed (idempotent)."""
        if not self.released:
            self.released = True
            self.intake._forget(self)


class Intake:
    """The bounds of the module docstring, for one peer (every protocol of its transport)."""

    def __init__(self, *, per_identity: int = PER_IDENTITY, per_address: int = PER_ADDRESS, total: int = TOTAL,
                 budget: int = BUDGET) -> None:
        self.per_identity = per_identity
        self.per_address = per_address
        self.total = total
        self.budget = budget
        self.tickets: dict[int, Ticket] = {}  # by arrival order: the oldest first
        self.streams: Counter[str] = Counter()  # per identity
        self.held: Counter[str] = Counter()  # bytes per identity
        self.per_ip: Counter[str] = Counter()
        self.bytes = 0
        self.refused = 0  # newcomers turned away
        self.evicted = 0  # streams that gave their place to a newcomer
        self.refusing = 0  # polite refusals under way (`refuse`)
        self._order = itertools.count()

    # -- places ---------------------------------------------------------------------------

    def enter(self, stream: object) -> Ticket | None:
        """A place for `stream` (heavier identities give way if a bound is full), or None: refused."""
        remote = str(getattr(stream, "remote"))
        address = address_of(stream)
        if self.streams[remote] >= self.per_identity:
            self.refused += 1
            return None
        if address is not None and self.per_ip[address] >= self.per_address:
            if not self._evict_one(remote, lambda t: t.address == address, by_bytes=False):
                self.refused += 1
                return None
        if len(self.tickets) >= self.total and not self._evict_one(remote, lambda t: True, by_bytes=False):
            self.refused += 1
            return None
        ticket = Ticket(self, remote, address, next(self._order), charged=0)
        if not self._make_room(ticket, READ_CHUNK):
            self.refused += 1
            return None
        self.tickets[ticket.order] = ticket
        self.streams[remote] += 1
        if address is not None:
            self.per_ip[address] += 1
        self._add(ticket, READ_CHUNK)
        return ticket

    def _recharge(self, ticket: Ticket, charge: int) -> None:
        extra = charge - ticket.charged
        if extra > 0 and not self._make_room(ticket, extra):
            raise NoRoom(f"a {charge}-byte frame from {ticket.remote} does not fit the {self.budget}-byte budget "
                         f"of streams not admitted yet ({self.bytes} held)")
        self._add(ticket, extra)

    def _add(self, ticket: Ticket, extra: int) -> None:
        ticket.charged += extra
        self.held[ticket.remote] += extra
        self.bytes += extra

    def _make_room(self, ticket: Ticket, extra: int) -> bool:
        """Evict heavier identities' streams (by bytes) until `extra` more bytes fit; False if they cannot."""
        while self.bytes + extra > self.budget:
            if not self._evict_one(ticket.remote, lambda t: t is not ticket, by_bytes=True):
                return False
        return True

    def _evict_one(self, newcomer: str, scope: Callable[[Ticket], bool], *, by_bytes: bool) -> bool:
        """Evict the oldest stream, in `scope`, of the identity that holds the most there, if it holds
        strictly more than `newcomer` (module docstring). Returns whether one was evicted."""
        weight: Counter[str] = Counter()
        for t in self.tickets.values():
            if scope(t):
                weight[t.remote] += t.charged if by_bytes else 1
        mine = weight.pop(newcomer, 0)
        if not weight:
            return False
        heaviest = max(weight, key=lambda r: (weight[r], r))
        if weight[heaviest] <= mine:
            return False
        victim = next(t for t in self.tickets.values() if t.remote == heaviest and scope(t))
        victim.evicted = True
        self.evicted += 1
        victim.release()
        victim.scope.cancel()
        return True

    def _forget(self, ticket: Ticket) -> None:
        self.tickets.pop(ticket.order, None)
        self.streams[ticket.remote] -= 1
        if self.streams[ticket.remote] <= 0:
            del self.streams[ticket.remote]
        self.held[ticket.remote] -= ticket.charged
        if self.held[ticket.remote] <= 0:
            del self.held[ticket.remote]
        if ticket.address is not None:
            self.per_ip[ticket.address] -= 1
            if self.per_ip[ticket.address] <= 0:
                del self.per_ip[ticket.address]
        self.bytes -= ticket.charged
        ticket.charged = 0

    # -- refusing -------------------------------------------------------------------------

    async def refuse(self, stream: Stream, answer: object | None = None, *, limit: int = READ_CHUNK) -> None:
        """Tell a stream it got no room (`answer`, a protocol message, when it has one) and end it:
        the answer, a half-close, and up to REFUSAL_LINGER for the remote to read it and close,
        discarding at most `limit` bytes it still sends; then a reset. Past REFUSING refusals at
        once (or with nothing to say) the stream is reset at once."""
        if answer is None or self.refusing >= REFUSING:
            await stream.reset()
            return
        self.refusing += 1
        try:
            with trio.move_on_after(REFUSAL_LINGER):
                try:
                    await stream.write(encode_frame(encode(answer)))
                    await stream.close()
                    drained = 0
                    while drained <= limit and (chunk := await stream.read(READ_CHUNK)):
                        drained += len(chunk)
                except PeerError:
                    pass  # it left: nothing more to tell it
        finally:
            self.refusing -= 1
        await stream.reset()

    def snapshot(self) -> dict:
        """What the intake holds now (for tests, benches and the status)."""
        return {"streams": len(self.tickets), "bytes": self.bytes, "identities": len(self.streams),
                "refused": self.refused, "evicted": self.evicted}


__all__ = ["Intake", "Ticket", "NoRoom", "address_of", "PER_IDENTITY", "PER_ADDRESS", "TOTAL", "BUDGET",
           "REFUSAL_LINGER", "RETRY_AFTER"]
