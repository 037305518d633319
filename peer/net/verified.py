"""A signed record, verified once: what a keeper holds of each peer it believes.

Verification (signature, peer id, decoding; protocol/crypto.py) costs far more than the
rest of a merge, and the same record arrives from several neighbours — and, in a
simulation, at thousands of peers in one process. `verified_entry` keeps what it verified,
by the record's bytes, and checks only the lifetime again (that depends on the time).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.protocol.crypto import MAX_CLOCK_SKEW, verify_record
from tessera.protocol.errors import ExpiredRecord, RecordFromFuture
from tessera.protocol.records import PeerRecord, SignedRecord

from tessera.peer.base.ids import peer_id_text
from tessera.peer.net import record_set as rs
from tessera.peer.plan.view import PeerInfo, merge_spans

VERIFIED_CACHE = 1 << 17
"""Verified records kept (by their bytes): the same record, brought by several neighbours, is
verified once. Also what lets a simulation verify each record once for all its peers."""


def info_from_record(record: PeerRecord) -> PeerInfo:
    return PeerInfo(
        peer_id=peer_id_text(record.peer_id),
        model_id=record.model_id,
        start=record.start,
        end=record.end,
        throughput=record.throughput,
        name=record.name,
        free_memory=record.free_memory,
        load=record.load,
        max_sessions=record.max_sessions,
        state=record.state,
        reachability=record.reachability,
        addrs=tuple(record.addrs),
        rtt_ms={peer_id_text(n.peer_id): n.rtt_ms for n in record.neighbours},
        expires_at=record.expires_at,
        issued_at=record.issued_at,
        dtype=record.dtype,
        shard_index=record.shard_index,
        shard_count=record.shard_count,
        shard_group=record.shard_group,
        device=record.device,
        device_free=record.device_free,
        held=merge_spans((h.start, h.end) for h in record.held),
        context_tokens=record.context_tokens,
    )


@dataclass(frozen=True)
class Known:
    signed: SignedRecord
    record: PeerRecord
    info: PeerInfo


_VERIFIED: dict[tuple[bytes, bytes, bytes], rs.Entry] = {}


def verified_entry(signed: SignedRecord, now: float) -> rs.Entry:
    """The entry of a signed record, verified (once per distinct record). Raises WireError."""
    key = (signed.signature, signed.public_key, signed.record)
    entry = _VERIFIED.get(key)
    if entry is None:
        record = verify_record(signed, now=now)
        entry = rs.Entry(record.peer_id, record.seq, dead=False, gone_until=0.0, ends=record.expires_at,
                         value=Known(signed, record, info_from_record(record)), tag=signed.signature[:8])
        _VERIFIED[key] = entry
        if len(_VERIFIED) > VERIFIED_CACHE:
            del _VERIFIED[next(iter(_VERIFIED))]  # the oldest
        return entry
    record = entry.value.record
    if now >= record.expires_at:
        raise ExpiredRecord(f"record of {record.peer_id.hex()!r} expired at {record.expires_at!r}; now is {now!r}")
    if record.issued_at > now + MAX_CLOCK_SKEW:
        raise RecordFromFuture(f"record of {record.peer_id.hex()!r} issued_at {record.issued_at!r} is in the future")
    return entry


__all__ = ["Known", "info_from_record", "verified_entry", "VERIFIED_CACHE"]
