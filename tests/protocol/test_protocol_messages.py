"""Messages: round trips for every registered type (strategies derived from the
schema), and a typed error naming the problem for every way a message can be wrong."""

from __future__ import annotations

import math
import struct

import cbor2
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from tessera.protocol import schema
from tessera.protocol.codec import PROTOCOL_VERSION, decode, encode
from tessera.protocol.errors import (
    FieldOutOfRange,
    FrameTooLarge,
    InconsistentFields,
    InvalidCbor,
    MalformedMessage,
    MissingField,
    UnexpectedMessage,
    UnknownField,
    UnknownMessageType,
    UnsupportedVersion,
    WireError,
    WrongFieldType,
)
from tessera.protocol.messages import Forward, SessionAccept
from tessera.protocol.records import GossipPush, Heartbeat, PeerRecord, SignedRecord

ALL_TYPES = sorted(schema.message_types().items())
_SMALL_FLOATS = st.sampled_from([0.0, 0.5, 1.0, 60.0, 1e3, 1.7e9])


def strategy(node: schema.Node) -> st.SearchStrategy:
    """A hypothesis strategy for any value the node accepts, derived from its limits."""
    if isinstance(node, schema.Int):
        return st.integers(node.lo, node.hi)
    if isinstance(node, schema.Float):
        floats = st.floats(
            min_value=node.lo, max_value=node.hi, allow_nan=not node.finite, allow_infinity=not node.finite
        )
        # Small values too, so that cross-field invariants (issued_at <= expires_at) hold often.
        return floats | _SMALL_FLOATS.filter(lambda x: (node.lo is None or x >= node.lo) and (node.hi is None or x <= node.hi))
    if isinstance(node, schema.Bool):
        return st.booleans()
    if isinstance(node, schema.Bytes):
        small = st.binary(min_size=node.min_len, max_size=min(node.max_len, 300))
        return small | st.just(bytes(node.max_len)) if node.max_len <= 4096 else small
    if isinstance(node, schema.Str):
        chars = st.characters(blacklist_categories=("Cs", "Cc"))
        return st.text(chars, min_size=node.min_len, max_size=min(node.max_len, 64))
    if isinstance(node, schema.Tuple):
        return st.lists(strategy(node.item), max_size=min(node.max_items, 4)).map(tuple)
    if isinstance(node, schema.Optional):
        return st.none() | strategy(node.inner)
    if isinstance(node, schema.Message):
        return _message(node)
    raise TypeError(f"no strategy for {node!r}")


def _message(node: schema.Message) -> st.SearchStrategy:
    fields = st.fixed_dictionaries({spec.name: strategy(spec.node) for spec in node.fields})

    def build(kwargs: dict) -> object:
        try:
            return node.cls(**kwargs)
        except InconsistentFields:
            reject()

    return fields.map(build)


@pytest.mark.parametrize(("tag", "cls"), ALL_TYPES, ids=[tag for tag, _ in ALL_TYPES])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_round_trips(tag: str, cls: type, data: st.DataObject) -> None:
    msg = data.draw(strategy(schema.schema_of(cls)))
    blob = encode(msg)
    back = decode(blob)
    assert type(back) is cls
    assert back == msg
    assert encode(back) == blob  # byte-exact: floats keep every bit, -0.0 stays -0.0
    assert cbor2.loads(blob)[:2] == [PROTOCOL_VERSION, tag]


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_floats_round_trip_bit_exactly(x: float) -> None:
    msg = Heartbeat(seq=1, sent_at=x)
    assert struct.pack("<d", decode(encode(msg)).sent_at) == struct.pack("<d", x)


def test_half_and_single_precision_floats_from_other_encoders_are_accepted() -> None:
    blob = cbor2.dumps([1, "hb", {"seq": 1, "sent_at": 1.5}], canonical=True)  # 1.5 shrinks to float16
    assert blob.endswith(b"\xf9\x3e\x00")
    assert decode(blob) == Heartbeat(seq=1, sent_at=1.5)


def raw(tag: str, fields: dict, version: object = PROTOCOL_VERSION) -> bytes:
    return cbor2.dumps([version, tag, fields])


HB = {"seq": 3, "sent_at": 2.5}


@pytest.mark.parametrize(
    ("blob", "error", "needle"),
    [
        (raw("hb", HB, version=2), UnsupportedVersion, "version 2, expected 1"),
        (raw("hb", HB, version=True), UnsupportedVersion, "version True"),
        (raw("hb", HB, version=1.0), UnsupportedVersion, "version 1.0"),
        (raw("nope", HB), UnknownMessageType, "'nope', expected one of ["),
        (cbor2.dumps([1, "hb"]), MalformedMessage, "3-item array"),
        (cbor2.dumps({"v": 1}), MalformedMessage, "envelope"),
        (raw("hb", {"seq": 3}), MissingField, "Heartbeat.sent_at is missing"),
        (raw("hb", {**HB, "extra": 1}), UnknownField, "no field 'extra'"),
        (raw("hb", {"seq": True, "sent_at": 2.5}), WrongFieldType, "Heartbeat.seq: expected int, got bool True"),
        (raw("hb", {"seq": 3, "sent_at": 2}), WrongFieldType, "Heartbeat.sent_at: expected float, got int 2"),
        (raw("hb", {"seq": -1, "sent_at": 2.5}), FieldOutOfRange, "Heartbeat.seq: -1 is outside"),
        (raw("hb", {"seq": 3, "sent_at": math.nan}), FieldOutOfRange, "Heartbeat.sent_at: nan is not finite"),
        (raw("hb", {"seq": 3, "sent_at": -math.inf}), FieldOutOfRange, "-inf is not finite"),
        (raw("hb", []), WrongFieldType, "expected map for Heartbeat"),
        (raw("accept", {"session_id": b"short", "max_length": 5}), FieldOutOfRange, "b'short' is 5 bytes, expected exactly 16"),
        (raw("close", {"session_id": bytes(16), "reason": "a\x1b[2Jb"}), FieldOutOfRange, "control character '\\x1b'"),
        (raw("close", {"session_id": bytes(16), "reason": "x" * 257}), FieldOutOfRange, "257 characters"),
        (raw("gossip", {"records": "no"}), WrongFieldType, "GossipPush.records: expected array, got str"),
        (raw("gossip", {"records": [{}] * 257}), FieldOutOfRange, "257 items, expected at most 256"),
        (cbor2.dumps([1, "hb", HB]) + b"\x00", InvalidCbor, "1 trailing bytes"),
    ],
)
def test_each_defect_gets_its_own_error_naming_field_and_value(blob: bytes, error: type, needle: str) -> None:
    with pytest.raises(error) as info:
        decode(blob)
    assert needle in str(info.value)


def test_errors_inside_nested_messages_say_where() -> None:
    bad = {"record": b"", "public_key": bytes(31), "signature": bytes(64)}
    with pytest.raises(FieldOutOfRange, match=r"SignedRecord.public_key: .* 31 bytes, expected exactly 32") as info:
        decode(raw("gossip", {"records": [bad]}))
    assert "at GossipPush.records[0]" in info.value.__notes__


def test_cross_field_invariants_are_checked_on_decode_and_construction() -> None:
    fields = {name: getattr(_record(), name) for name in schema.schema_of(PeerRecord).names}
    fields["neighbours"] = []
    fields["addrs"] = list(fields["addrs"])
    with pytest.raises(InconsistentFields, match=r"layer range \[4, 4\) is empty"):
        decode(raw("record", {**fields, "start": 4, "end": 4}))
    with pytest.raises(InconsistentFields, match="shard_index 2 is not below shard_count 2"):
        decode(raw("record", {**fields, "shard_index": 2, "shard_count": 2}))
    with pytest.raises(InconsistentFields, match="lifetime"):
        PeerRecord(**{**fields, "addrs": (), "neighbours": (), "expires_at": fields["issued_at"] + 1e6})


def test_max_size_and_expect() -> None:
    blob = encode(Heartbeat(seq=1, sent_at=0.0))
    with pytest.raises(FrameTooLarge, match=f"message of {len(blob)} bytes exceeds max_size 10"):
        decode(blob, max_size=10)
    assert decode(blob, expect=Heartbeat) == Heartbeat(seq=1, sent_at=0.0)
    assert decode(blob, expect=(SessionAccept, Heartbeat)).seq == 1
    with pytest.raises(UnexpectedMessage, match=r"'hb' \(Heartbeat\), expected \['SignedRecord'\]"):
        decode(blob, expect=SignedRecord)


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(FieldOutOfRange, match="SessionAccept.max_length: 0 is outside"):
        encode(SessionAccept(session_id=bytes(16), max_length=0))
    with pytest.raises(WrongFieldType, match="expected tuple, got list"):
        encode(GossipPush(records=[]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a registered message type"):
        encode(object())


def test_every_error_is_a_wire_error() -> None:
    import tessera.protocol.errors as errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert len(classes) > 25
    assert all(issubclass(c, WireError) for c in classes)


def test_a_forward_header_is_small() -> None:
    msg = Forward(session_id=bytes(16), step=1, link_id=1, counter=1, start_pos=0, n_tokens=1, stop_layer=1, payload=b"")
    assert len(encode(msg)) < 120


def test_schema_rejects_unsupported_annotations_at_registration() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Bad:
        values: list[int]

    with pytest.raises(TypeError, match="Bad.values: annotation .* is not a wire type"):
        schema.register(Bad, "bad-test-only")

    @dataclass
    class Mutable:
        x: int

    with pytest.raises(TypeError, match="frozen dataclass"):
        schema.register(Mutable, "mutable-test-only")
    assert "bad-test-only" not in schema.message_types()


def _record() -> PeerRecord:
    return PeerRecord(
        peer_id=b"\x00" * 38, name="n", model_id="m", start=0, end=4, shard_index=0, shard_count=1,
        throughput=1.0, free_memory=1, load=0.0, max_sessions=1, state="serving", reachability="direct",
        addrs=("/ip4/127.0.0.1/tcp/1",), neighbours=(), issued_at=100.0, expires_at=160.0, seq=1,
    )
