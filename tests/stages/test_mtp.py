"""Drafting with the model's own multi-token-prediction module (`--speculate mtp`), locally.

The module against transformers' own MTP implementation (`MtpModel`, loaded from the same
checkpoint: tests/stages/mtp_helpers.py) for DeepSeek-V3, GLM-4.5 and Qwen3.5-MoE, float32 logits
within 1e-4 over a prompt's pairs and chained steps; against the published formula computed by
hand for GLM-5 (transformers' MTP loader does not run its indexed attention) and for the
projection's two orders. The drafter's state is a function of what the model returned: drafts
after any run of verified blocks (rejected tails, guesses past the rows returned, written-over
rows) equal a fresh drafter's shown the same history. Greedy answers drafted by it and verified
by the model are the local answer token for token, plain and pipelined. Refusals in one line: a
model with no MTP layers, a folder without their tensors, an MTP tensor not computed here.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from tessera.peer.request.decode import Speculation, speculative_tokens
from tessera.stages.assembly.mtp import load_mtp
from tessera.stages.assembly.stage import load_stage
from tessera.stages.decoding.generate import LocalEngine
from tessera.stages.decoding.mtp import MtpDrafter
from tessera.stages.decoding.sampling import Sampler, SamplingParams
from tessera.stages.decoding.speculative import AdaptiveK
from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import mtp_of
from tessera.stages.layers.mtp import MtpEnds

from ..request.test_speculation import LocalChain
from .families.conformance import SHAPE, build
from .families.rows import ROWS
from .mtp_helpers import INDEX_FILE, add_mtp, transformers_mtp

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
# the swarm test's Qwen3.5-MoE shape (tests/swarm/test_hybrid_swarm.py): layers 0-2 Gated DeltaNet, 3 full
HYBRID_MOE = dict(SHAPE, num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48)
PROMPT = [5, 17, 260, 42, 99, 3, 250, 7, 17, 260, 42, 12, 64, 5, 17]
TOKENS = 20


def with_mtp(root, name: str, config, *, seed: int):
    return add_mtp(build(root, name, config, seed=seed), seed=seed + 1000)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The Qwen3.5-MoE-shaped tiny model with one MTP module."""
    return with_mtp(tmp_path_factory.mktemp("mtp"), "qwen3_5_moe", transformers.Qwen3_5MoeTextConfig(**HYBRID_MOE),
                    seed=71)


@pytest.fixture(scope="module")
def hybrid_parts(hybrid):
    """(the whole model as one stage with its edges, its MTP module over those edges)."""
    stage = load_stage(hybrid, embed=True, head=True)
    return stage, load_mtp(hybrid, stage)


def model_rows(stage, tokens: list[int]) -> torch.Tensor:
    """The model's last-layer rows (before the final norm) of `tokens` from position 0."""
    stage.open("rows", capacity=len(tokens) + 1)
    try:
        return stage.forward("rows", stage.embed(tokens), 0)
    finally:
        stage.close("rows")


# -- the module against transformers' MTP, and against the formula by hand ---------------------------


ORACLE_ROWS = {
    "deepseek_v3": ("deepseek_v3/lora-groups-shared-yarn", None),
    "glm4_moe": ("glm4_moe/qknorm-bias-groups-shared", None),
    "qwen3_5_moe": (None, lambda: transformers.Qwen3_5MoeTextConfig(**HYBRID_MOE)),
}


@pytest.mark.parametrize("family", sorted(ORACLE_ROWS))
def test_the_module_matches_transformers_mtp(tmp_path, family):
    """Pairs (h_i, t_{i+1}) of a prompt in one step, then two chained one-pair steps (the module's own output
    beside the next token), each step's logits within 1e-4 of transformers' `MtpModel` fed alike; and the
    hidden states it reads (the model's last rows after the final norm) transformers' to 1e-4."""
    row, config = ORACLE_ROWS[family]
    config = ROWS[row].config() if row else config()
    folder = with_mtp(tmp_path, family, config, seed=ROWS[row].seed if row else 71)
    main, oracle, cache = transformers_mtp(folder)
    ids = torch.tensor([PROMPT[:10]])
    n = ids.shape[1] - 1
    stage = load_stage(folder, embed=True, head=True)
    mtp = load_mtp(folder, stage)
    mtp.open("s", capacity=32)
    worst = 0.0
    with torch.inference_mode():
        h = main(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm, as transformers feeds it
        theirs = oracle.forward_layer(0, h[:, :n], torch.arange(1, n + 1)[None], cache, input_ids=ids[:, 1:])
        # the module reads what the model's own rows give after its final norm: transformers' h, to rounding
        normed = mtp.final_norm(model_rows(stage, PROMPT[:10])[:n])
        assert float((normed - h[0, :n]).abs().max()) <= TOLERANCE
        ours = mtp.forward("s", PROMPT[1:10], h[0, :n], 0)  # fed alike: the module's own rounding is compared
        worst = max(worst, float((oracle._project_to_logits(theirs)[0] - mtp.logits(ours)).abs().max()))
        for step, token in enumerate((33, 71)):  # the chain: o stands for the next position's hidden state
            theirs = oracle.forward_layer(0, theirs[:, -1:], torch.tensor([[n + 1 + step]]), cache,
                                          input_ids=torch.tensor([[token]]))
            ours = mtp.forward("s", [token], ours[-1:], n + step)
            worst = max(worst, float((oracle._project_to_logits(theirs)[0] - mtp.logits(ours)).abs().max()))
    assert worst <= TOLERANCE, f"{family}: max |logits diff| {worst:.3g}"


def tensor(folder, name: str) -> torch.Tensor:
    import json

    file = json.loads((folder / INDEX_FILE).read_text())["weight_map"][name]
    with safe_open(folder / file, framework="pt") as f:
        return f.get_tensor(name).float()


def test_the_module_is_the_published_formula_for_glm5(tmp_path):
    """GLM-5 (transformers does not run its MTP layer): logits = W_head · norm_out(block(W_proj [enorm(e); hnorm(h)]))
    with h the model's last hidden state after its final norm, each tensor read by hand from the checkpoint (the
    embedding and head the model's own, not the copies beside the module) and the block a DSA layer of its own indexer."""
    row = ROWS["glm_moe_dsa/shared-groups-yarn"]
    folder = with_mtp(tmp_path, "glm_moe_dsa", row.config(), seed=row.seed)
    stage = load_stage(folder, embed=True, head=True)
    mtp = load_mtp(folder, stage)
    spec = mtp_of(stage.spec)
    assert spec.block.attention.kind == "dsa" and not spec.block.attention.shared and spec.block.mlp.kind == "moe"
    n, eps = 9, stage.spec.rms_norm_eps
    hidden = model_rows(stage, PROMPT[: n + 1])[:n]
    mtp.open("s", capacity=32)
    ours = mtp.logits(mtp.forward("s", PROMPT[1 : n + 1], mtp.final_norm(hidden), 0))

    def norm(x, name):
        return F.rms_norm(x, (x.shape[-1],), tensor(folder, name), eps)

    h = norm(hidden, "model.norm.weight")
    e = tensor(folder, "model.embed_tokens.weight")[PROMPT[1 : n + 1]]
    x = torch.cat((norm(e, spec.embed_norm), norm(h, spec.hidden_norm)), -1) @ tensor(folder, spec.proj).T
    mtp.block.open("hand", capacity=32)
    y = mtp.block.forward("hand", x, 0)  # the DSA layer (tested against transformers by the conformance suite)
    expected = norm(y, spec.out_norm) @ tensor(folder, "lm_head.weight").T
    assert float((ours - expected).abs().max()) <= TOLERANCE


def test_the_projection_reads_the_halves_in_the_order_the_checkpoint_says():
    torch.manual_seed(3)
    e, h = torch.randn(4, 8), torch.randn(4, 8)
    for hidden_first in (False, True):
        ends = MtpEnds(8, 1e-6, hidden_first=hidden_first)
        with torch.no_grad():
            for p in ends.parameters():
                p.copy_(torch.randn_like(p))
        ne = F.rms_norm(e, (8,), ends.embed_norm.weight, 1e-6)
        nh = F.rms_norm(h, (8,), ends.hidden_norm.weight, 1e-6)
        halves = (nh, ne) if hidden_first else (ne, nh)
        torch.testing.assert_close(ends.into_block(e, h), torch.cat(halves, -1) @ ends.proj.weight.T)


# -- the drafter's state ------------------------------------------------------------------------------


def test_drafts_after_any_history_are_a_fresh_drafters(hybrid_parts):
    """A drafter led through verified blocks (a random number of drafts kept, the rest rows that are then
    written over), proposals guessed past the rows returned (a pipelined block's), and a prompt shown again
    drafts exactly what a fresh drafter shown the same accepted history drafts: nothing of a rejected draft
    or of a guess stays in the module's cache."""
    stage, mtp = hybrid_parts
    rng = random.Random(5)
    tokens = list(PROMPT)
    drafter = MtpDrafter(mtp, capacity=128)
    drafter.observe(0, tokens, model_rows(stage, tokens))
    tokens.append(int(stage.logits(model_rows(stage, tokens)[-1:])[-1].argmax()))
    checked = 0
    try:
        for _ in range(10):
            if rng.random() < 0.4:  # a guess past the rows returned: the next block drafted before this one returns
                drafter.propose(tokens + [rng.randrange(300) for _ in range(rng.randrange(1, 4))], rng.randrange(1, 4))
            k = rng.randrange(1, 5)
            draft = drafter.propose(tokens, k).tokens
            fresh = MtpDrafter(mtp, capacity=128, session="fresh")
            fresh.observe(0, tokens[:-1], model_rows(stage, tokens[:-1]))
            assert fresh.propose(tokens, k).tokens == draft
            fresh.close()
            checked += 1
            # verification: the block [last, drafts...] runs; a random number of drafts is "kept" (whatever the
            # model says: only the drafter's state is under test), then the model's own token
            kept = rng.randrange(0, len(draft) + 1)
            fed = [tokens[-1], *draft]
            rows = model_rows(stage, tokens[:-1] + fed)[len(tokens) - 1 :]
            drafter.observe(len(tokens) - 1, fed, rows)
            tokens += draft[:kept]
            tokens.append(int(stage.logits(model_rows(stage, tokens)[-1:])[-1].argmax()))
    finally:
        drafter.close()
    assert checked == 10


# -- greedy answers through drafts are the local answer ------------------------------------------------


@pytest.fixture(scope="module")
def expected(hybrid):
    tokens = LocalEngine(hybrid, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)
    assert len(tokens) == TOKENS
    return tokens


@pytest.mark.parametrize("k,pipeline", [(1, False), (4, False), (3, True)], ids=["k1", "k4", "k3-pipelined"])
async def test_greedy_drafted_by_the_mtp_module_is_the_local_answer(hybrid_parts, expected, k, pipeline):
    stage, mtp = hybrid_parts

    async def embed(t):
        return stage.embed(list(t))

    async def head(h):
        return stage.logits(h)

    chain = LocalChain(stage)
    drafter = MtpDrafter(mtp, capacity=256)
    spec = Speculation(drafter, k=AdaptiveK(k, backoff_after=10**9), pipeline=pipeline)
    try:
        got = [t async for t in speculative_tokens(chain, embed, head, PROMPT, TOKENS, Sampler(SamplingParams()), (),
                                                    spec)]
    finally:
        stage.close("chain")
        drafter.close()
    print(f"mtp k={k} pipeline={pipeline}: accepted {spec.accepted} of {spec.proposed} drafted")
    assert got == expected
    assert spec.proposed >= TOKENS // (k + 1)  # it drafted, and the drafts were verified (most rejected: random weights)


@pytest.mark.parametrize("row", ["deepseek_v3/lora-groups-shared-yarn", "glm_moe_dsa/shared-groups-yarn"],
                         ids=["deepseek_v3", "glm_moe_dsa"])
async def test_greedy_drafted_by_deepseek_and_glm5_mtp_modules_is_the_local_answer(tmp_path, row):
    """The nextn layout's module (an MLA block; GLM-5's a DSA block with its own indexer) drafting, pipelined."""
    folder = with_mtp(tmp_path, row.split("/")[0], ROWS[row].config(), seed=ROWS[row].seed)
    want = LocalEngine(folder, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=12)
    stage = load_stage(folder, embed=True, head=True)

    async def embed(t):
        return stage.embed(list(t))

    async def head(h):
        return stage.logits(h)

    drafter = MtpDrafter(load_mtp(folder, stage), capacity=128)
    spec = Speculation(drafter, k=AdaptiveK(3, backoff_after=10**9), pipeline=True)
    got = [t async for t in speculative_tokens(LocalChain(stage), embed, head, PROMPT, len(want),
                                                Sampler(SamplingParams()), (), spec)]
    assert got == want and spec.proposed > 0


# -- refusals -----------------------------------------------------------------------------------------


def test_a_model_without_mtp_layers_is_refused_in_one_line(tiny_llama):
    stage = load_stage(tiny_llama, start=0, end=0, embed=True, head=True)
    with pytest.raises(UnsupportedModel, match="has no multi-token-prediction .* --speculate mtp") as bad:
        load_mtp(tiny_llama, stage)
    assert "\n" not in str(bad.value)


def test_a_folder_without_the_mtp_tensors_is_refused_in_one_line(tmp_path):
    row = ROWS["deepseek_v3/plain-q-raw-fused"]  # transformers counts one MTP layer and saves none
    folder = build(tmp_path, "deepseek", row.config(), seed=row.seed, fused=True)
    stage = load_stage(folder, start=0, end=0, embed=True, head=True)
    with pytest.raises(ModelFormatError, match=r"holds no tensors of the model's 1 MTP layer\(s\) .*eh_proj") as bad:
        load_mtp(folder, stage)
    assert "\n" not in str(bad.value)


def test_an_mtp_tensor_not_computed_here_is_refused(hybrid, tmp_path):
    """A checkpoint whose MTP module holds more than we compute (dedicated embeddings) is not drafted with half-read."""
    import json
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "dedicated"
    shutil.copytree(hybrid, folder)
    save_file({"mtp.embed_tokens.weight": torch.zeros(SHAPE["vocab_size"], SHAPE["hidden_size"])},
              folder / "extra.safetensors")
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["mtp.embed_tokens.weight"] = "extra.safetensors"
    (folder / INDEX_FILE).write_text(json.dumps(index))
    stage = load_stage(folder, start=0, end=0, embed=True, head=True)
    with pytest.raises(UnsupportedModel, match="'mtp.embed_tokens.weight' of the MTP module is not one tessera computes"):
        load_mtp(folder, stage)


# -- the command line: --speculate mtp ----------------------------------------------------------------


def test_the_command_line_drafts_with_the_mtp_module_or_refuses_in_one_line(hybrid, tiny_llama):
    from types import SimpleNamespace

    from tessera.peer.base.errors import ConfigError
    from tessera.peer.cli.swarm_generate import mtp_groups, speculation_from

    def requester(folder):  # what speculation_from reads of a Swarm: its folder, spec and head
        head = load_stage(folder, start=0, end=0, embed=True, head=True)
        return SimpleNamespace(folder=folder, spec=head.spec, head=head)

    swarm = requester(hybrid)
    spec = speculation_from("mtp", 4, True, swarm, SamplingParams(), capacity=64)
    assert isinstance(spec.drafter, MtpDrafter) and spec.drafter.sampler is None and spec.pipeline
    sampled = speculation_from("mtp", 4, True, swarm, SamplingParams(temperature=0.8, seed=1), capacity=64)
    assert sampled.drafter.sampler is not None  # a sampled draft carries its distribution q for the acceptance rule
    assert mtp_groups(hybrid) == {"mtp"}  # what a requester without the files fetches beside its embedding and head
    with pytest.raises(UnsupportedModel, match="has no multi-token-prediction") as bad:
        speculation_from("mtp", 4, True, requester(tiny_llama), SamplingParams(), capacity=64)
    assert "\n" not in str(bad.value)
    with pytest.raises(ConfigError, match="none, ngram, mtp or self:N"):
        speculation_from("mpt", 4, True, swarm, SamplingParams(), capacity=64)


async def test_sampled_drafts_carry_the_modules_distribution(hybrid_parts):
    """With a sampler, each draft token is drawn from q = the sampler's distribution of the module's logits, and
    q travels with the draft (the speculative-sampling rule divides by it): q rows sum to one and put mass on
    the token drawn."""
    stage, mtp = hybrid_parts
    drafter = MtpDrafter(mtp, capacity=64, sampler=Sampler(SamplingParams(temperature=1.0, seed=3)), session="sampled")
    try:
        drafter.observe(0, PROMPT, model_rows(stage, PROMPT))
        draft = drafter.propose([*PROMPT, 9], 3)
    finally:
        drafter.close()
    assert len(draft.tokens) == 3 and draft.probs is not None and draft.probs.shape == (3, SHAPE["vocab_size"])
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3))
    assert all(float(draft.probs[i, t]) > 0 for i, t in enumerate(draft.tokens))


async def test_speculative_sampling_with_mtp_drafts_keeps_the_distribution(tiny_llama):
    """Sampled MTP drafts verified by the speculative-sampling rule: each answer token is distributed as
    plain sampling's (chi-square, as tests/request/test_speculation.py checks a draft model's, where a control
    shows the test catches a rule that accepts drafts unchecked). The module here is one of the tiny model's
    own layers between random ends: its q is far from p, so the rule's rejections and residual draws carry
    the test."""
    from collections import Counter
    from dataclasses import replace

    from tessera.peer.request.decode import plain_tokens
    from tessera.stages.engine.mtp import MtpStage
    from tessera.stages.engine.stage import Stage
    from tessera.stages.families.mtp import nextn_mtp

    from ..request.test_speculation import chi2_homogeneity, chi2_sf, peaky_model

    stage = peaky_model(tiny_llama)
    spec = nextn_mtp(replace(stage.spec, mtp_layers=1), stage.spec.layers[0])
    torch.manual_seed(4)
    ends = MtpEnds(stage.spec.hidden_size, stage.spec.rms_norm_eps)
    with torch.no_grad():
        ends.proj.weight.copy_(0.3 * torch.randn_like(ends.proj.weight))
    block = Stage(stage.spec, 0, [stage.blocks[0]])
    mtp = MtpStage(spec, ends.requires_grad_(False), block, stage)
    ids = [5, 17, 42, 5, 17]

    async def embed(t):
        return stage.embed(list(t))

    async def head(h):
        return stage.logits(h)

    async def sample(n: int, drafts: bool) -> list[tuple[int, ...]]:
        out = []
        for seed in range(n):
            chain, sampler = LocalChain(stage), Sampler(SamplingParams(temperature=1.0, seed=seed))
            if drafts:
                drafter = MtpDrafter(mtp, capacity=64,
                                     sampler=Sampler(SamplingParams(temperature=1.0, seed=10**6 + seed)))
                spec_ = Speculation(drafter, k=AdaptiveK(3, backoff_after=10**9), pipeline=False)
                gen = speculative_tokens(chain, embed, head, ids, 4, sampler, (), spec_)
            else:
                gen = plain_tokens(chain, embed, head, ids, 4, sampler, ())
            out.append(tuple([t async for t in gen]))
            stage.close("chain")
            if drafts:
                drafter.close()
        return out

    plain, drafted = await sample(600, False), await sample(600, True)
    for position in (1, 2, 3):  # the first token is sampled before any draft
        stat, dof = chi2_homogeneity(Counter(s[position] for s in plain), Counter(s[position] for s in drafted))
        p = chi2_sf(stat, dof)
        print(f"token {position}: chi2 {stat:.1f} on {dof} dof, p = {p:.3f}")
        assert dof >= 3 and p > 1e-3
