"""Speculative decoding: cheap drafts, one verification pass, exact acceptance rules.

A drafter proposes K tokens; the model scores [last token, d1..dK] in one pass
(K+1 logits rows); the longest acceptable prefix is kept plus one token from the
model itself, and every cache rolls back to the accepted length (a pointer move).

Drafters: `NgramDrafter` (prompt lookup: no model at all), `ModelDrafter`
(a smaller model with the same tokenizer — e.g. the first layers of the same
model plus its head, "self-speculation"), and stages/decoding/mtp.py's `MtpDrafter`
(the model's own multi-token-prediction module, which reads the model's hidden
states: a drafter that does is a `ReadsHidden` and is shown each step's rows).

Acceptance, greedy: draft d_i is kept while it is the argmax of row i-1 — and
only when that argmax wins by more than `TIE_MARGIN`. Rows of a K+1-token pass
are computed by other kernels than a one-token step (different float32
summation order, ~1e-5 apart in the logits), so a near-tie could flip between
them; at a near-tie we stop and let a one-token step decide, exactly as
non-speculative decoding would.

Acceptance, sampling (Leviathan et al. 2023, Chen et al. 2023): keep d_i with
probability min(1, p(d_i) / q(d_i)) where p is the model's and q the draft's
distribution; at the first rejection draw from normalise(max(0, p - q)); if all
K are kept draw the bonus token from p of the last row. The output
distribution is exactly p's. A deterministic draft (n-gram) has q = one-hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch

from tessera.stages.decoding.sampling import Sampler
from tessera.stages.engine.stage import Stage

# Logit gap under which two tokens count as tied for greedy acceptance: 100x the
# float32 summation-order noise seen between a one-token step and a K+1-token pass.
TIE_MARGIN = 1e-3
K_MIN, K_MAX = 1, 8


@dataclass
class Draft:
    """Proposed tokens and, for a model draft, the distribution each was drawn from (rows [K, V])."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # None: a deterministic draft (q is one-hot)


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> Draft: ...

    def accepted(self, tokens: Sequence[int]) -> None:
        """The sequence after verification (drafters with state resynchronise here)."""
        ...


@runtime_checkable
class ReadsHidden(Protocol):
    """A drafter that drafts from the model's hidden states (an MTP module): shown the last layer's
    rows of every step the model ran, before the final norm, as the last peer returns them."""

    def observe(self, start: int, fed: Sequence[int], hidden: torch.Tensor) -> None:
        """Rows [T, H] of tokens `fed` at positions [start, start + T)."""
        ...


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from `max_n` down to `min_n`) and propose what followed it."""

    def __init__(self, *, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        seq = list(tokens)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # latest match first
                if seq[start : start + n] == tail:
                    follow = seq[start + n : start + n + k]
                    if follow:
                        return Draft(follow)
        return Draft([])

    def accepted(self, tokens: Sequence[int]) -> None:
        pass  # stateless


class ModelDrafter:
    """A small local model proposes greedily (or samples, for sampling mode)."""

    SESSION = "draft"

    def __init__(self, stage: Stage, *, capacity: int, sampler: Sampler | None = None) -> None:
        assert stage.embedding is not None and stage.head is not None, "a draft model needs its embedding and head"
        self.stage = stage
        self.sampler = sampler  # None: greedy drafts
        self.capacity = capacity
        stage.open(self.SESSION, capacity=capacity)
        self.fed: list[int] = []  # tokens whose K/V the draft cache holds

    def _sync(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed what the draft cache lacks; return the logits after the last token."""
        common = 0
        while common < min(len(self.fed), len(tokens) - 1) and self.fed[common] == tokens[common]:
            common += 1
        todo = list(tokens[common:])
        self.stage.rollback(self.SESSION, common)
        hidden = self.stage.forward(self.SESSION, self.stage.embed(todo), common)
        self.fed = list(tokens)
        return self.stage.logits(hidden[-1:])[-1]

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        k = min(k, self.capacity - len(tokens) - 1)
        if k <= 0:
            return Draft([])
        logits = self._sync(tokens)
        out: list[int] = []
        rows = []
        for i in range(k):
            if self.sampler is None:
                token = int(logits.argmax())
            else:
                probs = self.sampler.distribution(logits)
                rows.append(probs)
                token = self.sampler.draw(probs)
            out.append(token)
            if i + 1 < k:
                logits = self._sync([*tokens, *out])
        return Draft(out, torch.stack(rows) if rows else None)

    def accepted(self, tokens: Sequence[int]) -> None:
        pass  # `_sync` finds the common prefix on the next proposal

    def close(self) -> None:
        self.stage.close(self.SESSION)


def greedy_accept(logits: torch.Tensor, draft: Sequence[int]) -> tuple[int, int | None]:
    """Greedy verification of rows [K+1, V] against `draft` (K tokens).

    Returns (accepted, next): the number of draft tokens kept, and the model's own
    token after them — or None when that row is a near-tie (decide it with a
    one-token step).
    """
    top2 = torch.topk(logits.float(), 2, dim=-1)
    for i in range(len(draft) + 1):
        best = int(top2.indices[i, 0])
        clear = float(top2.values[i, 0] - top2.values[i, 1]) > TIE_MARGIN
        if not clear:
            return i, None
        if i == len(draft) or best != draft[i]:
            return i, best
    raise AssertionError("unreachable: the loop returns at i == len(draft)")


def sampling_accept(logits: torch.Tensor, draft: Draft, sampler: Sampler) -> tuple[int, int]:
    """Speculative-sampling verification (see module docstring). Returns (accepted, next)."""
    k = len(draft.tokens)
    for i in range(k):
        p = sampler.distribution(logits[i])
        token = draft.tokens[i]
        q = draft.probs[i] if draft.probs is not None else None
        q_token = float(q[token]) if q is not None else 1.0
        if sampler.uniform() < min(1.0, float(p[token]) / max(q_token, 1e-30)):
            continue
        residual = p - q if q is not None else p.clone()
        if q is None:
            residual[token] = 0.0
        residual = residual.clamp_min(0.0)
        total = float(residual.sum())
        return i, sampler.draw(residual / total) if total > 0 else sampler.draw(p)
    return k, sampler.draw(sampler.distribution(logits[k]))


# The K controller's rule (AdaptiveK): a block "pays" when it produced tokens at least as
# fast as plain one-token steps do (tokens kept + 1 over its wall time, drafting included,
# against the smoothed rate of plain steps; before any plain step was timed: when it kept
# at least one draft token). After BACKOFF_MISSES blocks in a row that did not pay, K drops
# to 0 (plain decoding); every REPROBE_EVERY plain steps it re-probes with K = K_PROBE, and
# one probe that does not pay drops it back to 0. Three misses bound the loss of a stream
# that never hits to a few blocks; a probe per 16 steps costs at most ~1/16 of plain speed
# when drafts never hit (the floor is 0.95x), and finds a stream that starts to hit.
BACKOFF_MISSES = 3
REPROBE_EVERY = 16
K_PROBE = 1
RATE_SMOOTHING = 0.3  # weight of the newest plain step in the plain-rate average


@dataclass
class AdaptiveK:
    """K from the recent acceptance and cost: grow after a fully accepted block, shrink to what
    was kept, and back off to 0 (plain decoding) while drafts do not pay (rule above)."""

    k: int = 4
    history: list[float] = field(default_factory=list)
    misses: int = 0  # blocks in a row that did not pay
    plain_rate: float | None = None  # tokens/s of plain steps (smoothed), once one was timed
    plain_steps: int = 0  # plain steps since K dropped to 0
    backoffs: int = 0  # times K dropped to 0 (for summaries)
    backoff_after: int = BACKOFF_MISSES  # misses in a row before K drops to 0 (tests pin drafting on)

    def update(self, proposed: int, accepted: int, seconds: float | None = None) -> None:
        """One verified block: `proposed` draft tokens, `accepted` kept, `seconds` its wall time
        (None: untimed; only acceptance counts). `proposed == 0` is a plain step."""
        if proposed == 0:
            self._plain_step(seconds)
            return
        self.history.append(accepted / proposed)
        if seconds is not None and seconds > 0 and self.plain_rate is not None:
            pays = (accepted + 1) / seconds >= self.plain_rate
        else:
            pays = accepted > 0
        self.misses = 0 if pays else self.misses + 1
        if self.misses >= self.backoff_after:
            self.k, self.plain_steps, self.backoffs = 0, 0, self.backoffs + 1
        elif accepted == proposed:
            self.k = min(K_MAX, self.k + 1)
        else:
            self.k = max(K_MIN, accepted + 1)

    def _plain_step(self, seconds: float | None) -> None:
        if seconds is not None and seconds > 0:
            rate = 1.0 / seconds
            old = self.plain_rate
            self.plain_rate = rate if old is None else (1 - RATE_SMOOTHING) * old + RATE_SMOOTHING * rate
        if self.k == 0:
            self.plain_steps += 1
            if self.plain_steps >= REPROBE_EVERY:
                self.k, self.plain_steps = K_PROBE, 0
                self.misses = self.backoff_after - 1  # one probe that does not pay: back to 0

    @property
    def acceptance(self) -> float:
        return sum(self.history) / len(self.history) if self.history else 0.0
