"""Tamper tests for the link cipher: every bit of every input it authenticates, replays
and reordering, frames from another session, link or direction, forgotten keys."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tessera.protocol.activations import clear_header, open_activations, seal_activations
from tessera.protocol.codec import decode, encode
from tessera.protocol.errors import (
    BadKey,
    CipherClosed,
    DecryptionFailed,
    FieldOutOfRange,
    ReplayedFrame,
    WireError,
    WrongLink,
)
from tessera.protocol.links import Direction, LinkCipher
from tessera.protocol.messages import Forward, Result

KEY, SESSION = os.urandom(32), os.urandom(16)
HEADER = b"clear header: start_pos=5 n_tokens=1"


def cipher(key: bytes = KEY, session: bytes = SESSION, link: int = 2, direction: Direction = Direction.FORWARD) -> LinkCipher:
    return LinkCipher(key, session_id=session, link_id=link, direction=direction)


def flips(data: bytes):
    for i in range(len(data) * 8):
        changed = bytearray(data)
        changed[i // 8] ^= 1 << (i % 8)
        yield bytes(changed)


def test_round_trip_with_increasing_counters_and_fresh_nonces() -> None:
    sender, receiver = cipher(), cipher()
    c1, ct1 = sender.seal(step=0, header=HEADER, plaintext=b"same")
    c2, ct2 = sender.seal(step=0, header=HEADER, plaintext=b"same")
    assert (c1, c2) == (1, 2) and ct1 != ct2
    assert receiver.open(step=0, header=HEADER, counter=c1, ciphertext=ct1) == b"same"
    assert receiver.open(step=0, header=HEADER, counter=c2, ciphertext=ct2) == b"same"
    assert receiver.last_accepted == 2 and sender.last_sent == 2


def test_every_bit_of_ciphertext_header_step_and_counter_is_authenticated() -> None:
    counter, ct = cipher().seal(step=9, header=HEADER, plaintext=os.urandom(40))
    for bad in flips(ct):
        with pytest.raises(DecryptionFailed, match="does not authenticate"):
            cipher().open(step=9, header=HEADER, counter=counter, ciphertext=bad)
    for bad in flips(HEADER):
        with pytest.raises(DecryptionFailed):
            cipher().open(step=9, header=bad, counter=counter, ciphertext=ct)
    for bit in range(63):
        with pytest.raises(DecryptionFailed):
            cipher().open(step=9 ^ (1 << bit), header=HEADER, counter=counter, ciphertext=ct)
    for bit in range(1, 63):  # the counter selects the nonce: a changed counter is a wrong nonce
        with pytest.raises(DecryptionFailed):
            cipher().open(step=9, header=HEADER, counter=counter ^ (1 << bit), ciphertext=ct)
    with pytest.raises(ReplayedFrame):  # counter 1 -> 0: never valid
        cipher().open(step=9, header=HEADER, counter=counter ^ 1, ciphertext=ct)
    with pytest.raises(FieldOutOfRange, match="not an int in"):
        cipher().open(step=9, header=HEADER, counter=counter ^ (1 << 63), ciphertext=ct)
    with pytest.raises(FieldOutOfRange, match="step"):
        cipher().open(step=9 ^ (1 << 63), header=HEADER, counter=counter, ciphertext=ct)
    for short in (b"", ct[:15]):
        with pytest.raises(DecryptionFailed, match="shorter than a tag"):
            cipher().open(step=9, header=HEADER, counter=counter, ciphertext=short)


@pytest.mark.parametrize(
    "other",
    [
        {"session": os.urandom(16)},
        {"link": 3},
        {"direction": Direction.BACKWARD},
        {"key": os.urandom(32)},
    ],
    ids=["other-session", "other-link", "reflected", "other-key"],
)
def test_frames_from_another_session_link_direction_or_key_fail(other: dict) -> None:
    counter, ct = cipher().seal(step=1, header=HEADER, plaintext=b"activations")
    with pytest.raises(DecryptionFailed):
        cipher(**other).open(step=1, header=HEADER, counter=counter, ciphertext=ct)


def test_replayed_and_backwards_frames_are_rejected_gaps_are_not() -> None:
    sender, receiver = cipher(), cipher()
    frames = [sender.seal(step=s, header=HEADER, plaintext=bytes([s])) for s in range(4)]
    receiver.open(step=0, header=HEADER, counter=frames[0][0], ciphertext=frames[0][1])
    receiver.open(step=2, header=HEADER, counter=frames[2][0], ciphertext=frames[2][1])  # frame 1 lost: fine
    for step in (0, 1, 2):  # replayed, or late and older than what was accepted
        with pytest.raises(ReplayedFrame, match=f"counter {frames[step][0]} is not above the last accepted 3"):
            receiver.open(step=step, header=HEADER, counter=frames[step][0], ciphertext=frames[step][1])
    assert receiver.open(step=3, header=HEADER, counter=frames[3][0], ciphertext=frames[3][1]) == b"\x03"


def test_a_forged_frame_does_not_advance_the_window() -> None:
    sender, receiver = cipher(), cipher()
    counter, ct = sender.seal(step=0, header=HEADER, plaintext=b"real")
    with pytest.raises(DecryptionFailed):
        receiver.open(step=0, header=HEADER, counter=10**6, ciphertext=os.urandom(64))
    assert receiver.open(step=0, header=HEADER, counter=counter, ciphertext=ct) == b"real"


def test_forgotten_keys_cannot_be_used() -> None:
    with cipher() as c:
        c.seal(step=0, header=b"", plaintext=b"x")
    assert "forgotten" in repr(c) and KEY.hex() not in repr(c)
    with pytest.raises(CipherClosed):
        c.seal(step=1, header=b"", plaintext=b"x")
    with pytest.raises(CipherClosed):
        c.open(step=1, header=b"", counter=2, ciphertext=bytes(32))
    with pytest.raises(BadKey):
        LinkCipher(bytes(16), session_id=SESSION, link_id=1, direction=Direction.FORWARD)


def forward(step: int = 3, link: int = 2, session: bytes = SESSION) -> Forward:
    return Forward(session_id=session, step=step, link_id=link, counter=0, start_pos=17, n_tokens=2, stop_layer=12, payload=b"")


def test_activations_round_trip_through_an_encoded_frame() -> None:
    hidden = torch.randn(2, 64)
    sent = seal_activations(cipher(), forward(), hidden)
    assert sent.counter == 1 and len(sent.payload) > hidden.numel() * 4
    assert torch.equal(open_activations(cipher(), decode(encode(sent))), hidden)
    result = Result(session_id=SESSION, step=3, link_id=2, counter=0, start_pos=17, n_tokens=2, payload=b"")
    assert torch.equal(open_activations(cipher(), seal_activations(cipher(), result, hidden)), hidden)


def test_every_bit_of_an_encoded_forward_frame_is_protected() -> None:
    blob = encode(seal_activations(cipher(), forward(), torch.randn(2, 4)))
    for bad in flips(blob):
        with pytest.raises(WireError):
            open_activations(cipher(), decode(bad))


@pytest.mark.parametrize(
    "field",
    [
        {"start_pos": 18},
        {"n_tokens": 1},
        {"stop_layer": 30},
        {"step": 4},
    ],
)
def test_moving_a_payload_to_other_clear_fields_fails(field: dict) -> None:
    sent = seal_activations(cipher(), forward(), torch.randn(2, 4))
    assert clear_header(dataclasses.replace(sent, **field)) != clear_header(sent)
    with pytest.raises(DecryptionFailed):
        open_activations(cipher(), dataclasses.replace(sent, **field))


def test_frames_for_another_link_or_session_are_refused_by_name_or_by_tag() -> None:
    sent = seal_activations(cipher(), forward(), torch.randn(1, 4))
    with pytest.raises(WrongLink, match="link 2 reached the cipher of session .* link 5"):
        open_activations(cipher(link=5), sent)
    other = os.urandom(16)
    with pytest.raises(WrongLink):
        open_activations(cipher(session=other), sent)
    relabelled = dataclasses.replace(sent, session_id=other, link_id=5)  # a relay rewrites the names
    with pytest.raises(DecryptionFailed):
        open_activations(cipher(session=other, link=5), relabelled)
    with pytest.raises(WrongLink):
        seal_activations(cipher(link=5), sent, torch.zeros(1))
