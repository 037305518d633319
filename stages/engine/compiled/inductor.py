"""`InductorDecode`: a span's decode steps through torch.compile'd layers (inductor; the CPU default).

Profiled first (SmolLM2-135M, float32, one thread, `bench/engine.py`'s decode): the matrix
products were ~85% of an eager step, and they ran at about half the bandwidth one large
matrix-vector product reaches here (forms.py has the figures); norms, RoPE, residuals,
attention and the Python between them were the rest. So the compiled step does two things:
its products are reductions inductor streams well (forms.py), and everything between them
becomes a few fused C++ loops per layer, with no Python module calls.

One compiled function, `decode_layer`, over a copy of its code per layer kind (a distinct
`LayerSpec`: a Qwen3-MoE span has two), specialised by dynamo per row bucket (1, 2, 4, 8 rows:
a stacked step of 3 sessions pads to 4 with rows over a scratch store, whose outputs are
dropped). A copy per kind, not one function for all: dynamo tries a function's graphs newest
first, and a sparse MLP's graph breaks at its dispatch (moe.py), so its graph guards on less
than a dense kind's: a dense layer matched it, ran the rest of its block through frames
compiled only for the sparse MLP, and needed a compile at run time. The weights stay graph
inputs, so every layer of a kind shares one compiled graph. A session
store's capacity is a size symbol (marked dynamic at warm-up), and positions arrive as a
tensor (rows.py), so nothing a session does triggers a recompile; at run time recompiling
is forbidden (`fail_on_recompile`): a step that would need it runs eagerly and its layer
kind stays eager, said once.

Compiling happens in `compile()`, once per span load, layer kind by kind and bucket by bucket
with a progress line each; inductor's FX graph cache lives under the tessera cache
(`inductor_cache_dir`), so a peer that loads the same span again reuses the compiled code.
A kind whose compile fails (no C++ compiler, an operator inductor cannot lower) runs
eagerly, with the reason; the others stay compiled.
"""

from __future__ import annotations

import os
import time
import types
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.stages.engine.compiled.forms import decode_form, rows_linear, stored_signature, unfused
from tessera.stages.engine.compiled.modes import INDUCTOR
from tessera.stages.engine.compiled.rows import RowsStep
from tessera.stages.engine.sessions import SessionState
from tessera.stages.engine.stage import Stage
from tessera.stages.families.spec import CacheSpec, LayerSpec
from tessera.stages.layers.attention import Segment, StepContext
from tessera.stages.layers.cache import KeyValues, SessionCache
from tessera.stages.layers.moe import untraced_dispatch

ROW_BUCKETS = (1, 2, 4, 8)
# attention kinds whose cache rows.py's op meets (KeyValues); MLA's latent rows run eagerly
COMPILED_ATTENTION = ("gqa",)
# A pad row's store. Two positions, not one: a store's capacity is a size symbol of the
# compiled graph, and torch specialises sizes 0 and 1, so a capacity of 1 would not match it.
SCRATCH_CAPACITY = 2
# Graphs one compiled function may hold while warming up (dynamo's default, 8, is less than
# 2 layer kinds x 4 buckets plus the head's); at run time no graph is added at all.
RECOMPILE_LIMIT = 64

# Inductor inlines a cheap elementwise result into every loop that reads it unless more than
# this many read it (its default, 4). A layer's RMSNorm output feeds its q, k and v products:
# inlined, each product recomputes the norm at every weight it reads, which costs little
# beside a float32 weight's bytes but a third of a fused form's integer work (forms.py), and
# for MXFP4 means strided loads. Realised once instead (measured, SmolLM2 compiled, rounds
# side by side: float32 33.3 -> 33.6 tok/s; fp8 1.08 -> 1.20x float32, MXFP4 0.80 -> 0.93x,
# Q8_0 0.93 -> 1.03x, Q4_1 0.84 -> 0.91x).
REALIZE_READS = 1

HEAD = "the head"  # what `compiled` and `eager` call the final norm and head

Say = Callable[[str], None]


def inductor_cache_dir() -> Path:
    """Where inductor keeps compiled code across runs: $XDG_CACHE_HOME/tessera/inductor (~/.cache/...)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tessera" / "inductor"


def decode_layer(form: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                 keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """One layer (its decode form) over R rows, row i at positions[i] with store (keys[i], values[i])."""
    return form.forward(x, RowsStep(cos, sin, positions), list(zip(keys, values)))


def own_code(fn: Callable) -> Callable:
    """`fn` over a copy of its code object. dynamo keeps its compiled graphs (and checks their
    guards on every call) per code object: a copy per stage and layer kind gives each call only
    its own kind's buckets to check, and stages in one process (tests) no shared limit."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def head_logits(x: Tensor, norm: Tensor, head: Tensor, eps: float) -> Tensor:
    """Final norm and head over R rows -> float32 logits [R, V] (Stage.logits, as a reduction)."""
    return rows_linear(F.rms_norm(x, norm.shape, norm, eps), head, None).float()


class InductorDecode:
    """The compiled decode step of one Stage (module docstring). Not thread-safe, as the Stage."""

    backend = INDUCTOR

    def __init__(self, stage: Stage, *, buckets: Sequence[int] = ROW_BUCKETS, say: Say | None = None) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"row buckets must be positive, got {tuple(buckets)!r}")
        # before the first torch.compile of the process, which fixes inductor's cache directory
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
        self.stage = stage
        self.buckets = tuple(sorted(set(buckets)))
        self.say: Say = say or (lambda line: None)
        self.forms = [decode_form(block) for block in stage.blocks]
        self.layer_fns: dict[LayerSpec, Callable] = {}  # layer kind -> its compiled decode_layer
        self.head_fn = torch.compile(own_code(head_logits))
        untraced_dispatch()  # a sparse MLP's dispatch marked for dynamo before anything is traced
        self.compiled: set[LayerSpec | str] = set()  # layer kinds (and HEAD) that run compiled
        self.eager: dict[LayerSpec | str, str] = {}  # layer kind (or HEAD) -> why it runs eagerly
        self.steps = 0  # decode steps this runner ran (some of their layers may have run eagerly)
        self._scratch: dict[CacheSpec, list[KeyValues]] = {}

    # -- compiling (once per span load) ---------------------------------------------

    def compile(self) -> None:
        """Compile every layer kind of the span for every bucket (and the head), saying how far it got.
        A kind whose layers store their matrices differently (stored_signature) is compiled once per
        variant, from its first layer, so that no layer of the span needs a compile at run time."""
        stage = self.stage
        kinds = list(dict.fromkeys(stage.spec.layers[stage.start : stage.end]))
        layers = {kind: [i for i in range(stage.end - stage.start) if stage.spec.layers[stage.start + i] == kind]
                  for kind in kinds}
        variants = {kind: self._variants(layers[kind]) for kind in kinds}
        jobs = sum(len(v) for v in variants.values()) * len(self.buckets) + \
            (len(self.buckets) if stage.head is not None else 0)
        done, began = 0, time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                torch._inductor.config.patch(realize_reads_threshold=REALIZE_READS), torch.inference_mode():
            for kind in kinds:
                if kind.attention_kind not in COMPILED_ATTENTION:
                    self._fall_back(kind, f"no compiled step for {kind.attention_kind} attention's cache yet"
                                    if kind.attention is not None else "no compiled step for a layer without attention yet")
                    done += len(variants[kind]) * len(self.buckets)
                    continue
                stored = set().union(*(unfused(self.forms[i]) for i in layers[kind]))
                if stored:
                    self._fall_back(kind, f"no compiled form for its {', '.join(sorted(stored))} matrices yet")
                    done += len(variants[kind]) * len(self.buckets)
                    continue
                try:
                    for layer in variants[kind]:
                        for rows in self.buckets:
                            self._warm_layer(kind, rows, layer)
                            done += 1
                            self.say(f"compiling decode steps: {done}/{jobs} ({time.perf_counter() - began:.0f} s)")
                    self.compiled.add(kind)
                except Exception as bad:  # noqa: BLE001 - any failure to compile means: this kind runs eagerly
                    self._fall_back(kind, f"compiling failed: {first_line(bad)}")
            if stage.head is not None and stage.norm is not None:
                try:
                    for rows in self.buckets:
                        self.head_fn(torch.zeros(rows, stage.spec.hidden_size, dtype=stage.dtype, device=stage.device),
                                     stage.norm, stage.head, stage.spec.rms_norm_eps)
                        done += 1
                        self.say(f"compiling decode steps: {done}/{jobs} ({time.perf_counter() - began:.0f} s)")
                    self.compiled.add(HEAD)
                except Exception as bad:  # noqa: BLE001 - as above
                    self._fall_back(HEAD, f"compiling failed: {first_line(bad)}")

    def _variants(self, layers: list[int]) -> list[int]:
        """The first of `layers` for each distinct stored_signature among them."""
        first: dict[tuple, int] = {}
        for layer in layers:
            first.setdefault(stored_signature(self.forms[layer]), layer)
        return list(first.values())

    def _warm_layer(self, kind: LayerSpec, rows: int, layer: int) -> None:
        """Run layer `layer` (stage-relative, of `kind`) over `rows` rows, so dynamo and inductor build its graph."""
        stage = self.stage
        if kind not in self.layer_fns:
            self.layer_fns[kind] = torch.compile(own_code(decode_layer))
        stores = []
        for _ in range(rows):  # capacity a size symbol: what a session's store will pass
            store = KeyValues(kind.cache, SCRATCH_CAPACITY + 1, dtype=stage.dtype, device=stage.device)
            torch._dynamo.mark_dynamic(store.keys, 1)
            torch._dynamo.mark_dynamic(store.values, 1)
            stores.append(store)
        positions = torch.ones(rows, dtype=torch.long, device=stage.device)
        cos, sin = stage.rope.tables(positions, stage.dtype)[(kind.attention.rope, kind.attention.rope_dim)]
        x = torch.zeros(rows, stage.spec.hidden_size, dtype=stage.dtype, device=stage.device)
        self.layer_fns[kind](self.forms[layer], x, cos, sin, positions, [s.keys for s in stores], [s.values for s in stores])

    def _fall_back(self, what: LayerSpec | str, reason: str) -> None:
        """`what` (a layer kind, or HEAD) runs eagerly from now on; said once."""
        self.compiled.discard(what)
        if what not in self.eager:
            self.eager[what] = reason
            self.say(f"{what if isinstance(what, str) else 'layer kind ' + describe_kind(what)} decodes eagerly: {reason}")

    # -- running --------------------------------------------------------------------

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds `rows` rows (None: more than the largest)."""
        return next((b for b in self.buckets if b >= rows), None)

    def takes(self, rows: int) -> bool:
        return self.bucket(rows) is not None and bool(self.compiled)

    def run(self, first: int, last: int, x: Tensor, positions: list[int], states: Sequence[SessionState]
            ) -> Tensor | None:
        """Layers [first, last) of the stage (stage-relative) for one token of each session: row i of
        x [R, H] is states[i]'s at positions[i]. None when this step has no compiled form."""
        bucket = self.bucket(len(states))
        if bucket is None or any(state.cache.capacity < SCRATCH_CAPACITY for state in states):
            return None
        stage, rows = self.stage, len(states)
        pad = bucket - rows
        # the graphs were built over inference tensors (warm-up ran in inference mode); a row that
        # arrived from the network is a plain one, which dynamo's guards tell apart: a copy (one row)
        x = x if x.is_inference() else x.clone()
        pos = torch.tensor(positions + [0] * pad, dtype=torch.long, device=stage.device)
        tables = stage.rope.tables(pos, stage.dtype)
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
        eager_ctx: StepContext | None = None
        with torch.compiler.set_stance("fail_on_recompile"):
            for i in range(first, last):
                kind = stage.spec.layers[stage.start + i]
                stores = [state.cache.layers[i - (state.start - stage.start)] for state in states]
                if kind in self.compiled:
                    stores += self._scratch_stores(kind.cache, pad)
                    cos, sin = tables[(kind.attention.rope, kind.attention.rope_dim)]
                    try:
                        x = self.layer_fns[kind](self.forms[i], x, cos, sin, pos, [s.keys for s in stores],
                                          [s.values for s in stores])
                        continue
                    except Exception as bad:  # noqa: BLE001 - the step goes on eagerly, the kind stays eager
                        self._fall_back(kind, f"a step needed another compile ({first_line(bad)})")
                        stores = stores[:rows]
                if eager_ctx is None:
                    eager_ctx = eager_context(positions, {k: (c[:rows], s[:rows]) for k, (c, s) in tables.items()},
                                              stage.device)
                out = stage.blocks[i].forward(x[:rows], eager_ctx, stores[0] if rows == 1 else stores)
                x = torch.cat([out, x[rows:]]) if pad else out
        self.steps += 1
        return x[:rows]

    def logits(self, hidden: Tensor) -> Tensor | None:
        """Stage.logits for a few rows through the compiled head; None when it has none for them."""
        bucket = self.bucket(hidden.shape[0])
        stage = self.stage
        if HEAD not in self.compiled or bucket is None or stage.head is None or stage.norm is None:
            return None
        pad = bucket - hidden.shape[0]
        x = hidden.to(stage.device, stage.dtype)
        x = x if x.is_inference() else x.clone()  # as in `run`
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self.head_fn(x, stage.norm, stage.head, stage.spec.rms_norm_eps)[: hidden.shape[0]]
        except Exception as bad:  # noqa: BLE001 - as in run
            self._fall_back(HEAD, f"a step needed another compile ({first_line(bad)})")
            return None

    def session_cache(self, start: int, end: int, capacity: int) -> SessionCache | None:
        return None  # sessions keep their own stores: the op takes each one as it is

    def closed(self, cache: SessionCache) -> None:
        pass

    def _scratch_stores(self, spec: CacheSpec, count: int) -> list[KeyValues]:
        """`count` pad rows' stores, each its own: one store passed twice in a step is an aliased
        graph input, which dynamo guards against (warm-up passes distinct ones): a recompile."""
        stores = self._scratch.setdefault(spec, [])
        while len(stores) < count:
            stores.append(KeyValues(spec, SCRATCH_CAPACITY, dtype=self.stage.dtype, device=self.stage.device))
        return stores[:count]


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
