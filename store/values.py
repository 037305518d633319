"""Checks on values before they are queued for the writer: a bad value raises in the caller."""

from __future__ import annotations

import time
from typing import Any

from tessera.store.errors import BadRecord


def timestamp(at: float | None) -> float:
    """`at`, or the current unix time when it is None."""
    return time.time() if at is None else float(at)


def check_int(name: str, value: Any, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRecord(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise BadRecord(f"{name} must be a non-empty str, got {value!r}")
    return value


def check_span(value: Any) -> tuple[int, int]:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise BadRecord(f"span must be a (start, end) pair, got {value!r}")
    start, end = check_int("span start", value[0]), check_int("span end", value[1])
    if end <= start:
        raise BadRecord(f"span must be half-open with start < end, got {value!r}")
    return start, end


def session_hex(value: Any) -> str:
    """A session id as lowercase hex: from bytes, or from a hex str (validated)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, str) and value and not value.lower().strip("0123456789abcdef"):
        return value.lower()
    raise BadRecord(f"session must be bytes or a hex str, got {value!r}")


def hash_text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, str):
        return value
    raise BadRecord(f"{name} must be bytes, a hex str or None, got {value!r}")
