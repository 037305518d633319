"""A recurrent session state (stages/layers/state.py) goes back only where its checkpoints reach.

Checkpoints are kept per run of steps: a long step (a prefill chunk) alone, without its inputs;
short steps together, with theirs, up to REPLAY_TOKENS tokens.

Driven by a real Gated DeltaNet layer's fold: the state after going back to a position and folding
the same inputs on equals a state that never went past it (to float rounding), wherever the store
reaches; anywhere else is refused with one line and moves nothing; position 0 always starts afresh.
"""

from __future__ import annotations

import pytest
import torch

from tessera.stages.errors import StateRewindError
from tessera.stages.families.spec.recurrent import RECURRENT_CHECKPOINTS, REPLAY_TOKENS, GatedDeltaNetSpec
from tessera.stages.layers.recurrent.gated_deltanet import GatedDeltaNet
from tessera.stages.layers.state import RecurrentState

SPEC = GatedDeltaNetSpec(2, 4, 8, 8, 4)


@pytest.fixture(scope="module")
def layer() -> GatedDeltaNet:
    torch.manual_seed(0)
    module = GatedDeltaNet(32, SPEC, 1e-6)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return module.requires_grad_(False)


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, SPEC.cache.replay_width, generator=torch.Generator().manual_seed(seed))


def store() -> RecurrentState:
    return RecurrentState(SPEC.cache, dtype=torch.float32, device="cpu")


def straight(layer: GatedDeltaNet, inputs: torch.Tensor) -> torch.Tensor:
    """The state after folding `inputs` in one step from a fresh store."""
    s = store()
    layer.step(inputs, s)
    return s.state


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= 1e-5


@torch.inference_mode()
def test_going_back_into_either_of_the_last_two_runs_equals_never_going_past(layer):
    prefill, first, second = rows(20, 1), rows(9, 2), rows(9, 3)
    s = store()
    for step in (prefill, first, second):
        layer.step(step, s)
    # two blocks of 9: a run each (18 > REPLAY_TOKENS); the prefill's checkpoint has made way
    assert s.position == 38 and [(c.start, c.reach) for c in s.history] == [(20, 29), (29, 38)]
    s.rewind(22)  # into the older block: 2 of its tokens kept, the later block undone
    assert s.reachable(21) and s.reachable(20) and not s.reachable(30) and not s.reachable(19)
    s.rewind(21)  # again, before any step: the same checkpoint still reaches
    tail = rows(4, 4)
    layer.step(tail, s)
    assert s.position == 25
    assert close(s.state, straight(layer, torch.cat([prefill, first[:1], tail])))
    s.rewind(23)  # inside the run the refolded token and the tail now make
    layer.step(rows(1, 5), s)
    assert close(s.state, straight(layer, torch.cat([prefill, first[:1], tail[:2], rows(1, 5)])))


@torch.inference_mode()
def test_a_rewind_out_of_reach_is_refused_and_moves_nothing_and_zero_starts_afresh(layer):
    s = store()
    for n, seed in ((REPLAY_TOKENS + 4, 1), (3, 2), (3, 3)):
        layer.step(rows(n, seed), s)
    state, position = s.state, s.position
    assert not s.reachable(10) and not s.reachable(REPLAY_TOKENS + 4 - 1)  # a long step's inside, an older step
    with pytest.raises(StateRewindError, match="cannot go back to position 10") as refused:
        s.rewind(10)
    assert "\n" not in str(refused.value) and s.state is state and s.position == position
    s.rewind(0)
    assert s.position == 0 and not s.history and float(s.state.abs().max()) == 0.0
    layer.step(rows(7, 9), s)
    assert close(s.state, straight(layer, rows(7, 9)))


@torch.inference_mode()
def test_a_long_step_keeps_no_inputs_but_its_start_and_its_end_are_reached(layer):
    s = store()
    layer.step(rows(4, 1), s)
    layer.step(rows(REPLAY_TOKENS + 1, 2), s)  # a prefill chunk: no inputs kept
    assert s.history[-1].inputs is None
    assert s.reachable(4) and not s.reachable(5) and s.reachable(4 + REPLAY_TOKENS + 1)
    s.rewind(4)
    layer.step(rows(2, 3), s)
    assert close(s.state, straight(layer, torch.cat([rows(4, 1), rows(2, 3)])))


@torch.inference_mode()
def test_what_a_store_holds_stays_within_what_admission_charges(layer):
    s = store()
    for n in (30, 9, 9, 1, 9, 1, 1):
        layer.step(rows(n, n), s)
        assert s.nbytes <= SPEC.cache.fixed_bytes(4)
    assert len(s.history) == RECURRENT_CHECKPOINTS


@torch.inference_mode()
def test_one_token_steps_share_a_checkpoint_so_a_draft_model_goes_back_past_several(layer):
    """A local draft model feeds its drafts one token a step, then goes back to where they diverged:
    one-token steps join one run, so every position of the last REPLAY_TOKENS or more is reached."""
    s = store()
    layer.step(rows(REPLAY_TOKENS + 4, 1), s)
    singles = [rows(1, 10 + i) for i in range(8)]
    for one in singles:
        layer.step(one, s)
    assert len(s.history) == 2 and all(s.reachable(p) for p in range(REPLAY_TOKENS + 4, s.position + 1))
    s.rewind(REPLAY_TOKENS + 5)  # seven one-token steps back
    layer.step(rows(1, 99), s)
    assert close(s.state, straight(layer, torch.cat([rows(REPLAY_TOKENS + 4, 1), singles[0], rows(1, 99)])))
