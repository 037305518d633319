"""A dispute no third peer can break: the requester recomputes the disputed rows itself.

A spot check (peer/request/verify.py) that finds the route's peer for a span (the *accused*)
and its checker disagreeing beyond their dtypes' tolerance asks a third holder of the span
to break the tie. In a small swarm there is often none: two peers hold the span, one of them
lies, and a tie-break has nobody to ask. Then the requester settles it itself:

1. It obtains the span's weights — only those layers' tensors — through its `SpanWeights`
   port (peer/weights/on_demand.py): from its own model folder where that holds them, else
   fetched from the peers that hold them over the weights protocol, every chunk checked
   against the model's manifest as it arrives and every tensor hashed again as it loads, so
   a liar cannot feed it wrong weights. The memory this takes is bounded: the span's
   weights in float32 plus its KV cache for the disputed positions must fit the
   requester's dispute budget (`DISPUTE_MEMORY` unless it is given another), or nothing is
   fetched.
2. It recomputes the span over the inputs it sent (the history it holds: positions [0, b)
   in one prefill-shaped pass, in a worker thread) and compares the disputed rows with
   each side's, at each side's tolerance (`rule`): whoever differs from the recomputation is
   convicted — the accused, the checker, or both.
3. When it cannot (the budget is too small, no peer serves the weights, the manifest is not
   at hand, the span is quantized: a float recomputation differs from it by the
   quantization error, or it took longer than `SETTLE_TIMEOUT`), the dispute is
   *undecided*: both peers are avoided (`Failure.DISPUTED`, never paroled as the only cover
   of a span), the session repairs around them onto another route if one exists, and
   otherwise the answer ends with `DisputeUndecided` naming both peers, the span, the
   positions, and why it could not be decided. It never goes on silently with either side.

The cost, when it happens (once per liar: a convicted peer is banned for a day): a fetch of
the span's weights (none when the requester's folder holds them) and one prefill-shaped pass
of the span over the answer so far on the requester's CPU; the answer waits meanwhile.

What is decided is pure (`rule`, `Dispute`); the orchestration (`settle`) only gathers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import torch
import trio

from tessera.protocol.fingerprint import full_rows_agree, row_differences
from tessera.stages.engine.stage import Stage
from tessera.stages.errors import ModelFormatError

from tessera.peer.base.errors import PeerError
from tessera.peer.base.threads import in_worker
from tessera.peer.net.transport import Transport

log = logging.getLogger(__name__)

# What a requester may spend on settling a dispute by itself, unless told otherwise: the span's
# weights in float32 and its KV cache for the positions disputed. 2 GiB holds ~500M parameters
# of layers: every layer of SmolLM2-135M (0.4 GB) or of a 0.5B model, two layers of an 8B one.
# A requester runs the embedding and head of the same model, so it has this much to spare on any
# machine that runs a model of that size; a larger span is refused before anything is fetched.
DISPUTE_MEMORY = 2 << 30
# The whole of one settlement — manifest, fetch, load, recompute: 2 GiB at 20 MB/s (a home
# uplink, shared by both holders) is ~100 s, plus a prefill of the span on one CPU core. Each
# network wait inside has its own bound too (peer/weights/fetcher.py ASK_TIMEOUT, CHUNK_TIMEOUT).
SETTLE_TIMEOUT = 180.0
# How a verdict was reached (the verdict's "decided" field, and the log line's words).
BY_TIE_BREAKER = "by a tie-breaker"
BY_RECOMPUTING = "by recomputing locally"


class SpanWeights(Protocol):
    """The weights of a span, loaded for a requester that must recompute it (a port: the
    implementation fetches, peer/weights/on_demand.py, which this layer may not import)."""

    async def model_id(self) -> str:
        """The (unquantized) model id its weights are checked against. Raises ModelFormatError."""
        ...

    async def load(self, transport: Transport, start: int, end: int, holders: Mapping[str, Sequence[str]], *,
                   budget: int) -> Stage:
        """Layers [start, end) in float32, every tensor checked against the model's manifest;
        fetched from `holders` (peer -> addresses) what the requester's folder lacks. Raises
        PeerError (OverBudget above `budget` bytes, WeightsUnavailable, ManifestRejected, ...)
        or ModelFormatError, each saying why."""
        ...


@dataclass(frozen=True)
class Dispute:
    """Two peers that disagree on layers [start, end)'s output at positions [first, stop):
    `accused` computed them in the route, `checker` recomputed them for a spot check."""

    accused: str
    checker: str
    start: int
    end: int
    first: int
    stop: int

    def words(self) -> str:
        return (f"peers {self.accused} (in the route) and {self.checker} (its checker) disagree on layers "
                f"[{self.start}, {self.end}) at positions [{self.first}, {self.stop})")


@dataclass(frozen=True)
class Ruling:
    """How a dispute ended: `guilty` (empty: undecided, and `why` says why), `decided` (how:
    BY_RECOMPUTING), and the largest difference of each side from the recomputation."""

    dispute: Dispute
    guilty: tuple[str, ...]
    decided: str | None = None
    why: str | None = None
    differences: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0  # what deciding it took: loading (or fetching) the span's weights and recomputing

    @property
    def settled(self) -> bool:
        return self.decided is not None

    def undecided_words(self) -> str:
        return f"{self.dispute.words()}, and this requester could not decide which is right: {self.why}"


def rule(dispute: Dispute, accused_agrees: bool, checker_agrees: bool) -> tuple[str, ...]:
    """Who is guilty, given whether each side's rows agree with the requester's recomputation:
    whoever does not (both, if neither does; nobody if both do — an honest boundary case)."""
    return tuple(peer for peer, agrees in ((dispute.accused, accused_agrees), (dispute.checker, checker_agrees))
                 if not agrees)


def kv_bytes(n_layers: int, positions: int, hidden_size: int) -> int:
    """An upper bound on a span's KV cache in float32 (keys and values no wider than the hidden state)."""
    return n_layers * 2 * positions * hidden_size * 4


def recompute_rows(stage: Stage, inputs: torch.Tensor, first: int) -> torch.Tensor:
    """`stage`'s layers over `inputs` (positions [0, T)) in one prefill-shaped pass; rows [first, T).
    Blocking (torch): run it in a worker."""
    session = ("dispute", first)
    stage.open(session, capacity=inputs.shape[0])
    try:
        return stage.forward(session, inputs.float(), 0)[first:].clone()
    finally:
        stage.close(session)


async def settle(dispute: Dispute, weights: SpanWeights | None, *, transport: Transport,
                 holders: Mapping[str, Sequence[str]], model_id: str, inputs: torch.Tensor,
                 accused_rows: torch.Tensor, checker_rows: torch.Tensor, accused_tol: float, checker_tol: float,
                 budget: int, hidden_size: int) -> Ruling:
    """Decide `dispute` by recomputing it here (module docstring). `inputs`: the span's inputs at
    positions [0, dispute.stop); `*_rows`: each side's output at [first, stop); `*_tol`: each
    side's tolerance against a float32 recomputation; `model_id`: the id the disputing peers
    advertise (a quantized one differs from the weights' own). Never raises for what it
    cannot do: the ruling says why."""
    def undecided(why: str) -> Ruling:
        return Ruling(dispute, (), why=why)

    if weights is None:
        return undecided("this requester has no way to load the model's weights")
    try:
        ours = await weights.model_id()
    except ModelFormatError as bad:
        return undecided(str(bad))
    if ours != model_id:
        return undecided(f"the span is served as {model_id}, not the float weights {ours} this requester can load "
                         "(a float recomputation of a quantized span differs by the quantization error)")
    n_layers = dispute.end - dispute.start
    room = budget - kv_bytes(n_layers, dispute.stop, hidden_size)
    stage: Stage | None = None
    began = time.perf_counter()
    try:
        with trio.fail_after(SETTLE_TIMEOUT):
            stage = await weights.load(transport, dispute.start, dispute.end, holders, budget=room)
            recomputed = await in_worker(lambda: recompute_rows(stage, inputs, dispute.first))
    except trio.TooSlowError:
        return undecided(f"fetching and recomputing the span took longer than {SETTLE_TIMEOUT:.0f} s")
    except (PeerError, ModelFormatError) as bad:
        return undecided(str(bad))
    finally:
        del stage  # the span's weights go as soon as the rows are computed
    accused_agrees = bool(full_rows_agree(recomputed, accused_rows.float(), accused_tol).all())
    checker_agrees = bool(full_rows_agree(recomputed, checker_rows.float(), checker_tol).all())
    differences = {dispute.accused: float(row_differences(accused_rows.float(), recomputed).max()),
                   dispute.checker: float(row_differences(checker_rows.float(), recomputed).max())}
    return Ruling(dispute, rule(dispute, accused_agrees, checker_agrees), decided=BY_RECOMPUTING,
                  differences=differences, seconds=time.perf_counter() - began)


__all__ = ["BY_RECOMPUTING", "BY_TIE_BREAKER", "DISPUTE_MEMORY", "Dispute", "Ruling", "SETTLE_TIMEOUT", "SpanWeights",
           "kv_bytes", "recompute_rows", "rule", "settle"]
