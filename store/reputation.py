"""What a peer remembers about other peers: bans with back-off, and misbehaviour reports.

A mixin of `PeerStore` (store/db.py), which provides ``_query`` (a read after a flush),
``_submit`` (queue a write op) and ``_ban_lock``; kept apart so each file has one job.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from tessera.store.errors import BadRecord, ReportTooLarge
from tessera.store.values import check_int, check_span, check_text, hash_text, session_hex, timestamp

# A report's raw signed bytes: a few hashes, ids and a signature. 64 KiB is ample and keeps
# a hostile reporter from filling our disk through one row.
MAX_REPORT_BYTES = 64 * 1024
# Ban back-off: the n-th ban lasts BAN_BASE_S * 2**(n-1), at most BAN_CAP_S. A peer that has
# stayed clean for BAN_FORGIVE_S after its last ban ended starts again at the first step.
BAN_BASE_S = 60.0
BAN_CAP_S = 24 * 3600.0
BAN_FORGIVE_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Ban:
    """One ban as stored: who, until when (unix s), why, and how many bans so far."""

    peer: str
    until: float
    reason: str
    count: int


class Reputation:
    """Bans and reports; see the module docstring for what the host class provides."""

    _ban_lock: threading.Lock
    _query: Callable[..., list[dict]]
    _submit: Callable[[Any, str], None]

    # --- bans ----------------------------------------------------------------------------

    def add_ban(
        self,
        peer: str,
        reason: str,
        *,
        now: float | None = None,
        base: float = BAN_BASE_S,
        cap: float = BAN_CAP_S,
        forgive: float = BAN_FORGIVE_S,
    ) -> Ban:
        """Ban `peer` with exponential back-off and return the ban (its `until` to enforce)."""
        check_text("peer", peer)
        at = timestamp(now)
        with self._ban_lock:  # read-count-then-write must not interleave within this process
            rows = self._query("SELECT * FROM bans WHERE peer = ?", (peer,))
            previous = rows[0] if rows else None
            if previous is None or previous["until"] + forgive < at:
                count, first = 1, at
            else:
                count, first = previous["count"] + 1, previous["first"]
            until = at + min(cap, base * 2.0 ** min(count - 1, 60))
            row = {
                "peer": peer,
                "until": until,
                "reason": str(reason),
                "count": count,
                "first": first,
                "last": at,
            }
            self._submit(lambda db: db["bans"].upsert(row, pk="peer"), "ban")
        return Ban(peer=peer, until=until, reason=str(reason), count=count)

    def lift_ban(self, peer: str, *, now: float | None = None) -> None:
        """End `peer`'s ban now (its count stays, so a relapse still backs off)."""
        at = timestamp(now)
        self._submit(
            lambda db: db.execute("UPDATE bans SET until = min(until, ?) WHERE peer = ?", (at, peer)), "ban"
        )

    def active_bans(self, now: float | None = None) -> list[Ban]:
        """Bans still in force at `now`, soonest to end first."""
        rows = self._query("SELECT * FROM bans WHERE until > ? ORDER BY until, peer", (timestamp(now),))
        return [Ban(peer=r["peer"], until=r["until"], reason=r["reason"], count=r["count"]) for r in rows]

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
