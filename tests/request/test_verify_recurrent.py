"""A spot check's checker goes back to the step it doubts: through a span with a recurrent layer it
is replayed from position 0 first, since such a state is kept only at its last steps."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tessera.peer.request.verify import Shadow, SpotChecker
from tessera.protocol.messages import REPLY_FINGERPRINT
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.recurrent import GatedDeltaNetSpec

LINEAR = LayerSpec(GatedDeltaNetSpec(2, 4, 8, 8, 4), MlpSpec(32))
FULL = LayerSpec(AttentionSpec(4, 2, 16), MlpSpec(32))
SPEC = ModelSpec("qwen3_5", 64, 32, (LINEAR, LINEAR, LINEAR, FULL))


def checker_over(spec: ModelSpec) -> tuple[SpotChecker, list[tuple[int, int, int]]]:
    calls: list[tuple[int, int, int]] = []
    checker = SpotChecker.__new__(SpotChecker)
    checker.swarm = SimpleNamespace(spec=spec)

    async def recompute(shadow, inputs, start_pos, *, reply):
        calls.append((start_pos, inputs.shape[0], reply))
        shadow.upto = start_pos + inputs.shape[0]

    checker.recompute = recompute
    return checker, calls


def history(rows: int) -> SimpleNamespace:
    """A session whose history holds `rows` positions at every boundary."""
    held = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 32)
    return SimpleNamespace(history=SimpleNamespace(at=lambda layer: SimpleNamespace(upto=lambda n: held[:n])))


async def test_a_recurrent_span_is_replayed_from_zero_and_a_kv_span_goes_back_by_itself():
    checker, calls = checker_over(SPEC)
    shadow = Shadow(session=None, checker="c", dtype="float32", upto=40)
    await checker.go_back(history(40), shadow, 0, 3, 17)  # three linear layers: replayed [0, 17) from 0
    assert calls == [(0, 17, REPLY_FINGERPRINT)] and shadow.upto == 17
    calls.clear()
    await checker.go_back(history(40), shadow, 0, 3, 17)  # already there: nothing
    await checker.go_back(history(40), Shadow(None, "c", "float32", upto=40), 3, 4, 17)  # full attention only
    await checker.go_back(history(40), Shadow(None, "c", "float32", upto=40), 0, 3, 0)  # position 0: reached as is
    assert calls == []
