"""Identities and peer ids (checked against py-libp2p), signed advertisements, sealed
link keys, and the swarm key proof."""

from __future__ import annotations

import dataclasses
import os

import pytest
from libp2p.crypto.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from libp2p.peer.id import ID

from tessera.protocol.codec import decode, encode
from tessera.protocol.crypto import (
    RECORD_CONTEXT, sign_record, verify_record,
)
from tessera.protocol.keys import (
    EphemeralKey, Identity, peer_id_from_public_key, public_key_from_peer_id, x25519_public_from_ed25519,
)
from tessera.protocol.links import open_link_key, seal_link_key
from tessera.protocol.errors import (
    BadKey,
    BadSignature,
    DecryptionFailed,
    ExpiredRecord,
    ForgedPeerId,
    RecordFromFuture,
    UnexpectedMessage,
    WrongLink,
)
from tessera.protocol.records import Heartbeat, Neighbour, PeerRecord, SignedRecord
from tessera.protocol.messages import SealedKey

NOW = 1_700_000_000.0
NEIGHBOUR = Identity.from_seed(bytes([7]) * 32)


@pytest.mark.parametrize("seed", [bytes(32), bytes(range(32)), bytes.fromhex("d4c48b531c9a392f46353b7cb25cd395e715fd8a80fb80ceec3aa5dc44466c25")],
                         ids=["zeros", "counting", "random"])
def test_peer_id_is_the_libp2p_peer_id_of_the_same_key(seed: bytes) -> None:
    me = Identity.from_seed(seed)
    libp2p_key = Ed25519PrivateKey.from_bytes(seed)
    assert libp2p_key.get_public_key().to_bytes() == me.public_key
    assert ID.from_pubkey(Ed25519PublicKey.from_bytes(me.public_key)).to_bytes() == me.peer_id
    assert me.peer_id == peer_id_from_public_key(me.public_key)
    assert public_key_from_peer_id(me.peer_id) == me.public_key
    assert Identity.from_seed(me.seed).peer_id == me.peer_id
    assert seed.hex() not in repr(me)


def test_x25519_conversion_agrees_on_both_halves() -> None:
    me = Identity.generate()
    assert x25519_public_from_ed25519(me.public_key) == me.x25519_public()
    eph = EphemeralKey.generate()
    assert eph.exchange(me.x25519_public()) == EphemeralKey.from_private(me.x25519_private()).exchange(eph.public)


def test_bad_keys() -> None:
    with pytest.raises(BadKey, match="Ed25519 seed is 31 bytes, expected 32"):
        Identity.from_seed(bytes(31))
    with pytest.raises(BadKey, match="is not a valid curve point"):
        x25519_public_from_ed25519(bytes(32))
    with pytest.raises(BadKey, match="does not inline an Ed25519 public key"):
        public_key_from_peer_id(b"\x12\x20" + bytes(32))
    with pytest.raises(BadKey, match="low order"):
        EphemeralKey.generate().exchange(bytes(32))


def record_of(me: Identity, **changes: object) -> PeerRecord:
    base = PeerRecord(
        peer_id=me.peer_id, name="laptop", model_id="smollm2-135m", start=0, end=15, shard_index=0,
        shard_count=1, throughput=41.5, free_memory=2**31, load=0.25, max_sessions=8, state="serving",
        reachability="direct", addrs=("/ip4/10.0.0.2/tcp/4001",),
        neighbours=(Neighbour(peer_id=NEIGHBOUR.peer_id, rtt_ms=12.5),),
        issued_at=NOW, expires_at=NOW + 120, seq=7,
    )
    return dataclasses.replace(base, **changes)


def test_signed_records_verify_after_a_round_trip() -> None:
    me = Identity.generate()
    signed = decode(encode(sign_record(me, record_of(me))))
    assert verify_record(signed, now=NOW + 1) == record_of(me)


def test_tampered_or_forged_records_are_rejected() -> None:
    me, mallory = Identity.generate(), Identity.generate()
    signed = sign_record(me, record_of(me))
    for i in range(len(signed.record)):  # any changed byte of the record breaks the signature
        changed = bytearray(signed.record)
        changed[i] ^= 0x01
        with pytest.raises(BadSignature):
            verify_record(dataclasses.replace(signed, record=bytes(changed)), now=NOW)
    with pytest.raises(BadSignature):
        verify_record(dataclasses.replace(signed, signature=bytes(64)), now=NOW)
    with pytest.raises(BadSignature):  # the right record, re-attributed to another key
        verify_record(dataclasses.replace(signed, public_key=mallory.public_key), now=NOW)
    # Mallory signs, with her own key, a record that claims to be from me.
    forged_record = encode(record_of(me))
    forged = SignedRecord(record=forged_record, public_key=mallory.public_key, signature=mallory.sign(RECORD_CONTEXT + forged_record))
    with pytest.raises(ForgedPeerId, match="is not the signing key's"):
        verify_record(forged, now=NOW)
    with pytest.raises(ForgedPeerId, match="is not the signer's"):
        sign_record(mallory, record_of(me))
    # A signature over something that is not a PeerRecord proves nothing.
    other = encode(Heartbeat(seq=1, sent_at=NOW))
    with pytest.raises(UnexpectedMessage):
        verify_record(SignedRecord(record=other, public_key=me.public_key, signature=me.sign(RECORD_CONTEXT + other)), now=NOW)
    # ... and a bare signature without the domain prefix does not verify.
    plain = encode(record_of(me))
    with pytest.raises(BadSignature):
        verify_record(SignedRecord(record=plain, public_key=me.public_key, signature=me.sign(plain)), now=NOW)


def test_record_times() -> None:
    me = Identity.generate()
    signed = sign_record(me, record_of(me))
    verify_record(signed, now=NOW + 119.999)
    with pytest.raises(ExpiredRecord, match=f"expired at {NOW + 120!r}; now is {NOW + 120!r}"):
        verify_record(signed, now=NOW + 120)
    verify_record(signed, now=NOW - 300)
    with pytest.raises(RecordFromFuture, match="more than 300.0 s after now"):
        verify_record(signed, now=NOW - 300.5)
    with pytest.raises(RecordFromFuture):
        verify_record(signed, now=NOW - 10, max_skew=5)


SESSION, OTHER_SESSION = os.urandom(16), os.urandom(16)


def test_link_keys_open_only_for_their_peer_session_link_and_sender() -> None:
    requester, peer, stranger = EphemeralKey.generate(), Identity.generate(), Identity.generate()
    key = os.urandom(32)
    sealed = seal_link_key(key, session_id=SESSION, link_id=4, sender=requester, recipient_public_ed25519=peer.public_key)
    assert len(encode(sealed)) < 100
    sealed = decode(encode(sealed), expect=SealedKey)
    opened = open_link_key(sealed, session_id=SESSION, link_id=4, recipient=peer, sender_public=requester.public)
    assert opened == key

    def attempt(**changes: object) -> None:
        kwargs = {"session_id": SESSION, "link_id": 4, "recipient": peer, "sender_public": requester.public, **changes}
        open_link_key(kwargs.pop("sealed", sealed), **kwargs)

    with pytest.raises(DecryptionFailed, match="does not open with this peer's key"):
        attempt(recipient=stranger)
    with pytest.raises(DecryptionFailed):
        attempt(session_id=OTHER_SESSION)
    with pytest.raises(DecryptionFailed):
        attempt(sender_public=EphemeralKey.generate().public)
    with pytest.raises(WrongLink, match="sealed key is for link 4, expected link 5"):
        attempt(link_id=5)
    with pytest.raises(DecryptionFailed):  # relabelled to look like link 5
        attempt(link_id=5, sealed=dataclasses.replace(sealed, link_id=5))
    for i in range(len(sealed.box)):
        box = bytearray(sealed.box)
        box[i] ^= 0x80
        with pytest.raises(DecryptionFailed):
            attempt(sealed=dataclasses.replace(sealed, box=bytes(box)))
    with pytest.raises(BadKey, match="low order"):
        attempt(sender_public=bytes(32))


def test_the_same_key_sealed_twice_looks_different_and_forgotten_senders_cannot_seal() -> None:
    requester, peer = EphemeralKey.generate(), Identity.generate()
    key = os.urandom(32)
    a = seal_link_key(key, session_id=SESSION, link_id=1, sender=requester, recipient_public_ed25519=peer.public_key)
    b = seal_link_key(key, session_id=SESSION, link_id=1, sender=requester, recipient_public_ed25519=peer.public_key)
    assert a.box != b.box
    requester.forget()
    with pytest.raises(BadKey, match="forgotten"):
        seal_link_key(key, session_id=SESSION, link_id=1, sender=requester, recipient_public_ed25519=peer.public_key)
    with pytest.raises(BadKey, match="link key is 31 bytes"):
        seal_link_key(key[:31], session_id=SESSION, link_id=1, sender=EphemeralKey.generate(), recipient_public_ed25519=peer.public_key)


def test_remembered_exchanges_never_mix_senders_or_recipients() -> None:
    """Each side keeps the X25519 exchanges it made (one per peer per session, not per key):
    keys sealed by two sessions to two peers, opened interleaved, each open only where
    they were sealed to, and a recycled secret would show as a DecryptionFailed."""
    senders, peers = [EphemeralKey.generate() for _ in range(2)], [Identity.generate() for _ in range(2)]
    sealed = {(s, p, link): (key := os.urandom(32), seal_link_key(
        key, session_id=SESSION, link_id=link, sender=senders[s], recipient_public_ed25519=peers[p].public_key))
        for link in (1, 2) for s in (0, 1) for p in (0, 1)}
    for (s, p, link), (key, box) in sealed.items():
        for other in (0, 1):
            kwargs = {"session_id": SESSION, "link_id": link, "recipient": peers[other]}
            if other == p:
                assert open_link_key(box, sender_public=senders[s].public, **kwargs) == key
                with pytest.raises(DecryptionFailed):  # right after a success with the other sender
                    open_link_key(box, sender_public=senders[1 - s].public, **kwargs)
            else:
                with pytest.raises(DecryptionFailed):
                    open_link_key(box, sender_public=senders[s].public, **kwargs)
