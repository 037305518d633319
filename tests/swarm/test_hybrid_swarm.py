"""A Qwen3.5-MoE-shaped model through a real swarm, split inside its run of linear-attention layers.

Real peer processes on loopback: one serves layers [0, 2), four serve [2, 4) (layers 0-2 Gated
DeltaNet, 3 gated full attention; the cut between layers 1 and 2 lies inside the linear run, so
a recurrent state lives on both sides of it). The model carries one multi-token-prediction module
(written into its checkpoint: tests/stages/mtp_helpers.py). Greedy answers, plain, with
`--speculate ngram` and with `--speculate mtp` (the MTP module drafting at the requester from the
hidden states the last peer returns; blocks pipelined two deep: a rejected draft takes each peer's
recurrent state back into one of its last two runs of steps, and the module's cache back to the
rows that hold), are token for token what the whole model gives on one machine; and so are they
when the peer serving [2, 4) is killed mid-answer: the requester replays the history into a
replacement, which rebuilds its recurrent states from it, and re-sends the failed step, which takes
the surviving peer's state back to where that step began.
"""

from __future__ import annotations

import pytest

from tessera.peer.request.client import Swarm
from tessera.peer.request.client import SPECULATION_SLACK
from tessera.peer.request.decode import Speculation
from tessera.stages.assembly.mtp import load_mtp
from tessera.stages.decoding.generate import LocalEngine
from tessera.stages.decoding.mtp import MtpDrafter
from tessera.stages.decoding.speculative import AdaptiveK, NgramDrafter

from ..stages.families.conformance import SHAPE, build
from ..stages.mtp_helpers import add_mtp
from ..swarm_helpers import local_swarm

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

CONFIG = dict(SHAPE, num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=48)
SPANS = [(0, 2), (2, 4), (2, 4), (2, 4), (2, 4)]  # the last four: one serves, the others stand by as replacements
PROMPT = [5, 17, 260, 42, 99, 3, 250, 7, 17, 260, 42, 12, 64, 5, 17]  # repeats, so that n-grams draft
TOKENS = 24
AFTER = 6  # tokens out before the peer of [2, 4) is killed


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = build(tmp_path_factory.mktemp("hybrid-swarm"), "qwen3_5_moe", transformers.Qwen3_5MoeTextConfig(**CONFIG),
                   seed=71)
    return add_mtp(folder, seed=1071)


@pytest.fixture(scope="module")
def expected(folder):
    """What --local gives: the whole model in one process, greedy."""
    tokens = LocalEngine(folder, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)
    assert len(tokens) == TOKENS, "the reference answer must run the whole length (no EOS)"
    return tokens


@pytest.fixture(scope="module")
def peers(folder):
    with local_swarm(SPANS, model=str(folder)) as swarm:
        yield swarm


def speculation(swarm: Swarm, kind: str) -> Speculation:
    """n-gram drafts, or the model's MTP module's over the requester's embedding and head; K pinned (no back-off)."""
    if kind == "ngram":
        drafter = NgramDrafter()
    else:
        drafter = MtpDrafter(load_mtp(swarm.folder, swarm.head), capacity=len(PROMPT) + TOKENS + SPECULATION_SLACK)
    return Speculation(drafter, k=AdaptiveK(3, backoff_after=10**9), pipeline=True)


async def answer(peers, folder, *, drafts: str | None, kill: bool) -> tuple[list[int], dict]:
    """Generate through the swarm (`drafts`: None, "ngram" or "mtp"); with `kill`, after AFTER tokens the peer
    serving [2, 4) is killed (-9). The info's "speculation" says what was drafted and accepted."""
    async with Swarm.join(peers.addrs[:1], model=folder, spot_check=None) as swarm:
        await swarm.wait_for_route(30)
        info: dict = {}
        speculation_ = speculation(swarm, drafts) if drafts else None
        tokens: list[int] = []
        async for token in swarm.generate_ids(PROMPT, max_new_tokens=TOKENS, info=info, speculation=speculation_):
            tokens.append(token)
            if kill and len(tokens) == AFTER:
                (session,) = swarm.active
                (second,) = [h.peer for h in session.current.hops if h.hop.start == 2]
                peers.kill(next(i for i, addr in enumerate(peers.addrs) if addr.endswith(second)))
        return tokens, info


async def test_greedy_ngram_and_mtp_drafts_through_the_swarm_are_the_local_answer(peers, folder, expected):
    plain, info = await answer(peers, folder, drafts=None, kill=False)
    assert plain == expected
    assert [(h["start"], h["end"]) for h in info["route"]] == [(0, 2), (2, 4)]
    for kind in ("ngram", "mtp"):
        drafted, info = await answer(peers, folder, drafts=kind, kill=False)
        assert drafted == expected, kind
        drafts = info["speculation"]
        print(f"{kind}: accepted {drafts['accepted']} of {drafts['proposed']} drafted")
        assert drafts["proposed"] > drafts["accepted"]  # drafts were verified, and some rejected: states went back


@pytest.mark.parametrize("drafts", [None, "ngram", "mtp"], ids=["greedy", "ngram", "mtp"])
async def test_a_killed_peer_is_replaced_and_its_recurrent_state_rebuilt_exactly(peers, folder, expected, drafts):
    tokens, info = await answer(peers, folder, drafts=drafts, kill=True)
    assert tokens == expected
    assert info["failovers"] == 1
    spans = [[(h["start"], h["end"]) for h in route] for route in info["routes"]]
    assert spans[0] == spans[-1] == [(0, 2), (2, 4)] and info["routes"][0][1]["peer"] != info["routes"][-1][1]["peer"]
    if drafts is not None:
        assert info["speculation"]["proposed"] > 0
