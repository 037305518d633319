"""CUDA graphs (stages/engine/compiled/cuda_graphs.py) on a real GPU; skipped without one.

The runner's logic (slots, padding, length buckets, eager islands) is checked on any machine by
tests/stages/test_compiled.py with capture off; here the captured graphs themselves: SmolLM2 in
float32 (TF32 off) replayed against the eager path on the same GPU (greedy tokens equal, logits to
1e-3 relative, as bench/gpu.py holds float32 on a GPU), three sessions stacked against their solo
runs, and a bf16 span replaying every step."""

from __future__ import annotations

import pytest
import torch

from tessera.stages.engine.compiled.build import compile_decode
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 3365, 3511, 28, 7018, 411, 407, 19712, 8182, 2]
STEPS = 16
FLOAT32_GPU = 1e-3


def greedy(stage: Stage, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    stage.open("g", capacity=len(prompt) + n)
    logits = [stage.logits(stage.forward("g", stage.embed(prompt), 0)[-1:]).cpu()]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < n:
        logits.append(stage.logits(stage.forward("g", stage.embed(tokens[-1:]), len(prompt) + len(tokens) - 1)).cpu())
        tokens.append(int(logits[-1].argmax()))
    stage.close("g")
    return tokens, torch.cat(logits)


@pytest.fixture(scope="module")
def float32_stage(smol_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    stage = load_stage(smol_dir, embed=True, head=True, device="cuda", dtype=torch.float32)
    plan = compile_decode(stage, "cuda-graphs", buckets=(1, 4))
    assert plan.backend == "cuda-graphs" and stage.decode is not None and not stage.decode.eager
    return stage


def test_graphs_replay_the_eager_step(float32_stage):
    stage, runner = float32_stage, float32_stage.decode
    before = runner.steps
    tokens, logits = greedy(stage, PROMPT, STEPS)
    assert runner.steps - before == STEPS - 1
    stage.decode = None
    want, eager = greedy(stage, PROMPT, STEPS)
    stage.decode = runner
    assert tokens == want
    assert float((logits - eager).abs().max() / eager.abs().max()) <= FLOAT32_GPU


def test_stacked_sessions_replay_their_solo_runs(float32_stage):
    stage, runner = float32_stage, float32_stage.decode
    prompts = [PROMPT, PROMPT[:7], PROMPT[:12]]
    solo = [greedy(stage, p, 8)[0] for p in prompts]
    for i, p in enumerate(prompts):
        stage.open(i, capacity=len(p) + 8)
    tokens = [[int(stage.logits(stage.forward(i, stage.embed(p), 0)[-1:]).argmax())] for i, p in enumerate(prompts)]
    before = runner.steps
    for _ in range(7):
        outs = stage.forward_batch([(i, stage.embed(t[-1:]), len(p) + len(t) - 1)
                                    for i, (p, t) in enumerate(zip(prompts, tokens))])
        for t, out in zip(tokens, outs):
            t.append(int(stage.logits(out).argmax()))
    for i in range(len(prompts)):
        stage.close(i)
    assert runner.steps - before == 7  # three rows padded to the 4-row graph
    assert tokens == solo


def test_a_bfloat16_span_replays_every_step(smol_dir):
    stage = load_stage(smol_dir, start=0, end=10, device="cuda", dtype=torch.bfloat16)
    compile_decode(stage, "auto", buckets=(1,))
    stage.open("b", capacity=64)
    stage.forward("b", torch.randn(20, stage.spec.hidden_size), 0)
    for pos in range(20, 30):
        out = stage.forward("b", torch.randn(1, stage.spec.hidden_size), pos)
        assert out.shape == (1, stage.spec.hidden_size) and bool(torch.isfinite(out).all())
    assert stage.decode.steps == 10
