"""A session's cache: one store per layer, of the layer's cache kind, and one position pointer.

`SessionCache` holds, for a run of consecutive layers, each layer's store (built from its
`CacheSpec`, families/spec.py), and the position pointer `length`: positions [0, length) are valid; a write at position p first moves the
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

A new kind is a store class here with the interface its attention kind calls — for
`KeyValues`, `write_and_read` — plus `grow` and `nbytes`, registered in STORES, and its
spec's `fixed_bytes` and `bytes_per_position` (what admission budgets). A store that cannot be
cut back by a pointer also has `reachable(p)` and `rewind(p)`, which `SessionCache` asks before
any write or rollback.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tessera.stages.errors import ContextOverflow, StateRewindError, UnsupportedModel
from tessera.stages.families.spec import (
    CacheSpec, IndexedLatentCacheSpec, LatentCacheSpec, RecurrentStateSpec, StatelessSpec,
)
from tessera.stages.layers.state import RecurrentState

KV_CHUNK = 256  # positions a session's stores grow by (see the module docstring)


def kv_positions(need: int, capacity: int) -> int:
    """Positions a cache that must hold `need` of them allocates: whole chunks, at most `capacity`
    (the one rule both the cache and a server's memory accounting follow)."""
    return min(capacity, -(-need // KV_CHUNK) * KV_CHUNK)


class KeyValues:
    """One layer's keys and values of one session: [K, allocated, D] each, written in place."""

    def __init__(self, spec: CacheSpec, positions: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (spec.num_kv_heads, positions, spec.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
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
            new = old.new_zeros((old.shape[0], positions, old.shape[2]))  # [K, S, D]
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
        first = max(0, end - self.window) if self.window is not None and k.shape[0] == 1 else 0
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


LayerStore = KeyValues | LatentRows | RecurrentState | NoState
STORES = {"full": KeyValues, "sliding": KeyValues, "latent": LatentRows, "latent_indexed": IndexedLatentRows,
          "recurrent": RecurrentState, "none": NoState}
AnyCacheSpec = CacheSpec | LatentCacheSpec | IndexedLatentCacheSpec | RecurrentStateSpec | StatelessSpec


def layer_store(spec: AnyCacheSpec, positions: int, *, dtype: torch.dtype,
                device: torch.device | str) -> LayerStore:
    """An empty store of `spec`'s kind for `positions` (UnsupportedModel for a kind without a store here)."""
    store = STORES.get(spec.kind)
    if store is None:
        raise UnsupportedModel(f"cache kind {spec.kind!r} has no store in this engine ({sorted(STORES)})")
    return store(spec, positions, dtype=dtype, device=device)  # type: ignore[arg-type]


class SessionCache:
    """Every layer's store for one session over a run of consecutive layers, and the pointer."""

    def __init__(self, layers: Sequence[AnyCacheSpec], capacity: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.layers = [layer_store(spec, 0, dtype=dtype, device=device) for spec in layers]
        self.capacity = capacity
        self.allocated = 0  # positions every store holds memory for now
        self.length = 0
        # the stores a pointer move cannot take back (recurrent states): asked before any write or rollback
        self.rewinding = [store for store in self.layers if isinstance(store, RecurrentState)]

    @classmethod
    def over(cls, stores: Sequence[KeyValues], capacity: int) -> "SessionCache":
        """A session's cache over stores allocated elsewhere (a CUDA-graph step's static slot)."""
        cache = cls.__new__(cls)
        cache.layers, cache.capacity, cache.length = list(stores), capacity, 0
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
            for store in self.layers:
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
        """Take every recurrent store back to `position` (StateRewindError, moving nothing, unless all reach it)."""
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
        return sum(store.nbytes for store in self.layers)


def session_bytes(layers: Sequence[AnyCacheSpec], positions: int, itemsize: int) -> int:
    """Bytes a `SessionCache` of these layers allocates for `positions` (checked before growing)."""
    return sum(spec.bytes(positions, itemsize) for spec in layers)
