"""A session's cache: one store per layer, of the layer's cache kind, and one position pointer.

`SessionCache` holds, for a run of consecutive layers, each layer's store (built from its
`CacheSpec`, families/spec/attention.py), and the position pointer `length`: positions [0, length) are valid; a write at position p first moves the
pointer to p (a rollback: speculation's rejected drafts, a step re-sent after a repair),
then past what it wrote. Rolling back is moving the pointer; the next write overwrites what
lay beyond it. Checks come before any allocation or write, so a refused step moves nothing.

A session may hold up to `capacity` positions, but its stores are allocated in chunks of
KV_CHUNK positions as writes reach them (`kv_positions` is the one rounding rule the cache
and a server's memory accounting share): a session that stops after 40 tokens of a 4,096
capacity holds 256 positions, not 4,096 (SmolLM2-135M, 30 layers: 11.8 MB, not 189 MB), so
an idle or abandoned session cannot pin its maximum. Growing copies the valid positions,
once per chunk: a 2,048-token answer copies 8 times, each at most its current size.

Kinds (CACHE_KINDS):

- "full":    `KeyValues` [K, allocated, D] each for keys and values; a step reads every
             position up to its own.
- "sliding": the same store (every position is kept, so that any rollback can be honoured:
             see `CacheSpec`); a one-token step reads only the last `window` positions, and
             a longer step's mask (layers/attention.py) hides the rest.
             (Values may be narrower than keys: `CacheSpec.value_dim`, MiMo-V2-Flash.)
- "shared":  no store of its own: the layer reads the store of the earlier layer it names
             (`SharedCacheSpec`, Gemma 4's KV-shared layers), which `SessionCache` holds once and
             hands to both. That layer wrote the step's positions before this one reads them.

- "latent":  `LatentRows` [allocated, kv_lora_rank + rope_dim]: MLA's compressed kv and rotated
             rope key per position, one row for all heads (layers/mla.py expands or absorbs it).
- "latent_indexed": `IndexedLatentRows`: the latent rows, and DSA's index keys [allocated,
             index_head_dim] beside them (layers/dsa.py scores every position's key to pick
             the rows a query reads). Both are written at the same positions and roll back with
             the one pointer: a rejected draft's keys are overwritten like its rows.

- "recurrent": `RecurrentState` (layers/state.py): a linear-attention layer's fixed state, which
             cannot be cut back to a position: it keeps checkpoints, and a write at position p
             is honoured only where one reaches (`reachable`); any other is refused
             (StateRewindError) before anything moves, and the session replays from 0.
- "none":    `NoState`: a layer with no token mixer (a Nemotron-H MLP layer) keeps nothing.

- "compressed": `CompressedRows` (DeepSeek-V4): the window's rows and the projections of the
             positions not yet compressed, each in a ring of its last positions, and the
             compressed entries (with the indexer's) that grow by one every `ratio` positions.
             A write or rollback goes back by a pointer move as far as the rings reach
             (COMPRESSED_REACH past what the window and the open compression need), and to the
             starts of the last long steps (snapshots); further, it is refused before anything
             moves (StateRewindError, `reachable`) and the session replays from position 0.

A new kind is a store class here with the interface its attention kind calls — for
`KeyValues`, `write_and_read` — plus `grow` and `nbytes`, registered in STORES, and its
spec's `fixed_bytes` and `bytes_per_position` (what admission budgets). A store that cannot be
cut back by a pointer also has `reachable(p)` and `rewind(p)`, which `SessionCache` asks before
any write or rollback.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from tessera.stages.errors import ContextOverflow, StateRewindError, UnsupportedModel
from tessera.stages.families.spec.attention import CacheSpec, SharedCacheSpec
from tessera.stages.families.spec.compressed import COMPRESSED_REACH, COMPRESSED_SNAPSHOTS, CompressedCacheSpec
from tessera.stages.families.spec.layer import StatelessSpec
from tessera.stages.families.spec.mla import IndexedLatentCacheSpec, LatentCacheSpec
from tessera.stages.families.spec.recurrent import RecurrentStateSpec
from tessera.stages.layers.state import RecurrentState

KV_CHUNK = 256  # positions a session's stores grow by (see the module docstring)


def kv_positions(need: int, capacity: int) -> int:
    """Positions a cache that must hold `need` of them allocates: whole chunks, at most `capacity`
    (the one rule both the cache and a server's memory accounting follow)."""
    return min(capacity, -(-need // KV_CHUNK) * KV_CHUNK)


class KeyValues:
    """One layer's keys and values of one session: [K, allocated, D] each, written in place."""

    def __init__(self, spec: CacheSpec, positions: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        self.keys = torch.zeros((spec.num_kv_heads, positions, spec.head_dim), dtype=dtype, device=device)
        self.values = torch.zeros((spec.num_kv_heads, positions, spec.value_width), dtype=dtype, device=device)
        self.window = spec.window

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, window: int | None) -> "KeyValues":
        """A store over buffers allocated elsewhere, [K, capacity, D] each: a compiled decode step's
        view of a session's store (engine/compiled/), or a slot of a static pool (CUDA graphs)."""
        store = cls.__new__(cls)
        store.keys, store.values, store.window = keys, values, window
        return store

    def grow(self, positions: int, *, keep: int) -> None:
        """Reallocate for `positions`, copying the valid positions [0, keep)."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], positions, old.shape[2]))  # [K, S, D] (values: Dv)
            new[:, :keep] = old[:, :keep]
            setattr(self, name, new)

    def write_and_read(self, k: torch.Tensor, v: torch.Tensor, start: int
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Write k, v [T, K, D] at positions [start, start + T); return what the step attends to:
        (keys, values [K, S, D], the position of their first row). A one-token step gets the
        positions in its window only; a longer step gets [0, start + T), masked by the caller."""
        end = start + k.shape[0]
        self.keys[:, start:end] = k.transpose(0, 1)  # [K, T, D]
        self.values[:, start:end] = v.transpose(0, 1)
        return self.read(start, k.shape[0])

    def read(self, start: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What a step of `n_tokens` rows at `start` attends to, written already (by this layer, or by
        the layer whose store a KV-shared layer reads): as `write_and_read` returns it."""
        end = start + n_tokens
        first = max(0, end - self.window) if self.window is not None and n_tokens == 1 else 0
        return self.keys[:, first:end], self.values[:, first:end], first

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class LatentRows:
    """One MLA layer's cache of one session: [allocated, latent + rope dims], written in place."""

    def __init__(self, spec: LatentCacheSpec, positions: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.rows = torch.zeros((positions, spec.width), dtype=dtype, device=device)

    def grow(self, positions: int, *, keep: int) -> None:
        """Reallocate for `positions`, copying the valid positions [0, keep)."""
        new = self.rows.new_zeros((positions, self.rows.shape[1]))  # [S, C + Dr]
        new[:keep] = self.rows[:keep]
        self.rows = new

    def write_and_read(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        """Write rows [T, C + Dr] at positions [start, start + T); return positions [0, start + T)."""
        end = start + rows.shape[0]
        self.rows[start:end] = rows
        return self.rows[:end]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes


class IndexedLatentRows(LatentRows):
    """One DSA layer's cache of one session: the latent rows, and the indexer's keys
    [allocated, index dims] at the same positions, written in place."""

    def __init__(self, spec: IndexedLatentCacheSpec, positions: int, *, dtype: torch.dtype,  # type: ignore[override]
                 device: torch.device | str) -> None:
        super().__init__(LatentCacheSpec(spec.latent_dim, spec.rope_dim), positions, dtype=dtype, device=device)
        self.index_keys = torch.zeros((positions, spec.index_dim), dtype=dtype, device=device)

    def grow(self, positions: int, *, keep: int) -> None:
        super().grow(positions, keep=keep)
        new = self.index_keys.new_zeros((positions, self.index_keys.shape[1]))  # [S, Di]
        new[:keep] = self.index_keys[:keep]
        self.index_keys = new

    def write_and_read_keys(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """Write index keys [T, Di] at positions [start, start + T); return positions [0, start + T)."""
        end = start + keys.shape[0]
        self.index_keys[start:end] = keys
        return self.index_keys[:end]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.index_keys.nbytes


class NoState:
    """The store of a layer that keeps nothing per session (kind "none"): an MLP-only layer's."""

    def __init__(self, spec: StatelessSpec, positions: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        pass

    def grow(self, positions: int, *, keep: int) -> None:
        pass

    nbytes = 0



class Ring:
    """The rows of a store's last `rows` positions, [rows, width], position p at slot p % rows; valid
    for positions [low, end) where `end` is the store's position."""

    def __init__(self, rows: int, width: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        self.data = torch.zeros((rows, width), dtype=dtype, device=device)
        self.low = 0  # the first position whose row the ring still holds

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """Rows of positions [lo, hi) (all held: lo >= low), in order."""
        assert self.low <= lo <= hi, "a ring read of positions it holds"
        slots = torch.arange(lo, hi, device=self.data.device) % self.data.shape[0]
        return self.data.index_select(0, slots)

    def write(self, rows: torch.Tensor, start: int) -> None:
        """Rows [T, width] of positions [start, start + T); of a step longer than the ring, its last rows."""
        size, end = self.data.shape[0], start + rows.shape[0]
        lo = max(start, end - size)
        self.data[torch.arange(lo, end, device=self.data.device) % size] = rows[lo - start :]
        self.low = max(self.low, end - size)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass
class Snapshot:
    """A compressed store's rings at position `position` (the rows a step from there reads), kept
    at the start of a step longer than the rings reach past."""

    position: int
    window: torch.Tensor  # rows of positions [position - len, position)
    raw: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return self.window.nbytes + (self.raw.nbytes if self.raw is not None else 0)


class CompressedRows:
    """One DeepSeek-V4 layer's state of one session (kind "compressed": families/spec/compressed.py
    `CompressedCacheSpec`, layers/compressed.py reads and writes it).

    window:  `Ring` of the key-value rows [D] of the last W - 1 + COMPRESSED_REACH positions.
    raw:     `Ring` of each position's projections and gate logits [raw_width] until its
             compression window has closed (and, with overlap, the next one), + the reach.
    entries, index_entries: the compressed entries [allocated, D] and the indexer's [allocated, Di],
             entry w standing for positions [w m, (w + 1) m); grown with the context.
    position: the position the next step writes at (SessionCache's pointer, which moves it).
    """

    def __init__(self, spec: CompressedCacheSpec, positions: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.spec = spec
        window_rows, raw_rows = spec.ring_rows()
        self.window = Ring(window_rows, spec.head_dim, dtype=dtype, device=device)
        self.raw = Ring(raw_rows, spec.raw_width, dtype=dtype, device=device) if spec.ratio else None
        self.entries = torch.zeros((spec.entries(positions), spec.head_dim), dtype=dtype, device=device)
        self.index_entries = torch.zeros((spec.entries(positions), spec.index_dim), dtype=dtype, device=device)
        self.position = 0
        self.snapshots: deque[Snapshot] = deque(maxlen=COMPRESSED_SNAPSHOTS)

    def grow(self, positions: int, *, keep: int) -> None:
        """Room for the entries of `positions` positions, keeping those of the valid [0, keep)."""
        n, kept = self.spec.entries(positions), keep // self.spec.ratio if self.spec.ratio else 0
        for name in ("entries", "index_entries"):
            old = getattr(self, name)
            new = old.new_zeros((n, old.shape[1]))
            new[:kept] = old[:kept]
            setattr(self, name, new)

    # -- going back ---------------------------------------------------------------

    def first_read(self, position: int) -> tuple[int, int]:
        """The first positions whose window row and whose projections a step at `position` reads."""
        spec = self.spec
        window = max(0, position - spec.window + 1)
        if not spec.ratio:
            return window, position
        return window, max(0, (position // spec.ratio - (1 if spec.overlap else 0)) * spec.ratio)

    def reachable(self, position: int) -> bool:
        """Whether `rewind(position)` can go back there: the rings still hold what a step from it reads,
        or a snapshot was kept there (position 0 and the current one always)."""
        if position in (0, self.position):
            return True
        if position > self.position:
            return False
        if any(s.position == position for s in self.snapshots):
            return True
        window, raw = self.first_read(position)
        return window >= self.window.low and (self.raw is None or raw >= self.raw.low)

    def rewind(self, position: int) -> None:
        """Go back to `position` (StateRewindError, moving nothing, unless `reachable`): the entries of
        the windows before it stand, the rings' rows from it on are written anew."""
        if position == self.position:
            return
        if not self.reachable(position):
            raise StateRewindError(
                f"cannot go back to position {position}: this session's compressed attention state is at "
                f"{self.position} and keeps the rows of its last {COMPRESSED_REACH} positions past its window "
                f"(and the starts of its last {COMPRESSED_SNAPSHOTS} long steps: "
                f"{[s.position for s in self.snapshots]}); replay the history from position 0")
        while self.snapshots and self.snapshots[-1].position > position:
            self.snapshots.pop()
        with torch.inference_mode():  # the rings were made in a stage's inference mode; a rollback may come outside it
            self._restore(position)
        self.position = position

    def _restore(self, position: int) -> None:
        """The rings as a step from `position` reads them: as they are, or from the snapshot kept there."""
        if position == 0:
            self.window.low = 0
            if self.raw is not None:
                self.raw.low = 0
            self.snapshots.clear()
        else:
            window, raw = self.first_read(position)
            if window < self.window.low or (self.raw is not None and raw < self.raw.low):
                kept = next(s for s in self.snapshots if s.position == position)
                self.window.write(kept.window, position - kept.window.shape[0])
                self.window.low = position - kept.window.shape[0]
                if self.raw is not None and kept.raw is not None:
                    self.raw.write(kept.raw, position - kept.raw.shape[0])
                    self.raw.low = position - kept.raw.shape[0]

    # -- one step -----------------------------------------------------------------

    def write_window(self, rows: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
        """Write the step's key-value rows [T, D] at [start, start + T); return the rows a step's
        queries read as window, of positions [first, start + T), and `first`. Keeps a snapshot
        first when the step is longer than the rings reach past its start."""
        assert start == self.position, "SessionCache rewinds a store before a step writes"
        n = rows.shape[0]
        if n > COMPRESSED_REACH and start > 0:
            self._snapshot(start)
        first = max(0, start - self.spec.window + 1)
        read = torch.cat((self.window.read(first, start), rows)) if first < start else rows
        self.window.write(rows, start)
        return read, first

    def write_raw(self, raw: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
        """Write the step's projections [T, raw_width] at [start, start + T); return those of positions
        [first, start + T) (what the windows closing in this step read), and `first`."""
        assert self.raw is not None, "a compressing layer"
        first = self.first_read(start)[1]
        read = torch.cat((self.raw.read(first, start), raw)) if first < start else raw
        self.raw.write(raw, start)
        return read, first

    def write_entries(self, entries: torch.Tensor, index_entries: torch.Tensor | None, first: int) -> None:
        """Entries [n, D] (and the indexer's [n, Di]) of windows [first, first + n)."""
        self.entries[first : first + entries.shape[0]] = entries
        if index_entries is not None:
            self.index_entries[first : first + index_entries.shape[0]] = index_entries

    def advance(self, n_tokens: int) -> None:
        """The step's positions are written: the next step writes after them."""
        self.position += n_tokens

    def _snapshot(self, start: int) -> None:
        window, raw = self.first_read(start)
        self.snapshots.append(Snapshot(start, self.window.read(window, start).clone(),
                                       self.raw.read(raw, start).clone() if self.raw is not None else None))

    @property
    def nbytes(self) -> int:
        rings = self.window.nbytes + (self.raw.nbytes if self.raw is not None else 0)
        return rings + self.entries.nbytes + self.index_entries.nbytes + sum(s.nbytes for s in self.snapshots)


LayerStore = KeyValues | LatentRows | RecurrentState | NoState | CompressedRows
STORES = {"full": KeyValues, "sliding": KeyValues, "latent": LatentRows, "latent_indexed": IndexedLatentRows,
          "recurrent": RecurrentState, "none": NoState, "compressed": CompressedRows}
AnyCacheSpec = (CacheSpec | SharedCacheSpec | LatentCacheSpec | IndexedLatentCacheSpec | RecurrentStateSpec | StatelessSpec
                | CompressedCacheSpec)


def layer_store(spec: AnyCacheSpec, positions: int, *, dtype: torch.dtype,
                device: torch.device | str) -> LayerStore:
    """An empty store of `spec`'s kind for `positions` (UnsupportedModel for a kind without a store here)."""
    store = STORES.get(spec.kind)
    if store is None:
        raise UnsupportedModel(f"cache kind {spec.kind!r} has no store in this engine ({sorted(STORES)})")
    return store(spec, positions, dtype=dtype, device=device)  # type: ignore[arg-type]


class SessionCache:
    """Every layer's store for one session over a run of consecutive layers, and the pointer.

    `first` is the absolute index of the first of `layers`: a "shared" layer's entry is the store
    of the layer it names (`SharedCacheSpec.source`), which must lie among them (a span never
    parts the two: ModelSpec.span_starts), and `stores` lists each store once."""

    def __init__(self, layers: Sequence[AnyCacheSpec], capacity: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", first: int = 0) -> None:
        self.layers: list[LayerStore] = []
        for spec in layers:
            if isinstance(spec, SharedCacheSpec):
                if not 0 <= spec.source - first < len(self.layers):
                    raise UnsupportedModel(f"a layer reads the keys and values of layer {spec.source}, which this "
                                           f"session's layers from {first} do not hold")
                self.layers.append(self.layers[spec.source - first])
            else:
                self.layers.append(layer_store(spec, 0, dtype=dtype, device=device))
        self.stores = list({id(store): store for store in self.layers}.values())
        self.capacity = capacity
        self.allocated = 0  # positions every store holds memory for now
        self.length = 0
        # the stores a pointer move cannot take back (recurrent states, compressed layers' rings): asked
        # before any write or rollback
        self.rewinding = [store for store in self.layers if isinstance(store, (RecurrentState, CompressedRows))]

    @classmethod
    def over(cls, stores: Sequence[KeyValues], capacity: int) -> "SessionCache":
        """A session's cache over stores allocated elsewhere (a CUDA-graph step's static slot)."""
        cache = cls.__new__(cls)
        cache.layers, cache.capacity, cache.length = list(stores), capacity, 0
        cache.stores = list(stores)
        cache.allocated = capacity  # the slot holds every position already: it never grows
        cache.rewinding = []
        return cache

    def reserve(self, start: int, n_tokens: int) -> None:
        """Check that positions [start, start + n_tokens) can be written, grow the stores to hold
        them, and move the pointer there."""
        if start < 0 or start > self.length:
            raise ContextOverflow(
                f"write at position {start!r} but the cache holds positions [0, {self.length})"
            )
        if start + n_tokens > self.capacity:
            raise ContextOverflow(
                f"positions up to {start + n_tokens} exceed this session's capacity of {self.capacity}"
            )
        self._rewind(start)
        if start + n_tokens > self.allocated:
            self.allocated = kv_positions(start + n_tokens, self.capacity)
            for store in self.stores:
                store.grow(self.allocated, keep=start)
        self.length = start + n_tokens

    def rollback(self, position: int) -> None:
        """Forget every position >= `position` (a pointer move; nothing is erased)."""
        if not 0 <= position <= self.length:
            raise ContextOverflow(
                f"cannot roll back to {position!r}: the cache holds positions [0, {self.length})"
            )
        self._rewind(position)
        self.length = position

    def reachable(self, position: int) -> bool:
        """Whether a write or rollback at `position` (<= length) can be honoured by every store."""
        return all(store.reachable(position) for store in self.rewinding)

    def _rewind(self, position: int) -> None:
        """Take every store a pointer move cannot take back (recurrent states, compressed layers' rings) to
        `position` (StateRewindError, moving nothing, unless all reach it)."""
        if position == self.length or not self.rewinding:
            return
        blocked = next((store for store in self.rewinding if not store.reachable(position)), None)
        if blocked is not None:
            blocked.rewind(position)  # raises StateRewindError (naming where its state is kept) before moving
            raise StateRewindError(f"cannot go back to position {position}")  # not reached: rewind raised
        for store in self.rewinding:
            store.rewind(position)

    @property
    def nbytes(self) -> int:
        return sum(store.nbytes for store in self.stores)


def session_bytes(layers: Sequence[AnyCacheSpec], positions: int, itemsize: int) -> int:
    """Bytes a `SessionCache` of these layers allocates for `positions` (checked before growing)."""
    return sum(spec.bytes(positions, itemsize) for spec in layers)
