"""Seeded mutation fuzzing of every decoder in tessera.protocol (this test suite's and bench/fuzz.py's).

The contract under test: whatever the bytes, a decoder returns a valid value or
raises a `WireError` subclass — no other exception, no hang, no allocation beyond
the limits. `run_target` feeds one target `cases` inputs, each a valid seed input
(from the target's corpus) put through one to three mutations:

- byte-level: bit flips, interesting bytes (CBOR heads for huge or indefinite
  lengths, tags, break), truncation, insertion, deletion, duplication, splicing
  with another corpus entry, random bytes, deep nesting, huge claimed lengths;
- structure-level: the input is parsed as CBOR and one node of the tree is
  replaced by a random value of a random type (wrong types, boundary and
  out-of-range numbers, NaN, control characters, long strings, nested junk), then
  re-encoded, so that the schema checks behind the CBOR parser are reached too.

The corpora are derived from the message registry (`random_message` builds a valid
instance of any registered type from its schema), so a message added later is
fuzzed without touching this file. Deterministic for a given seed; no clock is
read (the caller times the run).
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cbor2
import torch

# Every protocol module that registers messages, so that the corpora hold them all whoever
# imported what before (messages and records come with the imports below).
import tessera.protocol.attest  # noqa: F401
import tessera.protocol.dedicated  # noqa: F401
import tessera.protocol.shards  # noqa: F401
import tessera.protocol.weights  # noqa: F401
from tessera.protocol import schema
from tessera.protocol.admission import OPEN_FRAME_LIMIT, has_work, session_frame_limit, solve_work
from tessera.protocol.activations import clear_header, open_activations, seal_activations
from tessera.protocol.codec import decode, encode
from tessera.protocol.crypto import RECORD_CONTEXT, sign_record, verify_record
from tessera.protocol.errors import EndOfStream, InconsistentFields, WireError
from tessera.protocol.framing import FrameDecoder, encode_frame, read_frame
from tessera.protocol.keys import EphemeralKey, Identity
from tessera.protocol.links import Direction, LinkCipher, open_link_key, seal_link_key
from tessera.protocol.messages import Forward, SealedKey, SessionOpen
from tessera.protocol.shards import ShardOpen
from tessera.protocol.records import PeerRecord, SignedRecord
from tessera.protocol.tensors import DTYPES, decode_tensor, encode_tensor

FRAME_LIMIT = 4096
"""The frame target's max_size: small, so that oversized claims are common."""

_INTERESTING = (0x00, 0x01, 0x17, 0x18, 0x1B, 0x1F, 0x3B, 0x40, 0x5B, 0x5F, 0x60, 0x7B, 0x7F, 0x80, 0x9B, 0x9F,
                0xA0, 0xBB, 0xBF, 0xC0, 0xC2, 0xD8, 0xF4, 0xF6, 0xF7, 0xF8, 0xF9, 0xFB, 0xFF)
_FLOATS = (0.0, -0.0, 0.5, 1.0, 10.0, 1e3, float("nan"), float("inf"), float("-inf"), 1e308, 5e-324)
_INTS = (0, 1, -1, 23, 24, 255, 256, 2**16, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -(2**64))
_SIZES = (0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 71, 72, 73, 255, 1025)


@dataclass(frozen=True)
class Target:
    """One decoder under test.

    Attributes:
        name: short name for reports.
        run: feeds one input to the decoder(s); may return anything.
        corpus: valid inputs that mutations start from.
    """

    name: str
    run: Callable[[bytes], object]
    corpus: tuple[bytes, ...]


@dataclass
class FuzzReport:
    """What a run of one target saw.

    Attributes:
        target: the target's name.
        cases: inputs fed.
        outcomes: count per outcome: "ok" (accepted) or the WireError class name.
        failures: count of inputs that raised anything other than a WireError.
        examples: up to ten of those inputs, with the exception's repr.
    """

    target: str
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: int = 0
    examples: list[tuple[bytes, str]] = field(default_factory=list)


def run_target(target: Target, *, cases: int, seed: int) -> FuzzReport:
    """Feed `cases` mutated inputs to `target`; never raises for a decoder's sake."""
    rng = random.Random(seed)
    report = FuzzReport(target.name)
    for _ in range(cases):
        data = mutate(rng, rng.choice(target.corpus), target.corpus)
        report.cases += 1
        try:
            target.run(data)
            report.outcomes["ok"] += 1
        except WireError as exc:
            report.outcomes[type(exc).__name__] += 1
        except Exception as exc:  # noqa: BLE001 - this is exactly what we are hunting for
            report.failures += 1
            if len(report.examples) < 10:
                report.examples.append((data, repr(exc)[:300]))
    return report


# --- mutations -----------------------------------------------------------------------


def mutate(rng: random.Random, data: bytes, corpus: tuple[bytes, ...]) -> bytes:
    """One to three random mutations of `data` (see the module docstring)."""
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        data = rng.choice(_MUTATORS)(rng, bytearray(data), corpus)
    return bytes(data)


def _flip(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    for _ in range(rng.randint(1, 4)):
        if b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def _interesting(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    if b:
        b[rng.randrange(len(b))] = rng.choice(_INTERESTING)
    return bytes(b)


def _truncate(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    return bytes(b[: rng.randrange(len(b) + 1)])


def _insert(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    at = rng.randrange(len(b) + 1)
    return bytes(b[:at] + rng.randbytes(rng.randint(1, 16)) + b[at:])


def _delete(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    at = rng.randrange(len(b) + 1)
    return bytes(b[:at] + b[at + rng.randint(1, 16) :])


def _duplicate(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    at, n = rng.randrange(len(b) + 1), rng.randint(1, 32)
    to = rng.randrange(len(b) + 1)
    return bytes(b[:to] + b[at : at + n] + b[to:])


def _splice(rng: random.Random, b: bytearray, corpus: tuple[bytes, ...]) -> bytes:
    other = rng.choice(corpus)
    return bytes(b[: rng.randrange(len(b) + 1)] + other[rng.randrange(len(other) + 1) :])


def _huge_length(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    major = rng.choice((2, 3, 4, 5)) << 5
    claim = rng.choice((0xFFFFFFFFFFFFFFFF, 2**32, 10 * 2**30, 2**24, 2**16))
    at = rng.randrange(len(b) + 1)
    return bytes(b[:at] + bytes((major | 27,)) + claim.to_bytes(8, "big") + b[at:])


def _deep(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    opener = rng.choice((b"\x81", b"\xa1\x61a", b"\x9f", b"\xc6"))
    return opener * rng.choice((17, 100, 1000, 20000)) + bytes(b)


def _random_bytes(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    return rng.randbytes(rng.randint(0, 64))


def _random_cbor(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    at = rng.randrange(len(b) + 1)
    return bytes(b[:at] + cbor2.dumps(_random_value(rng, 3)) + b[at + rng.randint(0, 8) :])


def _structural(rng: random.Random, b: bytearray, _: tuple[bytes, ...]) -> bytes:
    """Parse as CBOR, replace one node with a random value, re-encode."""
    try:
        tree = cbor2.loads(bytes(b))
    except Exception:  # noqa: BLE001 - not CBOR (any more): fall back to a byte mutation
        return _flip(rng, b, ())
    nodes: list[tuple[Any, Any]] = []
    _collect(tree, nodes)
    if not nodes:
        return cbor2.dumps(_random_value(rng, 2))
    container, key = rng.choice(nodes)
    if isinstance(container, dict) and rng.random() < 0.2:
        del container[key]
    elif isinstance(container, dict) and rng.random() < 0.1:
        container[rng.choice(("x", key + "_", ""))] = _random_value(rng, 1)
    else:
        container[key] = _random_value(rng, 2)
    return cbor2.dumps(tree)


def _collect(tree: Any, nodes: list[tuple[Any, Any]]) -> None:
    if isinstance(tree, list):
        for i, item in enumerate(tree):
            nodes.append((tree, i))
            _collect(item, nodes)
    elif isinstance(tree, dict):
        for key, item in tree.items():
            if isinstance(key, str):
                nodes.append((tree, key))
            _collect(item, nodes)


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(9 if depth > 0 else 7)
    if kind == 0:
        return rng.choice(_INTS)
    if kind == 1:
        return rng.choice(_FLOATS)
    if kind == 2:
        return rng.choice((True, False, None))
    if kind == 3:
        return rng.randbytes(rng.choice(_SIZES))
    if kind == 4:
        return "".join(rng.choices("aZ0/ \x00\x1b\n\x7f\u00e9\u200f\U0001f600", k=rng.choice(_SIZES)))
    if kind == 5:
        return rng.randint(-(2**64), 2**64 - 1)
    if kind == 6:
        return rng.uniform(-1e9, 1e9)
    if kind == 7:
        return [_random_value(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(("a", "step", "payload", "link_id")): _random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))}


# Weighted by repetition: a third structural, so that most inputs get past the CBOR
# parser and exercise the schema and the checks behind it.
_MUTATORS = (_flip, _flip, _interesting, _truncate, _insert, _delete, _duplicate, _splice, _huge_length,
             _deep, _random_bytes, _random_cbor) + (_structural,) * 6


# --- valid inputs from the schema ----------------------------------------------------


def random_message(rng: random.Random, cls: type) -> Any:
    """A valid instance of a registered message class, drawn from its schema.

    Retries when a draw violates the class's own invariants (e.g. start >= end).
    """
    node = schema.schema_of(cls)
    for _ in range(200):
        try:
            return _draw(rng, node)
        except InconsistentFields:
            continue
    raise RuntimeError(f"could not draw a valid {cls.__name__} in 200 tries")


def _draw(rng: random.Random, node: schema.Node) -> Any:
    if isinstance(node, schema.Int):
        return rng.choice((node.lo, node.hi, min(node.lo + 1, node.hi), rng.randint(node.lo, min(node.hi, node.lo + 4096))))
    if isinstance(node, schema.Float):
        lo = 0.0 if node.lo is None else node.lo
        hi = lo + 1e4 if node.hi is None else node.hi
        return min(hi, rng.choice((lo, lo + 0.5, lo + 2.0, lo + 1e3, rng.uniform(lo, hi))))
    if isinstance(node, schema.Bool):
        return rng.random() < 0.5
    if isinstance(node, schema.Bytes):
        return rng.randbytes(node.max_len if node.min_len == node.max_len else rng.randint(node.min_len, min(node.max_len, 48)))
    if isinstance(node, schema.Str):
        return "".join(rng.choices("abcxyz/019.-\u00e9", k=rng.randint(node.min_len, min(node.max_len, 24))))
    if isinstance(node, schema.Tuple):
        return tuple(_draw(rng, node.item) for _ in range(rng.randint(0, min(node.max_items, 3))))
    if isinstance(node, schema.Optional):
        return None if rng.random() < 0.3 else _draw(rng, node.inner)
    if isinstance(node, schema.Message):
        return node.cls(**{spec.name: _draw(rng, spec.node) for spec in node.fields})
    raise TypeError(f"no generator for {node!r}")


# --- the targets ---------------------------------------------------------------------


def build_targets(seed: int = 0) -> list[Target]:
    """Every decoder, each with a corpus of valid inputs drawn with `seed`."""
    rng = random.Random(seed)
    messages = [random_message(rng, cls) for cls in schema.message_types().values() for _ in range(4)]
    message_corpus = tuple(encode(m) for m in messages)

    tensors = []
    for name, dtype in DTYPES.items():
        for rank in range(5):
            shape = tuple(rng.randint(0, 3) if rank > 2 else rng.randint(1, 5) for _ in range(rank))
            tensors.append(encode_tensor((torch.randn(shape) * 4).to(dtype)))

    frames = tuple(b"".join(encode_frame(m) for m in rng.sample(message_corpus, 3)) for _ in range(32))

    now = 1_700_000_000.0
    signer = Identity.from_seed(rng.randbytes(32))
    records = []
    for _ in range(16):
        record = dataclasses.replace(random_message(rng, PeerRecord), peer_id=signer.peer_id, issued_at=now, expires_at=now + 60)
        records.append(encode(sign_record(signer, record)))

    session_id, link_id = rng.randbytes(16), 7
    recipient, sender = Identity.from_seed(rng.randbytes(32)), EphemeralKey.from_private(rng.randbytes(32))
    link_key = rng.randbytes(32)
    sealed = tuple(
        encode(seal_link_key(link_key, session_id=session_id, link_id=link_id, sender=sender,
                             recipient_public_ed25519=recipient.public_key))
        for _ in range(8)
    )

    def cipher() -> LinkCipher:
        return LinkCipher(link_key, session_id=session_id, link_id=link_id, direction=Direction.FORWARD)

    sending = cipher()
    forwards = []
    for step, blob in enumerate(tensors[:20]):
        template = Forward(session_id=session_id, step=step, link_id=link_id, counter=0, start_pos=step,
                           n_tokens=1, stop_layer=3, payload=b"")
        forwards.append(encode(seal_activations(sending, template, decode_tensor(blob))))
    ciphertexts = tuple(decode(f).payload for f in forwards[:1])

    # What a stage server reads first on a session stream: one frame of at most OPEN_FRAME_LIMIT,
    # an open request whose work it checks and whose declared length sets its frame limit.
    opener = Identity.from_seed(rng.randbytes(32))
    opens = [dataclasses.replace(random_message(rng, cls), requester=opener.peer_id, work=solve_work(opener.peer_id, bits=8))
             for cls in (SessionOpen, ShardOpen) for _ in range(4)]
    open_requests = tuple(encode_frame(encode(m), max_size=OPEN_FRAME_LIMIT) for m in opens)

    def run_open_request(data: bytes) -> None:
        frames = FrameDecoder(max_size=OPEN_FRAME_LIMIT).feed(data)
        for payload in frames[:1]:
            msg = decode(payload, max_size=OPEN_FRAME_LIMIT)
            if isinstance(msg, (SessionOpen, ShardOpen)):
                has_work(msg.requester, msg.work, bits=8)
                session_frame_limit(msg.max_length, 576)

    def run_frames(data: bytes) -> None:
        decoder = FrameDecoder(max_size=FRAME_LIMIT)
        n = len(data)  # split into pieces at input-dependent points, some one byte long
        cuts = sorted({0, n % 5, n % 5 + 1, n // 3 + n % 2, n // 2, n - n % 3, n})
        for start, end in zip(cuts, cuts[1:]):
            decoder.feed(data[start:end])
        decoder.close()
        _read_all_frames(data)

    def run_record(data: bytes) -> None:
        verify_record(decode(data, expect=SignedRecord), now=now + 1)

    def run_record_body(data: bytes) -> None:
        # A correctly signed record whose contents are hostile: the checks after the signature.
        body = SignedRecord(record=data, public_key=signer.public_key, signature=signer.sign(RECORD_CONTEXT + data))
        verify_record(body, now=now + 1)

    def run_link_key(data: bytes) -> None:
        open_link_key(decode(data, expect=SealedKey), session_id=session_id, link_id=link_id,
                      recipient=recipient, sender_public=sender.public)

    def run_activations(data: bytes) -> None:
        open_activations(cipher(), decode(data, expect=Forward))

    def run_cipher(data: bytes) -> None:
        cipher().open(step=0, header=forward_header, counter=1, ciphertext=data)

    forward_header = clear_header(decode(forwards[0]))
    return [
        Target("message", decode, message_corpus),
        Target("tensor", decode_tensor, tuple(tensors)),
        Target("frame", run_frames, frames),
        Target("open_request", run_open_request, open_requests),
        Target("record", run_record, tuple(records)),
        Target("record_body", run_record_body, tuple(decode(r).record for r in records)),
        Target("link_key", run_link_key, sealed),
        Target("activations", run_activations, tuple(forwards)),
        Target("cipher", run_cipher, ciphertexts),
    ]


def _read_all_frames(data: bytes) -> None:
    """Read `data` with read_frame until it ends; the reader must never be asked for
    more than FRAME_LIMIT bytes (AssertionError otherwise, which counts as a failure)."""
    pos = 0

    async def read_exactly(n: int) -> bytes:
        nonlocal pos
        assert n <= FRAME_LIMIT, f"read_frame asked for {n} bytes, limit {FRAME_LIMIT}"
        chunk = data[pos : pos + n]
        pos += n
        return chunk

    while True:
        coro = read_frame(read_exactly, max_size=FRAME_LIMIT)
        try:
            coro.send(None)
        except StopIteration:
            continue  # one frame read; the reader never suspends, so send() completes it
        except EndOfStream:
            return
        raise AssertionError("read_frame suspended on a reader that never blocks")
