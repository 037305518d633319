"""Constrained sampling: only tokens that keep the answer a valid JSON prefix may be drawn.

A `JsonConstraint` follows the answer's text and says which next tokens are
allowed (stages/text/json_prefix.py decides on text: a token is allowed if the text
with it is still a valid start of a document, or — for end-of-sequence — if the
document is complete). `ConstrainedSampler` is a `Sampler` that draws under
that mask; it runs wherever the head runs (the requester, or `LocalEngine`),
so a swarm's constrained answer is exactly the local one.

The mask is applied lazily, which gives the same token as masking the whole
vocabulary first:

- greedy: the candidates are tried from the highest logit down; the first
  allowed one is the argmax of the masked logits (ties go to the lower id, as
  argmax does, because the sort is stable).
- sampling: the usual distribution (temperature, top-k, top-p on the raw
  logits) is drawn from; a disallowed draw has its probability zeroed and is
  drawn again — which samples that distribution conditioned on the allowed
  set (after `MAX_REJECTIONS`, every remaining candidate is judged and one
  draw is made from the allowed ones: the same distribution). If the filters
  left no allowed token, the allowed token with the highest logit is taken.

A token's text is judged by decoding the whole answer with it (decoding is not
always concatenation); a token that ends inside a multi-byte character
(decodes to U+FFFD) or adds no text (a special token) is not allowed, so
non-ASCII text in a constrained answer comes only from whole-character tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tessera.stages.text.json_prefix import COMPLETE, INVALID, Shape, check
from tessera.stages.decoding.sampling import Sampler, SamplingParams, probabilities
from tessera.stages.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what decoding a partial UTF-8 sequence yields
# Rejected draws before a sampled step judges every candidate instead: a rejected draw costs one
# multinomial over the vocabulary, a judged candidate one decode; past this many, judging is cheaper.
MAX_REJECTIONS = 32


class JsonConstraint:
    """The answer so far, and which token may come next (see module docstring)."""

    def __init__(self, shape: Shape, tokenizer: Tokenizer, eos_ids: Sequence[int]) -> None:
        self.shape = shape
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_ids)
        self.ids: list[int] = []
        self.text = ""
        self.complete = False  # the document is whole: only end-of-sequence may follow
        self.checked = 0  # candidates judged (for tests and curiosity)

    def allows(self, token: int) -> bool:
        self.checked += 1
        if token in self.eos or self.complete:
            return token in self.eos and self.complete
        text = self.tokenizer.decode([*self.ids, token])
        if len(text) <= len(self.text) or not text.startswith(self.text) or REPLACEMENT in text[len(self.text):]:
            return False
        return check(text, self.shape) != INVALID

    def advance(self, token: int) -> None:
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        self.complete = check(self.text, self.shape) == COMPLETE


class ConstrainedSampler(Sampler):
    """A Sampler whose every draw is allowed by `constraint` (which it then advances)."""

    def __init__(self, params: SamplingParams, constraint: JsonConstraint) -> None:
        super().__init__(params)
        self.constraint = constraint

    def sample(self, logits: torch.Tensor) -> int:
        token = self.greedy_allowed(logits) if self.params.greedy else self.draw_allowed(logits)
        self.constraint.advance(token)
        return token

    def greedy_allowed(self, logits: torch.Tensor) -> int:
        order = torch.sort(logits.float(), descending=True, stable=True).indices.tolist()
        for token in order:
            if self.constraint.allows(token):
                return token
        raise AssertionError("no token continues the document: the grammar has a dead end")

    def draw_allowed(self, logits: torch.Tensor) -> int:
        probs = probabilities(logits, self.params).clone()
        for _ in range(MAX_REJECTIONS):
            if not probs.sum() > 0:
                break
            token = self.draw(probs)
            if self.constraint.allows(token):
                return token
            probs[token] = 0.0
        # Still nothing: judge every remaining candidate and draw once from what is allowed —
        # the same conditional distribution, at a bounded cost when little is allowed.
        candidates = probs.nonzero().flatten().tolist()
        allowed = torch.zeros_like(probs)
        for token in candidates:
            allowed[token] = float(self.constraint.allows(token))
        probs = probs * allowed
        return self.draw(probs) if probs.sum() > 0 else self.greedy_allowed(logits)
