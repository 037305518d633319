"""Compiled decode steps (stages/engine/compiled/) against the eager path and transformers, on CPU.

For every family the engine runs (llama, qwen3 with windows, biases and qk-norm, qwen3_moe with a
dense and a sparse layer kind, mixtral, gpt_oss with sinks, mimo_v2_flash with values narrower than keys;
deepseek_v3's MLA and glm_moe_dsa's DSA layers stay eager inside the compiled step, said so; gemma4 decodes
eagerly, tests/stages/families/test_gemma4.py), a tiny random model saved by transformers: the compiled
span's float32 logits within 1e-4 of transformers' and of the eager span's, greedy tokens
identical; sessions stacked in one compiled step (padded to a row bucket, of different capacities)
against their solo runs; draft blocks (eager) cut short and rolled back between compiled steps; the
local engine's whole step (embedding, layers, head, argmax) as one graph against transformers; a
graph that fails to compile split by kind. The CUDA-graph runner's
static slot step runs here too, uncaptured (`capture=False`: the same buffers, slots, padding and
eager islands a replay uses). Compiles stay small: three layers of width 64, one or two row buckets.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import trio

from tessera.stages.engine.compiled.build import compile_decode
from tessera.stages.engine.compiled.cuda_graphs import GraphDecode, group_halves
from tessera.stages.engine.compiled.inductor import HEAD, WHOLE, InductorDecode
from tessera.stages.engine.compiled.modes import CompileChoiceError, plan_compile
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage

from ..swarm_helpers import local_swarm
from .families.conformance import DECODE_STEPS, PROMPT, SHAPE, TOLERANCE, VOCAB, build, reference_run, until_eos

transformers = pytest.importorskip("transformers")

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE, intermediate_size=96),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, intermediate_size=96, use_sliding_window=True,
                                              sliding_window=8, max_window_layers=1, attention_bias=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, **MOE, mlp_only_layers=[0], norm_topk_prob=True),
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=8, num_experts_per_tok=2,
                                                  intermediate_size=32, sliding_window=8),
    # attention sinks, biased attention and experts, alternating sliding / full layers, YaRN
    "gpt_oss": lambda: transformers.GptOssConfig(**SHAPE, num_local_experts=8, num_experts_per_tok=2,
                                                 intermediate_size=32, sliding_window=8),
    # MLA: its layers decode eagerly inside the compiled step (no compiled step for the latent cache)
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{k: v for k, v in SHAPE.items() if k not in ("head_dim", "num_key_value_heads")}, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=1),
    # DSA: eager too, a layer reusing the selection the indexer layer before it made in the same step
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(
        **{k: v for k, v in SHAPE.items() if k not in ("head_dim", "num_key_value_heads")}, intermediate_size=96,
        moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, index_n_heads=8, index_head_dim=16, index_topk=6, indexer_types=["full", "shared", "full"],
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1),
    # values narrower than keys (12 against 16) and scaled, sinks in the sliding layers, partial RoPE per kind
    "mimo_v2_flash": lambda: transformers.MiMoV2FlashConfig(
        **SHAPE, v_head_dim=12, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "full_attention"], mlp_layer_types=["sparse"] * 3,
        rope_parameters={kind: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
                         for kind in ("full_attention", "sliding_attention")}),
}
EAGER_ATTENTION = {"deepseek_v3", "glm_moe_dsa"}  # families whose layer kinds all stay eager (MLA, DSA)
# llama also pads 3 rows to 4, and compiles what the swarm's peers (--batch-rows 2) ask for: from the disk cache
BUCKETS = {"llama": (1, 2, 4), "qwen3": (1,), "qwen3_moe": (1,), "mixtral": (1,), "gpt_oss": (1, 4), "deepseek_v3": (1,),
           "mimo_v2_flash": (1,),
           "glm_moe_dsa": (1, 4)}
WHOLE_STEP = {"llama", "qwen3_moe"}  # compiled as the local engine compiles (`whole`): one graph a token where it can
STACKED = [PROMPT, PROMPT[:5], PROMPT[:9]]  # three sessions at different positions
STEPS = 8
CLOSE = 2e-5  # compiled vs eager logits, relative to the row's largest: only the order of summation differs


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    return {name: build(root, name, config(), seed=40 + i) for i, (name, config) in enumerate(FAMILIES.items())}


@pytest.fixture(scope="module")
def compiled(folders):
    """Each family's whole model, compiled, with what its runner said."""
    out = {}
    for name, folder in folders.items():
        stage, said = load_stage(folder, embed=True, head=True), []
        plan = compile_decode(stage, "inductor", say=said.append, buckets=BUCKETS[name], whole=name in WHOLE_STEP)
        out[name] = (stage, plan, said)
    return out


def feed(stage: Stage, tokens: list[int]) -> list[torch.Tensor]:
    """Logits of PROMPT (prefill) then of each of `tokens` fed one step at a time."""
    stage.open("f", capacity=len(PROMPT) + len(tokens) + 1)
    logits, step, pos = [], PROMPT, 0
    for token in tokens:
        logits.append(stage.logits(stage.forward("f", stage.embed(step), pos))[-1:])
        pos, step = pos + len(step), [token]
    stage.close("f")
    return logits


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_compiled_matches_eager_and_transformers(folders, compiled, name):
    stage, plan, said = compiled[name]
    runner = stage.decode
    assert plan.backend == "inductor" and isinstance(runner, InductorDecode)
    kinds = set(stage.spec.layers)
    if name in EAGER_ATTENTION:  # said once per kind, with the reason; the head still compiled
        assert runner.compiled == {HEAD} and set(runner.eager) == kinds, said
        assert all(f"{kind.attention.kind} attention" in why for kind, why in runner.eager.items())
    else:
        assert not runner.eager, said  # every layer kind and the head compiled
        assert runner.compiled == kinds | {HEAD}
    tokens, ref = reference_run(folders[name])
    eager = load_stage(folders[name], embed=True, head=True)
    before = runner.steps
    ours, theirs = feed(stage, tokens), feed(eager, tokens)
    assert runner.steps - before == len(tokens) - 1  # every decode step compiled (the prefill eager)
    if name not in EAGER_ATTENTION:
        assert not runner.eager, said  # and no kind fell back at run time (a step that needed another compile)
    worst = max(float((a - b[-1:]).abs().max()) for a, b in zip(ours, ref))
    assert worst <= TOLERANCE, f"{name}: compiled vs transformers {worst:.3g}"
    assert max(gap(a, b) for a, b in zip(ours, theirs)) <= CLOSE
    from tessera.stages.decoding.generate import LocalEngine

    engine = LocalEngine(folders[name], device="cpu", dtype="float32")
    engine.stage = engine.head = stage  # the compiled span, through the engine's own greedy loop
    assert engine.generate_ids(PROMPT, max_new_tokens=len(tokens)) == until_eos(tokens)


def next_tokens(stage: Stage, tokens: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Stage.next_token's argmax and logits row for PROMPT, then for each of `tokens` fed in turn."""
    stage.open("n", capacity=len(PROMPT) + len(tokens) + 1)
    got, rows, step, pos = [], [], PROMPT, 0
    for token in tokens:
        row, best = stage.next_token("n", step, pos)
        got.append(best)
        rows.append(row[None])
        pos, step = pos + len(step), [token]
    stage.close("n")
    return got, rows


@pytest.mark.parametrize("name", sorted(WHOLE_STEP))
def test_the_whole_step_is_one_graph_and_exact(folders, compiled, name):
    """The local engine's one-token step, from token id through every layer, the final norm, the head
    and the argmax: one graph where every layer is in one run (llama), else the layers' graphs and the
    head's (qwen3_moe: its sparse layers break the run); transformers' tokens, logits within 1e-4."""
    stage, _, said = compiled[name]
    runner = stage.decode
    assert runner.whole == (name == "llama"), said
    tokens, ref = reference_run(folders[name])
    before = runner.steps
    got, rows = next_tokens(stage, tokens)
    assert runner.steps - before == len(tokens) - 1  # every decode step compiled (the prefill eager)
    assert got == tokens  # the graph's argmax is transformers' greedy token
    worst = max(float((a - b[-1:]).abs().max()) for a, b in zip(rows, ref))
    assert worst <= TOLERANCE, f"{name}: the whole step vs transformers {worst:.3g}"
    eager = load_stage(folders[name], embed=True, head=True)
    assert max(gap(a, b) for a, b in zip(rows, next_tokens(eager, tokens)[1])) <= CLOSE
    assert WHOLE not in runner.eager and not runner.eager, said


def solo_tokens(stage: Stage, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    stage.open("solo", capacity=64)
    hidden, tokens, logits = stage.forward("solo", stage.embed(prompt), 0), [], []
    for _ in range(n):
        logits.append(stage.logits(hidden[-1:]))
        tokens.append(int(logits[-1].argmax()))
        hidden = stage.forward("solo", stage.embed(tokens[-1:]), len(prompt) + len(tokens) - 1)
    stage.close("solo")
    return tokens, logits


def stacked_tokens(stage: Stage, prompts: list[list[int]], n: int, capacity: int = 64
                   ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Every session prefilled alone, then decoded together: one stacked step per token. Each
    session's capacity differs (from `capacity` down), as a peer's sessions' do."""
    tokens: list[list[int]] = []
    logits: list[list[torch.Tensor]] = []
    for i, prompt in enumerate(prompts):
        stage.open(("s", i), capacity=capacity - i)
        row = stage.logits(stage.forward(("s", i), stage.embed(prompt), 0)[-1:])
        tokens.append([int(row.argmax())])
        logits.append([row])
    for _ in range(n - 1):
        outs = stage.forward_batch([(("s", i), stage.embed(t[-1:]), len(p) + len(t) - 1)
                                    for i, (p, t) in enumerate(zip(prompts, tokens))])
        rows = stage.logits(torch.cat(outs))  # several rows through the head at once, as a requester's batch
        for i in range(len(prompts)):
            logits[i].append(rows[i : i + 1])
            tokens[i].append(int(rows[i].argmax()))
    for i in range(len(prompts)):
        stage.close(("s", i))
    return tokens, logits


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gpt_oss", "glm_moe_dsa"])
def test_stacked_compiled_steps_equal_solo_runs(folders, compiled, name):
    stage, _, _ = compiled[name]
    eager = load_stage(folders[name], embed=True, head=True)
    solo = [solo_tokens(eager, prompt, STEPS) for prompt in STACKED]
    prompts = STACKED if max(BUCKETS[name]) > 1 else STACKED[:1]  # a one-row bucket stacks nothing
    before = stage.decode.steps
    tokens, logits = stacked_tokens(stage, prompts, STEPS)
    assert stage.decode.steps - before == STEPS - 1
    assert not set(stage.decode.eager) - {k for k in stage.spec.layers if k.attention.kind != "gqa"}  # none fell back
    assert tokens == [t for t, _ in solo[: len(prompts)]]
    assert max(gap(a, b) for i in range(len(prompts)) for a, b in zip(logits[i], solo[i][1])) <= CLOSE


def test_rollback_between_compiled_steps(compiled):
    """Draft blocks (several tokens: eager) verified between compiled one-token steps, every other one
    cut short: the cut positions are overwritten by the next write, compiled or not."""
    stage, _, _ = compiled["qwen3"]
    want, _ = solo_tokens(stage, PROMPT, STEPS + 4)
    stage.open("r", capacity=64)
    seq = PROMPT + [int(stage.logits(stage.forward("r", stage.embed(PROMPT), 0))[-1].argmax())]
    blocks = 0
    while len(seq) - len(PROMPT) < len(want):
        done = len(seq) - len(PROMPT)
        if blocks % 2:  # a block of 3 drafts, the last wrong: two kept, the rest rolled back by the next write
            draft = list(want[done : done + 3])
            draft[-1] = (draft[-1] + 1) % VOCAB
            rows = stage.logits(stage.forward("r", stage.embed([seq[-1], *draft]), len(seq) - 1))
            kept = next((j for j, d in enumerate(draft) if int(rows[j].argmax()) != d), len(draft))
            seq += draft[:kept] + [int(rows[kept].argmax())]
        else:  # one compiled step
            seq.append(int(stage.logits(stage.forward("r", stage.embed(seq[-1:]), len(seq) - 1))[-1].argmax()))
        blocks += 1
    stage.close("r")
    assert seq[len(PROMPT):][: len(want)] == want


def test_a_kind_that_fails_to_compile_runs_eagerly_and_says_so_once(folders, monkeypatch):
    """qwen3_moe has two layer kinds; the sparse one's compile fails: it decodes eagerly, the dense
    one compiled, the output unchanged, one line said. A step that would need another compile at
    run time (forbidden) leaves its kind eager too, with one line."""
    stage, said = load_stage(folders["qwen3_moe"], embed=True, head=True), []
    runner = InductorDecode(stage, buckets=(1,), say=said.append)
    real = runner._warm

    def failing(piece, rows, **kwargs):
        if any(runner.kinds[i].mlp.kind == "moe" for i in range(piece.lo, piece.hi)):
            raise RuntimeError("no lowering for this\nsecond line")
        return real(piece, rows, **kwargs)

    monkeypatch.setattr(runner, "_warm", failing)
    runner.compile()
    stage.decode = runner
    sparse = next(k for k in stage.spec.layers if k.mlp.kind == "moe")
    assert sparse not in runner.compiled and "RuntimeError: no lowering for this" in runner.eager[sparse]
    assert [line for line in said if "eagerly" in line] == [f"layer kind gqa + moe decodes eagerly: {runner.eager[sparse]}"]
    assert [(p.lo, p.hi, p.fn is not None) for p in runner.pieces] == [(0, 1, True), (1, 2, False), (2, 3, False)]
    eager = load_stage(folders["qwen3_moe"], embed=True, head=True)
    tokens, _ = solo_tokens(eager, PROMPT, STEPS)
    assert solo_tokens(stage, PROMPT, STEPS)[0] == tokens

    def recompiles(*args, **kwargs):
        raise torch._dynamo.exc.RecompileError("Detected recompile when torch.compile stance is 'fail_on_recompile'")

    for piece in runner.pieces:
        if piece.fn is not None:
            piece.fn = recompiles
    assert solo_tokens(stage, PROMPT, STEPS)[0] == tokens
    assert solo_tokens(stage, PROMPT, STEPS)[0] == tokens
    assert not runner.compiled - {HEAD}
    assert sum("another compile" in line for line in said) == 1  # the dense kind, said once


def test_a_graph_that_fails_is_split_by_kind(folders, monkeypatch):
    """qwen3's sliding and full layers are one run, one graph. When the sliding kind cannot compile,
    the run's compile fails; each kind alone is tried: the sliding one decodes eagerly (said once),
    the full one stays compiled, in a graph of its own, and the answer is the eager one's."""
    stage, said = load_stage(folders["qwen3"], embed=True, head=True), []
    runner = InductorDecode(stage, buckets=(1,), say=said.append)
    real = runner._warm
    sliding = next(k for k in stage.spec.layers if k.attention.window is not None)

    def failing(piece, rows, **kwargs):
        if any(runner.kinds[i] == sliding for i in range(piece.lo, piece.hi)):
            raise RuntimeError("windows are hard")
        return real(piece, rows, **kwargs)

    monkeypatch.setattr(runner, "_warm", failing)
    runner.compile()
    stage.decode = runner
    assert set(runner.eager) == {sliding} and "RuntimeError: windows are hard" in runner.eager[sliding]
    assert runner.compiled == set(stage.spec.layers) - {sliding} | {HEAD}
    assert sum("decodes eagerly" in line for line in said) == 1
    assert all(p.fn is not None for p in runner.pieces if runner.kinds[p.lo] != sliding)
    eager = load_stage(folders["qwen3"], embed=True, head=True)
    before = runner.steps
    assert solo_tokens(stage, PROMPT, STEPS)[0] == solo_tokens(eager, PROMPT, STEPS)[0]
    assert runner.steps - before == STEPS  # each a step of the compiled runner


def test_a_sub_span_session_decodes_eagerly_on_a_compiled_stage(compiled, folders):
    """A session over part of the stage (a repair's other cut) has no graph: its steps run eagerly,
    and equal an eager stage's."""
    stage, _, _ = compiled["llama"]
    eager = load_stage(folders["llama"], embed=True, head=True)
    outs, before = [], stage.decode.steps
    for s in (stage, eager):
        s.open("part", capacity=32, start=0, end=2)
        hidden = s.forward("part", s.embed(PROMPT), 0)
        outs.append([hidden] + [s.forward("part", hidden[-1:], len(PROMPT) + i) for i in range(3)])
        s.close("part")
    assert all(gap(a, b) <= CLOSE for a, b in zip(*outs))
    assert stage.decode.steps == before


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "gpt_oss", "mimo_v2_flash"])
def test_slot_step_matches_eager(folders, name):
    """The CUDA-graph runner's step, uncaptured: slots of a static pool, positions as tensors, a
    length bucket, 3 sessions padded to 4 rows, a sparse MLP between the graph pieces."""
    stage = load_stage(folders[name], embed=True, head=True)
    runner = GraphDecode(stage, buckets=(1, 4), capacity=32, capture=False)
    runner.lengths = (16, 32)  # two length buckets: the sessions cross from the first to the second
    runner.compile()
    stage.decode = runner
    if name == "qwen3_moe":  # dense first layer, then sparse: graph, eager island, graph
        bucket = runner.captured[(1, 16)]
        assert [piece.captured for piece in bucket.pieces] == [True, False, True, False]
    eager = load_stage(folders[name], embed=True, head=True)
    solo = [solo_tokens(eager, prompt, STEPS) for prompt in STACKED]
    tokens, logits = stacked_tokens(stage, STACKED, STEPS, capacity=32)
    assert runner.steps == STEPS - 1
    assert tokens == [t for t, _ in solo]
    assert max(gap(a, b) for i in range(len(STACKED)) for a, b in zip(logits[i], solo[i][1])) <= CLOSE
    assert sorted(runner.pool.free) == [0, 1, 2, 3]  # every slot given back as its session closed
    stage.open("long", capacity=40)  # longer than the pool: its own cache, eager steps
    assert "long" in stage.sessions and stage.sessions["long"].cache not in runner.pool.slot_of


def test_halves_group_into_graph_pieces():
    plan = [("attention", 0), ("mlp", 0), ("attention", 1), ("mlp", 1), ("attention", 2), ("mlp", 2)]
    sparse = {1}
    runs = group_halves(plan, lambda h: h[0] == "attention" or h[1] not in sparse)
    assert runs == [([("attention", 0), ("mlp", 0), ("attention", 1)], True), ([("mlp", 1)], False),
                    ([("attention", 2), ("mlp", 2)], True)]


def test_compile_modes():
    assert plan_compile("auto", "cpu").backend == "inductor"
    assert plan_compile("auto", "cpu", quantized=True).backend is None
    assert plan_compile("auto", "cuda").backend == "cuda-graphs"
    assert plan_compile("auto", "mps").backend is None
    assert plan_compile("off", "cuda").backend is None
    assert plan_compile("inductor", "cuda").backend == "inductor"
    with pytest.raises(CompileChoiceError, match="needs a CUDA device"):
        plan_compile("cuda-graphs", "cpu")
    with pytest.raises(CompileChoiceError, match="'fast' is not one of"):
        plan_compile("fast", "cpu")


@pytest.mark.slow
async def test_compiled_peers_serve_exact_answers(folders, compiled):
    """Peers that compile their spans (--compile inductor, --batch-rows 2: row buckets 1 and 2), every
    layer held twice (one peer, and two that split it): a plain answer, two answers at once (stacked in one compiled step on each peer),
    a speculative one (draft blocks rolled back on every peer) and one whose first peer is killed
    mid-answer (its inputs replayed on the other copy) are each transformers' greedy tokens."""
    from tessera.peer.request.client import Swarm
    from tessera.peer.request.decode import Speculation
    from tessera.stages.decoding.speculative import AdaptiveK, ModelDrafter

    folder = folders["llama"]
    want = until_eos(reference_run(folder)[0])
    spans = [(0, 3), (0, 1), (1, 3)]
    with local_swarm(spans, model=str(folder), extra=["--compile", "inductor", "--batch-rows", "2"]) as peers:
        for i in range(len(spans)):
            assert "decode steps: inductor" in peers.log(i), peers.log(i)[-2000:]
        async with Swarm.join(peers.addrs[:1], model=folder) as swarm:
            await swarm.wait_for_route(60)
            assert [t async for t in swarm.generate_ids(PROMPT, max_new_tokens=DECODE_STEPS)] == want
            together: list[list[int]] = [[], []]

            async def answer(i: int) -> None:
                together[i] = [t async for t in swarm.generate_ids(PROMPT, max_new_tokens=DECODE_STEPS)]

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(answer, i)
            assert together == [want, want]
            draft = load_stage(folder, start=0, end=1, embed=True, head=True)
            speculation = Speculation(ModelDrafter(draft, capacity=64), k=AdaptiveK(3, backoff_after=10**9),
                                      pipeline=False)
            assert [t async for t in swarm.generate_ids(PROMPT, max_new_tokens=DECODE_STEPS,
                                                        speculation=speculation)] == want
            assert speculation.proposed > 0
            info: dict = {}
            tokens: list[int] = []
            async for token in swarm.generate_ids(PROMPT, max_new_tokens=DECODE_STEPS, info=info):
                tokens.append(token)
                if len(tokens) == 5:
                    (session,) = swarm.active
                    first = session.current.hops[0].peer
                    peers.kill(next(i for i, addr in enumerate(peers.addrs) if addr.endswith(first)))
            assert tokens == want and info["failovers"] == 1
        for i in range(len(spans)):  # every step of every peer ran compiled: none fell back
            assert "decodes eagerly" not in peers.log(i), peers.log(i)[-2000:]


def test_an_eager_peer_does_not_import_the_compiler():
    """torch._dynamo costs a second and a half of start-up; only a compiled stage needs it (a sparse
    MLP's dispatch is marked for it on first use, layers/moe.py `untraced_dispatch`)."""
    code = ("import sys; import tessera.peer.node.torch_compute, tessera.peer.request.client, "
            "tessera.stages.decoding.generate; print('torch._dynamo' in sys.modules)")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "False", ran.stderr[-2000:]
