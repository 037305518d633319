"""Signed peer records: the check that is about trust in the swarm rather than one session.

Keys and peer ids are in `tessera.protocol.keys`, link keys and ciphers in
`tessera.protocol.links`. (A private swarm's key is libp2p's pnet protector, peer/net/.)

- Signed advertisements. `sign_record` encodes a PeerRecord and signs
  "tessera/peer-record/v1\\0" + the encoding with the peer's identity key.
  `verify_record` checks, in order: the signature (over the exact bytes received,
  before parsing them), that the bytes are a valid PeerRecord, that its peer id is
  the one the signing key implies, and that it is current at `now` (which the
  caller passes in: this package reads no clock).
"""

from __future__ import annotations

import nacl.exceptions
import nacl.signing

from tessera.protocol.codec import decode, encode
from tessera.protocol.errors import (
    BadSignature,
    ExpiredRecord,
    ForgedPeerId,
    RecordFromFuture,
)
from tessera.protocol.keys import PEER_ID_PREFIX, Identity
from tessera.protocol.records import MAX_RECORD_SIZE, PeerRecord, SignedRecord

__all__ = ["MAX_CLOCK_SKEW", "RECORD_CONTEXT", "sign_record", "verify_record"]

RECORD_CONTEXT = b"tessera/peer-record/v1\x00"
"""Signed before the record bytes, so that a record signature means nothing elsewhere."""

MAX_CLOCK_SKEW = 300.0
"""Seconds a record's issued_at may lie ahead of our clock: volunteers' clocks
drift, and NTP-less laptops waking from sleep are minutes off."""


def sign_record(identity: Identity, record: PeerRecord) -> SignedRecord:
    """Encode and sign our own record.

    Raises:
        ForgedPeerId: `record.peer_id` is not `identity.peer_id`.
        MalformedMessage: a field of `record` is invalid (from `encode`).
    """
    if record.peer_id != identity.peer_id:
        raise ForgedPeerId(
            f"record peer_id {record.peer_id.hex()!r} is not the signer's {identity.peer_id.hex()!r}"
        )
    data = encode(record)
    return SignedRecord(record=data, public_key=identity.public_key, signature=identity.sign(RECORD_CONTEXT + data))


def verify_record(signed: SignedRecord, *, now: float, max_skew: float = MAX_CLOCK_SKEW) -> PeerRecord:
    """Check a signed record and return the PeerRecord inside it.

    Args:
        signed: as received (decoded, so its fields have their declared sizes).
        now: the current time, seconds since the epoch.
        max_skew: how far in the future `issued_at` may be.

    Raises:
        BadSignature: the signature does not verify under `signed.public_key`
            (or the key is not a valid Ed25519 key).
        MalformedMessage (any subclass): the signed bytes are not a valid PeerRecord.
        ForgedPeerId: the record's peer id is not derived from `signed.public_key`.
        ExpiredRecord: `now` is at or past `expires_at`.
        RecordFromFuture: `issued_at` is more than `max_skew` after `now`.
    """
    try:
        nacl.signing.VerifyKey(signed.public_key).verify(RECORD_CONTEXT + signed.record, signed.signature)
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        raise BadSignature(
            f"record signature {signed.signature[:8].hex()!r}... does not verify under key {signed.public_key.hex()!r}"
        ) from None
    record: PeerRecord = decode(signed.record, max_size=MAX_RECORD_SIZE, expect=PeerRecord)
    if record.peer_id != PEER_ID_PREFIX + signed.public_key:
        raise ForgedPeerId(
            f"record peer_id {record.peer_id.hex()!r} is not the signing key's "
            f"{(PEER_ID_PREFIX + signed.public_key).hex()!r}"
        )
    if now >= record.expires_at:
        raise ExpiredRecord(f"record of {record.peer_id.hex()!r} expired at {record.expires_at!r}; now is {now!r}")
    if record.issued_at > now + max_skew:
        raise RecordFromFuture(
            f"record of {record.peer_id.hex()!r} issued_at {record.issued_at!r} is more than "
            f"{max_skew!r} s after now ({now!r})"
        )
    return record
