"""The key file: created atomically with mode 0600, reloaded unchanged, refused when unsafe."""

from __future__ import annotations

import os
import stat

import pytest

from tessera.store.errors import KeyFileTooOpen, KeyFileWrongSize
from tessera.store.keyfile import SEED_BYTES, load_or_create_key

pytestmark = pytest.mark.skipif(os.name != "posix", reason="file modes are a POSIX notion")


def test_key_is_created_0600_and_reloaded(tmp_path):
    path = tmp_path / "new" / "peer.key"
    old_umask = os.umask(0o000)  # a careless umask must not widen the key's mode
    try:
        seed = load_or_create_key(path)
    finally:
        os.umask(old_umask)
    assert isinstance(seed, bytes) and len(seed) == SEED_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_key(path) == seed
    assert [p.name for p in path.parent.iterdir()] == ["peer.key"]  # no temp file left behind
    assert load_or_create_key(tmp_path / "other.key") != seed


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_group_or_world_readable_key_is_refused(tmp_path, mode):
    path = tmp_path / "peer.key"
    seed = load_or_create_key(path)
    os.chmod(path, mode)
    with pytest.raises(KeyFileTooOpen, match="chmod 600"):
        load_or_create_key(path)
    assert path.read_bytes() == seed  # refused, never rewritten


def test_wrong_size_key_is_refused(tmp_path):
    path = tmp_path / "peer.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"\x00" * 31)
    os.close(fd)
    with pytest.raises(KeyFileWrongSize, match="31"):
        load_or_create_key(path)
