"""Evidence about who computed what: attestations, fingerprints, misbehaviour reports.

Every Result a peer sends carries an **attestation**: its Ed25519 signature over
(session, step, positions, span, sha256 of the inputs it computed from, sha256
of the fingerprint of its output). A requester cannot forge one, so a peer that
returned wrong activations cannot deny it later.

A **fingerprint** is a compact summary of an output tensor (the top-k entries of
each row by magnitude, and the row's RMS; computed by `stages.fingerprint`), so a
spot-checking peer can answer with ~70 bytes per token instead of the whole row.

A **misbehaviour report** bundles the accused's attested fingerprint and those of
the witnesses (peers that recomputed the same step from the same inputs), signed
by the reporter. `verify_report` checks every signature and every hash — pure
cryptography; whether the fingerprints really disagree beyond honest float noise
is judged by `tessera.peer.request.verify.judge_report`, which knows the tolerances.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import nacl.exceptions
import nacl.signing

from tessera.protocol.codec import decode, encode, message
from tessera.protocol.errors import BadSignature, ForgedPeerId, InconsistentFields
from tessera.protocol.keys import Identity, peer_id_from_public_key, public_key_from_peer_id
from tessera.protocol.records import MAX_LAYERS, MAX_PEER_ID_SIZE
from tessera.protocol.schema import INT64_MAX, wire

ATTEST_CONTEXT = b"tessera/attestation/v1\x00"
REPORT_CONTEXT = b"tessera/misbehaviour-report/v1\x00"
MAX_FINGERPRINT = 16 * 1024  # bytes of one encoded fingerprint in a report (~200 rows)
MAX_ROWS = 64 * 1024  # bytes of full output rows one witness may carry
MAX_WITNESSES = 8
MAX_REPORT = 256 * 1024
REPORT_FRAME_LIMIT = MAX_REPORT + 1024
"""Largest frame the reports protocol reads: a MisbehaviourReport whose body is MAX_REPORT bytes
(a key, a signature and CBOR around it) is 262,285 bytes encoded; a ReportQuery 31."""


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@message("fingerprint")
@dataclass(frozen=True)
class Fingerprint:
    """The top-k entries of each row of an output [T, H], and each row's RMS.

    Attributes:
        indices: encoded int32 tensor [T, k], each row ascending.
        values: encoded float32 tensor [T, k], the entries at those indices.
        scale: encoded float32 tensor [T], the root mean square of each row.
    """

    indices: bytes = wire(max_len=2**24)
    values: bytes = wire(max_len=2**24)
    scale: bytes = wire(max_len=2**22)


@message("attestation")
@dataclass(frozen=True)
class Attestation:
    """What a peer signs about one step it computed (never sent alone; see Result.attestation)."""

    peer_id: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    session_id: bytes = wire(size=16)
    step: int = wire(max=INT64_MAX)
    start_pos: int = wire(max=INT64_MAX)
    n_tokens: int = wire(max=INT64_MAX)
    start: int = wire(max=MAX_LAYERS)
    end: int = wire(max=MAX_LAYERS)
    inputs_hash: bytes = wire(size=32)
    outputs_hash: bytes = wire(size=32)


def sign_attestation(identity: Identity, attestation: Attestation) -> bytes:
    """Raises ForgedPeerId if the attestation names another peer."""
    if attestation.peer_id != identity.peer_id:
        raise ForgedPeerId(f"attestation for {attestation.peer_id.hex()!r} cannot be signed by {identity.peer_id.hex()!r}")
    return identity.sign(ATTEST_CONTEXT + encode(attestation))


def verify_attestation(attestation: Attestation, signature: bytes) -> None:
    """Raises BadSignature unless `signature` is the named peer's over `attestation`."""
    try:
        key = nacl.signing.VerifyKey(public_key_from_peer_id(attestation.peer_id))
        key.verify(ATTEST_CONTEXT + encode(attestation), bytes(signature))
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError) as bad:
        raise BadSignature(f"attestation of step {attestation.step} does not verify: {bad}") from None


@message("witness")
@dataclass(frozen=True)
class Witness:
    """One peer's attested output for the reported step (the accused is one too).

    `output` optionally carries the full rows (an encoded tensor), so that anyone can
    compare them with the others beyond what fingerprints show."""

    peer_id: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    session_id: bytes = wire(size=16)
    step: int = wire(max=INT64_MAX)
    outputs_hash: bytes = wire(size=32)
    attestation: bytes = wire(size=64)
    fingerprint: bytes = wire(max_len=MAX_FINGERPRINT)
    dtype: str = wire(default="float32", max_len=16)
    output: bytes = wire(default=b"", max_len=MAX_ROWS)


@message("report-body")
@dataclass(frozen=True)
class ReportBody:
    """The claim: `accused` returned, for these inputs, an output unlike the witnesses'.

    Attributes:
        reporter: the requester's peer id.
        model_id, start, end: the model and the span [start, end) computed.
        start_pos, n_tokens: the positions of the reported step.
        inputs_hash: sha256 of the encoded inputs every party computed from.
        accused: the accused peer's attested output.
        witnesses: the recomputations it is compared against.
        issued_at: when the report was made (reporter's clock).
        reason: a short human-readable reason.
    """

    reporter: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    model_id: str = wire(max_len=128)
    start: int = wire(max=MAX_LAYERS)
    end: int = wire(max=MAX_LAYERS)
    start_pos: int = wire(max=INT64_MAX)
    n_tokens: int = wire(min=1, max=INT64_MAX)
    inputs_hash: bytes = wire(size=32)
    accused: Witness
    witnesses: tuple[Witness, ...] = wire(max_items=MAX_WITNESSES)
    issued_at: float = wire()
    reason: str = wire(default="", max_len=256)

    def __post_init__(self) -> None:
        if self.start >= self.end:
            raise InconsistentFields(f"ReportBody: span [{self.start!r}, {self.end!r}) is empty")


@message("report")
@dataclass(frozen=True)
class MisbehaviourReport:
    """A ReportBody, encoded, and the reporter's signature over it."""

    body: bytes = wire(max_len=MAX_REPORT)
    public_key: bytes = wire(size=32)
    signature: bytes = wire(size=64)


def sign_report(identity: Identity, body: ReportBody) -> MisbehaviourReport:
    if body.reporter != identity.peer_id:
        raise ForgedPeerId("a report must name its signer as the reporter")
    data = encode(body)
    return MisbehaviourReport(data, identity.public_key, identity.sign(REPORT_CONTEXT + data))


def witness_attestation(body: ReportBody, witness: Witness) -> Attestation:
    return Attestation(
        witness.peer_id, witness.session_id, witness.step, body.start_pos, body.n_tokens,
        body.start, body.end, body.inputs_hash, witness.outputs_hash,
    )


def verify_report(report: MisbehaviourReport) -> ReportBody:
    """Check the reporter's signature and every party's attestation and fingerprint hash.

    Raises BadSignature (reporter or any attestation), ForgedPeerId (the reporter id is
    not the signing key's), a decode error from `decode`, or InconsistentFields (a
    fingerprint whose hash is not the attested one, or the accused among the witnesses).
    """
    try:
        nacl.signing.VerifyKey(report.public_key).verify(REPORT_CONTEXT + report.body, report.signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError) as bad:
        raise BadSignature(f"report signature does not verify: {bad}") from None
    body = decode(report.body, expect=ReportBody)
    if body.reporter != peer_id_from_public_key(report.public_key):
        raise ForgedPeerId("the report's reporter is not the peer that signed it")
    for party in (body.accused, *body.witnesses):
        verify_attestation(witness_attestation(body, party), party.attestation)
        if sha256(party.fingerprint) != party.outputs_hash:
            raise InconsistentFields(f"the fingerprint of {party.peer_id.hex()[:16]}… is not the one it attested")
    if any(w.peer_id == body.accused.peer_id for w in body.witnesses):
        raise InconsistentFields("the accused cannot witness against itself")
    return body


@message("report-query")
@dataclass(frozen=True)
class ReportQuery:
    """Ask a peer for the misbehaviour reports it holds, issued at or after `since`."""

    since: float = wire(default=0.0)


@message("report-batch")
@dataclass(frozen=True)
class ReportBatch:
    """Reports, each to be verified on its own by the receiver."""

    reports: tuple[MisbehaviourReport, ...] = wire(max_items=64)
