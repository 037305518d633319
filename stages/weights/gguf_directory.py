"""A GGUF file's header, walked and checked before anything else reads the file.

A GGUF is a header — magic, version, a count of tensors and of key/value pairs, the pairs
(typed values: numbers, strings, arrays), then per tensor its name, dimensions, ggml type and
offset into the data — followed by the tensors' bytes, each at an aligned offset. Nothing in
the file says how many bytes a tensor has: that follows from its type and shape, so a header
whose type was rewritten (Q4_1 relabelled Q8_0) still "reads", its tensor running over the next
one's bytes. `read_gguf_directory` walks the header itself (the `gguf` package's reader builds
every metadata value as numpy views, seconds for a real tokenizer, and an out-of-range count or
length in a crafted file ends in an IndexError or a huge allocation there) and holds the file to
what llama.cpp's own loader requires:

- every count and length fits in the bytes that are left (a count of 2^60 is refused before any
  loop runs; a string's length before it is sliced), every value type is GGUF's;
- a tensor has 1 to 4 dimensions, none zero, of a ggml type the gguf package knows, its innermost
  dimension whole blocks of that type; names are unique;
- the tensors' bytes lie back to back in header order, each at the aligned end of the one before
  (llama.cpp's "tensor has offset X, expected Y"): so each tensor's byte length is exactly what its
  type and shape need, no two overlap, and a relabelled type moves every offset after it;
- the last tensor ends inside the file, with no more than the alignment's padding after it.

Any failure is one ModelFormatError line naming the file and what is wrong. The `gguf` package's
reader is used (by stages/weights/convert.py) only on a file that passed.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from tessera.stages.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4  # llama.cpp's GGML_MAX_DIMS
# GGUF metadata value types -> their fixed size in bytes (8 = string and 9 = array are walked)
VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY, GGUF_UINT32 = 8, 9, 4
MIN_FIELD_BYTES = 8 + 4  # a key's length and a value type: what each key/value pair takes at least
MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # a name's length, n_dims, one dimension, type, offset
STRING_BYTES = 8  # a string's length: what each string of an array takes at least


@dataclass(frozen=True)
class GgufTensor:
    """Where one tensor's bytes lie in a GGUF file.

    dims:   as GGUF lists them, innermost first ([K, N] for an N x K matrix).
    kind:   ggml_type (3 = Q4_1).
    offset: bytes from the start of the file.
    nbytes: its bytes, as its type and dims need them.
    """

    dims: tuple[int, ...]
    kind: int
    offset: int
    nbytes: int


def ggml_sizes() -> dict[int, tuple[int, int]]:
    """ggml type id -> (weights a block, bytes a block), for every type the gguf package knows."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}


def read_gguf_directory(path: Path) -> tuple[dict[str, GgufTensor], str | None]:
    """The tensors of a GGUF file (name -> where, in header order) and its `general.architecture`,
    the header checked as the module docstring says. Raises ModelFormatError."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse_directory(path, data)
    except (OSError, ValueError) as bad:  # ValueError: mmap of an empty file
        raise ModelFormatError(f"{str(path)!r} is not a readable GGUF file: {bad}") from None


def _parse_directory(path: Path, data: mmap.mmap) -> tuple[dict[str, GgufTensor], str | None]:
    """read_gguf_directory's walk over the mapped file (the map is closed once it returns)."""
    where, size, pos = repr(str(path)), len(data), 0

    def refuse(what: str) -> ModelFormatError:
        return ModelFormatError(f"{where}: {what}")

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def count(n: int, each: int, what: str) -> int:
        if n > (size - pos) // each:
            raise refuse(f"{what} ({n}) more than the {size - pos} bytes left can hold")
        return n

    def string(what: str) -> bytes:
        nonlocal pos
        (n,) = take("Q")
        count(n, 1, f"the length of {what} at byte {pos - 8} is")
        pos += n
        return data[pos - n:pos]

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == GGUF_STRING:
            string("a string")
        elif kind == GGUF_ARRAY:  # of numbers or strings (llama.cpp reads no array of arrays)
            inner, n = take("IQ")
            if inner in VALUE_SIZES:
                pos += VALUE_SIZES[inner] * count(n, VALUE_SIZES[inner], f"an array at byte {pos - 12} counts")
            elif inner == GGUF_STRING:
                for _ in range(count(n, STRING_BYTES, f"an array at byte {pos - 12} counts")):
                    string("a string")
            else:
                raise refuse(f"an array of GGUF value type {inner!r} (numbers or strings only)")
        elif kind in VALUE_SIZES:
            if VALUE_SIZES[kind] > size - pos:
                raise struct.error("a value past the end")
            pos += VALUE_SIZES[kind]
        else:
            raise refuse(f"unknown GGUF value type {kind!r}")

    try:
        if data[:4] != GGUF_MAGIC:
            raise refuse(f"not a GGUF file (magic {data[:4]!r})")
        pos = 4
        version, n_tensors, n_fields = take("IQQ")
        if version not in GGUF_VERSIONS:
            raise refuse(f"GGUF version {version!r} is not supported {GGUF_VERSIONS}")
        count(n_fields, MIN_FIELD_BYTES, "the header's count of key/value pairs is")
        count(n_tensors, MIN_TENSOR_BYTES, "the header's count of tensors is")
        architecture, alignment = None, GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_fields):
            key = string("a key").decode()
            (kind,) = take("I")
            if key == "general.architecture" and kind == GGUF_STRING:
                architecture = string(key).decode()
            elif key == "general.alignment" and kind == GGUF_UINT32:
                (alignment,) = take("I")
                if alignment <= 0 or alignment & (alignment - 1):
                    raise refuse(f"general.alignment {alignment} is not a power of two")
            else:
                skip(kind)
        infos: dict[str, tuple[tuple[int, ...], int, int]] = {}
        for _ in range(n_tensors):
            name = string("a tensor name").decode()
            (n_dims,) = take("I")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise refuse(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {GGML_MAX_DIMS})")
            dims = take("Q" * n_dims)
            kind, offset = take("IQ")
            if name in infos:
                raise refuse(f"tensor {name!r} is listed twice")
            infos[name] = (tuple(int(d) for d in dims), int(kind), int(offset))
    except (struct.error, UnicodeDecodeError) as bad:
        raise refuse(f"a truncated or corrupt GGUF header ({bad})") from None
    start = -(-pos // alignment) * alignment  # the tensor data begins at the next aligned offset
    return _place_tensors(refuse, infos, start, size, alignment), architecture


def _place_tensors(refuse, infos: dict[str, tuple[tuple[int, ...], int, int]], start: int, size: int,
                   alignment: int) -> dict[str, GgufTensor]:
    """Each tensor where its header says, its bytes from its type and dims, held back to back (module
    docstring); `refuse(what)` makes the error."""
    sizes, tensors, expected = ggml_sizes(), {}, 0
    for name, (dims, kind, offset) in infos.items():
        if kind not in sizes:
            raise refuse(f"tensor {name!r} has an unknown ggml type {kind}")
        block, block_bytes = sizes[kind]
        if min(dims) <= 0 or dims[0] % block:
            raise refuse(f"tensor {name!r} has dimensions {list(dims)}: not whole blocks of {block} of its type")
        numel = 1
        for d in dims:
            numel *= d
        nbytes = numel // block * block_bytes
        if offset != expected:
            raise refuse(f"tensor {name!r} has offset {offset}, expected {expected}: a tensor's type or shape "
                         f"does not match the bytes it has (or the tensors overlap)")
        if nbytes > size - start - offset:
            raise refuse(f"tensor {name!r} ({nbytes} bytes at {start + offset}) runs past the end of the file "
                         f"({size} bytes)")
        tensors[name] = GgufTensor(dims, kind, start + offset, nbytes)
        expected = -(-(offset + nbytes) // alignment) * alignment
    if tensors and size - start - expected >= alignment:
        raise refuse(f"{size - start - expected} bytes after the last tensor: the tensors' types or shapes do "
                     f"not account for the file's data")
    return tensors
