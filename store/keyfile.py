"""The peer's private key: a 32-byte Ed25519 seed in its own file, readable by its owner only.

The key never enters the database (the database records only the public peer id). Like
ssh, we refuse a key file that group or others can read or write, or that another user
owns: a leaked seed is a stolen identity, and the fix (``chmod 600``) is the user's to make.

A new key is written to a temporary file created with mode 0600 (``O_EXCL``, so never
through an existing file or link), fsynced, then hard-linked into place: the link fails if
another process created the key first, in which case we load theirs. A crash leaves either
no key file or a complete one, never a short one.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from tessera.store.errors import KeyFileNotOwned, KeyFileTooOpen, KeyFileWrongSize

SEED_BYTES = 32
KEY_FILE_MODE = 0o600


def _check(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileWrongSize(f"key file {str(path)!r} is not a regular file")
    if os.name == "posix":
        if st.st_mode & 0o077:
            raise KeyFileTooOpen(
                f"key file {str(path)!r} has mode {stat.S_IMODE(st.st_mode):#o}; it must be 0600"
                f" (run: chmod 600 {path})"
            )
        if st.st_uid != os.getuid():
            raise KeyFileNotOwned(
                f"key file {str(path)!r} is owned by uid {st.st_uid!r}, not by uid {os.getuid()!r}"
            )
    if st.st_size != SEED_BYTES:
        raise KeyFileWrongSize(
            f"key file {str(path)!r} holds {st.st_size!r} bytes; an Ed25519 seed is {SEED_BYTES!r}"
        )


def load_key(path: Path) -> bytes:
    """Read the seed at `path`; raises a `KeyFileError` subclass if the file is unsafe or wrong."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(Path(path), os.fstat(fd))
        seed = os.read(fd, SEED_BYTES + 1)
    finally:
        os.close(fd)
    if len(seed) != SEED_BYTES:
        raise KeyFileWrongSize(f"key file {str(path)!r} changed size while being read")
    return seed


def _create(path: Path) -> None:
    """Write a fresh seed at `path` atomically with mode 0600; lose quietly to a concurrent creator."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
    try:
        if os.name == "posix":
            os.fchmod(fd, KEY_FILE_MODE)  # the umask can only remove bits; make it exact anyway
        os.write(fd, secrets.token_bytes(SEED_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if the key exists: never overwrite an identity
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    if os.name == "posix":
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def load_or_create_key(path: Path) -> bytes:
    """The 32-byte Ed25519 seed at `path`, created (mode 0600, parents 0700) if there is none.

    Raises `KeyFileTooOpen`, `KeyFileNotOwned` or `KeyFileWrongSize` for an existing file
    that is not safe to use; it is never rewritten.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _create(path)
    return load_key(path)
