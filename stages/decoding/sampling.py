"""Sampling: a stack of tiny functions over a logits row, and a seeded `Sampler`.

temperature == 0 means greedy (argmax). Otherwise logits are divided by the
temperature, filtered by top-k then top-p, softmaxed, and one id is drawn with a
torch.Generator seeded from `seed`, so the same seed gives the same answer.
`Sampler.distribution` exposes the final probabilities, which speculative
verification needs to apply its acceptance rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature: 0 = greedy. top_k: 0 = off. top_p: 1.0 = off. seed: None = fresh entropy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[..., -1, None]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches p (always at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative - sorted_logits.softmax(-1) >= p  # mass before this token already reaches p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy sampler draws from (float32)."""
    x = logits.float() / params.temperature
    x = top_p_filter(top_k_filter(x, params.top_k), params.top_p)
    return x.softmax(-1)


class Sampler:
    """Draws token ids from logits rows, reproducibly for a given seed."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        if self.params.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return probabilities(logits, self.params)

    def sample(self, logits: torch.Tensor, argmax: int | None = None) -> int:
        """One id from a logits row [V]. `argmax`: the row's argmax where the caller has it (a compiled
        head computes it with the logits): greedy sampling's answer without another pass."""
        if self.params.greedy:
            return int(logits.argmax(-1)) if argmax is None else argmax
        return self.draw(probabilities(logits, self.params))

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        """A uniform draw in [0, 1) from the same seeded stream (speculative acceptance uses it)."""
        return float(torch.rand((), generator=self.generator))
