"""A session's fixed-size state: what a linear-attention layer keeps instead of a row per position.

A KV cache grows by a row per token and goes back to any position by moving its pointer. A
recurrent layer (Gated DeltaNet; a KDA or Mamba2 layer would be the same kind of thing) folds
every token into a state of fixed size — here a matrix per value head, [Hv, dk, dv], and the
last Kc - 1 inputs of its short causal convolution, [Kc - 1, C] — so a session of any length
costs the same, and the state at an earlier position is gone once the next token is folded in.

`RecurrentState` is that store, with how it goes back (`families/spec/recurrent.py`
`RecurrentStateSpec` sizes it, and admission budgets its `fixed_bytes`):

- Checkpoints. A step folds its tokens into a NEW state tensor (the layer never writes the
  state in place), so keeping the state it started from costs no copy, only memory. The store
  keeps the state at the start of each of its last RECURRENT_CHECKPOINTS runs of steps, and the
  per-token inputs to the recurrence of a run of short steps (`replay_width` values a token:
  the convolution's inputs and the gates' logits — what the layer computed from the token's
  hidden state, so that no projection runs again). A run is one step of several tokens (a
  speculative block; a prefill chunk, whose inputs are not kept when it is longer than
  REPLAY_TOKENS) and the one-token steps after it (decode steps, a local draft model's drafts),
  up to REPLAY_TOKENS tokens in all.
- Going back to position p (`rewind`): to the checkpoint of the run p falls in, and, when p
  lies inside that run, the inputs of [run start, p) are handed to the layer on its next step
  (`pending`) to be folded in again before the new tokens: the recurrence's own work for those
  tokens, no more. Position 0 is always reachable (a fresh state); so is the current position.
  Anything else is refused before anything moves (`reachable`, raising `StateRewindError`):
  the requester then replays the history into a fresh session, as it does for a replacement.
  Why checkpoint-and-recompute rather than a state per position: docs/pages/models.md has the
  measurement (bench/rollback.py).
- Rebuilding (failover, comeback): a replacement is fed the history in one prefill-shaped step
  (or in chunks); the state it ends with equals the uninterrupted one up to float rounding
  (the chunked and token-by-token forms of the recurrence agree to ~1e-6; tests hold 1e-4).

Every recurrent kind (Gated DeltaNet, KDA's per-channel gates, Mamba2's SSM state) is a store of
this shape: its layer has a `Fold` (a step's inputs, the state and the window -> its outputs and
NEW state and window tensors) and runs each session's rows through `RecurrentState.step`
(`fold_sessions` for a stacked step); checkpointing, rewinding and budgeting are the same.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from tessera.stages.errors import StateRewindError
from tessera.stages.families.spec.recurrent import RECURRENT_CHECKPOINTS, REPLAY_TOKENS, RecurrentStateSpec


# A recurrent layer's fold: (inputs [T, replay_width], state, convolution window) -> (its outputs [T, ...],
# the NEW state, the NEW window): the recurrence's work for those tokens, no projection
Fold = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class Rows(Protocol):
    """A session's rows [lo, hi) in a stacked step (layers/attention.py's `Segment`)."""

    lo: int
    hi: int


@dataclass
class Checkpoint:
    """The state at position `start`, and (for a short step) the inputs of the step that began there."""

    start: int
    state: torch.Tensor  # [Hv, dk, dv], float32
    conv: torch.Tensor  # [Kc - 1, C]
    inputs: torch.Tensor | None  # [T, replay_width] of the step from `start`, or None (a long step)

    @property
    def reach(self) -> int:
        """The last position inside this step a rewind can rebuild (its start, when inputs were not kept)."""
        return self.start + (self.inputs.shape[0] if self.inputs is not None else 0)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.conv.nbytes + (self.inputs.nbytes if self.inputs is not None else 0)


class RecurrentState:
    """One linear-attention layer's state of one session (module docstring)."""

    def __init__(self, spec: RecurrentStateSpec, positions: int = 0, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        self.state, self.conv = self._fresh()
        self.position = 0  # the position the next step writes at
        self.history: deque[Checkpoint] = deque(maxlen=RECURRENT_CHECKPOINTS)
        # after a rewind: the inputs [n, replay_width] to fold in again before the next step, which
        # begins from the last checkpoint (`resumed`) rather than from `state` moved on
        self.pending: torch.Tensor | None = None
        self.resumed = False

    def _fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        state = torch.zeros(s.num_heads, s.key_dim, s.value_dim, dtype=torch.float32, device=self.device)
        conv = torch.zeros(s.conv_kernel - 1, s.conv_channels, dtype=self.dtype, device=self.device)
        return state, conv

    def grow(self, positions: int, *, keep: int) -> None:
        """A fixed state does not grow with the context (SessionCache grows every store alike)."""

    def reachable(self, position: int) -> bool:
        """Whether `rewind(position)` can rebuild the state there (a position it holds: <= `position`)."""
        if position in (0, self.position):
            return True
        return position < self.position and any(c.start <= position <= c.reach for c in self.history)

    def rewind(self, position: int) -> None:
        """Go back to `position` (StateRewindError, moving nothing, unless `reachable`): to the
        checkpoint of the step it falls in, with the inputs before it inside that step pending."""
        if position == self.position:
            return
        if position > self.position:
            raise StateRewindError(f"cannot go forward to position {position}: this session's state is at {self.position}")
        if position == 0:
            self.state, self.conv = self._fresh()
            self.position, self.pending, self.resumed = 0, None, False
            self.history.clear()
            return
        for i in range(len(self.history) - 1, -1, -1):
            checkpoint = self.history[i]
            if checkpoint.start <= position <= checkpoint.reach:
                break
        else:
            kept = [c.start for c in self.history]
            raise StateRewindError(
                f"cannot go back to position {position}: this session's recurrent state is at {self.position} "
                f"and kept at {kept} (the starts of its last {RECURRENT_CHECKPOINTS} runs of steps, with the inputs "
                f"of runs of at most {REPLAY_TOKENS} tokens); replay the history from position 0")
        while len(self.history) > i + 1:  # every later step is undone; this one is resumed from its start
            self.history.pop()
        self.state, self.conv = checkpoint.state, checkpoint.conv
        n = position - checkpoint.start
        assert checkpoint.inputs is not None or n == 0, "a rewind inside a step needs its inputs"
        self.pending = checkpoint.inputs[:n] if n else None
        self.position, self.resumed = position, True

    def take_pending(self) -> torch.Tensor | None:
        """Before a step: after a rewind, the inputs to fold in again first (None: none), from the
        checkpoint it went back to, whose entry the refolding (or the step) makes anew."""
        if not self.resumed:
            return None
        checkpoint = self.history.pop()
        pending, self.pending, self.resumed = self.pending, None, False
        self.position = checkpoint.start
        return pending

    def advance(self, inputs: torch.Tensor, state: torch.Tensor, conv: torch.Tensor) -> None:
        """The layer folded `inputs` [T, replay_width] into the NEW tensors `state` and `conv`: keep the
        state it started from as a checkpoint (no copy: the layer made new tensors), and the inputs
        of a short step, then move on."""
        assert not self.resumed, "take_pending first: a rewound state resumes from its checkpoint"
        last = self.history[-1] if self.history else None
        if inputs.shape[0] == 1 and last is not None and last.inputs is not None and last.reach == self.position \
                and last.inputs.shape[0] < REPLAY_TOKENS:
            # a one-token step joins the run of short steps before it: the state it started from is
            # not kept (the run's first state and inputs rebuild it), so decode steps and a local
            # draft model's drafts cost a checkpoint per REPLAY_TOKENS tokens, not one each; a
            # block of several tokens starts a run (a rejected draft inside it refolds only the
            # block's accepted tokens: bench/rollback.py)
            last.inputs = torch.cat((last.inputs, inputs))
        else:
            kept = inputs if inputs.shape[0] <= REPLAY_TOKENS else None
            self.history.append(Checkpoint(self.position, self.state, self.conv, kept))
        self.state, self.conv = state, conv
        self.position += inputs.shape[0]

    def step(self, inputs: torch.Tensor, fold: Fold) -> torch.Tensor:
        """Fold a step's inputs [T, replay_width] in with the layer's `fold`, after the inputs a rollback
        left pending (folded in again: the recurrence's work, no projection); the step's outputs."""
        pending = self.take_pending()
        if pending is not None:
            _, state, conv = fold(pending, self.state, self.conv)
            self.advance(pending, state, conv)
        out, state, conv = fold(inputs, self.state, self.conv)
        self.advance(inputs, state, conv)
        return out

    @property
    def nbytes(self) -> int:
        """What the store holds: the state and its checkpoints (`pending` is a slice of one's inputs;
        resumed, `state` is the last checkpoint's, counted once)."""
        own = 0 if self.resumed else self.state.nbytes + self.conv.nbytes
        return own + sum(c.nbytes for c in self.history)


def fold_sessions(inputs: torch.Tensor, segments: Sequence[Rows], cache: RecurrentState | Sequence[RecurrentState],
                  fold: Fold) -> torch.Tensor:
    """Each session's rows of a step [T, replay_width] folded into its own store (`RecurrentState.step`):
    `cache` is the session's store (`segments` empty: a step of one session), or one store per segment of
    a stacked step, each folded from its own state. The outputs in row order."""
    if not segments:
        assert isinstance(cache, RecurrentState), "one session: one store"
        return cache.step(inputs, fold)
    assert not isinstance(cache, RecurrentState) and len(cache) == len(segments), "one store per segment"
    return torch.cat([store.step(inputs[s.lo : s.hi], fold) for s, store in zip(segments, cache)])
