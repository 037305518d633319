"""Local generation: the whole model as one stage, the same sampling the swarm uses.

`LocalEngine` is the single-machine reference ("oracle") that every distributed
way of running is compared with, token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from tessera.stages.decoding.constrained import ConstrainedSampler, JsonConstraint
from tessera.stages.errors import ContextOverflow
from tessera.stages.kernels.quant import NO_QUANT, Quant
from tessera.stages.decoding.sampling import Sampler, SamplingParams
from tessera.stages.engine.compiled.build import compile_decode
from tessera.stages.assembly.stage import load_stage
from tessera.stages.text.tokenizer import TextStream, Tokenizer

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, quant: Quant = NO_QUANT) -> torch.dtype:
    """float32 on CPU (the fast CPU dtype without native bf16, and the reference); bf16 on accelerators.

    A quantized span on a CPU computes in float32 too, whatever `quant`: its reference is its own
    dequantized float32 model, and bf16 activations drift from it far enough to change answers
    (int4 SmolLM2 on "What is the capital of France?"). `--dtype bfloat16` asks for torch's fast
    bf16 kernels instead: a declared bf16 peer (stages/kernels/quant.py)."""
    del quant  # the same rule for every storage; the parameter says which span the dtype is for
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[name]


def prompt_ids(tokenizer: Tokenizer, prompt: str, *, raw: bool) -> list[int]:
    """The chat template around `prompt` (one user message), or the plain text when `raw`."""
    if raw:
        return tokenizer.encode(prompt)
    return tokenizer.encode_chat([{"role": "user", "content": prompt}])


def plan_length(n_prompt: int, max_new_tokens: int, context: int) -> int:
    """How many tokens may be generated; raises ContextOverflow if the prompt itself does not fit."""
    if n_prompt == 0:
        raise ContextOverflow("the prompt is empty")
    if n_prompt >= context:
        raise ContextOverflow(f"the prompt has {n_prompt} tokens; the model's context is {context}")
    return min(max_new_tokens, context - n_prompt)


@dataclass
class GenerationResult:
    """What one generation produced, in the shape `--json` prints."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        rate = len(self.tokens) / self.seconds if self.seconds > 0 else 0.0
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(rate, 3),
            **self.extra,
        }


class LocalEngine:
    """The whole model on this machine."""

    def __init__(self, folder: Path, *, device: str = "auto", dtype: str = "auto", quant: Quant = NO_QUANT,
                 compile: str = "off", say: Callable[[str], None] | None = None) -> None:
        """`compile`: the decode steps' --compile mode (stages/engine/compiled/; compiled here, once);
        `say` hears what it compiles and what runs eagerly."""
        dev = pick_device(device)
        if quant.active:
            # as through a swarm: the quantized layers here, the embedding and head in float32 as a
            # requester holds them, so that `--local --quant` is the swarm's answer token for token
            self.stage = load_stage(folder, device=dev, dtype=pick_dtype(dtype, dev, quant), quant=quant)
            self.head = load_stage(folder, start=0, end=0, embed=True, head=True)
        else:
            self.stage = self.head = load_stage(folder, embed=True, head=True, device=dev, dtype=pick_dtype(dtype, dev))
        for stage in dict.fromkeys((self.stage, self.head)):  # the layers, and a separate head
            # one stage holding everything: its one-token step from token to next token is one graph
            compile_decode(stage, compile, say=say, whole=self.stage is self.head)
        self.tokenizer = Tokenizer.from_folder(folder)
        self.spec = self.stage.spec
        self._sessions = 0

    def generate_ids(
        self,
        ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        on_token: Callable[[int], None] | None = None,
        constraint: JsonConstraint | None = None,
    ) -> list[int]:
        """Greedy or sampled continuation of `ids`, stopping at an end-of-sequence id
        (with `constraint`, only tokens it allows: stages/decoding/constrained.py)."""
        budget = plan_length(len(ids), max_new_tokens, self.spec.max_position)
        if constraint is not None:
            constraint.limit(budget)  # it closes within the budget, or CannotClose now
        sampler = Sampler(sampling) if constraint is None else ConstrainedSampler(sampling, constraint)
        self._sessions += 1
        session = ("local", self._sessions)
        self.stage.open(session, capacity=len(ids) + budget)
        try:
            logits, greedy = self._step(session, ids, 0)
            out: list[int] = []
            while True:
                token = sampler.sample(logits, greedy)
                out.append(token)
                if on_token:
                    on_token(token)
                if token in self.spec.eos_token_ids or len(out) >= budget:
                    return out
                logits, greedy = self._step(session, [token], len(ids) + len(out) - 1)
        finally:
            self.stage.close(session)

    def _step(self, session: tuple, ids: Sequence[int], start_pos: int) -> tuple[torch.Tensor, int]:
        """The logits row after `ids` fed at `start_pos`, and its argmax: one stage's `next_token`
        (one compiled graph a token, where compiled), or a quantized span and a float32 head."""
        if self.stage is self.head:
            return self.stage.next_token(session, ids, start_pos)
        logits, greedy = self.head.logits_argmax(self.stage.forward(session, self.head.embed(ids), start_pos)[-1:])
        return logits[0], int(greedy[0])

    def generate(
        self,
        prompt: str,
        *,
        raw: bool = False,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        ids = prompt_ids(self.tokenizer, prompt, raw=raw)
        stream = TextStream(self.tokenizer)

        def emit(token: int) -> None:
            delta = stream.push(token)
            if delta and on_text:
                on_text(delta)

        started = time.perf_counter()
        tokens = self.generate_ids(ids, max_new_tokens=max_new_tokens, sampling=sampling, on_token=emit)
        seconds = time.perf_counter() - started
        tail = stream.flush()
        if tail and on_text:
            on_text(tail)
        return GenerationResult(self.tokenizer.decode(tokens), tokens, len(ids), seconds)
