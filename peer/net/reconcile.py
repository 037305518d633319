"""One view exchange, turn by turn: find where two record sets differ and send only that.

Two peers hold record sets (peer/net/record_set.py) with a hash for every range of
the key space. The initiator's first turn is the digest of its whole set; from then on
each side, given the other's turn, answers it (`answer`):

- the records and departures the other side wanted (`ViewTurn.want`);
- for each range digest received: nothing if the hashes match; if the other side holds
  nothing there, every entry of ours in it; if ours is small (WHOLE_RANGE entries or
  fewer), a listing of it (peer, seq, departure) — from which the other side works out,
  entry by entry, what to push and what to want; otherwise the 16 sub-ranges' digests,
  one level further down;
- for each listing received: our entries it lacks or holds older (pushed), and the peers
  whose newer entries it listed (wanted).

An empty turn ends the exchange. Each level down splits a range 16 ways, so a
difference is found in at most MAX_DEPTH + 2 turns, and in about log_16(N / LEAF_SIZE)
+ 2 in practice (3-4 at ten thousand peers); what crosses is the digests along the
paths to the differences (16 hashes a level) and the entries that differ. Two sets
that agree cost one digest each way.

A set with nothing in a range gets everything in it at once — except a set with nothing
at all (a newcomer), which gets a sample (JOIN_SAMPLE) and then pulls the view in
PULL_RANGES slices, each from another random peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from tessera.protocol.records import (
    MAX_GOSSIP_RECORDS, Departure, RangeDigest, SignedRecord, Version, ViewTurn,
)

from tessera.peer.net import record_set as rs

WHOLE_RANGE = 2 * rs.LEAF_SIZE
"""A range with this few entries is listed rather than split: listing 16 entries costs about
what one level of 16 sub-range digests does, and ends the descent there."""
JOIN_SAMPLE = 32
"""What a peer that holds nothing gets from the first peer it asks: this many records from
across the key space (addresses enough to find others), not the whole view, which it pulls
next in PULL_RANGES slices from random peers (`pull_ranges`, gossip.py `pull_view`): no peer —
a join address least of all — sends a whole view per newcomer."""
PULL_DEPTH = 2
PULL_RANGES = rs.FANOUT ** PULL_DEPTH  # 256 slices: at 10,000 peers about 40 records each
MAX_TURNS = 2 * rs.MAX_DEPTH + 6
"""Turns one exchange may take (each descends a level; a few more for pushes and wants)."""
FRAME_ITEMS = 6000
"""CBOR data items per frame, below the decoder's budget (protocol/cbor.py MAX_ITEMS = 8192)."""


@dataclass
class TurnOut:
    """What one side sends in a turn, before it is cut into frames."""

    ranges: list[RangeDigest] = field(default_factory=list)
    want: list[bytes] = field(default_factory=list)
    records: list[SignedRecord] = field(default_factory=list)
    departures: list[Departure] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.ranges or self.want or self.records or self.departures)

    def push(self, entry: rs.Entry) -> None:
        """Send an entry: its signed record, or the departure."""
        if entry.dead:
            self.departures.append(Departure(entry.peer_id, entry.seq, entry.gone_until))
        else:
            self.records.append(entry.value.signed)


def opening(root: rs.Node | None) -> TurnOut:
    """The initiator's first turn: the digest of its whole set."""
    return TurnOut(ranges=[_digest_of(root, 0, 0)])


def pull_ranges(root: rs.Node | None, slices: range | list[int]) -> TurnOut:
    """An opening that compares the given slices (ranges at PULL_DEPTH) instead of the whole set:
    a newcomer's pull of part of the view (where it holds nothing, everything there is sent)."""
    return TurnOut(ranges=[_digest_of(root, PULL_DEPTH, prefix) for prefix in slices])


def _sample(root: rs.Node | None, k: int, salt: int) -> list[rs.Entry]:
    """Up to k distinct live records spread over the key space (where depends on `salt`)."""
    out: dict[bytes, rs.Entry] = {}
    step = (1 << rs.KEY_BITS) // k
    for i in range(4 * k):
        entry = rs.sample(root, (salt + i * step + (i // k) * (step // 4)) % (1 << rs.KEY_BITS))
        if entry is not None and not entry.dead:
            out.setdefault(entry.peer_id, entry)
        if len(out) >= k:
            break
    return list(out.values())


def _digest_of(root: rs.Node | None, depth: int, prefix: int) -> RangeDigest:
    digest, count, _ = rs.digest(root, depth, prefix)
    return RangeDigest(depth=depth, prefix=prefix, count=count, hash=digest)


def _listing(depth: int, prefix: int, digest: bytes, held: Iterable[rs.Entry]) -> RangeDigest:
    versions = tuple(Version(e.peer_id, e.seq, e.gone_until if e.dead else 0.0) for e in held)
    return RangeDigest(depth=depth, prefix=prefix, count=len(versions), hash=digest, whole=True, versions=versions)


def _version(v: Version) -> tuple[int, bool, float]:
    return (v.seq, v.gone_until > 0.0, v.gone_until)


def answer(root: rs.Node | None, received: ViewTurn | TurnOut, *, salt: int = 0) -> TurnOut:
    """Our reply to the other side's turn, given our set after merging what it pushed.
    `salt` picks which records a newcomer's sample holds (the asker's key: each gets others)."""
    out = TurnOut()
    for peer_id in dict.fromkeys(received.want):
        entry = rs.get(root, peer_id)
        if entry is not None:
            out.push(entry)
    for theirs in received.ranges:
        digest, count, held = rs.digest(root, theirs.depth, theirs.prefix)
        if theirs.whole:
            listed = {v.peer_id: v for v in theirs.versions}
            for entry in rs.range_entries(held):
                v = listed.pop(entry.peer_id, None)
                if v is None or _version(v) < entry.version:
                    out.push(entry)
                elif _version(v) > entry.version:
                    out.want.append(entry.peer_id)
            out.want.extend(listed)  # entries we do not hold at all
        elif digest == theirs.hash:
            continue
        elif theirs.count == 0:
            sample = theirs.depth == 0 and count > JOIN_SAMPLE  # a newcomer: a sample, not the view
            for entry in _sample(root, JOIN_SAMPLE, salt) if sample else rs.range_entries(held):
                out.push(entry)
        elif count <= WHOLE_RANGE or theirs.depth >= rs.MAX_DEPTH:
            out.ranges.append(_listing(theirs.depth, theirs.prefix, digest, rs.range_entries(held)))
        else:
            for prefix, sub_hash, sub_count in rs.children(held, theirs.depth, theirs.prefix):
                out.ranges.append(RangeDigest(depth=theirs.depth + 1, prefix=prefix, count=sub_count, hash=sub_hash))
    return out


def frames(turn: TurnOut, *, link: int = 0) -> Iterator[ViewTurn]:
    """The turn as frames, each within the wire limits; `link` rides on the first."""
    ranges, want, records, departures = list(turn.ranges), list(turn.want), list(turn.records), list(turn.departures)
    first = True
    while True:
        budget = FRAME_ITEMS
        take_r: list[RangeDigest] = []
        while ranges and len(take_r) < 256:
            cost = 14 + 8 * len(ranges[0].versions)
            if cost > budget and take_r:
                break
            budget -= cost
            take_r.append(ranges.pop(0))
        n_rec = min(len(records), MAX_GOSSIP_RECORDS, max(0, budget) // 8)
        take_rec, records = records[:n_rec], records[n_rec:]
        budget -= 8 * n_rec
        n_dep = min(len(departures), MAX_GOSSIP_RECORDS, max(0, budget) // 8)
        take_dep, departures = departures[:n_dep], departures[n_dep:]
        budget -= 8 * n_dep
        n_want = min(len(want), MAX_GOSSIP_RECORDS, max(0, budget))
        take_want, want = want[:n_want], want[n_want:]
        more = bool(ranges or want or records or departures)
        yield ViewTurn(ranges=tuple(take_r), want=tuple(take_want), records=tuple(take_rec),
                       departures=tuple(take_dep), more=more, link=link if first else 0)
        first = False
        if not more:
            return


__all__ = ["TurnOut", "opening", "pull_ranges", "answer", "frames", "WHOLE_RANGE", "MAX_TURNS", "JOIN_SAMPLE",
           "PULL_RANGES", "PULL_DEPTH"]
