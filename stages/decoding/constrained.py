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

Judging is a decode and a parse of the whole answer, per candidate: on a vocabulary of
150,000 tokens where few may come next (a structural character of a tool call, and a
random-weight model's logits that put them anywhere), a greedy step judged ~75,000 of them,
and 90 tokens took 745 s under cProfile (issue 46: 6.7 M judgements, parse 60 %, decode 20 %).
So each step first *screens* the vocabulary (`JsonConstraint.screen`): a token whose first
character already breaks the document cannot be allowed whatever follows it (every prefix of
a valid prefix is one: the grammar is prefix-closed), and for a tokenizer that writes text by
concatenation, a token's first character is that of its text alone (`FirstChars`, read once
per tokenizer). One judgement per distinct first character (a few hundred) marks the whole
vocabulary; only tokens that pass are judged. The screen only rejects what judging would
reject, so the greedy token is the same; a draw is made from the same conditional distribution
(the screened-out tokens were disallowed), now without drawing them first.

An answer always closes. The driver (`LocalEngine.generate_ids`, `Swarm.generate_ids`)
tells the constraint how many tokens may still come (`limit`); it keeps a *plan*,
the tokens of the shortest closing of the answer so far (json_prefix.closing:
`0}` for a number left open in an object, the required keys with their shortest
values ...), and allows a token only if the closing after it, plus end-of-sequence,
still fits. The plan's own next token always fits (the rest of the plan does), so
there is no dead end: with slack the model writes what it likes, and as the budget
runs out only the plan's tokens are left — a number stops growing, a string is
closed, the required keys are written, the brackets shut, and end-of-sequence comes
on the last token. A format whose shortest answer does not fit the budget at all
is refused before anything runs (`CannotClose`; HTTP answers it with a 400).
The plan is the closing's own encoding where the tokenizer writes text by
concatenation (byte-level BPE: SmolLM2, Llama 3, Qwen), else one token per character.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tessera.stages.errors import StageError
from tessera.stages.text.json_prefix import COMPLETE, INVALID, PREFIX, Shape, parse
from tessera.stages.decoding.sampling import Sampler, SamplingParams, probabilities
from tessera.stages.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what decoding a partial UTF-8 sequence yields
# Rejected draws before a sampled step judges every candidate instead: a rejected draw costs one
# multinomial over the vocabulary, a judged candidate one decode; past this many, judging is cheaper.
MAX_REJECTIONS = 32
# Candidates a greedy step judges in the model's order before it screens the vocabulary: a screen
# judges a few hundred heads (see the module docstring), so it pays only when the favourites fail.
UNSCREENED = 16


class CannotClose(StageError, ValueError):
    """The token budget is too small for the shortest answer the constraint allows."""

    def __init__(self, needed: int, budget: int, closing: str) -> None:
        super().__init__(f"the requested format needs at least {needed} tokens (the shortest valid answer "
                         f"is {closing!r}, then end-of-sequence) but only {budget} may be generated: "
                         f"raise max_tokens")
        self.needed, self.budget, self.closing = needed, budget, closing


@dataclass(frozen=True)
class Form:
    """One way the answer may look: `prefix`, then a JSON document of `shape`, then `suffix`."""

    shape: Shape
    prefix: str = ""
    suffix: str = ""


class JsonConstraint:
    """The answer so far, and which token may come next (see module docstring).

    `shape` is one Shape, or the Forms the answer may take (any one of them). With `opener`,
    the constraint binds only an answer that begins with it: one that starts otherwise is free
    text (a tool call in `tool_choice: auto`: the model may answer in words, but a call it
    starts is a valid call). With a budget (`limit`), the answer always closes: a token is
    allowed only if the shortest closing after it still fits, so the last tokens write it.
    """

    def __init__(self, shape: Shape | Sequence[Form], tokenizer: Tokenizer, eos_ids: Sequence[int],
                 *, opener: str | None = None) -> None:
        self.forms = (Form(shape),) if isinstance(shape, Shape) else tuple(shape)
        if not self.forms:
            raise ValueError("a constraint needs at least one form")
        self.opener = opener
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_ids)
        self.ids: list[int] = []
        self.text = ""
        self.complete = False  # the document is whole: only end-of-sequence may follow
        self.free = False  # the answer did not begin with `opener`: nothing is constrained
        self.left: int | None = None  # tokens that may still be generated (end-of-sequence included)
        self.plan: list[int] = []  # tokens that close the answer from here (when a budget is set)
        self.checked = 0  # candidates judged (for tests and curiosity)
        self.concatenates = concatenates(tokenizer)

    def judge(self, text: str) -> tuple[str, str | None]:
        """(COMPLETE, PREFIX or INVALID, the shortest closing) of `text` over every form."""
        verdicts = [parse(text, f.shape, prefix=f.prefix, suffix=f.suffix) for f in self.forms]
        if any(v == COMPLETE for v, _ in verdicts):
            return COMPLETE, ""
        tails = [tail for v, tail in verdicts if v == PREFIX and tail is not None]
        return (PREFIX, min(tails, key=len)) if tails else (INVALID, None)

    def is_free(self, text: str) -> bool:
        """Whether `text` has left the opener's path (then it is plain text, unconstrained)."""
        return self.opener is not None and not (self.opener.startswith(text) or text.startswith(self.opener))

    def closing_ids(self, tail: str) -> list[int]:
        """Tokens that write `tail` after the answer so far: its own encoding where the tokenizer
        writes text by concatenation (byte-level BPE), else one token per character."""
        if not tail:
            return []
        if self.concatenates:
            return self.tokenizer.encode(tail)
        ids = [self.tokenizer.token_id(ch) for ch in tail]
        if None in ids:
            raise StageError(f"this tokenizer has no token for {tail[ids.index(None)]!r}: a constrained answer "
                             f"cannot be closed with it")
        return ids

    def limit(self, tokens: int) -> None:
        """From now on at most `tokens` more may be generated (end-of-sequence included).
        Raises CannotClose if the shortest closing of the answer so far does not fit."""
        if self.free:
            self.left = tokens
            return
        _, tail = self.judge(self.text)
        plan = self.closing_ids(tail or "")
        if self.opener is None and len(plan) + 1 > tokens:
            raise CannotClose(len(plan) + 1, tokens, self.text + (tail or ""))
        self.left, self.plan = tokens, plan

    def screen(self, size: int) -> torch.Tensor | None:
        """A bool mask over `size` token ids: False where a token cannot be allowed now, the start
        of its text already breaking the document (see the module docstring); None where no screen
        applies (a free answer, or a tokenizer that does not write by concatenation). A complete
        answer allows only end-of-sequence."""
        if self.complete:
            mask = torch.zeros(size, dtype=torch.bool)
            mask[[t for t in self.eos if t < size]] = True
            return mask
        if self.free or not self.concatenates:
            return None
        heads = token_heads(self.tokenizer)
        firsts = {c for c in heads.ones if self._may_begin(c)}
        ok = torch.tensor([h[0] in firsts and (len(h) == 1 or self._may_begin(h)) for h in heads.twos] + [False],
                          dtype=torch.bool)  # a two-character head is judged only where its first character passed
        mask = ok[heads.two[:size]]
        if size > len(mask):  # the model's vocabulary padded past the tokenizer's: those ids write nothing
            mask = torch.cat([mask, torch.zeros(size - len(mask), dtype=torch.bool)])
        return mask

    def _may_begin(self, head: str) -> bool:
        """Whether a token whose text begins with `head` might be allowed after the answer so far."""
        if REPLACEMENT in head:
            return False  # judging rejects a token that writes U+FFFD (see `allows`)
        text = self.text + head
        if self.opener is not None and (self.opener.startswith(text) or self.is_free(text)):
            return True  # on the opener's path, or leaving it (free text): not screened
        return self.judge(text)[0] != INVALID

    def allows(self, token: int) -> bool:
        self.checked += 1
        if token in self.eos or self.complete:
            return token in self.eos and (self.complete or self.free)
        if self.free:
            return True
        text = self.tokenizer.decode([*self.ids, token])
        if len(text) <= len(self.text) or not text.startswith(self.text) or REPLACEMENT in text[len(self.text):]:
            return False
        if self.is_free(text):
            return True
        verdict, tail = self.judge(text)
        if verdict == INVALID:
            return False
        if self.left is None:
            return True
        if self.plan and token == self.plan[0] and len(self.plan) + 1 <= self.left:
            return True  # the plan's next token keeps the rest of the plan, which fits
        # after this token, the closing and end-of-sequence must fit in what is left
        return len(self.closing_ids(tail or "")) + 1 <= self.left - 1

    def advance(self, token: int) -> None:
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        if self.free or self.is_free(self.text):
            self.free = True
            return
        verdict, tail = self.judge(self.text)
        self.complete = verdict == COMPLETE
        if self.left is not None:
            self.left -= 1
            fresh = self.closing_ids(tail or "")
            kept = self.plan[1:] if self.plan and token == self.plan[0] else None
            self.plan = kept if kept is not None and len(kept) < len(fresh) else fresh


@dataclass(frozen=True)
class Heads:
    """The start of each token's text, as it decodes alone: `ones` the distinct first characters,
    `twos` the distinct first two (one, for a one-character text); `two` per token id the position
    of its head in `twos` (len(twos): no text at all)."""

    ones: frozenset[str]
    twos: tuple[str, ...]
    two: torch.Tensor


# Read once per tokenizer (~1 s at 150k tokens), which lives as long as its engine or requester: a few
# at most in one process. Keyed by identity (a Tokenizer is a mutable dataclass), the tokenizer kept
# with its entry so that its id is not reused while the entry lives.
HEADS_KEPT = 8
_heads: dict[int, tuple[Tokenizer, Heads]] = {}


def token_heads(tokenizer: Tokenizer) -> Heads:
    kept = _heads.get(id(tokenizer))
    if kept is not None and kept[0] is tokenizer:
        return kept[1]
    heads = [tokenizer.decode([i])[:2] for i in range(tokenizer.backend.get_vocab_size(with_added_tokens=True))]
    twos = tuple(sorted(set(heads) - {""}))
    where = {h: i for i, h in enumerate(twos)}
    found = Heads(frozenset(h[0] for h in twos), twos,
                  torch.tensor([where[h] if h else len(twos) for h in heads], dtype=torch.long))
    if len(_heads) >= HEADS_KEPT:
        del _heads[next(iter(_heads))]  # the oldest
    _heads[id(tokenizer)] = (tokenizer, found)
    return found


def concatenates(tokenizer: Tokenizer) -> bool:
    """Whether encoding two texts apart and decoding them together gives both, as byte-level BPE
    does (a SentencePiece tokenizer may prepend a space to each encoding)."""
    probe = [('{"ab', 'c": 0'), ("[1", ", 2]}")]
    return all(tokenizer.decode(tokenizer.encode(a) + tokenizer.encode(b)) == a + b for a, b in probe)


class ConstrainedSampler(Sampler):
    """A Sampler whose every draw is allowed by `constraint` (which it then advances)."""

    def __init__(self, params: SamplingParams, constraint: JsonConstraint) -> None:
        super().__init__(params)
        self.constraint = constraint

    def sample(self, logits: torch.Tensor, argmax: int | None = None) -> int:
        del argmax  # the best allowed token, not the best token
        token = self.greedy_allowed(logits) if self.params.greedy else self.draw_allowed(logits)
        self.constraint.advance(token)
        return token

    def greedy_allowed(self, logits: torch.Tensor) -> int:
        order = torch.sort(logits.float(), descending=True, stable=True).indices
        for token in order[:UNSCREENED].tolist():  # the model's favourites are usually allowed: no screen
            if self.constraint.allows(token):
                return token
        rest = order[UNSCREENED:]
        mask = self.constraint.screen(logits.shape[-1])
        if mask is not None:
            rest = rest[mask[rest]]  # the same order, less what cannot be allowed
        for token in rest.tolist():
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
        # the same conditional distribution, at a bounded cost when little is allowed (the screen
        # leaves out, unjudged, what judging would reject).
        mask = self.constraint.screen(probs.shape[-1])
        if mask is not None:
            probs[~mask] = 0.0
        candidates = probs.nonzero().flatten().tolist()
        allowed = torch.zeros_like(probs)
        for token in candidates:
            allowed[token] = float(self.constraint.allows(token))
        probs = probs * allowed
        return self.draw(probs) if probs.sum() > 0 else self.greedy_allowed(logits)
