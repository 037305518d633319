"""Weights altered where the load check cannot see them are caught by a spot check in a real answer.

A peer T serves layers [0, 10) from a copy of SmolLM2. It starts once on the honest copy (its
load check hashes the span and records it in its data dir: peer/weights/verify.py), stops,
and then model.layers.5.mlp.down_proj.weight is scaled by 1.5 in place, with the file's size,
inode and mtime kept: the cache vouches for the file and T starts serving the altered layer.
`tessera generate --spot-check 1 --prefer T` (T is routed; two honest peers also serve
[0, 10), a checker and a tie-breaker) catches it: the requester's log names T and its layers,
T is banned, and the answer — regenerated from the last right token — is the reference.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tessera.peer.cli.demo import LocalSwarm

from ..swarm_helpers import reference_answer
from ..weights.test_weight_check import scale_in_place

pytestmark = pytest.mark.slow

PROMPT = "Write a short story about a robot who learns to paint."
TOKENS = 16
ALTERED = "model.layers.5.mlp.down_proj.weight"


def copy_of(folder, target):
    """The model folder with its weights copied (to alter them) and the other files hard-linked."""
    target.mkdir()
    for item in folder.iterdir():
        if item.name == "model.safetensors":
            shutil.copyfile(item, target / item.name)
        elif item.is_file():
            os.link(item, target / item.name)
    return target


def test_a_peer_serving_weights_altered_behind_the_cache_is_caught_by_a_spot_check(
        smol_dir, local_engine, smol_tokenizer, tmp_path):
    expected = reference_answer(local_engine, smol_tokenizer, PROMPT, TOKENS)
    copy = copy_of(smol_dir, tmp_path / "copy")
    spans = [(0, 10), (0, 10), (0, 10), (10, 30)]
    args = [["--layers", f"{a}:{b}"] for a, b in spans]
    args[0] += ["--model", str(copy)]  # T, the peer whose folder is altered
    (tmp_path / "peers").mkdir()
    peers = LocalSwarm(len(spans), extra_args=args, base_dir=tmp_path / "peers")
    try:
        peers.start_peer(0, [])  # T's first start: its span is hashed and recorded as checked
        peers.stop(0)
        scale_in_place(copy, ALTERED, 1.5, keep_mtime=True)
        first = peers.start_peer(0, [])  # the cache vouches for the untouched-looking file
        for i in range(1, len(spans)):
            peers.start_peer(i, [first])
        suspect = first.rsplit("/p2p/", 1)[1]
        done = subprocess.run(
            [sys.executable, "-m", "tessera.peer.cli.main", "generate", PROMPT, "--join", first,
             "--max-tokens", str(TOKENS), "--spot-check", "1", "--prefer", suspect, "--json", "--threads", "1"],
            capture_output=True, text=True, timeout=600,
        )
    finally:
        peers.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])  # the last of its JSON lines: the whole answer
    assert result["tokens"] == expected
    guilty = [v for v in result["checks"]["verdicts"] if v["guilty"] is not None]
    assert guilty and all(v["guilty"] == suspect for v in guilty), result["checks"]
    assert any(h["peer"] == suspect for r in result["routes"] for h in r)  # it was routed to, first
    assert all(h["peer"] != suspect for h in result["route"])  # and not any more
    caught = [line for line in done.stderr.splitlines() if "spot check: peer" in line]
    assert caught and suspect in caught[0] and "layers [0, 10)" in caught[0], done.stderr[-3000:]
