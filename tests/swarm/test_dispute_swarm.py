"""Two holders, one liar, three processes: the requester decides the dispute by recomputing.

Two peer processes hold every layer of a tiny model (4 layers, hidden 64); one of them
(`--misbehave perturb:1`) perturbs every output. There is no third holder to break a tie. A
requester process (`tessera generate --join`, spot-checking every step, preferring the liar)
starts without the model: it fetches the embedding and head from the peers, and — when its
spot check finds the two peers disagreeing — the four layers' weights too (every chunk checked
against the manifest), recomputes the disputed rows itself, bans the liar, and the answer is
`--local`'s.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tessera.peer.cli.demo import LocalSwarm
from tessera.stages.weights import registry

from ..request.memory_swarm import decisive_model

pytestmark = pytest.mark.slow

PROMPT = "paint"
TOKENS = 6
CLI = [sys.executable, "-m", "tessera.peer.cli.main", "generate", PROMPT, "--max-tokens", str(TOKENS), "--json",
       "--threads", "1"]


def test_the_liar_among_two_holders_is_banned_and_the_answer_is_local(tmp_path):
    model = decisive_model(tmp_path / "tiny")
    model_id = registry.model_id(model)
    local = subprocess.run([*CLI, "--local", "--model", str(model)], capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr[-3000:]
    expected = json.loads(local.stdout.splitlines()[-1])["tokens"]  # the last JSON line: the whole answer
    (tmp_path / "peers").mkdir()
    (tmp_path / "requester-models").mkdir()  # the requester has no copy of the model
    args = [["--layers", "0:4"], ["--layers", "0:4", "--misbehave", "perturb:1"]]
    peers = LocalSwarm(2, model=str(model), extra_args=args, base_dir=tmp_path / "peers")
    try:
        first = peers.start_peer(0, [])
        liar = peers.start_peer(1, [first]).rsplit("/p2p/", 1)[1]
        honest = first.rsplit("/p2p/", 1)[1]
        done = subprocess.run(
            [*CLI, "--join", first, "--model", model_id, "--spot-check", "1", "--prefer", liar],
            capture_output=True, text=True, timeout=300,
            env={**peers.env, "TESSERA_MODELS": str(tmp_path / "requester-models")},
        )
    finally:
        peers.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["tokens"] == expected
    decided = [v for v in result["checks"]["verdicts"] if v.get("convicted")]
    assert decided and all(v["convicted"] == [liar] and v["decided"] == "by recomputing locally" for v in decided), \
        result["checks"]
    assert any(h["peer"] == liar for r in result["routes"] for h in r)  # it was routed to, first
    assert all(h["peer"] == honest for h in result["route"])  # and then the honest holder only
    caught = [line for line in done.stderr.splitlines() if "spot check: peer" in line]
    assert caught and liar in caught[0] and "decided by recomputing locally" in caught[0], done.stderr[-3000:]
    # the layers were fetched for the recomputation, not kept: the requester's folder holds its parts only
    held = registry.held_tensors(tmp_path / "requester-models" / model_id)
    assert held and not any(name.startswith("model.layers.") for name in held)
