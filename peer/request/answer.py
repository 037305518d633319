"""What an answer gives its caller, besides token ids: `Piece`, `Rewind` and `merge_infos`.

`Swarm.generate` streams `Piece`s (a token and the text it completes); `Swarm.answer_ids`
streams token ids and, when a spot check catches a peer's wrong activations after tokens
were given from them, a `Rewind` saying how many stand; `merge_infos` folds the `info` of
every session such an answer took into one. Pure values and a pure function, with no
network or torch: the HTTP gateway and the CLI read them without the requester's machinery.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rewind:
    """In an answer (`Swarm.answer_ids`): only the first `kept` tokens given so far stand (the
    rest were computed from a peer's wrong activations); the tokens that follow continue from them."""

    kept: int


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it completes ("" while a character is still partial)."""

    token: int
    text: str


def merge_infos(attempts: list[dict]) -> dict:
    """One `info` for an answer that took several sessions (regenerated after a rewind)."""
    merged = dict(attempts[-1]) if attempts else {}
    merged["rewinds"] = len(attempts) - 1
    merged["failovers"] = sum(a.get("failovers", 0) for a in attempts)
    merged["routes"] = [r for a in attempts for r in a.get("routes", [])]
    checks = [a["checks"] for a in attempts if "checks" in a]
    if checks:
        unchecked = [u for c in checks for u in c.get("unchecked", [])]  # spans no check could cover (groups)
        merged["checks"] = {
            key: sum(c[key] for c in checks) for key in ("checks", "rows_compared", "fingerprint_bytes")
        } | {"verdicts": [v for c in checks for v in c["verdicts"]],
             "unchecked": [u for i, u in enumerate(unchecked) if u not in unchecked[:i]]}
    return merged
