"""A crafted config.json cannot make the engine build without bound: counts past any model are
refused by the reader before anything is built per layer or per expert, a count is an integer
written as one, and a folder's config may not describe more than its tensors hold."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.stages.errors import ModelFormatError
from tessera.stages.families.config import COUNT_LIMITS, MAX_CONFIG_INT, ConfigReader

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96)
# family -> a config as transformers writes it, and its key for the count of routed experts (None: dense)
BASES = {
    "llama": (lambda: transformers.LlamaConfig(**SHAPE), None),
    "qwen3": (lambda: transformers.Qwen3Config(**SHAPE), None),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(**SHAPE, num_experts=8, num_experts_per_tok=2,
                                                      moe_intermediate_size=32), "num_experts"),
    "mixtral": (lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=4), "num_local_experts"),
    "deepseek_v3": (lambda: transformers.DeepseekV3Config(**{**SHAPE, "num_key_value_heads": 4}, kv_lora_rank=16,
                                                          q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                                          v_head_dim=12, n_routed_experts=8, n_group=2, topk_group=1,
                                                          moe_intermediate_size=32), "n_routed_experts"),
    "gpt_oss": (lambda: transformers.GptOssConfig(**SHAPE, num_local_experts=4), "num_local_experts"),
    "mimo_v2_flash": (lambda: transformers.MiMoV2FlashConfig(
        **SHAPE, n_routed_experts=8, moe_intermediate_size=32, rope_parameters={
            kind: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
            for kind in ("full_attention", "sliding_attention")}), "n_routed_experts"),
    "gemma4": (lambda: transformers.Gemma4TextConfig(**SHAPE, global_head_dim=32, enable_moe_block=True, num_experts=8,
                                                     top_k_experts=2, moe_intermediate_size=32,
                                                     hidden_size_per_layer_input=0), "num_experts"),
}


def saved(family: str) -> dict:
    config = json.loads(json.dumps(BASES[family][0]().to_dict()))
    from tessera.stages.families.catalog import FAMILIES

    return {**config, "architectures": [FAMILIES[family].architecture]}


# Each crafted config read in a child process held to 1 GiB of address space: before the bounds,
# `num_hidden_layers: 1e9` filled 8 GB and `num_experts: 1e9` 2.6 GB without returning.
READ_BOUNDED = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from tessera.stages.errors import StageError
from tessera.stages.families.catalog import spec_from_config
for config in json.loads(sys.stdin.read()):
    try:
        spec_from_config(config)
        print("read")
    except StageError as refused:
        print(type(refused).__name__, str(refused).replace(chr(10), ' '))
    except MemoryError:
        print("MemoryError")
"""


def test_huge_counts_are_refused_at_once_in_bounded_memory():
    crafted = []
    for family, (_, experts) in BASES.items():
        for value in (10**9, 1e9, 2**40):
            crafted.append(({**saved(family), "num_hidden_layers": value}, "num_hidden_layers"))
            if experts is not None:
                crafted.append(({**saved(family), experts: value}, experts))
    done = subprocess.run([sys.executable, "-c", READ_BOUNDED], input=json.dumps([c for c, _ in crafted]),
                          capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert len(lines) == len(crafted), done.stderr[-2000:]
    for (_, key), line in zip(crafted, lines):
        assert line.startswith("ModelFormatError") and key in line, line


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(COUNT_LIMITS) + ["hidden_size", "vocab_size"]),
       st.one_of(st.integers(-10, 2**64), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                 st.text(max_size=3), st.none()))
def test_a_count_is_an_integer_within_its_bound_or_refused(key, value):
    """Any JSON value for a count: read as that integer when it is one within [1, its limit], refused
    with ModelFormatError otherwise (a float is refused even when whole: 1e9, 32.0)."""
    reader = ConfigReader({key: value}, "llama")
    limit = COUNT_LIMITS.get(key, MAX_CONFIG_INT)
    if value is None:
        with pytest.raises(ModelFormatError, match=f"lacks the field '{key}'"):
            reader.int(key)
    elif isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= limit:
        assert reader.int(key) == value
    else:
        with pytest.raises(ModelFormatError, match=key):
            reader.int(key)


def test_the_limits_lie_far_past_every_published_shape():
    from tessera.stages.families.config import MAX_EXPERTS, MAX_LAYERS
    from tessera.stages.families.shapes import SHAPES, shape_spec

    for name in SHAPES:
        spec = shape_spec(name)
        assert spec.num_layers * 4 <= MAX_LAYERS
        assert max(layer.mlp.num_experts for layer in spec.layers if layer.mlp is not None) * 4 <= MAX_EXPERTS


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    from .conformance import build

    return build(tmp_path_factory.mktemp("crafted"), "qwen3-moe", BASES["qwen3_moe"][0](), seed=3)


@pytest.mark.parametrize("change, words", [
    ({"num_hidden_layers": 1000}, "describes 1000 decoder layers, but the folder's tensors name 3"),
    ({"num_experts": 4000, "num_local_experts": 4000}, "parameters, more than the folder's"),
    ({"hidden_size": 65536, "head_dim": 16384}, "parameters, more than the folder's"),
    ({"moe_intermediate_size": 1 << 20}, "parameters, more than the folder's"),
])
def test_a_folder_config_describing_more_than_its_tensors_is_refused_before_it_is_expanded(
        moe_folder, tmp_path, change, words):
    """Within the reader's bounds, a config still may not describe more than the folder's tensors name
    (layers) or its files could store (experts, widths): one line, before any layer's tensors are
    listed, so neither `tessera model import` (check_folder) nor a load expands 4000 experts a layer."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.weights.folder_check import check_folder

    crafted = tmp_path / "crafted"
    crafted.mkdir()
    for item in moe_folder.iterdir():
        (crafted / item.name).symlink_to(item)
    (crafted / "config.json").unlink()
    config = json.loads((moe_folder / "config.json").read_text())
    (crafted / "config.json").write_text(json.dumps({**config, **change}))
    for attempt in (lambda: check_folder(crafted), lambda: load_stage(crafted, start=0, end=1)):
        with pytest.raises(ModelFormatError, match=words) as refused:
            attempt()
        assert "\n" not in str(refused.value)
