"""One running peer per data dir (issue 34, item 1): the second refuses, a dead one leaves no lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tessera.peer.node.data_dir import LOCK_FILE, DataDirInUse, DataDirLock

PY = sys.executable


def test_a_second_lock_on_one_data_dir_is_refused_and_a_released_one_is_free(tmp_path):
    first = DataDirLock.acquire(tmp_path / "peer")
    assert (tmp_path / "peer" / LOCK_FILE).read_text().strip() == str(os.getpid())
    with pytest.raises(DataDirInUse) as refused:
        DataDirLock.acquire(tmp_path / "peer")
    message = str(refused.value)
    assert "\n" not in message and "--data-dir" in message and f"pid {os.getpid()}" in message
    other = DataDirLock.acquire(tmp_path / "other")  # another dir is another peer
    first.release()
    first.release()  # idempotent
    again = DataDirLock.acquire(tmp_path / "peer")
    assert again.held
    again.release()
    other.release()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen(
        [PY, "-c", "import sys, time; from pathlib import Path; from tessera.peer.node.data_dir import DataDirLock; "
                   f"lock = DataDirLock.acquire(Path({str(tmp_path)!r})); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DataDirInUse, match=f"pid {holder.pid}"):
            DataDirLock.acquire(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    DataDirLock.acquire(tmp_path).release()  # the kernel dropped the lock with the process


def test_tessera_peer_on_a_data_dir_in_use_stops_with_one_line(tmp_path, smol_dir):
    """What a second `tessera peer` on one machine without --data-dir met: the same identity twice."""
    lock = DataDirLock.acquire(tmp_path / "peer")
    try:
        started = time.monotonic()
        done = subprocess.run([PY, "-m", "tessera.peer.cli.main", "peer", "--data-dir", str(tmp_path / "peer"),
                               "--threads", "1"], capture_output=True, text=True, timeout=120)
    finally:
        lock.release()
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: data dir ") and "--data-dir" in errors[0], done.stderr
    assert "listening on" not in done.stdout  # refused before the host started
    assert not (tmp_path / "peer" / "identity.key").exists()  # nor read or made its key
    assert time.monotonic() - started < 120
