"""`MtpDrafter`: drafts with the model's own multi-token-prediction module (`--speculate mtp`).

The module (families/mtp.py, stages/engine/mtp.py) predicts the token after next from the model's
last hidden state h_i and the next token t_{i+1}. It runs where the head runs: the requester sees
every hidden state the last peer returns (a verified block's rows, the prompt's) and hands them
to the drafter (`observe`) before it asks for the next draft (`propose`). Nothing else changes:
the swarm verifies the drafts as every draft is verified (stages/decoding/speculative.py), so the
output is exactly greedy, or exactly the sampled distribution.

State, per generation:

- the hidden rows the model returned, after its final norm, for positions [base, base + n), and
  the tokens fed at them. A rejected draft's rows are dropped on the next `observe` (written over)
  or never matched: a row counts only while the tokens up to it are the sequence's;
- the module's cache: its position j holds the pair (h_{base+j}, t_{base+j+1}) of *real* rows
  only. Drafting appends pairs whose h is the module's own output (the chain: o_i stands for
  h_{i+1} beside the drafted token) and cuts them off again before returning, so a rejected draft
  leaves nothing to roll back; when the sequence differs from what a cached pair was computed from
  (a verified block kept fewer tokens than the guess a pipelined proposal was drafted from), the
  cache is cut back to where it agrees and the real pairs after it are fed again.

A proposal past the rows returned so far (a pipelined block is drafted before the block ahead of
it returns) runs the chain through the tokens it is given, then drafts. `base` is where the rows
begin: the prompt's first position, or its last chunk's when the prompt went down the chain in
chunks (the requester keeps only that chunk's rows: the module then reads the context from there).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from tessera.stages.decoding.sampling import Sampler
from tessera.stages.decoding.speculative import Draft
from tessera.stages.engine.mtp import MtpStage


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class MtpDrafter:
    """Drafts greedily (or, with `sampler`, by sampling: the draft's distribution is q) with an MtpStage."""

    def __init__(self, mtp: MtpStage, *, capacity: int, sampler: Sampler | None = None,
                 session: Hashable = "mtp") -> None:
        """`session`: the name of its cache on `mtp` (drafters sharing one module need their own)."""
        self.mtp = mtp
        self.session = session
        self.capacity = capacity
        self.sampler = sampler
        self.base = 0
        self.fed: list[int] = []  # tokens the model was fed at positions [base, base + len)
        self.hidden = torch.empty(0, mtp.spec.hidden_size)  # their rows, after the final norm
        self.cached: list[int] = []  # the tokens the module's real pairs were computed from: [0, base + pairs + 1)
        self.outputs = torch.empty(0, mtp.spec.hidden_size)  # the module's output at each real pair
        mtp.open(self.session, capacity=capacity)

    # -- what the model returned ---------------------------------------------------------------

    def observe(self, start: int, fed: Sequence[int], hidden: torch.Tensor) -> None:
        """The model's last-layer rows [T, H] for tokens `fed` at positions [start, start + T) (before the
        final norm, as the last peer returns them). A step at or before `base` (a new prompt) or past
        what is held (rows were skipped) starts afresh from `start`."""
        if hidden.shape[0] != len(fed) or not fed:
            return
        rows = self.mtp.final_norm(hidden)
        if start <= self.base or start > self.base + len(self.fed):
            self.base, self.fed, self.hidden = start, [], rows[:0]
            self.cached, self.outputs = [], rows[:0]
            self.mtp.rollback(self.session, 0)
        keep = start - self.base
        self.fed = self.fed[:keep] + list(fed)
        self.hidden = torch.cat((self.hidden[:keep], rows))

    # -- drafting ------------------------------------------------------------------------------

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        k = min(k, self.capacity - len(tokens) - 1)
        tokens = list(tokens)
        if k <= 0 or self.base >= len(tokens) - 1:
            return Draft([])
        known = common_prefix(self.fed, tokens[self.base:])  # rows that still hold for `tokens`
        pairs = min(known, len(tokens) - 1 - self.base)  # real pairs (h_p, t_{p+1}) from base
        if pairs == 0:
            return Draft([])
        out = self._real_pairs(tokens, pairs)
        # the chain: o_p stands for h_{p+1}; through the tokens past the real rows, then the drafts
        position, nxt = pairs, self.base + pairs + 1  # the module's next position; the index o predicts
        drafted: list[int] = []
        rows = []
        try:
            while len(drafted) < k:
                if nxt >= len(tokens):
                    token = self._draw(out, rows)
                    drafted.append(token)
                    if len(drafted) == k:
                        break
                else:
                    token = tokens[nxt]
                out = self.mtp.forward(self.session, [token], out, position)
                position, nxt = position + 1, nxt + 1
        finally:
            self.mtp.rollback(self.session, pairs)  # only real pairs stay
        return Draft(drafted, torch.stack(rows) if rows else None)

    def _real_pairs(self, tokens: list[int], pairs: int) -> torch.Tensor:
        """Bring the module's cache to the first `pairs` real pairs of `tokens`; the last one's output [1, H]."""
        agree = max(0, common_prefix(self.cached, tokens) - self.base - 1)
        have = min(self.outputs.shape[0], agree, pairs)
        if have < pairs:
            lo, hi = self.base + have, self.base + pairs
            fresh = self.mtp.forward(self.session, tokens[lo + 1 : hi + 1], self.hidden[have:pairs], have)
            self.outputs = torch.cat((self.outputs[:have], fresh))
            self.cached = tokens[: hi + 1]
        else:
            self.outputs = self.outputs[:pairs]
            self.cached = tokens[: self.base + pairs + 1]
        return self.outputs[pairs - 1 : pairs]

    def _draw(self, out: torch.Tensor, rows: list[torch.Tensor]) -> int:
        logits = self.mtp.logits(out)[-1]
        if self.sampler is None:
            return int(logits.argmax())
        probs = self.sampler.distribution(logits)
        rows.append(probs)
        return self.sampler.draw(probs)

    def accepted(self, tokens: Sequence[int]) -> None:
        pass  # `propose` finds what still holds

    def close(self) -> None:
        self.mtp.close(self.session)
