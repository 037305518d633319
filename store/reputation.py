"""What a peer remembers about other peers: the misbehaviour reports it received.

A mixin of `PeerStore` (store/db.py), which provides ``_query`` (a read after a flush) and
``_submit`` (queue a write op); kept apart so each file has one job. Bans and their back-off
live in the swarm client's one back-off object (peer/base/backoff.py), not here.
"""

from __future__ import annotations

from typing import Any, Callable

from tessera.store.errors import BadRecord, ReportTooLarge
from tessera.store.values import check_int, check_span, check_text, hash_text, session_hex, timestamp

# A report's raw signed bytes: a few hashes, ids and a signature. 64 KiB is ample and keeps
# a hostile reporter from filling our disk through one row.
MAX_REPORT_BYTES = 64 * 1024


class Reputation:
    """Misbehaviour reports; see the module docstring for what the host class provides."""

    _query: Callable[..., list[dict]]
    _submit: Callable[[Any, str], None]

    # --- misbehaviour reports -----------------------------------------------------------

    def add_report(
        self,
        reporter: str,
        accused: str,
        *,
        span: tuple[int, int] | None,
        step: int | None,
        inputs_hash: bytes | str | None,
        outputs_hash: bytes | str | None,
        signature: bytes | None,
        raw: bytes = b"",
        session: bytes | str | None = None,
        model_id: str | None = None,
        verified: bool | None = None,
        received: float | None = None,
    ) -> None:
        """Keep a misbehaviour report, with its raw signed bytes (at most MAX_REPORT_BYTES)."""
        if not isinstance(raw, (bytes, bytearray)):
            raise BadRecord(f"raw must be bytes, got {type(raw).__name__!r}")
        if len(raw) > MAX_REPORT_BYTES:
            raise ReportTooLarge(f"report raw bytes are {len(raw)!r} long, limit {MAX_REPORT_BYTES!r}")
        if signature is not None and not isinstance(signature, (bytes, bytearray)):
            raise BadRecord(f"signature must be bytes or None, got {signature!r}")
        start, end = check_span(span) if span is not None else (None, None)
        row = {
            "received": timestamp(received),
            "reporter": check_text("reporter", reporter),
            "accused": check_text("accused", accused),
            "model_id": model_id,
            "session": session_hex(session) if session is not None else None,
            "span_start": start,
            "span_end": end,
            "step": check_int("step", step) if step is not None else None,
            "inputs_hash": hash_text("inputs_hash", inputs_hash),
            "outputs_hash": hash_text("outputs_hash", outputs_hash),
            "signature": bytes(signature) if signature is not None else None,
            "verified": None if verified is None else int(bool(verified)),
            "raw": bytes(raw),
        }
        self._submit(lambda db: db["reports"].insert(row), "report")

    def reports(self, *, accused: str | None = None, limit: int | None = None) -> list[dict]:
        """Reports, newest first (``verified`` back as None/False/True)."""
        where = "WHERE accused = ?" if accused is not None else ""
        tail = f"LIMIT {int(limit)}" if limit is not None else ""
        params = (accused,) if accused is not None else ()
        rows = self._query(f"SELECT * FROM reports {where} ORDER BY received DESC, id DESC {tail}", params)
        for row in rows:
            row["verified"] = None if row["verified"] is None else bool(row["verified"])
        return rows
