"""A `Stage`: a span of decoder layers serving many sessions.

Its layers are `Block`s built from the model's `LayerSpec`s (stages/layers/block.py), so
one Stage runs every family; layers of a span may differ (dense and MoE, full and
sliding), each with its own cache kind per session (stages/layers/cache.py).

A peer holds one stage (its claimed span); the requester holds one too, with no
layers, for the embedding and the head; the local engine holds one with
everything. A Stage is given its Blocks and edges; building them from a model folder is
stages/assembly/stage.py's `load_stage` (the runtime never reads weights). Each session owns a KV cache for the layers it uses — a session may
use a sub-span of the stage, which is what lets a requester route around a dead
peer with different cut points.

What a stage takes and hands on per token is the model's hop at its span's ends (stages/layers/hop.py,
`ModelSpec.hop_width(layer)`): the residual — DeepSeek-V4's several hyper-connection streams — the
token id where a layer routes by it, and where the layers take per-layer inputs (Gemma 4) those of
the layers not yet run, each stage peeling off its own. The stage holding the embedding makes it
(`embed`), the one holding the head reads it (`logits`: the streams mixed back into one first), and
the spans between hand it on; a model with none of these has a hop of [T, H].

A Stage is not thread-safe: a server runs one `forward` at a time (in a worker
thread) and serialises the rest. `forward_batch` runs the steps of several
sessions as one forward over their stacked rows (one pass over the weights for
all of them), which is how a peer serves many requesters at once.
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.engine.sessions import SessionState, SessionTable
from tessera.stages.errors import SpanError, StageError
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.kernels.quant import NO_QUANT, Quant
from tessera.stages.layers.attention import Segment, StepContext
from tessera.stages.layers.block import Block
from tessera.stages.layers.cache import SessionCache
from tessera.stages.layers.hop import Hop, HopParts
from tessera.stages.layers.hyper import HyperHead
from tessera.stages.layers.per_layer import PerLayerInputs
from tessera.stages.layers.rope import RopeTables


# One session's step in a stacked forward: (session, its hop [T, hop_width], start position).
BatchStep = tuple[Hashable, torch.Tensor, int]


class DecodeRunner(Protocol):
    """A compiled decode step attached to a Stage (stages/engine/compiled/): `forward` and
    `forward_batch` hand it their steps of one token per session, `logits` its few rows (it
    answers them with their argmax), `next_token` a whole model's step from a token id; each
    answers None for what it has no compiled form of, and the eager path runs that."""

    backend: str

    def run(self, first: int, last: int, x: torch.Tensor, positions: list[int],
            states: Sequence[SessionState]) -> torch.Tensor | None: ...

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def next_token(self, state: SessionState, token: int, position: int
                   ) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def session_cache(self, start: int, end: int, capacity: int) -> SessionCache | None: ...

    def closed(self, cache: SessionCache) -> None: ...


class Stage(SessionTable):
    """Layers [start, end) of one model, plus the embedding and/or head when asked for."""

    def __init__(
        self,
        spec: ModelSpec,
        start: int,
        blocks: Sequence[Block],
        *,
        embedding: torch.Tensor | None = None,
        norm: torch.Tensor | None = None,
        head: torch.Tensor | None = None,
        per_layer: PerLayerInputs | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        quant: Quant = NO_QUANT,
        head_mix: HyperHead | None = None,
    ) -> None:
        if not 0 <= start <= start + len(blocks) <= spec.num_layers:
            raise SpanError(f"span [{start}, {start + len(blocks)}) is outside [0, {spec.num_layers})")
        self.spec = spec
        self.start = start
        self.end = start + len(blocks)
        self.blocks = nn.ModuleList(blocks)
        self.embedding = embedding
        self.norm = norm
        self.head = head
        self.head_mix = head_mix  # the hyper-connection streams mixed into one before the final norm
        if head is not None and spec.hyper is not None and head_mix is None:
            raise SpanError(f"a head of this {spec.family} model mixes its {spec.streams} streams: it needs hc_head")
        self.hop = Hop(spec)
        if embedding is not None and spec.per_layer_width and per_layer is None:
            raise SpanError("this model's layers take per-layer inputs: a stage with the embedding holds their table")
        self.per_layer = per_layer  # with the embedding: every layer's per-layer inputs (layers/per_layer.py)
        self.device = torch.device(device)
        self.dtype = dtype
        self.quant = quant  # how the blocks' matrices are stored (stages/kernels/quant.py)
        self.rope = RopeTables(spec.layers[start : self.end], self.device)  # shared by the layers per step
        self.sessions: dict[Hashable, SessionState] = {}
        self.decode: DecodeRunner | None = None  # set by engine/compiled/build.py's compile_decode

    # -- compute ------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, session: Hashable, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run the session's layers on its hop [T, hop_width] (hidden states [T, H] for most models:
        module docstring) at positions [start_pos, start_pos + T); the hop after them.

        Writing at `start_pos` first rolls the cache back to it, so re-sending a step
        after a failure, or verifying a new draft after a rejected one, needs no
        separate rollback.
        """
        return self._run_solo(self._reserve(session, hidden, start_pos), hidden, start_pos)

    def _run_solo(self, state: SessionState, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        x = hidden.to(device=self.device, dtype=self.dtype)
        if hidden.shape[0] == 1 and self.decode is not None:
            out = self.decode.run(state.start - self.start, state.end - self.start, x, [start_pos], [state])
            if out is not None:
                return out
        positions = torch.arange(start_pos, start_pos + hidden.shape[0], device=self.device)
        ctx = StepContext(start_pos, self.rope.tables(positions, self.dtype), self.device,
                          rotaries=self.rope.rotaries)
        return self._run_layers(state.start, state.end, x, ctx, state.cache.layers)

    def _run_layers(self, start: int, end: int, hop: torch.Tensor, ctx: StepContext, stores: Sequence) -> torch.Tensor:
        """Layers [start, end) (absolute) over the rows of `hop` [R, hop_width(start)], each layer given
        its entry of `stores` (a store, or one per segment); returns the hop [R, hop_width(end)]: the
        residual after them, the token ids as they came, the per-layer inputs of the layers after `end`."""
        x, ctx.token_ids, per_layer = self.hop.split(hop)
        p = self.spec.per_layer_width
        for j in range(end - start):
            block = self.blocks[start - self.start + j]
            if per_layer is None:
                x = block(x, ctx, stores[j])
            else:
                x = block(x, ctx, stores[j], per_layer[:, j * p : (j + 1) * p])
        rest = None if per_layer is None else per_layer[:, (end - start) * p :]
        return self.hop.join(HopParts(x, ctx.token_ids, rest))

    @torch.inference_mode()
    def forward_batch(self, steps: Sequence[BatchStep]) -> list[torch.Tensor | StageError]:
        """Several sessions' steps as one stacked forward (each as `forward` would run it).

        Entry i of the answer is step i's output [T_i, hop_width], or the StageError that step
        raised: a bad step (unknown session, wrong shape, past its context) fails alone and
        moves no pointer, and the others run. Sessions may sit at different positions
        and hold different lengths; those over different sub-spans of this stage run as
        separate stacks, and a stack of one is exactly `forward`. A stacked step's outputs
        equal solo steps' up to the rounding of matmuls over more rows (float32 logits:
        a few 1e-6 of the largest).
        """
        results: list[torch.Tensor | StageError | None] = [None] * len(steps)
        # sub-span -> its steps (index, session state): the states are held, so that a session
        # closed meanwhile (on another thread) cannot fail the stack
        stacks: dict[tuple[int, int], list[tuple[int, SessionState]]] = {}
        seen: set[Hashable] = set()
        for i, (session, hidden, start_pos) in enumerate(steps):
            try:
                if session in seen:
                    raise SpanError(f"session {session!r} has two steps in one stacked forward")
                state = self._reserve(session, hidden, start_pos)
            except StageError as bad:
                results[i] = bad
                continue
            seen.add(session)
            stacks.setdefault((state.start, state.end), []).append((i, state))
        for (start, end), members in stacks.items():
            if len(members) == 1:
                (i, state), = members
                results[i] = self._run_solo(state, steps[i][1], steps[i][2])
                continue
            outputs = self._run_decode(start, end, [(state, *steps[i][1:]) for i, state in members])
            if outputs is None:
                outputs = self._run_stacked(start, end, [(state, *steps[i][1:]) for i, state in members])
            for (i, _), output in zip(members, outputs):
                results[i] = output
        assert all(r is not None for r in results), "every step has an output or an error"
        return results  # type: ignore[return-value]

    def _reserve(self, session: Hashable, hidden: torch.Tensor, start_pos: int) -> SessionState:
        """Check a step (session, shape, context) and move the session's pointer past it."""
        return self._reserve_rows(session, hidden.shape, start_pos)

    def _reserve_rows(self, session: Hashable, shape: torch.Size, start_pos: int) -> SessionState:
        state = self._session(session)
        width = self.spec.hop_width(state.start)
        if len(shape) != 2 or shape[1] != width:
            raise SpanError(f"hidden states have shape {tuple(shape)!r}, expected [T, {width}]")
        state.cache.reserve(start_pos, shape[0])
        return state

    def _run_decode(
        self, start: int, end: int, steps: Sequence[tuple[SessionState, torch.Tensor, int]]
    ) -> list[torch.Tensor] | None:
        """A stacked step of one token per session through the compiled decode step, if it takes it."""
        if self.decode is None or any(hidden.shape[0] != 1 for _, hidden, _ in steps):
            return None  # (a model whose hop is more than its residual is never compiled: engine/compiled/build.py)
        x = torch.cat([hidden.to(device=self.device, dtype=self.dtype) for _, hidden, _ in steps])  # [R, H]
        out = self.decode.run(start - self.start, end - self.start, x, [p for _, _, p in steps],
                              [state for state, _, _ in steps])
        return None if out is None else list(out.split(1))

    def _run_stacked(
        self, start: int, end: int, steps: Sequence[tuple[SessionState, torch.Tensor, int]]
    ) -> list[torch.Tensor]:
        """Layers [start, end) over the stacked rows of reserved steps; each one's output rows."""
        segments, lo = [], 0
        for _, hidden, start_pos in steps:
            segments.append(Segment(lo, lo + hidden.shape[0], start_pos))
            lo += hidden.shape[0]
        positions = torch.cat([torch.arange(s.start, s.start + s.hi - s.lo, device=self.device) for s in segments])
        # RoPE tables [R, 1, D], each row at its session's position
        ctx = StepContext(segments[0].start, self.rope.tables(positions, self.dtype), self.device, tuple(segments),
                          rotaries=self.rope.rotaries)
        x = torch.cat([hidden.to(device=self.device, dtype=self.dtype) for _, hidden, _ in steps])  # [R, hop_width]
        caches = [state.cache.layers for state, _, _ in steps]
        by_layer = [[stores[j] for stores in caches] for j in range(end - start)]  # layer j: a store per segment
        x = self._run_layers(start, end, x, ctx, by_layer)
        return [x[s.lo : s.hi] for s in segments]

    @torch.inference_mode()
    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> the first layer's hop [T, hop_width(0)] (hidden states [T, H] for most models):
        the embedding (times the model's `embed_scale`, Gemma), and every layer's per-layer input
        where the layers take them."""
        if self.embedding is None:
            raise SpanError("this stage holds no embedding")
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
            raise SpanError(f"token ids must lie in [0, {self.spec.vocab_size})")
        x = F.embedding(ids, self.embedding)
        if self.spec.embed_scale is not None:  # a float32 scalar cast to the matrix's dtype, as the reference
            x = x * torch.tensor(self.spec.embed_scale).to(self.embedding.dtype)
        per_layer = None if self.per_layer is None else self.per_layer.forward(ids, x).to(x.dtype)
        return self.hop.from_embedding(x, ids, per_layer)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's hop [T, hop_width] -> float32 logits [T, V] (`logits_argmax`'s)."""
        return self.logits_argmax(hidden)[0]

    @torch.inference_mode()
    def logits_argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's hop [T, hop_width] -> (float32 logits [T, V], their argmax [T]): greedy
        sampling's token without a second pass over the logits (one compiled graph with the head,
        where compiled). Several streams are mixed into one by the head's connection first; the logits
        are softcapped where the model's are (Gemma's c tanh(logits / c), in the stage's dtype as the
        reference). A hop of any width is read so: rows handed on from an earlier layer (a draft
        model's first layers) carry the per-layer inputs of the layers after it too, and the head
        reads the residual stream, the hop's first columns."""
        if self.head is None or self.norm is None:
            raise SpanError("this stage holds no head")
        x = hidden.to(self.device, self.dtype)
        if not self.hop.plain:
            x = self.hop.split(x)[0]
            x = self.head_mix.forward(x) if self.head_mix is not None else x
        if self.decode is not None and (out := self.decode.logits(x)) is not None:
            return out
        x = F.rms_norm(x, self.norm.shape, self.norm, self.spec.rms_norm_eps)
        logits = F.linear(x, self.head)
        cap = self.spec.logit_softcap
        logits = (logits if cap is None else torch.tanh(logits / cap) * cap).float()
        return logits, logits.argmax(-1)

    @torch.inference_mode()
    def next_token(self, session: Hashable, token_ids: Sequence[int], start_pos: int) -> tuple[torch.Tensor, int]:
        """Feed `token_ids` to the session (a stage holding the whole model: embedding, every layer,
        head) at positions [start_pos, ...) -> (the float32 logits row [V] after the last, its argmax).
        A one-token step is one compiled graph from the token to the argmax where compiled; else
        `embed`, `forward` and `logits_argmax` in turn, which is what the graph computes."""
        if self.embedding is None or self.head is None:
            raise SpanError("next_token needs a stage holding the embedding and the head")
        if len(token_ids) == 1 and self.decode is not None:
            hidden_shape = torch.Size((1, self.spec.hop_width(0)))
            token = int(token_ids[0])
            if not 0 <= token < self.spec.vocab_size:
                raise SpanError(f"token ids must lie in [0, {self.spec.vocab_size})")
            state = self._reserve_rows(session, hidden_shape, start_pos)
            out = self.decode.next_token(state, token, start_pos)
            if out is not None:
                return out[0][0], int(out[1][0])
            logits, ids = self.logits_argmax(self._run_solo(state, self.embed([token]), start_pos))
            return logits[0], int(ids[0])
        logits, ids = self.logits_argmax(self.forward(session, self.embed(token_ids), start_pos)[-1:])
        return logits[0], int(ids[0])

    def _new_cache(self, start: int, end: int, capacity: int) -> SessionCache:
        """A session's cache: a slot of the compiled step's static pool where it keeps one (CUDA graphs)."""
        pooled = self.decode.session_cache(start, end, capacity) if self.decode is not None else None
        return pooled if pooled is not None else super()._new_cache(start, end, capacity)

    def close(self, session: Hashable) -> None:
        state = self.sessions.pop(session, None)
        if state is not None and self.decode is not None:
            self.decode.closed(state.cache)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights held (a tied head and embedding count once; quantized matrices are buffers)."""
        extra = {id(t): t for t in (self.embedding, self.norm, self.head) if t is not None}
        if self.head_mix is not None:
            extra.update({id(t): t for t in self.head_mix.parameters()})
        if self.per_layer is not None:
            extra.update({id(t): t for t in self.per_layer.parameters()})
        blocks = sum(p.nbytes for p in self.blocks.parameters()) + sum(b.nbytes for b in self.blocks.buffers())
        return blocks + sum(t.nbytes for t in extra.values())
