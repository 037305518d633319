"""Real peer processes serving int8 spans: the swarm's answer is `generate --local --quant int8`'s,
through the Python requester and through `tessera serve --quant int8`, and the advertised model
id keeps requesters of another precision off them."""

from __future__ import annotations

import pytest

import httpx

from tessera.peer.base.errors import ModelMismatch
from tessera.peer.request.client import Swarm
from tessera.stages.decoding.generate import LocalEngine, prompt_ids
from tessera.stages.kernels.quant import Quant

from ..conftest import FRANCE
from ..swarm_helpers import local_swarm
from ..http.test_http import gateway_process

pytestmark = pytest.mark.slow

INT8 = Quant("int8")
PROMPTS = [(FRANCE, False), ("The quick brown fox", True)]
MAX_NEW = 16


@pytest.fixture(scope="module")
def int8_peers(smol_dir):
    with local_swarm([(0, 15), (15, 30)], extra=["--quant", "int8"]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def local_int8(smol_dir):
    return LocalEngine(smol_dir, device="cpu", quant=INT8)


async def test_int8_swarm_equals_local_int8(int8_peers, local_int8, smol_tokenizer):
    local = local_int8
    async with Swarm.join(int8_peers.addrs[:1], quant=INT8) as swarm:
        await swarm.wait_for_route(30)
        for prompt, raw in PROMPTS:
            ids = prompt_ids(smol_tokenizer, prompt, raw=raw)
            info: dict = {}
            got = [t async for t in swarm.generate_ids(ids, max_new_tokens=MAX_NEW, info=info)]
            assert got == local.generate_ids(ids, max_new_tokens=MAX_NEW), prompt
            assert [(h["start"], h["end"]) for h in info["route"]] == [(0, 15), (15, 30)]


async def test_requesters_chain_only_the_precision_they_accept(int8_peers):
    # unquantized by default: int8 peers are not its model, and joining says so (and what to pass) at once
    with pytest.RaisesGroup(pytest.RaisesExc(ModelMismatch, match=r"quantized as int8 .*--quant int8"),
                            flatten_subgroups=True):
        async with Swarm.join(int8_peers.addrs[:1]):
            pass
    with pytest.RaisesGroup(pytest.RaisesExc(ModelMismatch, match=r"--quant int8"), flatten_subgroups=True):
        async with Swarm.join(int8_peers.addrs[:1], quant=Quant("int4")):
            pass
    async with Swarm.join(int8_peers.addrs[:1], accept_mixed=True) as mixed:
        peers = mixed.keeper.snapshot().peers
        assert len(peers) >= 1 and all(p.model_id.endswith("+int8") for p in peers)
        assert all(p.dtype == "float32" for p in peers)  # a quantized CPU span computes in float32 (its reference)


def test_gateway_with_quant_answers_as_local_int8(int8_peers, local_int8):
    """`tessera serve --quant int8` chains the int8 peers (a gateway without --quant would find no
    peer of its model): its greedy chat answer is `generate --local --quant int8`'s."""
    with gateway_process(int8_peers.addrs[0], int8_peers.base_dir / "serve-int8.log", "--quant", "int8") as (url, _):
        assert "; chaining int8 peers" in (int8_peers.base_dir / "serve-int8.log").read_text()
        models = httpx.get(url + "/v1/models", timeout=60).json()["data"]
        assert models[0]["model_id"].endswith("+int8")
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": FRANCE}], "temperature": 0,
                "max_tokens": MAX_NEW}
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    want = local_int8.generate(FRANCE, max_new_tokens=MAX_NEW).text
    assert answer["choices"][0]["message"]["content"] == want
