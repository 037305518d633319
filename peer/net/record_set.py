"""The set of record versions a peer holds: a persistent trie with a hash for every range.

Gossip (peer/net/gossip.py) keeps every peer's view in agreement without sending one
entry per peer: two peers compare the hash of their whole set, and only where hashes
differ do they look closer — a range of the key space at a time — until the records
that differ are found. This module is the data structure under that.

Keys. A peer's key is the first 64 bits of blake2b(peer id): uniform over [0, 2**64),
whatever the ids look like. A *range* is a prefix of the key: ``(depth, prefix)`` holds
the keys whose top ``4 * depth`` bits are ``prefix`` (depth 0 is everything; each level
splits a range into 16).

Entries. One per peer: a live record (`seq`) or a departure (`seq` of the record that
died, `gone_until`: when the departure is forgotten). The *version* ``(seq, dead,
gone_until)`` orders them: a higher one replaces a lower one, so a departure beats the
record it reports and a record re-signed after it (a higher seq) beats the departure.

Shape. The trie's shape is a function of its entries alone: a range holding at most
LEAF_SIZE entries (or at MAX_DEPTH) is one leaf; a larger one is a branch of 16
sub-ranges. So two peers holding the same entries hold the same trie and the same
hashes, however they got there, and the hash of any range is well defined even where
one side's trie has a leaf above it (`digest`).

Persistence. Nodes are immutable: an update copies the path from the root down
(O(depth) = O(log_16 N) nodes) and shares everything else, so a snapshot is a root
pointer. Nodes are interned by hash, so the same content is one object: identical views
cost one copy, and work that depends only on a node (a `SwarmView` built from the
live records under a root) is done once per distinct node. A simulation of ten thousand
peers holding the same view holds it once; a real peer gets the same code and a
cache that rarely hits.

Costs: `put`, `remove` and `get` touch O(log N) nodes; `prune` touches only the
paths to entries whose time is up (every node knows the earliest time under it);
`entries` is O(N).
"""

from __future__ import annotations

import math
import weakref
from hashlib import blake2b
from struct import Struct
from typing import Any, Iterable, Iterator

KEY_BITS = 64
FANOUT_BITS = 4
FANOUT = 1 << FANOUT_BITS
MAX_DEPTH = KEY_BITS // FANOUT_BITS  # 16: a range at this depth is one key
LEAF_SIZE = 8
"""Entries a range holds before it splits. Eight keeps a leaf's listing (what a peer sends
when a range differs) near the size of one level of child hashes."""
HASH_SIZE = 16
EMPTY_HASH = bytes(HASH_SIZE)

_VERSION = Struct(">QBd")


def key_of(peer_id: bytes) -> int:
    """Where a peer sits in the key space (uniform whatever the id's format)."""
    return int.from_bytes(blake2b(peer_id, digest_size=8).digest(), "big")


def nibble(key: int, depth: int) -> int:
    """Which of the 16 sub-ranges of a range at `depth` holds `key`."""
    return (key >> (KEY_BITS - FANOUT_BITS * (depth + 1))) & (FANOUT - 1)


def in_range(key: int, depth: int, prefix: int) -> bool:
    return depth == 0 or key >> (KEY_BITS - FANOUT_BITS * depth) == prefix


class Entry:
    """One peer's entry: its version, what it holds, and when it leaves the set.

    value: what the set carries for it (gossip keeps its verified record, or the departure).
    ends:  the time the entry drops out (a record's expiry, a departure's `gone_until`).
    tag:   a few bytes that tell two different records of the same seq apart (the signature's).
    """

    __slots__ = ("key", "peer_id", "seq", "dead", "gone_until", "ends", "value", "digest")

    def __init__(self, peer_id: bytes, seq: int, *, dead: bool, gone_until: float, ends: float, value: Any,
                 tag: bytes = b"", key: int | None = None) -> None:
        self.key = key_of(peer_id) if key is None else key
        self.peer_id = peer_id
        self.seq = seq
        self.dead = dead
        self.gone_until = gone_until
        self.ends = ends
        self.value = value
        self.digest = blake2b(peer_id + _VERSION.pack(seq, dead, gone_until) + tag, digest_size=HASH_SIZE).digest()

    @property
    def version(self) -> tuple[int, bool, float]:
        return (self.seq, self.dead, self.gone_until)

    def __repr__(self) -> str:
        return f"Entry({self.peer_id[-4:].hex()}, seq={self.seq}, dead={self.dead})"


class Leaf:
    __slots__ = ("entries", "hash", "count", "ends", "memo", "__weakref__")

    def __init__(self, entries: tuple[Entry, ...], digest: bytes) -> None:
        self.entries = entries  # sorted by (key, peer id)
        self.hash = digest
        self.count = len(entries)
        self.ends = min(e.ends for e in entries)
        self.memo: dict = {}  # results that depend on this node alone (see module docstring)


class Branch:
    __slots__ = ("children", "hash", "count", "ends", "memo", "__weakref__")

    def __init__(self, children: tuple["Node | None", ...], digest: bytes) -> None:
        self.children = children
        self.hash = digest
        self.count = sum(c.count for c in children if c is not None)
        self.ends = min((c.ends for c in children if c is not None), default=math.inf)
        self.memo: dict = {}


Node = Leaf | Branch

# Every live node, by hash: the same content is built once (see "Persistence").
_INTERNED: "weakref.WeakValueDictionary[bytes, Node]" = weakref.WeakValueDictionary()


def _leaf_hash(entries: Iterable[Entry]) -> bytes:
    return blake2b(b"L" + b"".join(e.digest for e in entries), digest_size=HASH_SIZE).digest()


def _leaf(entries: tuple[Entry, ...]) -> Leaf:
    digest = _leaf_hash(entries)
    node = _INTERNED.get(digest)
    if node is None:
        node = _INTERNED[digest] = Leaf(entries, digest)
    return node  # type: ignore[return-value]


def _branch(children: tuple[Node | None, ...]) -> Branch:
    digest = blake2b(b"B" + b"".join(EMPTY_HASH if c is None else c.hash for c in children),
                     digest_size=HASH_SIZE).digest()
    node = _INTERNED.get(digest)
    if node is None:
        node = _INTERNED[digest] = Branch(children, digest)
    return node  # type: ignore[return-value]


def _sort_key(entry: Entry) -> tuple[int, bytes]:
    return (entry.key, entry.peer_id)


def build(entries: Iterable[Entry], depth: int = 0) -> Node | None:
    """The trie of `entries` (at most one per peer) under a range at `depth`."""
    items = sorted(entries, key=_sort_key)
    return _build(items, depth)


def _build(items: list[Entry], depth: int) -> Node | None:
    if not items:
        return None
    if len(items) <= LEAF_SIZE or depth >= MAX_DEPTH:
        return _leaf(tuple(items))
    groups: list[list[Entry]] = [[] for _ in range(FANOUT)]
    for e in items:
        groups[nibble(e.key, depth)].append(e)
    return _branch(tuple(_build(g, depth + 1) for g in groups))


def entries(node: Node | None) -> Iterator[Entry]:
    """Every entry under `node`, in key order."""
    if node is None:
        return
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, Leaf):
            yield from n.entries
        else:
            stack.extend(c for c in reversed(n.children) if c is not None)


def get(node: Node | None, peer_id: bytes, key: int | None = None) -> Entry | None:
    key = key_of(peer_id) if key is None else key
    depth = 0
    while node is not None:
        if isinstance(node, Leaf):
            for e in node.entries:
                if e.peer_id == peer_id:
                    return e
            return None
        node = node.children[nibble(key, depth)]
        depth += 1
    return None


def put(node: Node | None, entry: Entry, depth: int = 0) -> Node:
    """The trie with `entry` in place of the peer's old one (whatever its version: the caller decides)."""
    if node is None:
        return _leaf((entry,))
    if isinstance(node, Leaf):
        items = [e for e in node.entries if e.peer_id != entry.peer_id]
        items.append(entry)
        items.sort(key=_sort_key)
        return _build(items, depth)  # type: ignore[return-value]
    i = nibble(entry.key, depth)
    children = list(node.children)
    children[i] = put(children[i], entry, depth + 1)
    return _branch(tuple(children))


def remove(node: Node | None, peer_id: bytes, depth: int = 0, key: int | None = None) -> Node | None:
    """The trie without the peer's entry (the same node if it held none)."""
    key = key_of(peer_id) if key is None else key
    if node is None:
        return None
    if isinstance(node, Leaf):
        items = tuple(e for e in node.entries if e.peer_id != peer_id)
        if len(items) == node.count:
            return node
        return _leaf(items) if items else None
    i = nibble(key, depth)
    child = remove(node.children[i], peer_id, depth + 1, key)
    if child is node.children[i]:
        return node
    children = node.children[:i] + (child,) + node.children[i + 1:]
    return _collapse(children, depth)


def _collapse(children: tuple[Node | None, ...], depth: int) -> Node | None:
    """A branch, or the leaf it becomes once it holds LEAF_SIZE entries or fewer (canonical shape)."""
    count = sum(c.count for c in children if c is not None)
    if count == 0:
        return None
    if count <= LEAF_SIZE:
        return _leaf(tuple(sorted((e for c in children for e in entries(c)), key=_sort_key)))
    return _branch(children)


def prune(node: Node | None, now: float, depth: int = 0) -> Node | None:
    """The trie without the entries whose time is up (`ends <= now`); untouched below a node whose
    earliest end is later."""
    if node is None or node.ends > now:
        return node
    if isinstance(node, Leaf):
        items = tuple(e for e in node.entries if e.ends > now)
        return _leaf(items) if items else None
    children = tuple(prune(c, now, depth + 1) for c in node.children)
    return _collapse(children, depth)


def union(a: Node | None, b: Node | None, depth: int = 0) -> Node | None:
    """Both tries' entries, the higher version of each peer's (a's on a tie)."""
    if a is None:
        return b
    if b is None or a is b:
        return a
    if isinstance(a, Branch) and isinstance(b, Branch):
        return _branch(tuple(union(x, y, depth + 1) for x, y in zip(a.children, b.children)))
    small, big, small_is_a = (a, b, True) if isinstance(a, Leaf) else (b, a, False)
    out = big
    for e in small.entries:  # type: ignore[union-attr]
        other = get(big, e.peer_id, e.key)
        if other is None or e.version > other.version or (small_is_a and e.version == other.version):
            out = put(out, e, depth)
    return out


def digest(node: Node | None, depth: int, prefix: int) -> tuple[bytes, int, Node | tuple[Entry, ...] | None]:
    """The hash and entry count of range (depth, prefix), and what holds it: a node whose
    range it is, or the entries of a leaf above it that fall inside it."""
    d = 0
    while node is not None and d < depth:
        if isinstance(node, Leaf):
            items = tuple(e for e in node.entries if in_range(e.key, depth, prefix))
            return (_leaf_hash(items) if items else EMPTY_HASH), len(items), items
        node = node.children[(prefix >> (FANOUT_BITS * (depth - d - 1))) & (FANOUT - 1)]
        d += 1
    if node is None:
        return EMPTY_HASH, 0, None
    return node.hash, node.count, node


def range_entries(held: Node | tuple[Entry, ...] | None) -> Iterator[Entry]:
    """The entries of what `digest` returned."""
    if held is None:
        return iter(())
    if isinstance(held, tuple):
        return iter(held)
    return entries(held)


def children(held: Node | tuple[Entry, ...] | None, depth: int, prefix: int) -> list[tuple[int, bytes, int]]:
    """The 16 sub-ranges of range (depth, prefix) — (prefix, hash, count) each — from what `digest` returned."""
    out = []
    if isinstance(held, Branch):
        for i, c in enumerate(held.children):
            out.append(((prefix << FANOUT_BITS) | i, EMPTY_HASH if c is None else c.hash, 0 if c is None else c.count))
        return out
    items = list(range_entries(held))
    for i in range(FANOUT):
        sub = (prefix << FANOUT_BITS) | i
        mine = tuple(e for e in items if in_range(e.key, depth + 1, sub))
        out.append((sub, _leaf_hash(mine) if mine else EMPTY_HASH, len(mine)))
    return out


def sample(node: Node | None, target: int) -> Entry | None:
    """An entry near key `target` (the first on or after it, going round): with a uniformly
    random target, a close to uniform draw from the set. O(log N)."""
    depth = 0
    while node is not None:
        if isinstance(node, Leaf):
            return node.entries[target % node.count]
        i = nibble(target, depth)
        for step in range(FANOUT):
            child = node.children[(i + step) % FANOUT]
            if child is not None:
                break
        node = child
        depth += 1
    return None


def interned() -> int:
    """How many distinct nodes exist (for tests and the simulator's memory figures)."""
    return len(_INTERNED)


__all__ = ["Entry", "Leaf", "Branch", "Node", "build", "children", "digest", "entries", "get", "key_of", "nibble",
           "prune", "put", "range_entries", "remove", "sample", "union", "in_range", "interned", "LEAF_SIZE", "MAX_DEPTH",
           "FANOUT", "EMPTY_HASH", "HASH_SIZE", "KEY_BITS"]
