"""The manual's tour, run as written (issue 46): docs/pages/tour.md, command by command.

Each `tessera` and `curl` line of the page's code blocks runs as a user would run it, in a
home of its own: peers and the gateway in the background (in their own terminals, on the
page), the rest to completion. The test puts in only what a user copies from a terminal: the
address the first peer printed where the page shows `/ip4/…`, and — since this machine's port
8000 may be another program's — a free port where the page says 8000. Between the page's
blocks it does what the page's prose says: Ctrl-C on the first peer before starting it again,
and on every process at the end. What it checks is what the page promises.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.stages.decoding.generate import prompt_ids
from tessera.stages.weights import registry

from ..conftest import FRANCE

pytestmark = pytest.mark.slow

PAGE = Path(__file__).resolve().parents[2] / "docs" / "pages" / "tour.md"
PLACEHOLDER = "/ip4/…/tcp/4001/p2p/12D3KooW…"
STARTUP = 240.0  # s: a peer imports torch, measures and loads SmolLM2 on a loaded 2-core machine
RUN_LIMIT = 300.0  # s: a command run to completion
TESSERA = str(Path(sys.executable).with_name("tessera"))


def tour_commands(page: Path = PAGE) -> list[tuple[str, list[str]]]:
    """(the section's heading, argv) for every command line of the page's ```sh blocks, in order."""
    found, heading = [], ""
    for block in re.split(r"^(## .*)$", page.read_text(), flags=re.M):
        if block.startswith("## "):
            heading = block[3:].strip()
            continue
        for code in re.findall(r"```sh\n(.*?)```", block, flags=re.S):
            found += [(heading, shlex.split(line)) for line in code.splitlines() if line.startswith(("tessera ", "curl "))]
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(log: Path, proc: subprocess.Popen, pattern: str, timeout: float = STARTUP) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)  # polling a log another process writes
    raise AssertionError(f"{pattern!r} not seen within {timeout:g} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, log: Path) -> str:
    """Ctrl-C, as in its terminal; it must leave cleanly (status 0, nothing that looks like a failure)."""
    proc.send_signal(signal.SIGINT)
    status = proc.wait(60)
    text = log.read_text()
    assert status == 0 and "Traceback" not in text and "error:" not in text, text[-3000:]
    return text


def test_the_manuals_tour_as_written(tmp_path, smol_dir, local_engine, smol_tokenizer):
    steps = tour_commands()
    assert [h for h, _ in steps][:2] == ["1. Start a swarm", "2. Join it"]
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1", "TESSERA_MODELS": str(registry.models_root())}
    want = smol_tokenizer.decode(local_engine.generate_ids(prompt_ids(smol_tokenizer, FRANCE, raw=False),
                                                           max_new_tokens=128)).strip()
    port = free_port()
    running: dict[str, tuple[subprocess.Popen, Path]] = {}
    join = None
    first_addr = None
    try:
        for n, (heading, argv) in enumerate(steps):
            argv = [TESSERA if a == "tessera" else join if a == PLACEHOLDER else a for a in argv]
            argv = [os.path.expanduser(a).replace(str(Path.home()), str(tmp_path)) if a.startswith("~") else a
                    for a in argv]  # the shell's ~, in the tour's home
            argv = [a.replace("8000", str(port)) if "8000" in a else a for a in argv]
            log = tmp_path / f"step{n}.log"
            if argv[1] == "peer":
                name = argv[argv.index("--name") + 1]
                if name in running:  # "Start it again": the page's prose said Ctrl-C first
                    stop(*running.pop(name))
                proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
                running[name] = (proc, log)
                addr = wait_for(log, proc, r"listening on (/\S+)").group(1)
                wait_for(log, proc, r"serving layers")
                if join is None:
                    join, first_addr = addr, addr
                elif name == "first":  # back with the same identity, and on the same port (it was 4001)
                    assert addr.rsplit("/p2p/", 1)[1] == first_addr.rsplit("/p2p/", 1)[1]
                    if "/tcp/4001/" in first_addr:
                        assert "/tcp/4001/" in addr, log.read_text()
            elif argv[1] == "serve":
                proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
                running["serve"] = (proc, log)
                wait_for(log, proc, r"web view: http://")
            else:
                done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=RUN_LIMIT)
                assert done.returncode == 0, f"{argv}:\n{done.stderr[-3000:]}"
                assert "Traceback" not in done.stderr and "WARNING" not in done.stderr, done.stderr
                if argv[:2] == [TESSERA, "generate"]:
                    assert done.stdout.strip() == want, done.stdout
                elif argv[0] == "curl":
                    answer = json.loads(done.stdout)
                    assert answer["choices"][0]["message"]["content"] == want, answer
                    stop(*running.pop("serve"))  # "Ctrl-C stops the gateway"
                elif argv[1:3] == ["swarm", "status"]:
                    assert "2 peers" in done.stdout.splitlines()[0] and "gaps: none" in done.stdout, done.stdout
                elif argv[1] == "ledger":
                    assert done.stdout.startswith("peer " + first_addr.rsplit("/p2p/", 1)[1]), done.stdout
                elif argv[1:3] == ["trace", "export"]:
                    exported = json.loads((tmp_path / argv[argv.index("-o") + 1]).read_text())
                    assert exported["traceEvents"], "an empty trace"
        for name in list(running):
            text = stop(*running.pop(name))
            if name != "serve":
                assert "left the swarm" in text
    finally:
        for proc, _ in running.values():
            proc.kill()
            proc.wait()
