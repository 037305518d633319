"""`GraphDecode`: a CUDA span's decode steps captured as CUDA graphs and replayed (the CUDA default).

On a GPU a decode step of a small model is kernel launches and Python: SmolLM2's 30 layers
took ~10 ms a token on an H200 whose memory reads the weights in ~0.05 ms (docs/pages/gpus.md).
A CUDA graph records a step's kernels once and replays them with one launch.

What is captured: for each row bucket R (1, 2, 4, 8 sessions; fewer rows pad to the bucket
with the scratch slot) and each length bucket L (LENGTH_BUCKETS up to the pool's capacity),
the span's step over static buffers: the rows' hidden states [R, H], positions and slots
[R], the RoPE tables computed from those positions inside the graph, and every layer's slot
pool (slots.py). A layer is two residual halves (`Block.with_attention`, `Block.with_mlp`);
runs of halves that can be captured become one graph, and a half that cannot (a sparse MLP:
which experts run depends on the router's picks, read back to the host) runs eagerly between
them on the graph's static buffers. A dense span is one graph per (R, L).

What replays: a step of one token per session, every session in a slot over the whole span,
with rows <= the largest bucket and positions < the pool's capacity. Anything else (prefill,
drafts, a session opened when every slot was taken or longer than the pool, a sub-span) runs
eagerly, on the same caches. The pool is allocated once, at compile: `slots` sessions x
`capacity` positions of every layer's keys and values (said at start-up).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from tessera.stages.engine.compiled.inductor import ROW_BUCKETS, Say, describe_kind, first_line
from tessera.stages.engine.compiled.modes import CUDA_GRAPHS
from tessera.stages.engine.compiled.slots import SlotPool, SlotStep
from tessera.stages.engine.sessions import SessionState
from tessera.stages.engine.stage import Stage
from tessera.stages.layers.cache import SessionCache

POOL_CAPACITY = 4096  # positions per slot (a peer's default --max-length); never more than the model's context
LENGTH_BUCKETS = (256, 1024, 4096, 16384, 65536)  # L: positions a replayed step reads per row (then the capacity)
CAPTURED_ATTENTION = ("gqa",)  # attention kinds with a slot step (slots.py)
CAPTURED_MLPS = ("dense",)  # MLP kinds without host round trips; others run between graphs
WARMUP_RUNS = 2  # eager runs on a side stream before capturing (cuBLAS and allocator set-up, as torch asks)

Half = tuple[str, int]  # ("attention" | "mlp", stage-relative layer index)


@dataclass
class Piece:
    """A run of halves, captured (`graph`) or eager; it reads the piece before it (the first: the
    step's rows) and leaves its rows in `out`."""

    halves: list[Half]
    captured: bool
    out: Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


@dataclass
class Captured:
    """The graphs of one (rows, length) bucket and their static inputs."""

    x: Tensor
    positions: Tensor
    slots: Tensor
    pieces: list[Piece] = field(default_factory=list)


class GraphDecode:
    """The CUDA-graph decode step of one Stage (module docstring). Not thread-safe, as the Stage."""

    backend = CUDA_GRAPHS

    def __init__(self, stage: Stage, *, buckets: Sequence[int] = ROW_BUCKETS, capacity: int = POOL_CAPACITY,
                 say: Say | None = None, capture: bool = True) -> None:
        self.stage = stage
        # capture=False runs every piece eagerly at "replay" (same buffers, slots and padding): how the
        # tests check this runner on a machine without CUDA
        self.capture = capture
        self.buckets = tuple(sorted(set(buckets)))
        self.say: Say = say or (lambda line: None)
        capacity = min(capacity, stage.spec.max_position)
        self.lengths = tuple(n for n in LENGTH_BUCKETS if n < capacity) + (capacity,)
        # a span with a kind of attention no slot step serves (MLA's latent, a linear layer's recurrent
        # state) captures nothing: no pool either (compile() says why and the span decodes eagerly)
        capturable = all(k.attention_kind in CAPTURED_ATTENTION for k in stage.spec.layers[stage.start : stage.end])
        self.pool = SlotPool(stage.cache_specs(stage.start, stage.end), slots=max(self.buckets), capacity=capacity,
                             dtype=stage.dtype, device=stage.device) if capturable else None
        self.plan = halves_plan(stage)
        self.captured: dict[tuple[int, int], Captured] = {}
        self.compiled: set[tuple[int, int]] = set()  # (rows, length) buckets captured
        self.eager: dict[str, str] = {}
        self.steps = 0  # decode steps replayed
        self._memory = None  # one graph memory pool for every capture

    # -- capturing (once per span load) --------------------------------------------

    def compile(self) -> None:
        stage = self.stage
        odd = [describe_kind(k) for k in dict.fromkeys(stage.spec.layers[stage.start : stage.end])
               if k.attention_kind not in CAPTURED_ATTENTION]
        if odd or self.pool is None:
            self._fall_back("span", f"attention kind(s) without a slot step: {', '.join(odd)}")
            return
        self.say(f"CUDA graphs: a KV pool of {self.pool.scratch} sessions x {self.pool.capacity} positions "
                 f"({self.pool.nbytes / 2**30:.2f} GiB)")
        eager_halves = {describe_kind(stage.spec.layers[stage.start + i]) for kind, i in self.plan
                        if kind == "mlp" and stage.spec.layers[stage.start + i].mlp_kind not in CAPTURED_MLPS}
        if eager_halves:
            self.say(f"CUDA graphs: the MLP of {', '.join(sorted(eager_halves))} runs eagerly between graphs "
                     "(its expert dispatch reads the router's picks on the host)")
        self._memory = torch.cuda.graph_pool_handle() if self.capture else None
        jobs, began = [(r, n) for r in self.buckets for n in self.lengths], time.perf_counter()
        with torch.inference_mode():
            for done, (rows, length) in enumerate(jobs, 1):
                try:
                    self.captured[(rows, length)] = self._capture(rows, length)
                    self.compiled.add((rows, length))
                except Exception as bad:  # noqa: BLE001 - a bucket that cannot be captured decodes eagerly
                    self._fall_back(f"{rows} rows x {length} positions", f"capture failed: {first_line(bad)}")
                self.say(f"capturing decode steps: {done}/{len(jobs)} ({time.perf_counter() - began:.0f} s)")

    def _capture(self, rows: int, length: int) -> Captured:
        stage = self.stage
        device = stage.device
        bucket = Captured(x=torch.zeros(rows, stage.spec.hidden_size, dtype=stage.dtype, device=device),
                          positions=torch.zeros(rows, dtype=torch.long, device=device),
                          slots=torch.full((rows,), self.pool.scratch, dtype=torch.long, device=device))
        pieces = [Piece(list(run), captured) for run, captured in group_halves(self.plan, self._capturable)]
        if not self.capture:
            for piece in pieces:
                piece.out = torch.empty_like(bucket.x)
            bucket.pieces = pieces
            return bucket
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # eager runs first: what cuBLAS and the allocator set up stays out of the graph
            for _ in range(WARMUP_RUNS):
                x = bucket.x
                for piece in pieces:
                    x = self._run_halves(piece.halves, x, bucket, length)
        torch.cuda.current_stream(device).wait_stream(side)
        source = bucket.x
        for piece in pieces:  # each piece reads the one before it (the first, the step's rows)
            if piece.captured:
                piece.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(piece.graph, pool=self._memory):
                    piece.out = self._run_halves(piece.halves, source, bucket, length)
            else:
                piece.out = torch.empty_like(source)
            source = piece.out
        bucket.pieces = pieces
        return bucket

    def _run_halves(self, halves: list[Half], x: Tensor, bucket: Captured, length: int) -> Tensor:
        stage = self.stage
        step: SlotStep | None = None  # built by the first attention half (an eager MLP piece has none)
        for kind, i in halves:
            block = stage.blocks[i]
            if kind == "mlp":
                x = block.with_mlp(x)
                continue
            if step is None:
                tables = stage.rope.tables(bucket.positions, stage.dtype)
                step = SlotStep(tables, bucket.positions, bucket.slots, length)
            x = block.with_attention(x, step, (self.pool.keys[i], self.pool.values[i]))
        return x

    def _capturable(self, half: Half) -> bool:
        kind, i = half
        return kind == "attention" or self.stage.spec.layers[self.stage.start + i].mlp_kind in CAPTURED_MLPS

    def _fall_back(self, what: str, reason: str) -> None:
        if what not in self.eager:
            self.eager[what] = reason
            self.say(f"{what} decodes eagerly: {reason}")

    # -- replaying -----------------------------------------------------------------

    def run(self, first: int, last: int, x: Tensor, positions: list[int], states: Sequence[SessionState]
            ) -> Tensor | None:
        stage, rows = self.stage, len(states)
        slots = [self.pool.slot_of.get(state.cache) for state in states]
        if (first, last) != (0, len(stage.blocks)) or None in slots or max(positions) >= self.pool.capacity:
            return None
        key = next(((r, n) for r in self.buckets for n in self.lengths
                    if r >= rows and n > max(positions) and (r, n) in self.compiled), None)
        if key is None:
            return None
        bucket = self.captured[key]
        pad = key[0] - rows
        bucket.x[:rows].copy_(x)
        bucket.positions.copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        bucket.slots.copy_(torch.tensor(slots + [self.pool.scratch] * pad), non_blocking=True)
        source = bucket.x
        for piece in bucket.pieces:
            assert piece.out is not None, "every piece has its output buffer"
            if piece.graph is not None:
                piece.graph.replay()
            elif piece.captured:  # capture=False: the very step a graph would replay, run eagerly
                piece.out.copy_(self._run_halves(piece.halves, source, bucket, key[1]))
            else:  # an eager half between graphs: only the real rows (a pad row would pick experts too)
                piece.out[:rows].copy_(self._run_halves(piece.halves, source[:rows], bucket, key[1]))
            source = piece.out
        assert bucket.pieces[-1].out is not None, "a captured step ends in a buffer"
        self.steps += 1
        return bucket.pieces[-1].out[:rows].clone()

    def logits(self, hidden: Tensor) -> tuple[Tensor, Tensor] | None:
        return None  # the head is one norm and one matmul: nothing to save by capturing

    def next_token(self, state: SessionState, token: int, position: int) -> tuple[Tensor, Tensor] | None:
        return None  # the layers replay as graphs (run); the embedding and head run as they are

    def session_cache(self, start: int, end: int, capacity: int) -> SessionCache | None:
        if (start, end) != (self.stage.start, self.stage.end):
            return None  # a sub-span session (a repair's other cut) keeps its own cache and decodes eagerly
        return self.pool.take(capacity)

    def closed(self, cache: SessionCache) -> None:
        self.pool.give_back(cache)


def halves_plan(stage: Stage) -> list[Half]:
    """Every layer of the stage as its two residual halves, in order."""
    return [(kind, i) for i in range(len(stage.blocks)) for kind in ("attention", "mlp")]


def group_halves(plan: list[Half], capturable: Callable[[Half], bool]) -> list[tuple[list[Half], bool]]:
    """Consecutive halves of the same capturability as one run: [(halves, captured)], in order."""
    runs: list[tuple[list[Half], bool]] = []
    for half in plan:
        can = capturable(half)
        if runs and runs[-1][1] == can:
            runs[-1][0].append(half)
        else:
            runs.append(([half], can))
    return runs
