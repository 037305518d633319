"""YaRN RoPE against transformers: the config read, the frequencies and the cos/sin tables.

The tables are what every layer of a YaRN model rotates q and k by (layers/rope.py), so equal
tables (bit for bit: the same float32 operations in the same order) mean equal rotations in
any family; DeepSeek-V3's and gpt-oss' conformance runs check whole models. Each case changes
something the arithmetic reads: the factor, the ramp's betas, truncation, an explicit
attention factor, DeepSeek's mscale pair.
"""

from __future__ import annotations

import pytest
import torch

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.config import read_rope
from tessera.stages.families.spec.rope import RopeSpec
from tessera.stages.layers.rope import Rotary, attention_scaling, rope_frequencies

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=64, hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=4096)
YARN = {
    "plain": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "betas-no-truncate": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 256,
                          "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},  # gpt-oss style
    "attention-factor": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                         "attention_factor": 1.25},
    "mscale-pair": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 100,
                    "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},  # DeepSeek style
}


def rope_spec(block: dict, theta: float = 5e4) -> RopeSpec:
    base, scaling = read_rope({**SHAPE, "rope_parameters": {**block, "rope_theta": theta}})
    assert scaling is not None
    return RopeSpec(scaling["rope_type"], base, tuple(sorted((k, v) for k, v in scaling.items() if k != "rope_type")))


@pytest.mark.parametrize("name", sorted(YARN))
def test_yarn_tables_equal_transformers(name):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(**SHAPE, rope_parameters={**YARN[name], "rope_theta": 5e4})
    theirs = LlamaRotaryEmbedding(config)
    rope = rope_spec(YARN[name])
    assert torch.equal(rope_frequencies(rope, 32), theirs.inv_freq)
    assert attention_scaling(rope) == theirs.attention_scaling
    positions = torch.tensor([0, 1, 7, 100, 1023, 1024, 4000])
    cos, sin = theirs(torch.zeros(1, 1, 32), positions[None])
    ours_cos, ours_sin = Rotary(rope, 32).cos_sin(positions)  # [T, 1, D]; sin holds (-sin, sin) per half
    assert torch.equal(ours_cos[:, 0], cos[0])
    assert torch.equal(ours_sin[:, 0, 16:], sin[0, :, 16:]) and torch.equal(ours_sin[:, 0, :16], -sin[0, :, :16])
    if name != "plain":  # each case changes the frequencies or the scaling it is there for
        plain = rope_spec(YARN["plain"])
        assert not torch.equal(rope_frequencies(rope, 32), rope_frequencies(plain, 32)) \
            or attention_scaling(rope) != attention_scaling(plain)


def test_the_read_keeps_what_transformers_keeps():
    raw = {**SHAPE, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
           "rope_theta": 1e4}
    theta, scaling = read_rope(raw)
    assert theta == 1e4
    assert scaling == {"rope_type": "yarn", "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                       "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    # the original context falls back to the top level, then to max_position_embeddings
    _, scaling = read_rope({**SHAPE, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    assert scaling["original_max_position_embeddings"] == 4096
    _, scaling = read_rope({**SHAPE, "rope_parameters": {"rope_type": "yarn", "factor": 2.0},
                            "original_max_position_embeddings": 512})
    assert scaling["original_max_position_embeddings"] == 512


@pytest.mark.parametrize("block, error, words", [
    ({"rope_type": "yarn", "factor": 4.0, "beta_gamma": 3.0}, UnsupportedModel, "beta_gamma"),
    ({"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}, UnsupportedModel, "low_freq_factor"),
    ({"rope_type": "yarn", "factor": -4.0}, ModelFormatError, "factor"),
    ({"rope_type": "yarn"}, ModelFormatError, "factor"),  # transformers requires it too
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, ModelFormatError, "truncate"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}, ModelFormatError, "beta_fast"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0}, ModelFormatError, "attention_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": "one"}, ModelFormatError, "mscale"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "mscale": 1.0},
     UnsupportedModel, "mscale"),
])
def test_bad_yarn_blocks_are_refused_by_name(block, error, words):
    with pytest.raises(error, match=words):
        read_rope({**SHAPE, "rope_parameters": block})
