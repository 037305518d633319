"""Every model configuration we accept runs exactly as `transformers` runs it, in either config form.

Tiny random-weight models are built by `transformers` itself, saved by it (the
transformers 5 form, with a `rope_parameters` block) and rewritten in the older
form (top-level `rope_theta` / `rope_scaling`); for each, our float32 logits over a
prefill and greedy decode must be within 1e-4 of the reference's, and our greedy
tokens identical — locally for every configuration, and through a 2-peer swarm
for two of them. Sequences run past the Mistral window and the llama3 original
context, so both settings change the numbers the test compares.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.weights.folder_check import check_folder
from tessera.stages.decoding.generate import LocalEngine
from tessera.stages.families.catalog import spec_from_config, spec_from_file
from tessera.stages.assembly.stage import load_stage
from tessera.stages.weights.synth import CHATML, byte_tokenizer_json

from ..swarm_helpers import local_swarm

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # float32 logits, max abs (the charter's bound)
VOCAB = 320  # the byte tokenizer needs >= 259 ids
PROMPT = [5, 17, 260, 42, 99, 3, 250, 7, 300, 12, 64, 128]
DECODE_STEPS = 14  # 12 + 14 = 26 positions: past the window (8) and the llama3 original context (16)
EOS = 2
WEIGHT_STD = 0.2  # large enough that greedy picks are far from ties in float32
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             bos_token_id=1, eos_token_id=EOS)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)

# name -> (config class, rope block as transformers 5 writes it, other settings)
CONFIGS = {
    "llama": ("LlamaConfig", {"rope_type": "default", "rope_theta": 10000.0}, dict(tie_word_embeddings=False)),
    "llama3-tied": ("LlamaConfig", {**LLAMA3, "rope_theta": 500000.0}, dict(tie_word_embeddings=True)),
    "llama-linear": ("LlamaConfig", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, {}),
    "qwen2-1e6": ("Qwen2Config", {"rope_type": "default", "rope_theta": 1e6}, dict(tie_word_embeddings=False)),
    "qwen2-1e2": ("Qwen2Config", {"rope_type": "default", "rope_theta": 1e2}, dict(tie_word_embeddings=False)),
    "mistral-window": ("MistralConfig", {"rope_type": "default", "rope_theta": 10000.0},
                       dict(sliding_window=8, tie_word_embeddings=False)),
}
FORMS = ("rope_parameters", "top-level")


def build(name: str, root: Path) -> Path:
    """Save a seeded random `transformers` model of configuration `name` with a tokenizer."""
    cls, rope, extra = CONFIGS[name]
    config = getattr(transformers, cls)(**SHAPE, rope_parameters=dict(rope), **extra)
    torch.manual_seed(sorted(CONFIGS).index(name))
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():  # transformers zeroes biases at init: draw them all
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in pname else WEIGHT_STD * torch.randn_like(p))
    folder = root / name / FORMS[0]
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(byte_tokenizer_json(VOCAB))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


def older_form(folder: Path) -> Path:
    """A copy whose config.json holds RoPE as transformers 4 wrote it: top-level keys."""
    old = folder.parent / FORMS[1]
    shutil.copytree(folder, old)
    config = json.loads((old / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    config.pop("layer_types", None)  # Qwen2's list of layer kinds is transformers 5's too
    (old / "config.json").write_text(json.dumps(config, indent=2))
    return old


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("conformance")
    out = {}
    for name in CONFIGS:
        new = build(name, root)
        out[(name, FORMS[0])], out[(name, FORMS[1])] = new, older_form(new)
    return out


def reference_run(folder: Path) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and float32 logits per step, loading `folder` as a user would."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens, logits, cache, step = [], [], None, PROMPT
    with torch.inference_mode():
        for _ in range(DECODE_STEPS):
            out = model(torch.tensor([step]), cache=cache, use_cache=True)
            cache = out.cache
            logits.append(out.logits[0])
            step = [int(out.logits[0, -1].argmax())]
            tokens.append(step[0])
    return tokens, logits


def our_run(folder: Path, tokens: list[int]) -> list[torch.Tensor]:
    """Our float32 logits per step, feeding the reference's tokens."""
    stage = load_stage(folder, embed=True, head=True)
    stage.open("c", capacity=len(PROMPT) + DECODE_STEPS)
    out, step, pos = [], PROMPT, 0
    for token in tokens:
        out.append(stage.logits(stage.forward("c", stage.embed(step), pos)))
        pos, step = pos + len(step), [token]
    return out


def until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(folders, name, form):
    folder = folders[(name, form)]
    spec = check_folder(folder)  # what `tessera model import` checks accepts it
    assert spec == spec_from_file(folders[(name, FORMS[0])] / "config.json")  # both forms read alike
    tokens, ref = reference_run(folder)
    ours = our_run(folder, tokens)
    worst = max(float((a - b).abs().max()) for a, b in zip(ref, ours))
    assert worst <= TOLERANCE, f"{name} ({form}): max |logits diff| {worst:.3g}"
    greedy = LocalEngine(folder, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=DECODE_STEPS)
    assert greedy == until_eos(tokens)


def test_the_rope_base_changes_the_output(folders):
    """The reported bug: a Qwen2 folder with base 1e6 and its copy with base 1e2 ran identically."""
    runs = {name: reference_run(folders[(name, FORMS[0])]) for name in ("qwen2-1e6", "qwen2-1e2")}
    ours = {name: our_run(folders[(name, FORMS[0])], runs[name][0]) for name in runs}
    first = ours["qwen2-1e6"][0][-4:], ours["qwen2-1e2"][0][-4:]  # same weights, same prompt, different base
    assert float((first[0] - first[1]).abs().max()) > 1e-2
    for name in runs:
        assert max(float((a - b).abs().max()) for a, b in zip(runs[name][1], ours[name])) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3-tied", "mistral-window"])
async def test_a_two_peer_swarm_matches_transformers(folders, name):
    from tessera.peer.request.client import Swarm

    folder = folders[(name, FORMS[0])]
    tokens, _ = reference_run(folder)
    with local_swarm([(0, 1), (1, 2)], model=str(folder)) as procs:
        async with Swarm.join(procs.addrs[:1], model=folder) as swarm:
            got = [t async for t in swarm.generate_ids(PROMPT, max_new_tokens=DECODE_STEPS)]
    assert got == until_eos(tokens)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "beta_gamma": 2.0}},
         "beta_gamma"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "longrope"),
        ({"rope_parameters": {**LLAMA3, "rope_theta": 1e4, "attention_factor": 2.0}}, "attention_factor"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"quantization_config": {"quant_method": "gptq"}}, "gptq"),
    ],
)
def test_unsupported_settings_are_refused_by_name(folders, change, key):
    config = json.loads((folders[("llama", FORMS[0])] / "config.json").read_text())
    config.update(change)
    with pytest.raises(UnsupportedModel, match=key):
        spec_from_config(config)


def test_impossible_rope_values_are_refused(folders):
    config = json.loads((folders[("llama3-tied", FORMS[0])] / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "factor": "eight"}
    with pytest.raises(ModelFormatError, match="factor"):
        spec_from_config(config)


def test_import_refuses_a_broken_folder_and_registers_nothing(folders, tmp_path, monkeypatch):
    """Each defect gets one error naming it, and the registry stays empty."""
    from tessera.peer.cli.model_files import import_model
    from safetensors.torch import load_file, save_file

    registry_root = tmp_path / "registry"
    monkeypatch.setenv("TESSERA_MODELS", str(registry_root))
    source = folders[("llama", FORMS[0])]

    def broken(label: str) -> Path:
        copy = tmp_path / label
        shutil.copytree(source, copy)
        return copy

    no_tokenizer = broken("no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    bad_template = broken("bad-template")
    (bad_template / "chat_template.jinja").write_text("{% for m in messages %}")
    state = load_file(str(source / "model.safetensors"))
    missing = broken("missing-tensor")
    save_file({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"},
              str(missing / "model.safetensors"))
    extra = broken("extra-tensor")
    save_file({**state, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, str(extra / "model.safetensors"))
    misshapen = broken("misshapen")
    save_file({**state, "model.norm.weight": torch.ones(63)}, str(misshapen / "model.safetensors"))
    dynamic = broken("dynamic")
    config = json.loads((dynamic / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}
    (dynamic / "config.json").write_text(json.dumps(config))
    cases = [
        (no_tokenizer, ModelFormatError, "tokenizer.json"),
        (bad_template, ModelFormatError, "chat template"),
        (missing, ModelFormatError, "model.layers.1.mlp.up_proj.weight"),
        (extra, UnsupportedModel, "o_proj.bias"),
        (misshapen, ModelFormatError, r"model.norm.weight.*\(63,\)"),
        (dynamic, UnsupportedModel, "dynamic"),
    ]
    for folder, error, words in cases:
        with pytest.raises(error, match=words):
            import_model(folder, name=folder.name)
        assert not (registry_root / folder.name).exists()
    assert [p.name for p in registry_root.iterdir()] == []  # no staging folder left either
    assert (import_model(source, name="good") / "manifest.json").exists()


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 5e5},  # only the older top-level base
        {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 1e4},  # transformers 4.3x's `type`
        {"rope_scaling": {**LLAMA3}, "rope_theta": 5e5},
        {"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}},
        {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}, "rope_theta": 1.0},  # the block's base wins
        {},  # nothing at all: 10000
    ],
    ids=["top-level-theta", "legacy-type-key", "llama3-top-level", "llama3-context-fallback", "block-wins", "none"],
)
def test_rope_reading_agrees_with_transformers(rope):
    """What `read_rope` makes of a raw config dict is what transformers 5 standardises it to."""
    from tessera.stages.families.config import read_rope

    raw = {"architectures": ["LlamaForCausalLM"], **SHAPE, **rope}
    theirs = dict(transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}).rope_parameters)
    theta, scaling = read_rope(raw)
    assert theta == theirs.pop("rope_theta")
    kind = theirs.pop("rope_type")
    theirs.pop("type", None)
    assert scaling == (None if kind == "default" else {"rope_type": kind, **theirs})
