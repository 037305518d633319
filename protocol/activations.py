"""Putting a tensor into a Forward/Result frame and getting it out again.

The frame's clear fields (session, step, positions, layers, ...) are bound into the
AEAD associated data, so a relay cannot move a payload to another step or position.
The clear header bound is the message itself, encoded with `counter = 0` and
`payload = b""`: every field, including fields added to Forward or Result later,
is covered without anyone having to remember to add it here.

    msg = seal_activations(cipher, Forward(..., counter=0, payload=b""), hidden)
    ...                                   # frame crosses the network
    hidden = open_activations(cipher, msg)          # raises a WireError if anything is off
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch

from tessera.protocol import cbor
from tessera.protocol.codec import PROTOCOL_VERSION
from tessera.protocol.errors import WrongLink
from tessera.protocol.links import LinkCipher
from tessera.protocol.messages import Forward, Result
from tessera.protocol.schema import schema_of
from tessera.protocol.tensors import DEFAULT_LIMITS, TensorLimits, decode_tensor, encode_tensor

StepMessage = TypeVar("StepMessage", Forward, Result)


def clear_header(msg: Forward | Result) -> bytes:
    """The bytes of `msg`'s clear fields that the AEAD binds: its encoding with
    counter 0 and an empty payload (built from the field map, without a copy of msg).

    Raises:
        MalformedMessage: a field of `msg` is invalid.
    """
    node = schema_of(type(msg))
    fields = node.dump(msg)
    fields["counter"], fields["payload"] = 0, b""
    return cbor.dumps([PROTOCOL_VERSION, node.tag, fields])


def seal_activations(cipher: LinkCipher, template: StepMessage, tensor: torch.Tensor) -> StepMessage:
    """Encode and encrypt `tensor`; return `template` with counter and payload filled in.

    Raises:
        WrongLink: `template` names another session or link than `cipher`.
        UnsupportedDtype: the tensor's dtype cannot be encoded.
        MalformedMessage: a field of `template` is invalid.
        CipherClosed, CounterExhausted: see LinkCipher.seal.
    """
    return seal_payload(cipher, template, encode_tensor(tensor))


def seal_payload(cipher: LinkCipher, template: StepMessage, plaintext: bytes) -> StepMessage:
    """Encrypt any plaintext (an encoded tensor, or a fingerprint) into `template`'s payload."""
    _check_link(cipher, template)
    header = clear_header(template)
    counter, payload = cipher.seal(step=template.step, header=header, plaintext=plaintext)
    return dataclasses.replace(template, counter=counter, payload=payload)


def open_payload(cipher: LinkCipher, msg: Forward | Result) -> bytes:
    """Decrypt a received frame's payload (raises WrongLink, ReplayedFrame, DecryptionFailed)."""
    _check_link(cipher, msg)
    return cipher.open(step=msg.step, header=clear_header(msg), counter=msg.counter, ciphertext=msg.payload)


def open_activations(
    cipher: LinkCipher,
    msg: Forward | Result,
    *,
    limits: TensorLimits = DEFAULT_LIMITS,
) -> torch.Tensor:
    """Decrypt and decode the tensor in a received Forward/Result.

    The tensor views the decrypted plaintext (read-only memory: clone before
    modifying it in place; see `decode_tensor`). NaN/inf are not checked here: the
    stage calls `check_finite`.

    Raises:
        WrongLink: `msg` names another session or link than `cipher`.
        ReplayedFrame, DecryptionFailed, CipherClosed: see LinkCipher.open.
        BadTensor (any subclass): the plaintext is not a valid tensor within `limits`.
    """
    return decode_tensor(open_payload(cipher, msg), limits=limits)


def _check_link(cipher: LinkCipher, msg: Forward | Result) -> None:
    if msg.session_id != cipher.session_id or msg.link_id != cipher.link_id:
        raise WrongLink(
            f"frame for session {msg.session_id.hex()!r} link {msg.link_id!r} reached the cipher of "
            f"session {cipher.session_id.hex()!r} link {cipher.link_id!r}"
        )
