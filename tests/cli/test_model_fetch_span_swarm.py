"""Through the commands users run, with real peer processes on loopback: two volunteers fetch the
files of their spans of a sharded model from the stand-in hub (the first with no swarm to ask, so
it hashes every shard and keeps its span's; the second takes the manifest from the first and asks
the hub only for its own shards' ranges), a requester fetches its embedding and head, and the
2-peer route answers exactly what the whole model answers on one machine (`generate --local`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.peer.cli.demo import LocalSwarm

from .fake_hub import FakeHub
from .test_model_fetch_span import REPO, shard_holding, sharded_model, weight_gets

pytestmark = pytest.mark.slow

PROMPT = "hello there"
TOKENS = 12


def tessera(env: dict, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tessera.peer.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"tessera {' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def answer(env: dict, *args: str) -> dict:
    lines = [json.loads(line) for line in tessera(env, "generate", PROMPT, "--json", "--max-tokens", str(TOKENS),
                                                  *args).splitlines() if line.startswith("{")]
    return next(line for line in lines if line.get("done"))


def test_peers_of_span_folders_answer_as_the_whole_model(tmp_path):
    model = sharded_model(tmp_path / "source")
    root = tmp_path / "models"
    with FakeHub() as hub:
        hub.add(REPO, model)
        env = {**os.environ, "TESSERA_MODELS": str(root), "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1",
               "PYTHONUNBUFFERED": "1"}
        tessera(env, "model", "fetch", REPO, "--layers", "0:3", "--name", "tiny-a")  # no swarm yet: hashes all
        model_id = json.loads((root / "tiny-a" / "manifest.json").read_text())["model_id"]
        (tmp_path / "swarm").mkdir()
        swarm = LocalSwarm(2, model="tiny-a", base_dir=tmp_path / "swarm", env=env,
                           extra_args=[["--layers", "0:3"], ["--layers", "3:6", "--model", "tiny-b"]])
        try:
            swarm.spawn(0, [])
            first = swarm.wait_ready(0)
            hub.requests.clear()
            tessera(env, "model", "fetch", REPO, "--layers", "3:6", "--name", "tiny-b", "--join", first, "--id", model_id)
            gets = weight_gets(hub)
            needed = {shard_holding(model, g) for g in ("layer.3", "layer.4", "layer.5", "norm", "lm_head")}
            assert set(gets) == needed and None not in sum(gets.values(), []), gets  # only its shards, by ranges
            swarm.spawn(1, [first])
            swarm.wait_ready(1)
            tessera(env, "model", "fetch", REPO, "--requester", "--name", "tiny-r", "--join", first, "--id", model_id)
            through = answer(env, "--join", first, "--model", "tiny-r")
        finally:
            swarm.stop(timeout=15)
    local = answer(env, "--local", "--model", str(model))
    assert [(hop["start"], hop["end"]) for hop in through["route"]] == [(0, 3), (3, 6)], through["route"]
    assert through["tokens"] == local["tokens"] and len(local["tokens"]) >= 4, (through, local)
    for name, layers in (("tiny-a", "0-2"), ("tiny-b", "3-5")):
        manifest = json.loads((root / name / "manifest.json").read_text())
        assert manifest["model_id"] == model_id and manifest["partial"], (name, layers)
    assert sorted(p.name for p in Path(root / "tiny-r").glob("*.safetensors")) == sorted(
        {shard_holding(model, g) for g in ("embed_tokens", "norm", "lm_head")})
