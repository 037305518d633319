"""Tiny checkpoints with multi-token-prediction weights, which transformers' `save_pretrained` never writes.

transformers 5 runs MTP modules (`modeling_layers.MtpModel`, loaded beside the model from its
checkpoint) but saves none, so a tiny random model built by it has the config and not the
tensors. `add_mtp` writes them with the published names and shapes (families/mtp.py: DeepSeek's
`model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm}` with the block under the same layer and
copies of the embedding and head; Qwen3.5's `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}`
with the block under `mtp.layers.0.`), experts one tensor each as published, into a file of its own
listed in the folder's index. transformers' own MTP loader reads them back (test_mtp.py), so the
names are checked against an implementation that is not ours.

`transformers_mtp` loads transformers' MtpModel for such a folder: for DeepSeek-V3 and GLM the
model class names the MTP layer of the *published* depth (`model.layers.61` ...) as the tensors to
load, so the pattern is pointed at the tiny model's layer L; Qwen3.5's config does not count its
MTP layers for transformers (`num_mtp_layers`, `mtp_layer_types`: a gated full-attention layer),
so the loaded config is told, as the published checkpoints' layout implies. (GLM-5's MTP layer
does not run in transformers 5.24: its mask table has no row for indexed attention, and its eager
MLA attention fails; test_mtp.py computes GLM-5's formula by hand instead.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tessera.stages.families.catalog import mtp_of, spec_from_file, tensors_of_layer
from tessera.stages.families.tensors import embedding_name

# the model's one file becomes the first of two shards: transformers reads a folder's single
# `model.safetensors` before its index, and would look for the MTP tensors there
MAIN_FILE, MTP_FILE = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX_FILE = "model.safetensors.index.json"
WEIGHT_STD = 0.2  # as the tiny models' own weights (conformance.py)


def count_mtp(config: dict, family: str) -> dict:
    """The config with one MTP layer counted, under the family's key (a multimodal one's text_config)."""
    if family.startswith("qwen3_5"):
        if "text_config" in config:
            return {**config, "text_config": {**config["text_config"], "mtp_num_hidden_layers": 1}}
        return {**config, "mtp_num_hidden_layers": 1}
    return {**config, "num_nextn_predict_layers": 1}


def add_mtp(folder: Path, *, seed: int) -> Path:
    """Write one MTP module's seeded random weights into `folder` (module docstring); returns it."""
    config = json.loads((folder / "config.json").read_text())
    family = config.get("model_type", "").replace("_text", "")
    config = count_mtp(config, family)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    spec = spec_from_file(folder / "config.json")
    mtp = mtp_of(spec)
    gen = torch.Generator().manual_seed(seed)
    shapes = {name: shape for choices in tensors_of_layer(mtp.blocks, mtp.layer).values()
              for name, shape in zip(choices[0].names, choices[0].shapes)}
    shapes.update(mtp.tensors())
    tensors = {name: (1 + 0.1 * torch.randn(shape, generator=gen)) if len(shape) == 1 and "norm" in name
               else WEIGHT_STD * torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    if mtp.copies:  # DeepSeek publishes copies of the embedding and head beside its MTP layer
        main = main_tensors(folder)
        head = "lm_head.weight" if "lm_head.weight" in main else embedding_name(spec)
        embed_copy, head_copy = mtp.copies[:2]
        tensors[embed_copy] = read(folder, main[embedding_name(spec)], embedding_name(spec))
        tensors[head_copy] = read(folder, main[head], head)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / MTP_FILE, metadata={"format": "pt"})
    weight_map = main_tensors(folder)
    if (folder / "model.safetensors").exists():
        (folder / "model.safetensors").rename(folder / MAIN_FILE)
        weight_map = dict.fromkeys(weight_map, MAIN_FILE)
    weight_map.update(dict.fromkeys(tensors, MTP_FILE))
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return folder


def main_tensors(folder: Path) -> dict[str, str]:
    """Tensor -> file of the model's own weights (its index, or its one file)."""
    index = folder / INDEX_FILE
    if index.exists():
        return {k: v for k, v in json.loads(index.read_text())["weight_map"].items() if v != MTP_FILE}
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def read(folder: Path, file: str, name: str) -> torch.Tensor:
    with safe_open(folder / file, framework="pt") as f:
        return f.get_tensor(name)


def transformers_mtp(folder: Path):
    """(transformers' model, its MtpModel, an MtpCache) for a folder `add_mtp` filled (module docstring)."""
    import transformers
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    main = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    text = main.config.get_text_config()
    qwen = text.model_type.startswith("qwen3_5")
    if qwen:  # its config does not count MTP layers for transformers, nor say their kind
        text.num_mtp_layers = 1
        text.mtp_layer_types = ["full_attention"]
    else:  # DeepSeek-V3, GLM-4.5: the pattern names layer L of the tiny model, not the published depth's
        main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{text.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(main, device_map={"": "cpu"}).float().eval()
    return main, mtp, MtpCache(config=main.config.get_mtp_config())
