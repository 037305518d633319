"""A split GGUF (`NAME-00001-of-00003.gguf`, how every large model ships) imports as the one file would.

The fixture's every-type Llama GGUF is written split in three by the gguf package's writer
(conftest.py SPLIT_GGUF), and it is that import which the exactness tests, the compiled tests and
the 2-peer swarm of test_shipped_swarm.py serve. Here: its folder holds one safetensors file per
shard and the index, every tensor equal to the import of the same model written unsplit; any shard
names the whole; a missing shard, or a shard that says it is another, is refused in one line.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tessera.stages.errors import ModelFormatError
from tessera.stages.weights.convert import convert_gguf, gguf_shards, split_name
from tessera.stages.weights.folder import INDEX_FILE, WeightFolder

from . import checkpoints as ck
from .conftest import LOW_BIT_ORDER, SPLIT_GGUF, in_turn


def shards_of(shipped) -> list:
    folder = shipped[SPLIT_GGUF][0]
    return sorted(folder.parent.glob(f"{SPLIT_GGUF}-*-of-*.gguf"))


def test_the_split_import_is_the_unsplit_one(shipped, sources, tmp_path):
    shards = shards_of(shipped)
    assert [s.name for s in shards] == [f"{SPLIT_GGUF}-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert gguf_shards(shards[1]) == shards and split_name(shards[2]) == SPLIT_GGUF
    folder = shipped[SPLIT_GGUF][0]
    assert (folder / INDEX_FILE).exists() and len(list(folder.glob("model-*-of-00003.safetensors"))) == 3
    whole = ck.gguf_file(sources["llama"], tmp_path / "whole.gguf", in_turn(LOW_BIT_ORDER), edge_type="IQ4_XS")
    convert_gguf(whole, tmp_path / "whole", keep_blocks=True)
    want = load_file(str(tmp_path / "whole" / "model.safetensors"))
    split = WeightFolder(folder)
    assert split.names() == set(want)
    for name, tensor in want.items():
        assert torch.equal(split.read_stored(name, tuple(tensor.shape), ("U8", "F32", "F16", "BF16")), tensor), name
    assert (folder / "config.json").read_text() == (tmp_path / "whole" / "config.json").read_text()


def test_a_missing_or_foreign_shard_is_refused(shipped, tmp_path):
    shards = shards_of(shipped)
    for shard in shards[:2]:
        shutil.copy(shard, tmp_path / shard.name)
    with pytest.raises(ModelFormatError, match="-00003-of-00003.gguf' is missing") as missing:
        convert_gguf(tmp_path / shards[0].name, tmp_path / "out", keep_blocks=True)
    assert "\n" not in str(missing.value)
    shutil.copy(shards[1], tmp_path / shards[2].name)  # shard 2's bytes under shard 3's name
    with pytest.raises(ModelFormatError, match="says it is shard 2 of 3, where its name and its neighbours make it 3"):
        convert_gguf(tmp_path / shards[0].name, tmp_path / "out", keep_blocks=True)
    lone = tmp_path / "lone.gguf"  # one shard renamed as a whole file
    shutil.copy(shards[0], lone)
    with pytest.raises(ModelFormatError, match="says it is shard 1 of 3"):
        convert_gguf(lone, tmp_path / "out", keep_blocks=True)


def test_the_import_command_takes_any_shard_and_names_the_model(shipped, tmp_path, monkeypatch):
    from tessera.peer.cli.model_files import import_model

    monkeypatch.setenv("TESSERA_MODELS", str(tmp_path / "models"))
    folder = import_model(shards_of(shipped)[2])
    assert folder.name == SPLIT_GGUF and (folder / INDEX_FILE).exists()
