"""The rows of the family conformance suite (test_conformance.py): one per configuration tested.

A row is a family, a transformers config builder, and the knobs that differ between rows:
whether its experts are saved fused (as transformers 5 holds them) or one tensor each (as
published), where a two-stage split cuts it, which rows also run through a real 2-peer swarm,
how transformers is stepped for the reference, the family's own refusals, and the one line a
tensor-shard rank is refused with. Adding a family adds its rows here; every check of the suite
then runs on them. The family test files (test_<family>.py) hold what only that family has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import FAMILIES

from .conformance import SHAPE, VOCAB

transformers = pytest.importorskip("transformers")

# A refusal: a change to the row's saved config, the error it raises, and words its one line holds.
Refusal = tuple[dict[str, Any], type[Exception], str]


@dataclass(frozen=True)
class Row:
    """One configuration of a family (module docstring).

    family:   the `model_type`.
    config:   builds the transformers config (its `to_dict` is what save_pretrained writes).
    seed:     the random weights' seed.
    fused:    the experts saved fused (transformers 5's in-memory layout), not one tensor each.
    split:    the layer a two-stage split (and the swarm) cuts the model at: a span start.
    swarm:    also run through a real 2-peer swarm split at `split` (one row per family).
    stepped:  transformers' reference fed one token at a time, prompt included: for sparse
              attention whose index scores tie at the k-th place, where transformers' whole-prompt
              prefill picks other tied positions than its own one-token steps (layers/dsa.py `select`).
    refusals: changes to the saved config the family does not compute: each refused in one line.
    shard:    words of the one-line refusal of a tensor-shard rank, or None where a family's layers
              split across ranks (those are checked against the unsharded span elsewhere).
    """

    family: str
    config: Callable[[], Any]
    seed: int
    split: int
    fused: bool = False
    swarm: bool = False
    stepped: bool = False
    refusals: tuple[Refusal, ...] = ()
    shard: str | None = None
    spans: tuple[tuple[int, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        layers = self.config().num_hidden_layers
        object.__setattr__(self, "spans", ((0, self.split), (self.split, layers)))


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16, rope_theta=500000.0)
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)
MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
# DeepSeek-V3 and GLM-5 at tiny MLA sizes
MLA = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, max_position_embeddings=1024, bos_token_id=1,
           eos_token_id=2, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=12)
DEEPSEEK = dict(MLA, num_hidden_layers=3)
# 4 layers; 8 indexer heads: a position scores exactly 0 only when every head's relu is 0, so ties at
# the top-k's edge are rare (the two-index-heads row meets them)
GLM5 = dict(MLA, num_hidden_layers=4, q_lora_rank=24, index_n_heads=8, index_head_dim=16)
# YaRN from an original context of 256 to 1024 (the ramp and scale change every position), with DeepSeek's
# mscale pair: cos/sin scaled by mscale(4, 1) / mscale(4, 0.8), scores by mscale(4, 0.8)^2
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
GLM4 = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8)
MINIMAX = dict(SHAPE, intermediate_size=32)
# top-6 of up to 26 positions; layers 1 and 3 reuse layers 0's and 2's selections; a dense first layer, 16
# experts in 4 groups (best 2 searched for the top 3), renormalised, one shared expert, YaRN
GLM5_SHARED = dict(index_topk=6, indexer_types=["full", "shared", "full", "shared"],
                   mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_routed_experts=16, n_group=4,
                   topk_group=2, num_experts_per_tok=3, n_shared_experts=1, norm_topk_prob=True,
                   routed_scaling_factor=2.5, rope_parameters=YARN)
# every layer its own indexer (top-9), every layer sparse, raw top-2 of 8, no shared experts, biased projections
GLM5_FULL = dict(index_topk=9, indexer_types=["full"] * 4, mlp_layer_types=["sparse"] * 4, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=0, norm_topk_prob=False, routed_scaling_factor=1.0,
                 attention_bias=True)

# The hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): 4 layers, 0-2 Gated DeltaNet and 3 gated full attention
# (the default full_attention_interval of 4), linear heads 2 key / 4 value of 8
HYBRID = dict(SHAPE, num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4)
HYBRID_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
LINEAR_SHARD = "tensor shards of {} are not supported: layer 0 is Gated DeltaNet linear attention"
SHIPPED_HYBRID = ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                           "activation_scheme": "dynamic"}}, UnsupportedModel, "ship quantized")
# DeepSeek-V4 at tiny sizes: 4 heads of 32 (8 rope dims), a window of 8, compressed entries every 2 (CSA) and
# 4 (HCA) positions, so a 26-position run closes 13 and 6 of them; indexer top-3; 2 hyper-connection streams
V4 = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.25,
          q_lora_rank=24, o_groups=2, o_lora_rank=16, sliding_window=8, index_head_dim=16, index_topk=3,
          compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
          n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=1024,
          bos_token_id=1, eos_token_id=2)
S4, C4, H4 = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# window, CSA, HCA, CSA; two hash layers, then sqrt-softplus routing; 8 indexer heads; the experts fused
V4_MIXED = dict(V4, num_hidden_layers=4, layer_types=[S4, C4, H4, C4], mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 2,
                hc_mult=2, index_n_heads=8, swiglu_limit=0.6)
# two indexer heads (index scores tie at exactly 0 at the top-k's edge), three streams, sigmoid scores, YaRN on
# the compressed layers' RoPE, groups of one head, one hash layer; DeepSeek's names (save_original_format)
V4_TIES = dict(V4, num_hidden_layers=4, layer_types=[C4, C4, S4, H4], mlp_layer_types=["hash_moe"] + ["moe"] * 3,
               hc_mult=3, index_n_heads=2, o_groups=4, scoring_func="sigmoid", routed_scaling_factor=2.0,
               hc_sinkhorn_iters=5, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64})

# Kimi Linear: MLA at tiny sizes (NoPE), KDA of 4 heads of 8, a dense first layer then 8 experts in 2 groups
KIMI = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, intermediate_size=96, moe_intermediate_size=32,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, linear_num_heads=4,
            linear_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=4)
# Nemotron-H: Mamba2 of 4 heads of 8, a state of 16 in 2 groups, scanned in chunks of 8 (the prompt spans two);
# attention of 4 heads (2 KV) of 16; relu^2 MLPs of 96 or experts of 32 (and a shared one of 48)
NEMOTRON = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2, intermediate_size=96,
                mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8)

# MiMo-V2-Flash: global and sliding layers (4 key/value heads where the global ones have 2, sinks, window 8), values
# 12 wide against q/k's 16 and scaled, RoPE on half of each head with each kind's base, a dense first layer then 8
# sigmoid-routed experts in 2 groups
MIMO = dict(SHAPE, v_head_dim=12, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2)
MIMO_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}

# Gemma 4 text at tiny sizes: sliding layers of 2 key/value heads of 16 (window 8), global ones of 32, softcapped
GEMMA4 = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              global_head_dim=32, intermediate_size=96, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
              sliding_window=8, final_logit_softcapping=30.0)
SLIDE, GLOBAL = "sliding_attention", "full_attention"

FP8_ONE_SCALE = ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedModel, "weight_block_size null")
AWQ = ({"quantization_config": {"quant_method": "awq"}}, UnsupportedModel, "quant_method 'awq'")

ROWS: dict[str, Row] = {
    # the Llama block: Llama 3's RoPE and tied embeddings; Mistral's window (8, shorter than the prompt);
    # Qwen2's q/k/v biases
    "llama/llama3-tied": Row("llama", lambda: transformers.LlamaConfig(
        **SHAPE, intermediate_size=96, tie_word_embeddings=True, rope_parameters=LLAMA3), seed=1, split=1, refusals=(
            ({"attention_bias": True}, UnsupportedModel, "attention_bias True"),
            ({"sliding_window": 8}, UnsupportedModel, "'sliding_window'"),  # Llama has none: not silently dropped
            ({"mlp_bias": True}, UnsupportedModel, "mlp_bias True"),
            ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"))),
    "mistral/window": Row("mistral", lambda: transformers.MistralConfig(
        **SHAPE, intermediate_size=96, sliding_window=8), seed=2, split=2,
        refusals=(({"layer_types": ["sliding_attention"] * 3}, UnsupportedModel, "layer_types"),)),
    "qwen2/bias": Row("qwen2", lambda: transformers.Qwen2Config(**SHAPE, intermediate_size=96), seed=3, split=1,
                      refusals=(({"use_sliding_window": True}, UnsupportedModel, "use_sliding_window True"),)),
    # Qwen3: per-head q/k norms; layer 0 full, layers 1 and 2 within 8 positions; biases everywhere
    "qwen3/tied": Row("qwen3", lambda: transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True,
                                                                intermediate_size=96), seed=0, split=1),
    "qwen3/window-bias": Row("qwen3", lambda: transformers.Qwen3Config(
        **SHAPE, use_sliding_window=True, sliding_window=8, max_window_layers=1, attention_bias=True,
        intermediate_size=96), seed=1, split=1, swarm=True, refusals=(
            ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
            ({"layer_types": ["full_attention"] * 2 + ["chunked_attention"]}, UnsupportedModel, "layer_types"),
            ({"use_sliding_window": False, "layer_types": ["sliding_attention"] * 3}, UnsupportedModel,
             "layer_types"),
            ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}}, UnsupportedModel,
             "dynamic"))),
    # Qwen3-MoE: a dense first layer, then sparse ones whose top-2 weights are renormalised; or every second
    # layer sparse, raw weights, every layer windowed (8 < the prompt), the experts saved fused
    "qwen3_moe/dense-first-renorm": Row("qwen3_moe", lambda: transformers.Qwen3MoeConfig(
        **SHAPE, **QWEN3_MOE, mlp_only_layers=[0], norm_topk_prob=True), seed=10, split=1, swarm=True, refusals=(
            ({"hidden_act": "gelu_pytorch_tanh"}, UnsupportedModel, "hidden_act 'gelu_pytorch_tanh'"),
            ({"partial_rotary_factor": 0.5}, UnsupportedModel, "partial_rotary_factor"),
            ({"num_experts": 16}, UnsupportedModel, r"num_local_experts 8 .* differs from num_experts \(16\)"),
            # keys of other MoE families, which compute what this engine does not
            ({"shared_expert_intermediate_size": 64}, UnsupportedModel, "'shared_expert_intermediate_size'"),
            ({"n_group": 8}, UnsupportedModel, "'n_group'"),
            ({"num_experts_per_tok": 9}, ModelFormatError, "num_experts_per_tok")),
        shard="tensor shards of qwen3_moe are not supported: layer 1 is 'moe'"),
    "qwen3_moe/step2-window-fused": Row("qwen3_moe", lambda: transformers.Qwen3MoeConfig(
        **SHAPE, **QWEN3_MOE, decoder_sparse_step=2, norm_topk_prob=False, use_sliding_window=True,
        sliding_window=8), seed=11, split=2, fused=True),
    # Mixtral: experts named w1/w3/w2 under block_sparse_moe as published, or fused; a window of 8
    "mixtral/published": Row("mixtral", lambda: transformers.MixtralConfig(
        **SHAPE, **MIXTRAL, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), seed=20, split=1,
        refusals=(({"hidden_act": "relu"}, UnsupportedModel, "hidden_act 'relu'"),
                  ({"routed_scaling_factor": 2.5}, UnsupportedModel, "'routed_scaling_factor'"),
                  ({"is_encoder_decoder": True}, UnsupportedModel, "is_encoder_decoder True"),
                  ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                            "activation_scheme": "static"}}, UnsupportedModel,
                   "activation_scheme 'static'"), AWQ),
        shard="tensor shards of mixtral are not supported: layer 0 is 'moe'"),
    "mixtral/window-fused": Row("mixtral", lambda: transformers.MixtralConfig(**SHAPE, **MIXTRAL, sliding_window=8),
                                seed=21, split=2, fused=True, swarm=True),
    # DeepSeek-V3: low-rank q, a dense first layer, 16 experts in 4 groups of which the best 2 are searched for
    # the top 3, renormalised and scaled by 2.5, one shared expert, interleaved YaRN; or plain q (q_lora_rank
    # null), every layer sparse, no shared experts, raw top-2 weights of one group, biased projections, rope
    # in halves, the experts saved fused
    "deepseek_v3/lora-groups-shared-yarn": Row("deepseek_v3", lambda: transformers.DeepseekV3Config(
        **DEEPSEEK, q_lora_rank=24, first_k_dense_replace=1, n_routed_experts=16, n_group=4, topk_group=2,
        num_experts_per_tok=3, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters=YARN), seed=30, split=2, swarm=True, refusals=(
            ({"scoring_func": "softmax"}, UnsupportedModel, "scoring_func 'softmax'"),
            ({"topk_method": "group_limited_greedy"}, UnsupportedModel, "topk_method 'group_limited_greedy'"),
            ({"moe_layer_freq": 2}, UnsupportedModel, "moe_layer_freq 2"),
            ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
            ({"partial_rotary_factor": 0.5}, UnsupportedModel, "partial_rotary_factor"),
            ({"rope_parameters": {**YARN, "rope_type": "longrope"}}, UnsupportedModel, "longrope"),
            FP8_ONE_SCALE, AWQ,
            ({"use_qk_norm": True}, UnsupportedModel, "'use_qk_norm'"),  # GLM's key: not one DeepSeek-V3 computes
            ({"num_local_experts": 7}, UnsupportedModel, r"num_local_experts 7 .* differs from n_routed_experts \(16\)"),
            ({"n_group": 3}, ModelFormatError, "n_group"),  # 16 experts do not split into 3 groups
            ({"topk_group": 5}, ModelFormatError, "topk_group"),
            ({"topk_group": 1, "num_experts_per_tok": 5}, ModelFormatError, "num_experts_per_tok"),  # one group of 4
            ({"routed_scaling_factor": 0}, ModelFormatError, "routed_scaling_factor"),
            ({"n_shared_experts": -1}, ModelFormatError, "n_shared_experts"),
            ({"kv_lora_rank": 0}, ModelFormatError, "kv_lora_rank"),
            ({"qk_rope_head_dim": 7}, ModelFormatError, "qk_rope_head_dim"),
            ({"rope_interleave": "yes"}, ModelFormatError, "rope_interleave")),
        shard="tensor shards of deepseek_v3 are not supported: layer 0 is 'mla'"),
    "deepseek_v3/plain-q-raw-fused": Row("deepseek_v3", lambda: transformers.DeepseekV3Config(
        **DEEPSEEK, q_lora_rank=None, first_k_dense_replace=0, n_routed_experts=8, n_group=1, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=0, norm_topk_prob=False, routed_scaling_factor=1.0,
        attention_bias=True, rope_interleave=False), seed=31, split=1, fused=True),
    # GLM-4.5: qk-norm, biased q/k/v, RoPE on half of each head (the default), a dense first layer, top-2 of
    # the best of 2 groups, renormalised and scaled, one shared expert; or no qk-norm, no bias, YaRN on a
    # quarter of each head, every layer sparse, raw top-3 weights, no shared experts, the experts saved fused
    "glm4_moe/qknorm-bias-groups-shared": Row("glm4_moe", lambda: transformers.Glm4MoeConfig(**{
        **SHAPE, **GLM4, "use_qk_norm": True, "attention_bias": True, "first_k_dense_replace": 1, "n_group": 2,
        "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "n_shared_experts": 1}), seed=50, split=2, swarm=True, refusals=(
            ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
            ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, UnsupportedModel, "dynamic"),
            ({"scoring_func": "sigmoid"}, UnsupportedModel, "'scoring_func'"),  # DeepSeek's key: GLM's config has none
            ({"q_lora_rank": 16}, UnsupportedModel, "'q_lora_rank'"),
            ({"n_group": 3}, ModelFormatError, "n_group"),
            ({"use_qk_norm": 1}, ModelFormatError, "use_qk_norm"),
            FP8_ONE_SCALE, AWQ),
        shard="tensor shards of glm4_moe are not supported: layer 0 turns"),
    "glm4_moe/quarter-yarn-raw-fused": Row("glm4_moe", lambda: transformers.Glm4MoeConfig(**{
        **SHAPE, **GLM4, "first_k_dense_replace": 0, "num_experts_per_tok": 3, "norm_topk_prob": False,
        "n_shared_experts": 0, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
            "partial_rotary_factor": 0.25}}), seed=51, split=1, fused=True),
    # GLM-5 (module constants above); the swarm splits at layer 2, where an indexer layer starts a span
    "glm_moe_dsa/shared-groups-yarn": Row("glm_moe_dsa", lambda: transformers.GlmMoeDsaConfig(
        **GLM5, **GLM5_SHARED), seed=70, split=2, swarm=True, refusals=(
            ({"indexer_types": ["shared", "full", "full", "full"]}, UnsupportedModel, "indexer_types .* layer 0 reuses"),
            ({"indexer_types": ["full", "dense", "full", "full"]}, UnsupportedModel, "indexer_types"),
            ({"indexer_types": ["full"]}, ModelFormatError, "indexer_types"),
            ({"layer_types": ["full_attention"] * 4}, UnsupportedModel, "layer_types"),
            ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, ModelFormatError, "mlp_layer_types"),
            ({"mlp_bias": True}, UnsupportedModel, "mlp_bias True"),
            ({"index_topk": 0}, ModelFormatError, "index_topk"),
            ({"index_head_dim": 4}, ModelFormatError, "index_head_dim"),  # narrower than the rope dims it turns
            ({"q_lora_rank": None}, ModelFormatError, "q_lora_rank"),  # the indexer's queries come from it
            ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
            ({"rope_interleave": False}, UnsupportedModel, "'rope_interleave'"),  # DeepSeek's: GLM-5 always interleaves
            ({"rope_parameters": {**YARN, "rope_type": "longrope"}}, UnsupportedModel, "longrope"),
            FP8_ONE_SCALE, AWQ),
        shard="tensor shards of glm_moe_dsa are not supported: layer 0 is 'dsa'"),
    "glm_moe_dsa/full-raw-bias-fused": Row("glm_moe_dsa", lambda: transformers.GlmMoeDsaConfig(
        **GLM5, **GLM5_FULL), seed=71, split=3, fused=True),
    # two indexer heads: every head's relu is 0 at many positions, so index scores tie at exactly 0 at the
    # top-k's edge, every step (issue 42: this config gave other tokens than transformers from the first)
    "glm_moe_dsa/two-index-heads": Row("glm_moe_dsa", lambda: transformers.GlmMoeDsaConfig(
        **{**GLM5, "index_n_heads": 2}, **GLM5_FULL), seed=70, split=2, fused=True, stepped=True),
    # gpt-oss: GptOssConfig's own defaults where it has them (YaRN over 4096 positions, not truncated; sliding /
    # full / sliding layers, window 8; biased attention; swiglu limit 7), top-2 of 8; or a full first layer then
    # two sliding ones (window 5), no attention bias, a limit of 0.8 that clamps often (alpha 1.2), top-3 of 6,
    # a truncated YaRN whose original context (16) the sequence outgrows
    "gpt_oss/yarn-alternating": Row("gpt_oss", lambda: transformers.GptOssConfig(
        **SHAPE, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8),
        seed=30, split=1, swarm=True, shard="tensor shards of gpt_oss are not supported: layer 0 is 'moe'"),
    "gpt_oss/clamped-full-first": Row("gpt_oss", lambda: transformers.GptOssConfig(
        **SHAPE, num_local_experts=6, num_experts_per_tok=3, intermediate_size=32, sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], attention_bias=False,
        swiglu_limit=0.8, swiglu_alpha=1.2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 8.0, "truncate": True}), seed=31, split=2),
    # MiniMax-M2: q and k normed over all heads, RoPE on 8 of 16 dims (the published `rotary_dim`), a sigmoid
    # router with its correction bias in every layer, Mixtral's expert names; or every dim rotated by YaRN,
    # top-3 of 6, the experts saved fused
    "minimax_m2/partial-published": Row("minimax_m2", lambda: transformers.MiniMaxM2Config(
        **MINIMAX, num_local_experts=8, num_experts_per_tok=2, rotary_dim=8), seed=90, split=1, swarm=True,
        refusals=(
            ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
            ({"rotary_dim": 4}, UnsupportedModel, r"rotary_dim 4 .* differs from partial_rotary_factor 0.5"),
            ({"use_qk_norm": False}, UnsupportedModel, "use_qk_norm False"),
            ({"qk_norm_type": "per_head"}, UnsupportedModel, "qk_norm_type 'per_head'"),
            ({"scoring_func": "softmax"}, UnsupportedModel, "scoring_func 'softmax'"),
            ({"use_routing_bias": False}, UnsupportedModel, "use_routing_bias False"),
            ({"shared_intermediate_size": 64}, UnsupportedModel, "shared_intermediate_size 64"),
            ({"attn_type_list": [0, 1, 1]}, UnsupportedModel, "attn_type_list"),  # MiniMax-01's lightning attention
            ({"sliding_window": 8}, UnsupportedModel, "sliding_window 8"),
            ({"layernorm_mlp_beta": 0.5}, UnsupportedModel, "layernorm_mlp_beta 0.5"),
            ({"num_experts": 4}, UnsupportedModel, r"num_experts 4 .* differs from num_local_experts \(8\)"),
            ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, UnsupportedModel, "dynamic"),
            FP8_ONE_SCALE, AWQ),
        shard="tensor shards of minimax_m2 are not supported: layer 0 is 'moe'"),
    # Qwen3-Next: a dense first layer, then MoE with the gated shared expert; q, k, v, z grouped per key head.
    # Split at layer 2, inside the run of linear layers: a recurrent state on both sides of the cut
    "qwen3_next/dense-first-moe": Row("qwen3_next", lambda: transformers.Qwen3NextConfig(
        **HYBRID, **HYBRID_MOE, intermediate_size=96, mlp_only_layers=[0]), seed=60, split=2, swarm=True, refusals=(
            ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
            ({"attn_output_gate": False}, UnsupportedModel, "attn_output_gate False"),
            ({"use_sliding_window": True}, UnsupportedModel, "use_sliding_window True"),
            ({"sliding_window": 8}, UnsupportedModel, "sliding_window 8"),
            ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, UnsupportedModel, "layer_types"),
            ({"layer_types": [{}] * 4}, UnsupportedModel, "layer_types"),
            ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, UnsupportedModel,
             "dynamic"),
            ({"mtp_num_hidden_layers": 1}, UnsupportedModel, "'mtp_num_hidden_layers'"),  # Qwen3.5's key
            ({"linear_num_value_heads": 3}, ModelFormatError, "linear_num_value_heads"),  # not a multiple of 2
            ({"linear_conv_kernel_dim": 0}, ModelFormatError, "linear_conv_kernel_dim"),
            SHIPPED_HYBRID),
        shard=LINEAR_SHARD.format("qwen3_next")),
    # Qwen3.5 (dense): its text-only form (the multimodal one: test_qwen3_next.py); split inside the linear run
    "qwen3_5/dense": Row("qwen3_5", lambda: transformers.Qwen3_5TextConfig(**HYBRID, intermediate_size=96), seed=61,
                         split=1, swarm=True, refusals=(
            ({"num_experts": 8}, UnsupportedModel, "'num_experts'"),  # the dense family: not silently dropped
            ({"attn_output_gate": False}, UnsupportedModel, "attn_output_gate False"),
            ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0}},
             ModelFormatError, "partial_rotary_factor"),
            ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": "x"}},
             ModelFormatError, "mrope_section"),
            SHIPPED_HYBRID),
        shard=LINEAR_SHARD.format("qwen3_5")),
    # Qwen3.5-MoE: every layer sparse, always renormalised; full attention second, the experts saved fused
    "qwen3_5_moe/full-second-fused": Row("qwen3_5_moe", lambda: transformers.Qwen3_5MoeTextConfig(
        **HYBRID, **HYBRID_MOE, layer_types=["linear_attention", "full_attention", "linear_attention",
                                            "linear_attention"]), seed=62, split=3, fused=True, swarm=True, refusals=(
            ({"norm_topk_prob": False}, UnsupportedModel, "'norm_topk_prob'"),
            ({"num_experts": 0}, UnsupportedModel, "num_experts 0"),
            ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'")),
        shard=LINEAR_SHARD.format("qwen3_5_moe")),
    # Kimi Linear: KDA, KDA, MLA (NoPE), KDA; a dense first layer, then top-2 of 8 experts in the best of 2 groups,
    # renormalised and scaled, one shared expert, saved as published. Split at layer 1, inside the KDA run
    "kimi_linear/groups-shared-published": Row("kimi_linear", lambda: transformers.KimiLinearConfig(
        **KIMI, layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1), seed=80, split=1,
        swarm=True, refusals=(
            ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
            ({"mla_use_nope": False}, UnsupportedModel, "mla_use_nope False"),
            ({"num_key_value_heads": 2}, UnsupportedModel, "num_key_value_heads 2"),
            ({"moe_router_activation_func": "softmax"}, UnsupportedModel, "moe_router_activation_func 'softmax'"),
            ({"use_grouped_topk": False}, UnsupportedModel, "use_grouped_topk False"),
            ({"moe_layer_freq": 2}, UnsupportedModel, "moe_layer_freq 2"),
            ({"num_nextn_predict_layers": 1}, UnsupportedModel, "num_nextn_predict_layers 1"),
            ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
             UnsupportedModel, "NoPE"),
            ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, UnsupportedModel, "layer_types"),
            ({"linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 16}},
             UnsupportedModel, "linear_head_dim 8 .* differs from linear_attn_config's head_dim"),
            ({"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4]}}, UnsupportedModel,
             "layer_types .* differs from linear_attn_config"),
            ({"linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "gate_low_rank": 4}},
             UnsupportedModel, "'gate_low_rank'"),
            ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, UnsupportedModel, "mlp_layer_types"),
            ({"first_k_dense_replace": 2, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
             UnsupportedModel, "mlp_layer_types .* differs from first_k_dense_replace"),
            ({"norm_topk_prob": False}, UnsupportedModel, "moe_renormalize True .* differs from norm_topk_prob"),
            ({"num_local_experts": 16}, UnsupportedModel, r"num_experts 8 .* differs from num_local_experts \(16\)"),
            ({"linear_conv_kernel_dim": 0}, ModelFormatError, "linear_conv_kernel_dim"),
            ({"num_expert_group": 3}, ModelFormatError, "n_group"),  # 8 experts do not split into 3 groups
            SHIPPED_HYBRID),
        shard="tensor shards of kimi_linear are not supported: layer 0 is Kimi Delta Attention"),
    # MLA first and last (low-rank q, biased projections), KDA between; every layer sparse, raw top-3 weights of
    # one group, two shared experts; saved as transformers 5 holds it (one convolution, fused experts, `mlp.`)
    "kimi_linear/lora-raw-fused": Row("kimi_linear", lambda: transformers.KimiLinearConfig(
        **KIMI, layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        q_lora_rank=24, attention_bias=True, mlp_layer_types=["sparse"] * 4, num_local_experts=6,
        num_experts_per_tok=3, n_group=1, topk_group=1, norm_topk_prob=False, n_shared_experts=2,
        routed_scaling_factor=1.5), seed=81, split=2, fused=True),
    # Nemotron-H: Mamba2, Mamba2, MLP, attention (NoPE), MLP, Mamba2, saved as published (under backbone.); split
    # at layer 1, between the two Mamba2 layers
    "nemotron_h/mamba-mlp-attention": Row("nemotron_h", lambda: transformers.NemotronHConfig(
        **NEMOTRON, layers_block_type=["linear_attention", "linear_attention", "mlp", "full_attention", "mlp",
                                       "linear_attention"]), seed=85, split=1, swarm=True, refusals=(
            ({"mamba_hidden_act": "gelu"}, UnsupportedModel, "mamba_hidden_act 'gelu'"),
            ({"mlp_hidden_act": "silu"}, UnsupportedModel, "mlp_hidden_act 'silu'"),
            ({"mlp_bias": True}, UnsupportedModel, "mlp_bias True"),
            ({"attention_bias": True}, UnsupportedModel, "attention_bias True"),
            ({"mamba_proj_bias": True}, UnsupportedModel, "mamba_proj_bias True"),
            ({"sliding_window": 8}, UnsupportedModel, "sliding_window 8"),
            ({"mamba_ssm_cache_dtype": "bfloat16"}, UnsupportedModel, "mamba_ssm_cache_dtype 'bfloat16'"),
            ({"time_step_limit": [0.0, 10.0]}, UnsupportedModel, "time_step_limit .* finite upper bound"),
            ({"moe_latent_size": 16}, UnsupportedModel, "moe_latent_size 16"),
            ({"n_shared_experts": 2}, UnsupportedModel, "n_shared_experts 2"),
            ({"num_nextn_predict_layers": 1}, UnsupportedModel, "num_nextn_predict_layers 1"),
            ({"hybrid_override_pattern": "M-M*-"}, UnsupportedModel, "hybrid_override_pattern .* differs"),
            ({"layers_block_type": ["linear_attention"] * 5 + ["sliding_attention"]}, UnsupportedModel,
             "layers_block_type"),
            ({"num_hidden_layers": 4}, UnsupportedModel, "num_hidden_layers 4 .* has 6 layers"),
            ({"attention_head_dim": 8}, UnsupportedModel, "attention_head_dim 8 .* differs from head_dim"),
            ({"rms_norm_eps": 1e-6}, UnsupportedModel, "rms_norm_eps .* differs from layer_norm_epsilon"),
            ({"n_groups": 3}, ModelFormatError, "n_groups"),  # 4 heads do not split into 3 groups
            ({"time_step_limit": [-1.0, {"__float__": "Infinity"}]}, ModelFormatError, "time_step_limit"),
            SHIPPED_HYBRID),
        shard="tensor shards of nemotron_h are not supported: layer 0 is a Mamba2 state-space mixer"),
    # Nemotron 3's MoE layers: Mamba2 (no convolution bias), relu^2 experts (top-2 of 8 in the best of 2 groups,
    # a shared one), attention, experts again; split at 2, after the first MoE layer
    "nemotron_h/moe": Row("nemotron_h", lambda: transformers.NemotronHConfig(
        **NEMOTRON, layers_block_type=["linear_attention", "moe", "full_attention", "moe"], use_conv_bias=False,
        n_routed_experts=8, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.0), seed=86, split=2),
    # DeepSeek-V4 (module constants above); the swarm splits at layer 2, after the hash layers
    "deepseek_v4/csa-hca-hash-fused": Row("deepseek_v4", lambda: transformers.DeepseekV4Config(**V4_MIXED), seed=80,
                                          split=2, fused=True, swarm=True, refusals=(
        ({"scoring_func": "softmax"}, UnsupportedModel, "scoring_func 'softmax'"),
        ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
        ({"attention_bias": True}, UnsupportedModel, "attention_bias True"),
        ({"mlp_bias": True}, UnsupportedModel, "mlp_bias True"),
        ({"num_key_value_heads": 4}, UnsupportedModel, "num_key_value_heads 4"),
        ({"n_shared_experts": 2}, UnsupportedModel, "n_shared_experts 2"),
        ({"norm_topk_prob": False}, UnsupportedModel, "norm_topk_prob False"),
        ({"layer_types": [S4, C4, H4, "full_attention"]}, UnsupportedModel, "layer_types"),
        ({"layer_types": [S4, C4]}, ModelFormatError, "layer_types"),
        ({"mlp_layer_types": ["hash_moe", "dense", "moe", "moe"]}, UnsupportedModel, "mlp_layer_types"),
        ({"num_hash_layers": 3}, UnsupportedModel, "num_hash_layers 3 .* differs from mlp_layer_types"),
        ({"compress_ratios": [0, 4, 128, 64]}, UnsupportedModel, "compress_ratios"),
        ({"compress_ratios": [0, 4, 4, 4]}, UnsupportedModel, "compress_ratios .* differs from layer_types"),
        ({"compress_rates": {C4: 2, S4: 3}}, UnsupportedModel, "compress_rates"),
        ({"compress_rates": {C4: 0}}, ModelFormatError, "compress_rates"),
        ({"qk_rope_head_dim": 16}, UnsupportedModel, "qk_rope_head_dim 16 .* differs from partial_rotary_factor"),
        ({"partial_rotary_factor": 0.1}, UnsupportedModel, "partial_rotary_factor"),  # 3.2 dims
        ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
                              "compress": {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.25}}},
         UnsupportedModel, "longrope"),
        ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                              "compress": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}}},
         UnsupportedModel, "main RoPE turns 0.5"),
        ({"hc_mult": 0}, ModelFormatError, "hc_mult"),
        ({"o_groups": 3}, ModelFormatError, "o_groups"),  # 4 heads do not split into 3 groups
        ({"index_head_dim": 4}, ModelFormatError, "index_head_dim"),  # narrower than the rope dims it turns
        ({"swiglu_limit": 0}, ModelFormatError, "swiglu_limit"),
        FP8_ONE_SCALE, AWQ),
        shard="tensor shards of deepseek_v4 are not supported: layer 0 is 'moe'"),
    "deepseek_v4/two-index-heads-published": Row("deepseek_v4", lambda: transformers.DeepseekV4Config(**V4_TIES),
                                                 seed=81, split=3, stepped=True),
    "minimax_m2/yarn-fused": Row("minimax_m2", lambda: transformers.MiniMaxM2Config(
        **MINIMAX, num_local_experts=6, num_experts_per_tok=3, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}),
        seed=92, split=2, fused=True),
    # MiMo-V2-Flash: its published shape in small (module constants above), with the published config's own keys
    # saying what transformers computes; or 6 layers of its default pattern (global at 0 and 5), the window from
    # `sliding_window_size` (5 + the query), unscaled values (an explicit null), biased q/k/v, experts saved fused
    "mimo_v2_flash/published": Row("mimo_v2_flash", lambda: transformers.MiMoV2FlashConfig(
        **{**MIMO, "num_hidden_layers": 4}, sliding_window=8, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], rope_parameters=MIMO_ROPE), seed=110, split=2,
        swarm=True, refusals=(
            ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
            ({"hybrid_layer_pattern": [0, 1, 0, 0]}, UnsupportedModel, "hybrid_layer_pattern .* computes"),
            ({"swa_num_key_value_heads": 2}, UnsupportedModel, "swa_num_key_value_heads 2 .* computes 4"),
            ({"swa_v_head_dim": 16}, UnsupportedModel, "swa_v_head_dim 16"),
            ({"rope_theta": 1e4}, UnsupportedModel, "rope_theta 10000.0 .* computes 5000000.0"),
            ({"add_full_attention_sink_bias": True}, UnsupportedModel, "add_full_attention_sink_bias True"),
            ({"layernorm_epsilon": 1e-6}, UnsupportedModel, "layernorm_epsilon"),
            ({"moe_layer_freq": [1, 1, 1, 1]}, UnsupportedModel, "moe_layer_freq"),
            ({"n_shared_experts": 1}, UnsupportedModel, "n_shared_experts 1"),
            ({"scoring_func": "softmax"}, UnsupportedModel, "scoring_func 'softmax'"),
            ({"layer_types": ["full_attention", "chunked_attention", "sliding_attention", "full_attention"]},
             UnsupportedModel, "layer_types"),
            ({"rope_parameters": {**MIMO_ROPE, "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}},
             UnsupportedModel, "rope_type 'yarn'"),
            ({"rope_parameters": {**MIMO_ROPE, "full_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                                  "partial_rotary_factor": 0.1}}},
             ModelFormatError, "partial_rotary_factor"),
            ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, ModelFormatError, "mlp_layer_types"),
            ({"attention_value_scale": -1}, ModelFormatError, "attention_value_scale"),
            FP8_ONE_SCALE, AWQ),
        shard="tensor shards of mimo_v2_flash are not supported: layer 0 turns only 8 of its 16 head dims"),
    "mimo_v2_flash/default-pattern-fused": Row("mimo_v2_flash", lambda: transformers.MiMoV2FlashConfig(
        **{**MIMO, "num_hidden_layers": 6}, sliding_window_size=5, attention_value_scale=None, attention_bias=True,
        rope_parameters=MIMO_ROPE), seed=111, split=3, fused=True),
    # Gemma 4 text, E2B's layout in small: per-layer inputs (8 per layer), the last two layers reading layers 2's
    # and 1's keys and values (so spans start at 0, 1 or 5), their MLPs twice as wide; or the 26B's: experts beside
    # the dense MLP, global layers whose values are their keys' projection, one global key head, biased attention,
    # an untied head, no per-layer inputs
    "gemma4/ple-kv-shared": Row("gemma4", lambda: transformers.Gemma4TextConfig(
        **GEMMA4, num_hidden_layers=5, layer_types=[SLIDE, GLOBAL, SLIDE, SLIDE, GLOBAL], hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, use_double_wide_mlp=True), seed=120, split=1,
        swarm=True, refusals=(
            ({"hidden_activation": "silu"}, UnsupportedModel, "hidden_activation 'silu'"),
            ({"layer_types": [SLIDE, GLOBAL, SLIDE, GLOBAL, SLIDE]}, UnsupportedModel, "last layer must be full"),
            ({"layer_types": [SLIDE, "chunked_attention", SLIDE, SLIDE, GLOBAL]}, UnsupportedModel, "layer_types"),
            ({"use_bidirectional_attention": "all"}, UnsupportedModel, "use_bidirectional_attention 'all'"),
            ({"vocab_size_per_layer_input": 1000}, UnsupportedModel, "vocab_size_per_layer_input 1000"),
            ({"num_kv_shared_layers": 5}, ModelFormatError, "num_kv_shared_layers"),
            ({"num_kv_shared_layers": 4}, ModelFormatError, "no earlier full_attention layer"),
            ({"per_layer_config": {"1": {"head_dim": 32, "intermediate_size": 8}, "4": {"head_dim": 32}}},
             UnsupportedModel, "'intermediate_size' is not computed per layer"),
            ({"per_layer_config": {"1": {"head_dim": 32}, "4": {"head_dim": 64}}}, UnsupportedModel, "differ in shape"),
            ({"rope_parameters": {SLIDE: {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                                  GLOBAL: {"rope_type": "default", "rope_theta": 1e6}}}, UnsupportedModel, "yarn"),
            ({"num_experts": 8}, UnsupportedModel, "num_experts 8 .* enable_moe_block is false"),
            ({"expert_intermediate_size": 32}, UnsupportedModel, "expert_intermediate_size 32"),
            ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, UnsupportedModel,
             "ship quantized")),
        shard="tensor shards of gemma4 are not supported: layer 0 has a scores' scale of its own"),
    "gemma4/moe-k-eq-v": Row("gemma4", lambda: transformers.Gemma4TextConfig(
        **GEMMA4, num_hidden_layers=3, layer_types=[SLIDE, SLIDE, GLOBAL], hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
        num_global_key_value_heads=1, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={SLIDE: {"rope_type": "default", "rope_theta": 1e4},
                         GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e5,
                                  "factor": 2.0}}), seed=121, split=2, fused=True),
}


def saved_config(name: str) -> dict[str, Any]:
    """Row `name`'s config as transformers writes it (save_pretrained's config.json)."""
    row = ROWS[name]
    config = json.loads(json.dumps(row.config().to_dict()))
    return {**config, "architectures": [FAMILIES[row.family].architecture]}
