"""Every protocol reads a stranger's frames with the smallest limit its own messages need.

For each limit, the largest message its protocol may send at every wire limit (the longest
strings in 4-byte characters, every list full, the widest integers and floats) is built and
encoded: it must fit — a limit under it would refuse an honest peer — and the limit must not
be much more than it (the point of the limit; before, ping, gossip, reports and weights read
up to 64 MiB from anyone)."""

from __future__ import annotations

import pytest

from tessera.peer.net.nat import dialback, links
from tessera.peer.net.nat.dialback import NONCE_SIZE, DialBackProbe, DialBackRequest
from tessera.peer.net.nat.links import LinkReport
from tessera.protocol.admission import LINK_FRAME_LIMIT
from tessera.protocol.attest import MAX_REPORT, REPORT_FRAME_LIMIT, MisbehaviourReport, ReportQuery
from tessera.protocol.codec import encode
from tessera.protocol.framing import encode_frame
from tessera.protocol.messages import LinkHello
from tessera.protocol.records import (
    GOSSIP_FRAME_LIMIT, HEARTBEAT_FRAME_LIMIT, LINK_BYE, MAX_GOSSIP_RECORDS, MAX_LOAD_COUNT, MAX_LOAD_WAIT,
    MAX_PEER_ID_SIZE, MAX_RANGE_DEPTH, MAX_RANGE_VERSIONS, MAX_RECORD_SIZE, MAX_TURN_RANGES, RANGE_HASH_SIZE, Departure,
    GossipPush, Heartbeat, LoadReport, RangeDigest, SignedRecord, Version, ViewTurn,
)
from tessera.protocol.schema import INT64_MAX
from tessera.protocol.weights import (
    MAX_NAME_LEN, MODEL_ID_LEN, REQUEST_FRAME_LIMIT, WeightChunkRequest, WeightManifestRequest,
)

WIDE = "\U0001F600"  # a 4-byte character: string limits count characters
FAR = -1.7976931348623157e308  # a float that CBOR cannot shorten


def largest_view_turn() -> ViewTurn:
    record = SignedRecord(b"r" * MAX_RECORD_SIZE, b"k" * 32, b"s" * 64)
    version = Version(b"p" * MAX_PEER_ID_SIZE, INT64_MAX, -FAR)
    ranges = (RangeDigest(MAX_RANGE_DEPTH, 2 ** 64 - 1, INT64_MAX, b"h" * RANGE_HASH_SIZE, True,
                          (version,) * MAX_RANGE_VERSIONS),) * MAX_TURN_RANGES
    departures = (Departure(b"p" * MAX_PEER_ID_SIZE, INT64_MAX, -FAR),) * MAX_GOSSIP_RECORDS
    return ViewTurn(ranges, (b"p" * MAX_PEER_ID_SIZE,) * MAX_GOSSIP_RECORDS, (record,) * MAX_GOSSIP_RECORDS,
                    departures, True, LINK_BYE)


CASES = {
    "link hello": (LINK_FRAME_LIMIT, [LinkHello(b"s" * 16, 2 ** 31 - 1)]),
    "ping": (HEARTBEAT_FRAME_LIMIT, [Heartbeat(INT64_MAX, FAR),  # a probe, and an echo with its load
                                     Heartbeat(INT64_MAX, FAR, LoadReport(*(MAX_LOAD_COUNT,) * 4, MAX_LOAD_WAIT * (1 - 1e-16)))]),
    "gossip": (GOSSIP_FRAME_LIMIT, [largest_view_turn(),
                                    GossipPush((SignedRecord(b"r" * MAX_RECORD_SIZE, b"k" * 32, b"s" * 64),)
                                               * MAX_GOSSIP_RECORDS)]),
    "reports": (REPORT_FRAME_LIMIT, [MisbehaviourReport(b"b" * MAX_REPORT, b"k" * 32, b"s" * 64), ReportQuery(FAR)]),
    "weights": (REQUEST_FRAME_LIMIT, [WeightChunkRequest(WIDE * MODEL_ID_LEN, WIDE * MAX_NAME_LEN, INT64_MAX, True),
                                      WeightManifestRequest(WIDE * MODEL_ID_LEN, True)]),
    "links": (links.REQUEST_FRAME_LIMIT, [LinkReport(())]),
    "dial-back request": (dialback.REQUEST_FRAME_LIMIT,
                          [DialBackRequest(b"n" * NONCE_SIZE, (WIDE * 256,) * dialback.MAX_ADDRS)]),
    "dial-back probe": (dialback.PROBE_FRAME_LIMIT, [DialBackProbe(b"n" * NONCE_SIZE)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_largest_message_fits_and_the_limit_is_not_much_more(name):
    limit, messages = CASES[name]
    largest = max(len(encode(m)) for m in messages)
    assert largest <= limit, f"{name}: a valid message of {largest} bytes would be refused by {limit}"
    encode_frame(encode(max(messages, key=lambda m: len(encode(m)))), max_size=limit)  # the framing agrees
    assert limit <= 1.25 * largest + 64, f"{name}: {limit} bytes is far more than its largest message, {largest}"
