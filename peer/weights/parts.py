"""Where fetched bytes wait until a span is complete: one part file per tensor, then one rename.

    folder/.parts/<tensor sha256>.part     chunk i at offset i * chunk_bytes, written only
                                           after it matched the manifest
    folder/model.safetensors               rewritten only when every needed tensor is in:
                                           tmp + fsync + rename (+ fsync of the folder)

Resuming after a kill -9 needs no journal: a part file is named by its tensor's
content hash, and on restart each chunk range is re-hashed — a chunk that matches the
manifest is kept, anything else (never written, or torn by the kill) is fetched again.
The safetensors file the loader reads is either the old one or the complete new one.

Every write goes through one `write_at(fd, data, offset)` (os.pwrite by default), so a
test can make the disk fill up; ENOSPC becomes `DiskFull` and the temporary file is
removed: no half-written file is ever renamed into place.

All of this is blocking file I/O: the fetcher calls it through `trio.to_thread`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from tessera.stages.weights.tensor_table import read_header

from tessera.peer.weights.errors import DiskFull

PARTS = ".parts"
COPY_BYTES = 1 << 20  # assembling copies tensors through a buffer of this size

WriteAt = Callable[[int, bytes, int], int]


def _disk_full(what: str, bad: OSError) -> DiskFull:
    return DiskFull(f"disk full while writing {what} ({bad.strerror}); free space and restart: "
                    "verified chunks are kept and will not be fetched again")


class PartStore:
    """Part files and the final safetensors files of one model folder (see module docstring)."""

    def __init__(self, folder: Path, manifest: dict, *, write_at: WriteAt = os.pwrite) -> None:
        self.folder = Path(folder)
        self.entries: dict[str, dict] = manifest["tensors"]["entries"]
        self.chunk_bytes = int(manifest["tensors"]["chunk_bytes"])
        self.write_at = write_at
        self.dir = self.folder / PARTS

    def part_path(self, name: str) -> Path:
        return self.dir / f"{self.entries[name]['sha256']}.part"

    def chunk_range(self, name: str, index: int) -> tuple[int, int]:
        """Bytes [start, end) of chunk `index` within its tensor."""
        entry = self.entries[name]
        size = entry["end"] - entry["begin"]
        start = index * self.chunk_bytes
        return start, min(size, start + self.chunk_bytes)

    def verified_chunks(self, name: str) -> set[int]:
        """Chunks of `name` already on disk and matching the manifest (re-hashed, not trusted)."""
        path = self.part_path(name)
        if not path.exists():
            return set()
        good: set[int] = set()
        with open(path, "rb") as f:
            for index, want in enumerate(self.entries[name]["chunks"]):
                start, end = self.chunk_range(name, index)
                f.seek(start)
                data = f.read(end - start)
                if len(data) == end - start and hashlib.sha256(data).hexdigest() == want:
                    good.add(index)
        return good

    def write_chunk(self, name: str, index: int, data: bytes) -> None:
        """Store one verified chunk. Raises DiskFull."""
        self.dir.mkdir(parents=True, exist_ok=True)
        start, _ = self.chunk_range(name, index)
        fd = os.open(self.part_path(name), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            self._write_all(fd, data, start, f"a part of {name!r}")
        finally:
            os.close(fd)

    def _write_all(self, fd: int, data: bytes, offset: int, what: str) -> None:
        view = memoryview(data)
        try:
            while view:
                n = self.write_at(fd, bytes(view), offset)
                view, offset = view[n:], offset + n
        except OSError as bad:
            if bad.errno == errno.ENOSPC:
                raise _disk_full(what, bad) from None
            raise

    def held(self, file: str) -> set[str]:
        """Tensors already in the folder's final `file` (its header only)."""
        path = self.folder / file
        return {n for n in read_header(path)[1] if n != "__metadata__"} if path.exists() else set()

    def assemble(self, file: str, new: list[str]) -> None:
        """Rewrite `file` holding what it held plus the tensors `new` (complete in part files; kept
        until `discard`).

        Raises DiskFull (the old file stays as it was, the part files too).
        """
        path = self.folder / file
        old_at, old_header = read_header(path) if path.exists() else (0, {})
        names = sorted(set(self.held(file)) | set(new), key=lambda n: (self.entries[n]["begin"], n))
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        at = 0
        for name in names:
            entry = self.entries[name]
            size = entry["end"] - entry["begin"]
            header[name] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [at, at + size]}
            at += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        tmp = path.with_name(f".{file}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._write_all(fd, len(raw).to_bytes(8, "little") + raw, 0, str(tmp))
            offset = 8 + len(raw)
            for name in names:
                if name in old_header:
                    b, e = old_header[name]["data_offsets"]
                    source, start, size = path, old_at + b, e - b
                else:
                    source, start, size = self.part_path(name), 0, self.entries[name]["end"] - self.entries[name]["begin"]
                offset = self._copy(source, start, size, fd, offset)
            os.fsync(fd)  # some filesystems report a full disk only here
        except BaseException as bad:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            if isinstance(bad, OSError) and bad.errno == errno.ENOSPC:
                raise _disk_full(str(tmp), bad) from None
            raise
        os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(self.folder)

    def discard(self, names: list[str]) -> None:
        """Remove the part files of `names`, assembled into their files: only once every file of a
        fetch is, since tensors of equal bytes (a norm's ones in every layer) share one part file."""
        for name in names:
            self.part_path(name).unlink(missing_ok=True)

    def _copy(self, source: Path, start: int, size: int, fd: int, offset: int) -> int:
        with open(source, "rb") as f:
            f.seek(start)
            while size > 0:
                data = f.read(min(COPY_BYTES, size))
                if not data:
                    raise OSError(errno.EIO, f"{str(source)!r} ended early")
                self._write_all(fd, data, offset, f"{self.folder.name}'s weights")
                offset += len(data)
                size -= len(data)
        return offset


def write_file_atomically(folder: Path, name: str, data: bytes, *, write_at: WriteAt = os.pwrite) -> None:
    """A small model file (config, tokenizer), verified by the caller: tmp + fsync + rename."""
    tmp = folder / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, offset = memoryview(data), 0
        while view:
            n = write_at(fd, bytes(view), offset)
            view, offset = view[n:], offset + n
        os.fsync(fd)
    except OSError as bad:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        if bad.errno == errno.ENOSPC:
            raise _disk_full(name, bad) from None
        raise
    os.close(fd)
    os.replace(tmp, folder / name)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
