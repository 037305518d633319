"""One running peer per data directory: an exclusive lock held while the peer runs.

A peer's data directory is its identity (the key file), its sqlite store and its trace.
Two peers on one directory are one peer id twice: the swarm counts one peer, each
"links" to itself, and both write one ledger. So a peer locks its directory before it
reads the key, and a second peer started on the same directory stops at once, with one
line saying to give it a directory of its own:

    error: data dir /home/ana/.local/share/tessera/peer is in use by another running peer
    (pid 4242); give each peer its own: --data-dir DIR (or --name NAME, which picks
    ~/.local/share/tessera/NAME)

The lock is `flock(2)` on `DATA_DIR/peer.lock`: the kernel drops it when the process
ends however it ends (kill -9 included), so a crash never leaves a stale lock behind.
The file keeps the holder's pid, for that message only.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from tessera.peer.base.errors import ConfigError

LOCK_FILE = "peer.lock"


class DataDirInUse(ConfigError):
    """Another running peer holds this data directory."""


class DataDirLock:
    """The lock on one data directory, held from `acquire` until `release` (or the process ends)."""

    def __init__(self, path: Path, handle: IO[str]) -> None:
        self.path = path
        self._handle: IO[str] | None = handle

    @classmethod
    def acquire(cls, data_dir: Path) -> "DataDirLock":
        """Lock `data_dir` (created if missing). Raises DataDirInUse when another peer holds it."""
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / LOCK_FILE
        handle = open(path, "a+", encoding="ascii")  # a file object: closed (and unlocked) if dropped
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            pid = f" (pid {holder})" if holder.isdigit() else ""
            raise DataDirInUse(
                f"data dir {data_dir} is in use by another running peer{pid}; give each peer its own: "
                f"--data-dir DIR (or --name NAME, which picks ~/.local/share/tessera/NAME)"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        return cls(path, handle)

    @property
    def held(self) -> bool:
        return self._handle is not None

    def release(self) -> None:
        """Unlock (idempotent). The file stays: removing it would race with the next peer's open."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.truncate(0)
            handle.close()  # closing the last descriptor drops the flock


__all__ = ["LOCK_FILE", "DataDirInUse", "DataDirLock"]
