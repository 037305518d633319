"""The hand-made three-peer example of the manual, run exactly as written (issue 34).

Three `tessera peer` processes and one `tessera generate`, each with the flags the example
gives and nothing else (the test only puts in the address the first peer printed, where the
example shows `/ip4/…`). Before issue 34 the peers of such an example shared one data dir —
one identity — and listened on loopback only. Each must now have its own peer id, listen on
every interface, and the answer must be exactly the single-process one.

`EXAMPLE` is read from the manual (docs/pages/peer.md, "A swarm on one machine").
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.stages.weights import registry
from tessera.stages.decoding.generate import prompt_ids

from ..conftest import FRANCE

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "pages" / "peer.md"


def manual_example(page: Path = DOCS_PAGE) -> str:
    """The code block under the page's "A swarm on one machine" heading."""
    section = page.read_text().split("## A swarm on one machine", 1)[1]
    return "```sh" + section.split("```sh", 1)[1].split("```", 1)[0] + "```\n"


EXAMPLE = manual_example()
PLACEHOLDER = "/ip4/…/tcp/4001/p2p/12D3KooW…"
STARTUP = 180.0  # three peers import torch, measure and load on a shared 2-core box
TESSERA = str(Path(sys.executable).with_name("tessera"))


def commands(example: str) -> list[list[str]]:
    """The example's command lines, as argv lists (comments dropped)."""
    lines = [line for line in example.splitlines() if line.startswith("tessera ")]
    return [shlex.split(line, comments=True) for line in lines]


def wait_for(log: Path, proc: subprocess.Popen, pattern: str, timeout: float = STARTUP) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)  # polling a log another process writes
    raise AssertionError(f"{pattern!r} not seen within {timeout:g} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_the_manuals_three_peer_example_as_written(tmp_path, smol_dir, local_engine, smol_tokenizer):
    peers, ask = commands(EXAMPLE)[:3], commands(EXAMPLE)[3]
    assert [argv[:2] for argv in peers] == [["tessera", "peer"]] * 3 and ask[:2] == ["tessera", "generate"]
    # A user's home: the default data dirs go under it. The model stays where it was fetched.
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1",
           "TESSERA_MODELS": str(registry.models_root())}
    procs: list[subprocess.Popen] = []
    logs = [tmp_path / f"peer{i}.log" for i in range(3)]
    try:
        join = None
        for argv, log in zip(peers, logs):
            argv = [TESSERA if a == "tessera" else join if a == PLACEHOLDER else a for a in argv]
            procs.append(subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env))
            if join is None:  # the others join through what the first printed, once it serves (as a user would)
                join = wait_for(log, procs[0], r"listening on (/\S+)").group(1)
                wait_for(log, procs[0], r"serving layers")
        for proc, log in zip(procs, logs):
            wait_for(log, proc, r"serving layers")
        ids = [wait_for(log, proc, r"listening on \S+/p2p/(\w+)").group(1) for proc, log in zip(procs, logs)]
        assert len(set(ids)) == 3, ids  # three identities, not one data dir thrice
        for name in "abc":
            assert (tmp_path / ".local" / "share" / "tessera" / name / "identity.key").exists()
        first = logs[0].read_text()
        assert "/ip4/127.0.0.1/" in first and "(loopback: this machine only)" in first  # listens on every interface
        if "/tcp/4001/" in join:  # the customary port was free for the first: the others found it taken
            assert all("port 4001 is taken" in log.read_text() for log in logs[1:])

        argv = [TESSERA if a == "tessera" else join if a == PLACEHOLDER else a for a in ask]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=STARTUP)
        assert done.returncode == 0, done.stderr
        want = local_engine.generate_ids(prompt_ids(smol_tokenizer, FRANCE, raw=False), max_new_tokens=128)
        assert done.stdout.strip() == smol_tokenizer.decode(want).strip()
        assert "WARNING" not in done.stderr, done.stderr  # a normal exit says nothing on stderr
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
