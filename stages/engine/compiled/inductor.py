"""`InductorDecode`: a span's decode steps as torch.compile'd graphs (inductor; the CPU default).

Profiled first (SmolLM2-135M, float32, one thread, `bench/engine.py`'s decode): the matrix
products were ~85% of an eager step, and they ran at about half the bandwidth one large
matrix-vector product reaches here (forms.py has the figures); norms, RoPE, residuals,
attention and the Python between them were the rest. So the compiled step does three things:
its products are reductions inductor streams well (forms.py); everything between them becomes
a few fused C++ loops per layer; and the span is one graph, not one call per layer.

Why one graph: a call of a compiled function costs what dynamo's guards, the AOT wrapper and
the Python around it cost, whatever the graph computes. Measured (a 30-layer model of SmolLM2's
heads at width 144, whose weights sit in the caches, so a step is nothing but that overhead;
thread clock, one thread): one compiled call per layer took 8.3 ms a step, more than the eager
step's 6.4 ms, against SmolLM2's 19 ms memory bound. So a run of consecutive layers whose kinds
compile is one graph (`decode_graph`, unrolled over the run's decode forms), and where the
stage holds them, the embedding, the final norm, the head and the argmax join it: the local
engine's step (`next_token`) is one call from a token id to the next token id. The head alone
(a requester's, or logits for a few rows) is one graph too, its argmax inside.

Each row's cache write and attention is one opaque op per layer that finds the rows' stores
through the step (rows.py), so no store is a graph input: a session's capacity, its growing,
stacked sessions of different lengths trigger no recompile. A layer kind with a sparse MLP
(its dispatch is data-dependent: a graph break, moe.py) is a graph of its own (`decode_one`);
a kind without a compiled form (MLA, DSA, a recurrent layer, a matrix format without a fused
form) runs eagerly between graphs, said once.

Graphs are specialised per row bucket (1, 2, 4, 8 rows: a stacked step of 3 sessions pads to
4 with rows that attend nowhere, whose outputs are dropped). The weights stay graph inputs,
so runs of the same kinds share a graph. Compiling happens in `compile()`, once per span load,
with a progress line per graph; inductor's FX graph cache lives under the tessera cache
(`inductor_cache_dir`), so a peer that loads the same span again reuses the compiled code. At
run time recompiling is forbidden (`fail_on_recompile`): a step that would need it runs
eagerly and its graph's layer kinds stay eager, said once. A graph whose compile fails is
split by kind: a kind that fails alone runs eagerly with the reason, the others stay compiled.
A session over a sub-span of the stage (a repair's other cut) decodes eagerly.
"""

from __future__ import annotations

import os
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.stages.engine.compiled.forms import decode_form, rows_linear, stored_signature, unfused
from tessera.stages.engine.compiled.modes import INDUCTOR
from tessera.stages.engine.compiled.rows import RowsStep, StepRows, rows_of_step
from tessera.stages.engine.sessions import SessionState
from tessera.stages.engine.stage import Stage
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.layers.attention import Segment, StepContext
from tessera.stages.layers.cache import KeyValues, SessionCache
from tessera.stages.layers.moe import untraced_dispatch

ROW_BUCKETS = (1, 2, 4, 8)
# attention kinds whose cache rows.py's op meets (KeyValues); MLA's latent rows run eagerly
COMPILED_ATTENTION = ("gqa",)
# MLP kinds a run's graph holds ("none": an attention layer without an MLP, Nemotron-H's); a sparse
# one breaks the graph at its dispatch: a graph of its own
RUN_MLPS = ("dense", "none")
WARMUP_CAPACITY = 2  # positions of the stores a warm-up writes (it writes position 0)
# Graphs one compiled function may hold while warming up (dynamo's default, 8, is less than
# 4 buckets of a few variants); at run time no graph is added at all.
RECOMPILE_LIMIT = 64

# Inductor inlines a cheap elementwise result into every loop that reads it unless more than
# this many read it (its default, 4). A layer's RMSNorm output feeds its q, k and v products:
# inlined, each product recomputes the norm at every weight it reads, which costs little
# beside a float32 weight's bytes but a third of a fused form's integer work (forms.py), and
# for MXFP4 means strided loads. Realised once instead (measured, SmolLM2 compiled, rounds
# side by side: float32 33.3 -> 33.6 tok/s; fp8 1.08 -> 1.20x float32, MXFP4 0.80 -> 0.93x,
# Q8_0 0.93 -> 1.03x, Q4_1 0.84 -> 0.91x).
REALIZE_READS = 1

HEAD = "the head"  # what `compiled` and `eager` call the final norm and head (with its argmax)
WHOLE = "the whole step"  # the embedding, every layer, the final norm, the head and the argmax

Say = Callable[[str], None]
Signature = tuple  # a graph's layers: (LayerSpec, stored_signature) each, in order


def inductor_cache_dir() -> Path:
    """Where inductor keeps compiled code across runs: $XDG_CACHE_HOME/tessera/inductor (~/.cache/...)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tessera" / "inductor"


def decode_graph(forms: list[nn.Module], x: Tensor, tables: list[Tensor], ropes: tuple[int, ...],
                 embedding: Tensor | None, norm: Tensor | None, head: Tensor | None, eps: float):
    """A run of layers (their decode forms) over R rows as one graph: x [R, H] (or token ids [R]
    with `embedding`) -> x [R, H], or with `head` (and `norm`) -> (float32 logits [R, V], their
    argmax [R]). tables: cos, sin of each RoPE in turn; ropes[j]: the one layer j turns by."""
    if embedding is not None:
        x = F.embedding(x, embedding)
    step = RowsStep()
    for j, form in enumerate(forms):
        step.table = (tables[2 * ropes[j]], tables[2 * ropes[j] + 1])
        x = form.forward(x, step, j)
    if head is None:
        return x
    assert norm is not None, "a head comes with its final norm"
    logits = rows_linear(F.rms_norm(x, norm.shape, norm, eps), head, None).float()
    return logits, logits.argmax(-1)


def decode_one(form: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """One layer over R rows (a sparse MLP's: its dispatch breaks the graph, so no loop around it)."""
    return form.forward(x, RowsStep((cos, sin)), 0)


def own_code(fn: Callable) -> Callable:
    """`fn` over a copy of its code object. dynamo keeps its compiled graphs (and checks their
    guards on every call) per code object: a copy per graph signature gives each call only its
    own graphs to check, and stages in one process (tests) no shared limit."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


@dataclass
class Piece:
    """Layers [lo, hi) of the stage (stage-relative) in a step: one compiled graph (`fn`: a run's
    decode_graph, a sparse layer's decode_one), or eager (`fn` None)."""

    lo: int
    hi: int
    signature: Signature = ()
    fn: Callable | None = None
    forms: list[nn.Module] = field(default_factory=list)
    ropes: tuple[int, ...] = ()
    sparse: bool = False


class InductorDecode:
    """The compiled decode step of one Stage (module docstring). Not thread-safe, as the Stage."""

    backend = INDUCTOR

    def __init__(self, stage: Stage, *, buckets: Sequence[int] = ROW_BUCKETS, say: Say | None = None,
                 whole: bool = False) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"row buckets must be positive, got {tuple(buckets)!r}")
        self.whole_asked = whole  # compile the local engine's whole step as one graph too (`next_token`)
        self.whole = False  # ... and it is compiled
        # before the first torch.compile of the process, which fixes inductor's cache directory
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
        self.stage = stage
        self.buckets = tuple(sorted(set(buckets)))
        self.say: Say = say or (lambda line: None)
        self.forms = [decode_form(block) for block in stage.blocks]
        self.kinds = [stage.spec.layers[stage.start + i] for i in range(len(stage.blocks))]
        self.rope_keys = list(stage.rope.rotaries)  # the order of a graph's tables
        self.fns: dict[tuple, Callable] = {}  # (what, signature) -> its compiled function
        untraced_dispatch()  # a sparse MLP's dispatch marked for dynamo before anything is traced
        self.compiled: set[LayerSpec | str] = set()  # layer kinds (and HEAD) that run compiled
        self.eager: dict[LayerSpec | str, str] = {}  # layer kind (or HEAD, WHOLE) -> why it runs eagerly
        self.pieces: list[Piece] = []
        self.steps = 0  # decode steps this runner ran (some of their layers may have run eagerly)

    # -- compiling (once per span load) ---------------------------------------------

    def compile(self) -> None:
        """Compile every graph of the span for every bucket (the head's and the whole step's too),
        saying how far it got. A graph whose compile fails is split by kind (module docstring)."""
        stage = self.stage
        for kind in dict.fromkeys(self.kinds):
            why = self._why_eager(kind)
            if why is None:
                self.compiled.add(kind)
            else:
                self._fall_back(kind, why)
        began = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                torch._inductor.config.patch(realize_reads_threshold=REALIZE_READS), torch.inference_mode():
            while True:
                self.pieces = self._plan()
                graphs = {(p.sparse, p.signature): p for p in self.pieces if p.fn is not None}
                whole = self._whole_piece()
                jobs = len(graphs) * len(self.buckets) + (len(self.buckets) if self._holds_head() else 0) + bool(whole)
                done, failed = 0, None
                for piece in graphs.values():
                    try:
                        for rows in self.buckets:
                            self._warm(piece, rows)
                            done += 1
                            self.say(f"compiling decode steps: {done}/{jobs} ({time.perf_counter() - began:.0f} s)")
                    except Exception as bad:  # noqa: BLE001 - any failure to compile: split by kind, below
                        failed = (piece, bad)
                        break
                if failed is None:
                    break
                self._isolate(*failed)
            for what, warm in ((HEAD, self._warm_head if self._holds_head() else None),
                               (WHOLE, (lambda: self._warm(whole, 1, whole=True)) if whole else None)):
                if warm is None:
                    continue
                try:
                    warm()
                    if what == WHOLE:
                        self.whole = True
                    else:
                        self.compiled.add(what)
                except Exception as bad:  # noqa: BLE001 - as above: this part runs eagerly
                    self._fall_back(what, f"compiling failed: {first_line(bad)}")
                done += len(self.buckets) if what == HEAD else 1
                self.say(f"compiling decode steps: {done}/{jobs} ({time.perf_counter() - began:.0f} s)")

    def _why_eager(self, kind: LayerSpec) -> str | None:
        if kind.attention is None:
            return "no compiled step for a layer without attention yet"
        if kind.attention_kind not in COMPILED_ATTENTION:
            return f"no compiled step for {kind.attention_kind} attention's cache yet"
        stored = set().union(*(unfused(self.forms[i]) for i, k in enumerate(self.kinds) if k == kind))
        if stored:
            return f"no compiled form for its {', '.join(sorted(stored))} matrices yet"
        return None

    def _plan(self) -> list[Piece]:
        """The step's pieces: maximal runs of layers of compiled dense kinds (one graph each), a
        compiled sparse layer alone, an eager layer alone."""
        pieces: list[Piece] = []
        for i, kind in enumerate(self.kinds):
            if kind not in self.compiled:
                pieces.append(Piece(i, i + 1))
                continue
            signature = ((kind, stored_signature(self.forms[i])),)
            sparse = kind.mlp_kind not in RUN_MLPS
            last = pieces[-1] if pieces else None
            if not sparse and last is not None and last.signature and not last.sparse and last.hi == i:
                last.hi, last.signature = i + 1, last.signature + signature
                continue
            pieces.append(Piece(i, i + 1, signature, sparse=sparse))
        for piece in pieces:
            if piece.signature:
                piece.forms = self.forms[piece.lo : piece.hi]
                piece.ropes = tuple(self._rope_index(self.kinds[i]) for i in range(piece.lo, piece.hi))
                piece.fn = self._fn("one" if piece.sparse else "run", piece.signature)
        return pieces

    def _fn(self, what: str, signature: Signature) -> Callable:
        if (what, signature) not in self.fns:
            self.fns[(what, signature)] = torch.compile(own_code(decode_one if what == "one" else decode_graph))
        return self.fns[(what, signature)]

    def _rope_index(self, kind: LayerSpec) -> int:
        return self.rope_keys.index((kind.attention.rope, kind.attention.rope_dim))

    def _holds_head(self) -> bool:
        return self.stage.head is not None and self.stage.norm is not None

    def _whole_piece(self) -> Piece | None:
        """The one graph of the local engine's step, when this stage can be it: the embedding, every
        layer of the model in one run, the final norm and the head."""
        stage = self.stage
        if not self.whole_asked or stage.embedding is None or not self._holds_head() or stage.start != 0 \
                or stage.end != stage.spec.num_layers or len(self.pieces) > 1:
            return None
        if self.pieces and (self.pieces[0].fn is None or self.pieces[0].sparse):
            return None
        return self.pieces[0] if self.pieces else Piece(0, 0)

    def _isolate(self, piece: Piece, bad: BaseException) -> None:
        """A graph failed to compile: each of its kinds alone (one layer's graph), those that fail
        run eagerly; if none fails alone, all of them (the graph's own reason)."""
        kinds = {self.kinds[i]: i for i in range(piece.lo, piece.hi)}
        culprits = {}
        if len(kinds) > 1:
            for kind, i in kinds.items():
                alone = Piece(i, i + 1, ((kind, stored_signature(self.forms[i])),), sparse=kind.mlp_kind not in RUN_MLPS,
                              forms=[self.forms[i]], ropes=(self._rope_index(kind),))
                alone.fn = torch.compile(own_code(decode_one if alone.sparse else decode_graph))
                try:
                    self._warm(alone, self.buckets[0])
                except Exception as why:  # noqa: BLE001 - this kind is a culprit
                    culprits[kind] = why
        for kind, why in (culprits or {kind: bad for kind in kinds}).items():
            self._fall_back(kind, f"compiling failed: {first_line(why)}")

    def _warm(self, piece: Piece, rows: int, *, whole: bool = False) -> None:
        """Run `piece`'s graph over `rows` rows at position 0 of fresh stores, so that dynamo and
        inductor build it (with `whole`: from token ids through the head, `next_token`'s graph)."""
        stage = self.stage
        stores = [[KeyValues(self.kinds[i].cache, WARMUP_CAPACITY, dtype=stage.dtype, device=stage.device)
                   for _ in range(rows)] for i in range(piece.lo, piece.hi)]
        positions = torch.zeros(rows, dtype=torch.long, device=stage.device)
        x = torch.zeros(rows, dtype=torch.long, device=stage.device) if whole else \
            torch.zeros(rows, stage.spec.hidden_size, dtype=stage.dtype, device=stage.device)
        with rows_of_step(StepRows([0] * rows, rows, stores)):
            self._call(piece, x, self._tables(positions), whole=whole)

    def _warm_head(self) -> None:
        for rows in self.buckets:
            hidden = torch.zeros(rows, self.stage.spec.hidden_size, dtype=self.stage.dtype, device=self.stage.device)
            self._head_fn()(hidden)

    def _head_fn(self) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
        stage = self.stage
        fn = self._fn("head", ())
        return lambda x: fn([], x, [], (), None, stage.norm, stage.head, stage.spec.rms_norm_eps)

    def _tables(self, positions: Tensor) -> list[Tensor]:
        tables = self.stage.rope.tables(positions, self.stage.dtype)
        return [t for key in self.rope_keys for t in tables[key]]

    def _call(self, piece: Piece, x: Tensor, tables: list[Tensor], *, whole: bool = False):
        assert piece.fn is not None or whole, "an eager piece has no graph"
        if piece.sparse:
            r = piece.ropes[0]
            return piece.fn(piece.forms[0], x, tables[2 * r], tables[2 * r + 1])
        stage = self.stage
        if whole:
            fn = self._fn("whole", piece.signature)
            return fn(piece.forms, x, tables, piece.ropes, stage.embedding, stage.norm, stage.head,
                      stage.spec.rms_norm_eps)
        return piece.fn(piece.forms, x, tables, piece.ropes, None, None, None, 0.0)

    def _fall_back(self, what: LayerSpec | str, reason: str) -> None:
        """`what` (a layer kind, HEAD or WHOLE) runs eagerly from now on; said once."""
        self.compiled.discard(what)
        if what == WHOLE:
            self.whole = False
        if what not in self.eager:
            self.eager[what] = reason
            self.say(f"{what if isinstance(what, str) else 'layer kind ' + describe_kind(what)} decodes eagerly: {reason}")

    # -- running --------------------------------------------------------------------

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds `rows` rows (None: more than the largest)."""
        return next((b for b in self.buckets if b >= rows), None)

    def run(self, first: int, last: int, x: Tensor, positions: list[int], states: Sequence[SessionState]
            ) -> Tensor | None:
        """Layers [first, last) of the stage (stage-relative) for one token of each session: row i of
        x [R, H] is states[i]'s at positions[i]. None when this step has no compiled form."""
        bucket = self.bucket(len(states))
        if bucket is None or (first, last) != (0, len(self.forms)):
            return None
        stage, rows = self.stage, len(states)
        pad = bucket - rows
        # the graphs were built over inference tensors (warm-up ran in inference mode); a row that
        # arrived from the network is a plain one, which dynamo's guards tell apart: a copy (one row)
        x = x if x.is_inference() else x.clone()
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
        pos = torch.tensor(positions + [0] * pad, dtype=torch.long, device=stage.device)
        x = self._layers(x, pos, positions, states)
        self.steps += 1
        return x[:rows]

    def _layers(self, x: Tensor, pos: Tensor, positions: list[int], states: Sequence[SessionState]) -> Tensor:
        """Every piece of the step in turn over the bucket's rows (the first len(states) real)."""
        stage, rows = self.stage, len(states)
        tables = stage.rope.tables(pos, stage.dtype)
        flat = [t for key in self.rope_keys for t in tables[key]]
        caches = [state.cache.layers for state in states]
        eager_ctx: StepContext | None = None
        step = StepRows(positions, rows)
        with rows_of_step(step), torch.compiler.set_stance("fail_on_recompile"):
            for piece in self.pieces:
                if piece.fn is not None:
                    step.stores = [[layers[i] for layers in caches] for i in range(piece.lo, piece.hi)]
                    try:
                        x = self._call(piece, x, flat)
                        continue
                    except Exception as bad:  # noqa: BLE001 - the step goes on eagerly, the piece stays eager
                        self._stay_eager(piece, f"a step needed another compile ({first_line(bad)})")
                if eager_ctx is None:
                    eager_ctx = eager_context(positions, {k: (c[:rows], s[:rows]) for k, (c, s) in tables.items()},
                                              stage.device)
                for i in range(piece.lo, piece.hi):
                    out = stage.blocks[i].forward(x[:rows], eager_ctx, caches[0][i] if rows == 1 else
                                                  [layers[i] for layers in caches])
                    x = torch.cat([out, x[rows:]]) if x.shape[0] > rows else out
        return x

    def _stay_eager(self, piece: Piece, reason: str) -> None:
        """`piece` runs eagerly from now on, and so does the whole step's graph (which holds it)."""
        piece.fn = None
        for i in range(piece.lo, piece.hi):
            self._fall_back(self.kinds[i], reason)
        if self.whole:
            self._fall_back(WHOLE, reason)

    def logits(self, hidden: Tensor) -> tuple[Tensor, Tensor] | None:
        """Stage.logits for a few rows through the compiled head, and their argmax; None when it has
        no graph for them."""
        bucket = self.bucket(hidden.shape[0])
        stage = self.stage
        if HEAD not in self.compiled or bucket is None:
            return None
        pad = bucket - hidden.shape[0]
        x = hidden if hidden.device == stage.device and hidden.dtype == stage.dtype else hidden.to(stage.device, stage.dtype)
        x = x if x.is_inference() else x.clone()  # as in `run`
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                logits, ids = self._head_fn()(x)
        except Exception as bad:  # noqa: BLE001 - as in run
            self._fall_back(HEAD, f"a step needed another compile ({first_line(bad)})")
            return None
        n = hidden.shape[0]
        return (logits, ids) if not pad else (logits[:n], ids[:n])

    def next_token(self, state: SessionState, token: int, position: int) -> tuple[Tensor, Tensor] | None:
        """The local engine's step as one graph: `token` at `position` of the session (the whole
        model) -> (logits [1, V], argmax [1]); None when this stage has no such graph."""
        if not self.whole or (state.start, state.end) != (self.stage.start, self.stage.end):
            return None
        piece = self.pieces[0] if self.pieces else Piece(0, 0)
        stage = self.stage
        pos = torch.tensor([position], dtype=torch.long, device=stage.device)
        tables = stage.rope.tables(pos, stage.dtype)
        flat = [t for key in self.rope_keys for t in tables[key]]
        step = StepRows([position], 1, [[store] for store in state.cache.layers])
        ids = torch.tensor([token], dtype=torch.long, device=stage.device)
        try:
            with rows_of_step(step), torch.compiler.set_stance("fail_on_recompile"):
                out = self._call(piece, ids, flat, whole=True)
        except Exception as bad:  # noqa: BLE001 - as in run: this graph stays eager
            self._fall_back(WHOLE, f"a step needed another compile ({first_line(bad)})")
            return None
        self.steps += 1
        return out

    def session_cache(self, start: int, end: int, capacity: int) -> SessionCache | None:
        return None  # sessions keep their own stores: the op finds each one through the step

    def closed(self, cache: SessionCache) -> None:
        pass


def eager_context(positions: list[int], tables: dict, device: torch.device) -> StepContext:
    """The eager step of one token per session (a layer kind that runs eagerly within a compiled step)."""
    if len(positions) == 1:
        return StepContext(positions[0], tables, device)
    return StepContext(positions[0], tables, device, tuple(Segment(i, i + 1, p) for i, p in enumerate(positions)))


def describe_kind(kind: LayerSpec) -> str:
    """'gqa + dense' / 'gqa + moe (window 4096)': a layer kind in a few words."""
    window = getattr(kind.attention, "window", None)  # MlaSpec has none
    window = f" (window {window})" if window is not None else ""
    return f"{kind.attention_kind} + {kind.mlp_kind}{window}"


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
