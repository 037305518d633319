"""A peer that cannot join says why, once per attempt, and exits unless told it may serve alone;
a memory offer too small for one layer is refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.peer.cli.demo import LocalSwarm

pytestmark = pytest.mark.slow

JOIN_TIMEOUT = "2"  # seconds: enough for two attempts at a dead address, short for a test
RUN_LIMIT = 120  # seconds a joiner process may take in all (start-up on a loaded machine included)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    from tessera.peer.cli.model_files import synthesise

    root = tmp_path_factory.mktemp("join")
    shape = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=300)
    return synthesise(root / "a", seed=1, **shape), synthesise(root / "b", seed=2, **shape)


@pytest.fixture(scope="module")
def keyed_peer(models):
    """One peer of model A in a private swarm (the key below)."""
    key = os.urandom(32).hex()
    swarm = LocalSwarm(1, model=str(models[0]), extra_args=[["--swarm-key", key]])
    try:
        swarm.start()
        yield swarm.addrs[0], key
    finally:
        swarm.stop(timeout=15)


def peer(model: Path, tmp_path: Path, *args: str, until: str | None = None) -> tuple[int | None, str]:
    """Run `tessera peer`; (exit status, output). With `until`, stop it (SIGINT) once that line appears."""
    cmd = [sys.executable, "-m", "tessera.peer.cli.main", "peer", "--model", str(model), "--threads", "1",
           "--data-dir", str(tmp_path / "joiner"), "--join-timeout", JOIN_TIMEOUT, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if until is None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_LIMIT, env=env)
        return done.returncode, done.stdout + done.stderr
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:  # blocks on the process's own output, not on a clock
            lines.append(line)
            if until in line:
                break
    finally:
        proc.send_signal(2)
        rest, _ = proc.communicate(timeout=RUN_LIMIT)
    return None, "".join(lines) + rest


def dead_addr(addr: str) -> str:
    """The same peer id on a port nothing listens on."""
    return "/ip4/127.0.0.1/tcp/1/p2p/" + addr.rsplit("/p2p/", 1)[1]


def attempt_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("join attempt")]


def test_a_dead_join_address_is_retried_then_the_peer_exits(models, keyed_peer, tmp_path):
    status, output = peer(models[0], tmp_path, "--join", dead_addr(keyed_peer[0]))
    assert status == 1, output
    lines = attempt_lines(output)
    assert len(lines) >= 2 and all("unreachable: nothing listens at 127.0.0.1:1" in line for line in lines), output
    assert "could not join any --join address within 2 s" in output and "--allow-alone" in output


def test_allow_alone_serves_a_new_swarm_instead(models, keyed_peer, tmp_path):
    _, output = peer(models[0], tmp_path, "--join", dead_addr(keyed_peer[0]), "--allow-alone", until="serving layers")
    assert "serving alone as a new swarm" in output and "serving layers [0, 2)" in output, output


def test_a_missing_swarm_key_gets_the_hint(models, keyed_peer, tmp_path):
    status, output = peer(models[0], tmp_path, "--join", keyed_peer[0])
    assert status == 1, output
    assert "wrong or missing swarm key?" in attempt_lines(output)[0], output


def test_a_peer_of_another_model_is_named(models, keyed_peer, tmp_path):
    addr, key = keyed_peer
    status, output = peer(models[1], tmp_path, "--join", addr, "--swarm-key", key)
    assert status == 1, output
    assert "different model" in attempt_lines(output)[0], output


def test_memory_too_small_for_one_layer_is_refused_with_the_number(models, tmp_path):
    status, output = peer(models[0], tmp_path, "--memory", "0.00001")
    assert status == 1, output
    from tessera.stages.families.catalog import spec_from_file

    # one float32 layer's weights over the 75% of the offer not kept for KV caches
    need = spec_from_file(models[0] / "config.json").layer_bytes(4) / 0.75 / (1 << 30)
    assert f"--memory 1e-05 GB is too small: one layer of this model in float32 needs {need:.3g} GB" in output
    assert "listening on" not in output  # refused before the host started
