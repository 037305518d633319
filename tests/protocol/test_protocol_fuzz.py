"""Fuzzing in the normal test run: 100,000 mutated inputs into every decoder (20,000
for the one that signs each input first), and nothing but a WireError may come out.

The targets and mutations live in `tests/protocol/fuzz.py` (shared with the longer campaign in
bench/fuzz.py). Corpora are drawn from the message registry, so a message added
later is fuzzed here without a new test. Set TESSERA_FUZZ_SEED to explore other
seeds; a failure report shows the offending inputs in hex.
"""

from __future__ import annotations

import os

import pytest

from tessera.protocol import schema
from tessera.protocol.codec import decode
from tessera.protocol.errors import WireError
from .fuzz import build_targets, random_message, run_target

# Messages registered outside protocol/ (the NAT protocols) join the registry when their
# modules are imported: import them here, so the corpora hold them whatever ran before
# (fuzz.py imports protocol's own).
import tessera.peer.net.nat.dialback  # noqa: E402
import tessera.peer.net.nat.links  # noqa: F401,E402

CASES = 100_000
FEWER = {"record_body": 20_000}  # signs every input first (~170 us a case); bench/fuzz.py runs it longer
SEED = int(os.environ.get("TESSERA_FUZZ_SEED", "20240601"))
TARGETS = build_targets(SEED)


def test_there_is_a_target_for_every_decoder() -> None:
    assert {t.name for t in TARGETS} == {
        "message", "tensor", "frame", "open_request", "record", "record_body", "link_key", "activations", "cipher"
    }


def test_the_message_corpus_holds_every_registered_type() -> None:
    (messages,) = [t for t in TARGETS if t.name == "message"]
    assert {type(decode(blob)) for blob in messages.corpus} == set(schema.message_types().values())
    assert tessera.peer.net.nat.dialback.DialBackRequest in {type(decode(blob)) for blob in messages.corpus}


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_every_corpus_entry_is_accepted(target) -> None:
    for blob in target.corpus:
        target.run(blob)  # a valid seed: the mutations start from inputs that get all the way through


@pytest.mark.timeout(180)
@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_only_wire_errors_escape(target) -> None:
    cases = FEWER.get(target.name, CASES)
    report = run_target(target, cases=cases, seed=SEED)
    shown = "\n".join(f"{data[:200].hex()}  ->  {error}" for data, error in report.examples)
    assert report.failures == 0, f"{report.failures} inputs raised something other than WireError:\n{shown}"
    assert report.cases == cases
    # The mutations reach past the first check: several distinct outcomes, some inputs accepted
    # (except where acceptance needs a forged signature or authentication tag).
    assert len(report.outcomes) >= 3 or target.name == "cipher", report.outcomes
    assert sum(report.outcomes.values()) == cases


def test_random_message_draws_valid_instances_of_every_type() -> None:
    import random

    rng = random.Random(1)
    for cls in schema.message_types().values():
        msg = random_message(rng, cls)
        assert type(msg) is cls


@pytest.mark.parametrize(
    "blob",
    [
        b"\x81" * 1_000_000 + b"\x00",  # a million levels of nesting
        b"\x83\x01\x62hb\xbb" + b"\xff" * 8,  # a map claiming 2**64 - 1 entries
        b"\x83\x01\x62hb\xa1\x63seq\x5b" + b"\x00\x00\x00\x02\x80\x00\x00\x00",  # a 10 GiB byte string
        bytes(range(256)) * 64,
    ],
    ids=["deep", "huge-map", "huge-bytes", "noise"],
)
def test_hostile_inputs_into_every_target(blob: bytes) -> None:
    for target in TARGETS:
        try:
            target.run(blob)
        except WireError:
            pass
