"""`tessera model fetch ORG/NAME --layers A:B` (peer/cli/model_span.py): only the files of a span,
from a stand-in for the hub (tests/cli/fake_hub.py, which logs every request) and the real
`huggingface_hub` client. A tiny Llama of 6 layers saved by transformers in 8 shards (the
embedding, one per layer, the last with the final norm, the head): the manifest is computed
from every shard when no swarm is asked (the first volunteer), or taken from a holder and checked
against the hub's files; the span's tensors come by HTTP ranges of exactly their bytes; what is
kept loads and computes as the whole model does; a tampered shard, a manifest not of the
repository and a header the manifest does not describe are refused. A real 2-peer swarm of such
folders is tests/cli/test_model_fetch_span_swarm.py."""

from __future__ import annotations

import json
import re
import shutil
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch

from tessera.peer.cli.model_files import import_model
from tessera.peer.cli.model_span import fetch_hub_span, fetch_span
from tessera.peer.net.memory import LinkSpec, MemoryNetwork, open_memory_transport
from tessera.peer.weights.bootstrap import ensure_span, held_layers
from tessera.peer.weights.errors import ManifestRejected, WeightsUnavailable
from tessera.peer.weights.fetcher import Fetcher
from tessera.peer.weights.hub import HubRepo, HubSource
from tessera.peer.weights.source import WeightLimits, WeightSource
from tessera.peer.cli.model_files import FetchError
from tessera.stages.assembly.stage import load_stage
from tessera.stages.weights import registry
from tessera.stages.weights.tensor_table import table_digest, model_id_of
from tessera.stages.weights.synth import CHATML, byte_tokenizer_json

from .fake_hub import FakeHub

transformers = pytest.importorskip("transformers")

REPO = "tiny-org/Tiny-Sharded"
NAME = "Tiny-Sharded"
LAYERS = 6


def sharded_model(folder: Path) -> Path:
    """A random-weight Llama saved in one shard per layer (plus the embedding's and the head's)."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="40KB")
    (folder / "tokenizer.json").write_text(byte_tokenizer_json(300))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


def shards_of(folder: Path) -> dict[str, set[str]]:
    """{shard: the groups of its tensors}."""
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        match = re.match(r"model\.layers\.(\d+)\.", name)
        out.setdefault(file, set()).add(f"layer.{match[1]}" if match else name.split(".")[-2])
    return out


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    folder = sharded_model(tmp_path_factory.mktemp("tiny-sharded"))
    assert len(list(folder.glob("*.safetensors"))) == 8, sorted(folder.iterdir())
    return folder


@pytest.fixture
def hub(model_folder, monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with FakeHub() as hub:
        hub.add(REPO, model_folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub


@pytest.fixture
def whole(hub, model_folder) -> Path:
    """The whole model, imported as `tessera model import` does."""
    return import_model(model_folder, name="whole")


def shard_holding(model_folder: Path, group: str) -> str:
    return next(file for file, groups in shards_of(model_folder).items() if group in groups)


def weight_gets(hub: FakeHub) -> dict[str, list[str | None]]:
    """{shard: the Range of every GET of it} (a whole GET has None)."""
    out: dict[str, list[str | None]] = {}
    for method, path, ranged in hub.requests:
        if method == "GET" and path.endswith(".safetensors"):
            out.setdefault(path.rsplit("/", 1)[1], []).append(ranged)
    return out


def outputs(folder: Path, start: int, end: int) -> torch.Tensor:
    stage = load_stage(folder, start=start, end=end)
    stage.open("s", capacity=8)
    return stage.forward("s", torch.randn(3, 32, generator=torch.Generator().manual_seed(1)), 0)


def test_without_a_swarm_every_shard_is_hashed_once_and_only_the_span_s_are_kept(hub, model_folder, whole):
    folder = fetch_hub_span(REPO, layers=(2, 4), log=lambda _: None)
    assert folder == registry.models_root() / NAME
    kept = {p.name for p in folder.glob("*.safetensors")}
    assert kept == {shard_holding(model_folder, "layer.2"), shard_holding(model_folder, "layer.3")}
    gets = weight_gets(hub)
    assert set(gets) == set(shards_of(model_folder)) and all(r == [None] for r in gets.values()), gets  # once each
    manifest = registry.read_manifest(folder)
    assert manifest["partial"] and manifest["source"]["manifest"] == "computed"
    assert manifest["model_id"] == registry.model_id(whole)  # the id `model import` computes from the whole
    assert registry.verify(folder) == [] and held_layers(folder) == ((2, 4),)
    assert torch.equal(outputs(folder, 2, 4), outputs(whole, 2, 4))
    assert not (folder / ".hub-tables").exists() and not (folder / ".span-fetch.json").exists()

    # again, for more layers: the manifest it has is kept; only the new layers' tensors come, by ranges
    hub.requests.clear()
    fetch_hub_span(REPO, layers=(2, 5), log=lambda _: None)
    gets = weight_gets(hub)
    assert set(gets) == {shard_holding(model_folder, "layer.4")} and None not in gets[shard_holding(model_folder, "layer.4")]
    assert held_layers(folder) == ((2, 5),)


async def test_with_a_swarm_the_manifest_is_the_holders_and_the_hub_serves_only_the_span_s_bytes(
        hub, model_folder, whole, tmp_path):
    """A holder of the whole model gives the manifest; the span's tensors come from it and from the
    hub at once (every range the hub is asked for lies in a tensor of the span, or a header of its
    shards; no other shard is asked for)."""
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    lines: list[str] = []
    async with AsyncExitStack() as stack:
        holder = await stack.enter_async_context(open_memory_transport(network, "A"))
        WeightSource(holder, whole, name=NAME, limits=WeightLimits(rate=50_000.0))  # a volunteer's slow uplink
        folder = await fetch_span(REPO, layers=(0, 2), join=["/memory/0/p2p/A"], log=lines.append,
                                  open_transport=lambda key: open_memory_transport(network, "C"))
    manifest = registry.read_manifest(folder)
    assert manifest["model_id"] == registry.model_id(whole) and manifest["source"]["manifest"] == "swarm"
    assert held_layers(folder) == ((0, 2),) and registry.verify(folder) == []
    assert torch.equal(outputs(folder, 0, 2), outputs(whole, 0, 2))
    span_files = {shard_holding(model_folder, g) for g in ("embed_tokens", "layer.0", "layer.1")}
    gets = weight_gets(hub)
    assert set(gets) <= span_files and None not in sum(gets.values(), []), gets  # only ranges, only the span's shards
    entries = manifest["tensors"]["entries"]
    for file, ranges in gets.items():
        data_at = 8 + int.from_bytes((model_folder / file).read_bytes()[:8], "little")
        spans = [(data_at + e["begin"], data_at + e["end"]) for e in entries.values()
                 if e["file"] == file and e["group"] in {"embed", "layer.0", "layer.1"}]
        for ranged in ranges:
            a, b = (int(x) for x in ranged.removeprefix("bytes=").split("-"))
            assert b < data_at or any(lo <= a and b < hi for lo, hi in spans), (file, ranged)
    assert any("from the hub and 1 peer" in line for line in lines), lines  # both served


def test_a_tampered_shard_is_refused(hub, model_folder, whole):
    """A mirror serving other bytes for layer 3's shard: without a swarm the shard's sha256 is not
    the hub's listing's; with the manifest known, its chunk does not match and the hub is dropped."""
    tampered = shard_holding(model_folder, "layer.3")
    hub.tamper.add(tampered)
    with pytest.raises(FetchError, match=f"{tampered}.*sha256"):
        fetch_hub_span(REPO, layers=(2, 4), log=lambda _: None)
    hub.tamper.clear()
    folder = fetch_hub_span(REPO, layers=(2, 3), log=lambda _: None)  # layer 2's shard alone is kept
    hub.tamper.add(tampered)
    lines: list[str] = []
    with pytest.raises(WeightsUnavailable, match="layers.3"):
        fetch_hub_span(REPO, layers=(2, 4), log=lines.append)
    assert any("banned the hub" in line and "corrupt chunk" in line for line in lines), lines
    assert held_layers(folder) == ((2, 3),)  # nothing of layer 3 was kept
    assert registry.verify(folder) == []


async def test_a_swarm_manifest_that_is_not_the_repository_s_is_refused(hub, model_folder, tmp_path):
    """A holder of another model (its config changed) answers for the name: its manifest's files
    are not the repository's, and nothing is fetched."""
    other = tmp_path / "other-src"
    shutil.copytree(model_folder, other)
    config = json.loads((other / "config.json").read_text()) | {"rms_norm_eps": 1e-5}
    (other / "config.json").write_text(json.dumps(config))
    liar = import_model(other, name="liar")
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        holder = await stack.enter_async_context(open_memory_transport(network, "L"))
        WeightSource(holder, liar, name=NAME)
        with pytest.raises(ManifestRejected, match=r"is not tiny-org/Tiny-Sharded@\w+ on .*: config.json: its sha256"):
            await fetch_span(REPO, layers=(0, 2), join=["/memory/0/p2p/L"], log=lambda _: None,
                             open_transport=lambda key: open_memory_transport(network, "C"))
    assert not [r for r in weight_gets(hub).values() if r]  # no weights were asked for


async def test_a_manifest_whose_table_does_not_describe_the_hub_s_file_is_refused_at_its_header(hub, whole, tmp_path):
    """The files' hashes are the repository's but the table is forged (two tensors' byte ranges
    swapped, consistently rehashed into another id): the hub's header of the file says otherwise,
    and the hub is dropped before a byte of weights is asked for."""
    manifest = registry.read_manifest(whole)
    entries = json.loads(json.dumps(manifest["tensors"]["entries"]))
    q, k = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    for key in ("begin", "end"):
        entries[q][key], entries[k][key] = entries[k][key], entries[q][key]
    chunk = manifest["tensors"]["chunk_bytes"]
    tensors = {"chunk_bytes": chunk, "entries": entries, "digest": table_digest(entries, chunk)}
    forged = {**manifest, "tensors": tensors, "model_id": model_id_of(manifest["files"], tensors)}
    folder = tmp_path / "forged"
    folder.mkdir()
    registry.save_manifest(folder, {**forged, "partial": True})
    lines: list[str] = []
    fetcher = Fetcher(None, folder, forged, out=lines.append, hub=HubSource(HubRepo(hub.url, REPO, hub.repos[REPO].refs["main"]), forged))
    with pytest.raises(WeightsUnavailable):
        await fetcher.fetch_groups([], {"layer.1"}, label="layer 1")
    assert any("is not the file the manifest describes" in line for line in lines), lines
    assert all(r in ("bytes=0-7",) or r.startswith("bytes=8-") for rs in weight_gets(hub).values() for r in rs)


async def test_a_peer_whose_span_moves_fetches_the_new_layers_from_the_hub(hub, model_folder, whole):
    """The folder names its hub: a later span (the peer's claim moved) comes from it with no peer holding it."""
    folder = await fetch_span(REPO, layers=(4, 6), log=lambda _: None)
    hub.requests.clear()
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    lines: list[str] = []
    async with open_memory_transport(network, "C") as me:
        progress = await ensure_span(me, folder, (1, 3), [], out=lines.append)
    assert progress is not None and list(progress.by_peer) == [HubRepo.from_source(registry.read_manifest(folder)["source"]).label]
    assert "from the hub" in lines[-1], lines
    assert held_layers(folder) == ((1, 3), (4, 6))
    assert set(weight_gets(hub)) == {shard_holding(model_folder, "layer.1"), shard_holding(model_folder, "layer.2")}
    assert torch.equal(outputs(folder, 1, 3), outputs(whole, 1, 3))


def test_what_a_span_fetch_refuses(hub, whole):
    registry.models_root().mkdir(parents=True, exist_ok=True)
    shutil.copytree(whole, registry.models_root() / NAME, symlinks=True)  # another model under the name
    (registry.models_root() / NAME / "manifest.json").write_text(json.dumps(
        {**registry.read_manifest(whole), "source": {"imported": "/elsewhere"}}))
    with pytest.raises(FetchError, match="registered already .*give --name"):
        fetch_hub_span(REPO, layers=(0, 2), log=lambda _: None)
    with pytest.raises(FetchError, match="outside the model's 6 layers"):
        fetch_hub_span(REPO, layers=(4, 9), register_as="tiny-part", log=lambda _: None)
    with pytest.raises(ManifestRejected, match="not the f{32} asked for"):
        fetch_hub_span(REPO, layers=(0, 2), register_as="tiny-part", model_id="f" * 32, log=lambda _: None)
    assert not weight_gets(hub) or all(len(r) == 1 for r in weight_gets(hub).values())
    # a whole model of this repository and commit, fetched before, is not fetched again
    full = fetch_hub_span(REPO, layers=(0, LAYERS), register_as="tiny-all", log=lambda _: None)
    assert not registry.read_manifest(full).get("partial")  # every shard was kept whole
    lines: list[str] = []
    fetch_hub_span(REPO, layers=(1, 2), register_as="tiny-all", log=lines.append)
    assert "already whole" in lines[-1]
