"""What a peer offers for sessions: the longest context one session over its span can hold.

A span's session state is `fixed + per token x context` summed over its layers, each per its
state kind (families/spec/): a span of linear-attention layers holds the model's whole
context in a fixed state, a span of full attention as many tokens as its budget buys. The
peer's record says it (`PeerRecord.context_tokens`), signed like the rest, and the swarm view
reads it back.
"""

from __future__ import annotations

from types import SimpleNamespace

from tessera.peer.net.verified import info_from_record
from tessera.peer.node.config import KV_RESERVE_FRACTION
from tessera.peer.node.peer_node import PeerNode
from tessera.protocol.crypto import sign_record, verify_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import PeerRecord
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.recurrent import GatedDeltaNetSpec

LINEAR = LayerSpec(GatedDeltaNetSpec(16, 32, 128, 128, 4), MlpSpec(512))
FULL = LayerSpec(AttentionSpec(16, 2, 256, output_gate=True), MlpSpec(512))
HYBRID = ModelSpec("qwen3_5", 1024, 2048, (LINEAR, LINEAR, LINEAR, FULL) * 2, max_position=262144)


def offered(span: tuple[int, int], memory: int) -> int:
    """`PeerNode.context_tokens` of a node serving `span` of HYBRID with `memory` bytes offered."""
    return PeerNode.context_tokens(SimpleNamespace(span=span, memory_bytes=memory, spec=HYBRID, itemsize=4))


def test_a_span_of_linear_layers_holds_the_whole_context_once_its_fixed_state_fits():
    fixed = HYBRID.state_fixed_bytes(0, 3, 4)  # three linear layers: ~20 MB, whatever the context
    assert fixed == 3 * LINEAR.cache.fixed_bytes(4) and HYBRID.kv_bytes_per_position(0, 3, 4) == 0
    enough = int(fixed / KV_RESERVE_FRACTION) + 4
    assert offered((0, 3), enough) == HYBRID.max_position
    assert offered((0, 3), int(fixed / KV_RESERVE_FRACTION) - 4) == 0  # not even one session's fixed state


def test_a_span_with_full_attention_holds_what_its_budget_buys_past_the_fixed_state():
    memory = 1 << 30
    budget = int(memory * KV_RESERVE_FRACTION)
    per_token = 2 * 2 * 256 * 4  # one full layer's keys and values: 4 KB a token
    fixed = HYBRID.state_fixed_bytes(0, 4, 4)
    assert offered((0, 4), memory) == (budget - fixed) // per_token
    # a full-attention span of as many layers holds a quarter as much context
    full = ModelSpec("qwen3_5", 1024, 2048, (FULL,) * 4, max_position=262144)
    assert full.context_tokens(0, 4, budget, 4) == budget // (4 * per_token)
    assert PeerNode.context_tokens(SimpleNamespace(span=None, memory_bytes=memory, spec=HYBRID, itemsize=4)) == 0


def test_the_record_carries_it_signed_and_the_view_reads_it():
    identity = Identity.from_seed(b"\x07" * 32)
    record = PeerRecord(
        peer_id=identity.peer_id, name="", model_id="m", start=0, end=3, shard_index=0, shard_count=1,
        shard_group="", throughput=10.0, free_memory=0, load=0.0, max_sessions=16, state="serving",
        reachability="public", addrs=(), neighbours=(), issued_at=1000.0, expires_at=1010.0, seq=1,
        context_tokens=262144)
    info = info_from_record(verify_record(sign_record(identity, record), now=1000.0))
    assert info.context_tokens == 262144
    older = PeerRecord(**{**vars(record), "context_tokens": 0})  # a peer that does not say
    assert info_from_record(verify_record(sign_record(identity, older), now=1000.0)).context_tokens == 0
