"""Helpers for tests that run real peer processes on loopback."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

from tessera.peer.cli.demo import LocalSwarm
from tessera.stages.decoding.generate import prompt_ids


def layer_args(spans: Sequence[tuple[int, int]], extra: Sequence[str] = ()) -> list[list[str]]:
    return [["--layers", f"{a}:{b}", *extra] for a, b in spans]


@contextmanager
def local_swarm(spans: Sequence[tuple[int, int]], *, extra: Sequence[str] = (), model: str = "smollm2-135m",
                per_peer: Sequence[Sequence[str]] | None = None) -> Iterator[LocalSwarm]:
    """Peer processes with forced spans, started together; stopped (gracefully) at the end."""
    args = layer_args(spans, extra)
    if per_peer is not None:
        args = [a + list(p) for a, p in zip(args, per_peer)]
    swarm = LocalSwarm(len(spans), model=model, extra_args=args)
    try:
        swarm.start(together=True)
        yield swarm
    finally:
        swarm.stop(timeout=15)


def reference_answer(local_engine, tokenizer, prompt: str, tokens: int) -> list[int]:
    """The local engine's greedy answer (chat template), which must run the whole length."""
    out = local_engine.generate_ids(prompt_ids(tokenizer, prompt, raw=False), max_new_tokens=tokens)
    assert len(out) == tokens, "the reference answer must run the whole length"
    return out
