"""Weights from peers, on the in-memory transport: manifests checked against the model id,
every chunk checked, a lying holder banned and the fetch completed from another, a resumed
fetch that does not fetch verified chunks again, a full disk that leaves nothing
half-written behind. A tiny synthetic model, hashed in 4 KiB chunks so that every tensor
has several."""

from __future__ import annotations

import errno
import json
import os
import shutil
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch
import trio
from safetensors import safe_open

from tessera.peer.base.protocols import WEIGHTS_PROTOCOL
from tessera.peer.net.memory import LinkSpec, MemoryNetwork, open_memory_transport
from tessera.peer.net.transport import Channel
from tessera.peer.weights.bootstrap import (
    REQUESTER_GROUPS, FolderWeights, bootstrap_model, ensure_model, ensure_span, held_layers,
)
from tessera.peer.weights.errors import DiskFull, ManifestRejected, WeightsUnavailable
from tessera.peer.weights.fetcher import Fetcher, learn_manifest
from tessera.peer.weights.source import WeightLimits, WeightSource, serve_weights
from tessera.protocol.weights import (
    WeightChunk, WeightChunkRequest, WeightManifest, WeightManifestRequest, WeightRefused,
)
from tessera.stages.weights import registry
from tessera.stages.errors import ModelFormatError
from tessera.stages.weights.registry import held_tensors
from tessera.stages.assembly.stage import load_stage
from tessera.stages.text.tokenizer import Tokenizer
from tessera.stages.weights.tensor_table import check_manifest, groups_for_span, table_digest

CHUNK = 4096
NAME = "tiny"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tessera.peer.cli.model_files import synthesise

    folder = synthesise(tmp_path_factory.mktemp("weights") / NAME, hidden=64, layers=4, heads=4, kv_heads=2,
                        intermediate=128, vocab=300, seed=7)
    registry.write_manifest(folder, chunk_bytes=CHUNK)
    return folder


@pytest.fixture
def liar(model, tmp_path) -> Path:
    """A copy of the model with one byte flipped in every chunk of layer 1 (manifest untouched):
    whichever chunk of layer 1 it is asked for, it lies."""
    folder = tmp_path / "liar" / NAME
    shutil.copytree(model, folder)
    manifest = registry.read_manifest(folder)
    data_at, _ = registry.read_header(folder / "model.safetensors")
    with open(folder / "model.safetensors", "r+b") as f:
        for entry in manifest["tensors"]["entries"].values():
            for start in range(entry["begin"], entry["end"], CHUNK) if entry["group"] == "layer.1" else ():
                f.seek(data_at + start)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0xFF]))
    return folder


async def holders(stack: AsyncExitStack, network: MemoryNetwork, folders: dict[str, Path], **kw) -> dict[str, WeightSource]:
    out = {}
    for peer, folder in folders.items():
        transport = await stack.enter_async_context(open_memory_transport(network, peer))
        out[peer] = WeightSource(transport, folder, name=NAME, **kw)
    return out


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


def span_names(model: Path, start: int, end: int) -> set[str]:
    manifest = registry.read_manifest(model)
    groups = groups_for_span(start, end, 4, tied=False)
    return {n for n, e in manifest["tensors"]["entries"].items() if e["group"] in groups}


# -- the manifest ----------------------------------------------------------------------------


def test_the_tensor_table_is_bound_into_the_model_id(model) -> None:
    manifest = registry.read_manifest(model)
    check_manifest(manifest, expected_id=manifest["model_id"])
    entry = manifest["tensors"]["entries"]["model.layers.2.self_attn.q_proj.weight"]
    assert entry["group"] == "layer.2" and len(entry["chunks"]) == 64 * 64 * 4 // CHUNK
    assert {e["group"] for e in manifest["tensors"]["entries"].values()} >= {"embed", "head", "norm", "layer.3"}
    lied = json.loads(json.dumps(manifest))
    lied["tensors"]["entries"]["model.layers.2.self_attn.q_proj.weight"]["chunks"][3] = "0" * 64
    with pytest.raises(ModelFormatError, match="digest"):
        check_manifest(lied)
    lied["tensors"]["digest"] = table_digest(lied["tensors"]["entries"], CHUNK)  # a consistent lie...
    with pytest.raises(ModelFormatError, match="hashes to"):
        check_manifest(lied)  # ...changes the id
    with pytest.raises(ModelFormatError, match="not the"):
        check_manifest(manifest, expected_id="f" * 32)


def test_an_older_manifest_is_upgraded_in_place_with_the_same_id(model, tmp_path) -> None:
    folder = tmp_path / "old"
    shutil.copytree(model, folder)
    registry.write_manifest(folder)  # default 1 MiB chunks: what a fresh folder gets
    fresh = registry.read_manifest(folder)
    old = {"files": {n: {"sha256": e["sha256"], "bytes": e["bytes"]} for n, e in fresh["files"].items()},
           "model_id": "0123456789abcdef0123456789abcdef", "source": {"x": 1}}
    (folder / "manifest.json").write_text(json.dumps(old))
    assert registry.model_id(folder) == fresh["model_id"]
    on_disk = json.loads((folder / "manifest.json").read_text())
    assert on_disk["format"] == 2 and on_disk["model_id"] == fresh["model_id"] and on_disk["source"] == {"x": 1}
    assert not list(folder.glob(".manifest-*"))  # the temporary file was renamed, not left behind


async def test_a_manifest_is_learned_by_name_or_id_and_checked(model) -> None:
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    model_id = registry.model_id(model)
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"A": model})
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        assert (await learn_manifest(me, ["A"], NAME))["model_id"] == model_id
        assert (await learn_manifest(me, ["A"], model_id))["model_id"] == model_id
        with pytest.raises(ManifestRejected, match="no model"):
            await learn_manifest(me, ["A"], "e" * 32)


# -- fetching ----------------------------------------------------------------------------------


async def test_a_span_is_fetched_from_two_holders_and_loads_exactly(model, tmp_path) -> None:
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"A": model, "B": model})
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["A", "B"], NAME, tmp_path / "models")
        assert registry.model_id(folder) == registry.model_id(model)
        assert (folder / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
        progress = await ensure_span(me, folder, (0, 2), ["A", "B"])
    assert set(progress.by_peer) == {"A", "B"}  # both holders served chunks
    got, want = tensors_of(folder), tensors_of(model)
    assert set(got) == span_names(model, 0, 2)
    assert all(torch.equal(got[n], want[n]) for n in got)
    assert registry.verify(folder) == []  # a partial folder checks what it holds
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    outs = []
    for f in (folder, model):
        stage = load_stage(f, start=0, end=2)
        stage.open("s", capacity=8)
        outs.append(stage.forward("s", hidden, 0))
    assert torch.equal(*outs)


async def test_a_lying_holder_is_banned_and_the_fetch_completes_from_the_other(model, liar, tmp_path) -> None:
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    lines: list[str] = []
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"L": liar, "H": model})
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["H"], NAME, tmp_path / "models")
        fetcher = Fetcher(me, folder, registry.read_manifest(folder), out=lines.append)
        await fetcher.fetch_groups(["L", "H"], {"layer.1"}, label="layer 1")
    assert fetcher.banned == {"L"}
    assert any("banned peer L" in line and "corrupt chunk" in line and "layers.1" in line for line in lines), lines
    got, want = tensors_of(folder), tensors_of(model)
    assert set(got) == span_names(model, 1, 2) and all(torch.equal(got[n], want[n]) for n in got)


async def test_with_only_a_liar_left_the_error_names_the_chunk(model, liar, tmp_path) -> None:
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"L": liar, "H": model})
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["H"], NAME, tmp_path / "models")
        fetcher = Fetcher(me, folder, registry.read_manifest(folder))
        with pytest.raises(WeightsUnavailable, match="layers.1"):
            await fetcher.fetch_groups(["L"], {"layer.1"}, label="layer 1")
    assert not (folder / "model.safetensors").exists()


class FillsUp:
    """A disk that takes `room` writes and then answers ENOSPC."""

    def __init__(self, room: int) -> None:
        self.room = room

    def __call__(self, fd: int, data: bytes, offset: int) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= 1
        return os.pwrite(fd, data, offset)


async def test_disk_full_is_a_clear_error_and_the_restart_resumes_from_verified_chunks(model, tmp_path) -> None:
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"A": model})
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["A"], NAME, tmp_path / "models")
        manifest = registry.read_manifest(folder)
        groups = {"layer.0", "layer.1"}
        total = sum(len(e["chunks"]) for e in manifest["tensors"]["entries"].values() if e["group"] in groups)
        first = Fetcher(me, folder, manifest, write_at=FillsUp(10), streams_per_source=1)
        with pytest.raises(DiskFull, match="disk full"):
            await first.fetch_groups(["A"], groups, label="layers [0, 2)")
        assert not (folder / "model.safetensors").exists()  # nothing half-written is used
        assert first.fetched_chunks == 10
        second = Fetcher(me, folder, manifest)  # the restart: a new fetcher, the same folder
        await second.fetch_groups(["A"], groups, label="layers [0, 2)")
    assert second.fetched_chunks == total - 10  # the ten verified chunks were not fetched again
    assert not list((folder / ".parts").glob("*.part")) and not list(folder.glob(".*.tmp"))
    got, want = tensors_of(folder), tensors_of(model)
    assert all(torch.equal(got[n], want[n]) for n in got) and len(got) == 18


async def test_disk_full_while_assembling_keeps_the_old_file(model, tmp_path) -> None:
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"A": model})
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["A"], NAME, tmp_path / "models")
        manifest = registry.read_manifest(folder)
        await Fetcher(me, folder, manifest).fetch_groups(["A"], {"layer.0"}, label="layer 0")
        before = (folder / "model.safetensors").read_bytes()
        layer1 = sum(len(e["chunks"]) for e in manifest["tensors"]["entries"].values() if e["group"] == "layer.1")
        with pytest.raises(DiskFull):  # every chunk fits; the assembled file does not
            await Fetcher(me, folder, manifest, write_at=FillsUp(layer1 + 1)).fetch_groups(["A"], {"layer.1"}, label="layer 1")
    assert (folder / "model.safetensors").read_bytes() == before
    assert not list(folder.glob(".*.tmp"))


# -- the holder's side ---------------------------------------------------------------------------


async def test_the_holder_refuses_what_it_does_not_serve_and_limits_streams(model) -> None:
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    model_id = registry.model_id(model)
    async with AsyncExitStack() as stack:
        (source,) = (await holders(stack, network, {"A": model}, limits=WeightLimits(streams_per_peer=2))).values()
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        channels = [Channel(await me.open_stream("A", WEIGHTS_PROTOCOL))]
        for ask, refused in [
            (WeightChunkRequest(model_id, "nope", 0), "no tensor"),
            (WeightChunkRequest(model_id, "model.norm.weight", 99), "no chunk 99"),
            (WeightChunkRequest("a" * 32, "model.norm.weight", 0), "no model"),
            (WeightChunkRequest(model_id, "model.safetensors", 0, True), "tensor by tensor"),
            (WeightManifestRequest("other"), "no model 'other'"),
        ]:
            await channels[0].send(ask)
            reply = await channels[0].receive()
            assert isinstance(reply, WeightRefused) and refused in reply.reason, reply
        await channels[0].send(WeightManifestRequest(NAME, with_manifest=False))  # a survey: holdings only
        survey = await channels[0].receive()
        assert isinstance(survey, WeightManifest) and survey.manifest == b"" and "layer.3" in survey.held
        channels.append(Channel(await me.open_stream("A", WEIGHTS_PROTOCOL)))
        await channels[1].send(WeightChunkRequest(model_id, "model.norm.weight", 0))
        assert isinstance(await channels[1].receive(), WeightChunk)
        channels.append(Channel(await me.open_stream("A", WEIGHTS_PROTOCOL)))
        busy = await channels[2].receive()  # the third stream from one peer is over the limit
        assert isinstance(busy, WeightRefused) and "busy" in busy.reason
        await channels[0].stream.write(b"\x05garbage")  # garbage resets that stream only
        await channels[1].send(WeightChunkRequest(model_id, "model.norm.weight", 0))
        assert isinstance(await channels[1].receive(), WeightChunk)
        assert source.bytes_served == 2 * 64 * 4


class FromAddress:
    """A memory stream as if it came from `addr` (the in-memory transport has no addresses)."""

    def __init__(self, inner, addr: str) -> None:
        self._inner = inner
        self.remote_addr = addr

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


async def squat(stack: AsyncExitStack, network: MemoryNetwork, peer: str, holder: str, streams: int) -> list[Channel]:
    """`streams` weights streams of a throwaway identity `peer` to `holder`, each admitted (its one
    survey answered) and then held open, idle: what costs an attacker nothing."""
    transport = await stack.enter_async_context(open_memory_transport(network, peer))
    held = []
    for _ in range(streams):
        channel = Channel(await transport.open_stream(holder, WEIGHTS_PROTOCOL))
        await channel.send(WeightManifestRequest(NAME, with_manifest=False))
        assert isinstance(await channel.receive(), WeightManifest)
        held.append(channel)
    return held


async def test_throwaway_identities_holding_every_upload_slot_do_not_lock_a_fetcher_out(model, tmp_path) -> None:
    """8 identities holding 4 idle streams each fill a holder's 32 upload slots. A fetcher that
    comes then takes the places of the identities that hold the most (peer/net/intake.py's
    policy), each told "busy", and gets its span; before, it was refused ("busy") on every stream
    until the squatters' streams idled out, and the fetch failed."""
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        (source,) = (await holders(stack, network, {"A": model})).values()
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["A"], NAME, tmp_path / "models")
        squatters = [ch for i in range(8) for ch in await squat(stack, network, f"X{i}", "A", 4)]
        assert source.places.snapshot()["streams"] == 32
        told: list[object] = []
        four_told = trio.Event()

        async def listen(channel: Channel) -> None:  # the evicted are told why, in the protocol's words
            reply = await channel.receive_or_none()
            if isinstance(reply, WeightRefused) and reply.reason.startswith("busy"):
                told.append(reply)
                if len(told) == 4:
                    four_told.set()

        async with trio.open_nursery() as nursery:
            for channel in squatters:
                nursery.start_soon(listen, channel)
            with trio.fail_after(20):
                progress = await ensure_span(me, folder, (0, 2), ["A"])
                await four_told.wait()
            nursery.cancel_scope.cancel()
        assert progress is not None and set(progress.by_peer) == {"A"}
        assert len(told) == 4 and source.places.snapshot()["evicted"] == 4  # one per stream the fetcher opened
        assert source.places.snapshot()["streams"] <= 32
    got, want = tensors_of(folder), tensors_of(model)
    assert set(got) == span_names(model, 0, 2) and all(torch.equal(got[n], want[n]) for n in got)


async def test_one_address_holds_at_most_its_share_of_upload_slots(model) -> None:
    """Throwaway identities behind one address share `streams_per_address` places (8); a fetcher
    from another address is not held up by them."""
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    crowd, elsewhere = "/ip4/203.0.113.5/tcp/4001", "/ip4/198.51.100.7/tcp/4001"
    async with AsyncExitStack() as stack:
        holder = await stack.enter_async_context(open_memory_transport(network, "A"))
        source = WeightSource(holder, model, name=NAME)
        where = {f"X{i}": crowd for i in range(5)} | {"C": elsewhere}
        holder.set_handler(WEIGHTS_PROTOCOL, lambda stream: source.handle(FromAddress(stream, where[stream.remote])))
        held = {f"X{i}": await squat(stack, network, f"X{i}", "A", 2) for i in range(4)}
        assert source.places.per_ip["203.0.113.5"] == 8
        held["X4"] = await squat(stack, network, "X4", "A", 1)  # a ninth from that address, of a lighter identity:
        assert source.places.per_ip["203.0.113.5"] == 8 and source.places.evicted == 1  # a heavier one gave way
        x0 = network.transports["X0"]
        third = Channel(await x0.open_stream("A", WEIGHTS_PROTOCOL))  # X0 holds as many as the heaviest there
        refused = await third.receive()
        assert isinstance(refused, WeightRefused) and refused.reason.startswith("busy")
        await squat(stack, network, "C", "A", 4)  # another address: all four of its streams admitted
        assert source.places.snapshot()["streams"] == 12


async def test_a_holder_with_a_partial_folder_serves_only_what_it_holds(model, tmp_path) -> None:
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"A": model})
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["A"], NAME, tmp_path / "models")
        await ensure_span(me, folder, (2, 4), ["A"])
        (partial,) = (await holders(stack, network, {"P": folder})).values()
        assert set(partial.held_groups()) == {"layer.2", "layer.3", "head", "norm"}
        other = await stack.enter_async_context(open_memory_transport(network, "D"))
        second = await bootstrap_model(other, ["P"], NAME, tmp_path / "models2")
        fetcher = Fetcher(other, second, registry.read_manifest(second))
        await fetcher.fetch_groups(["P", "A"], {"layer.0", "layer.3"}, label="mixed")
        assert fetcher.last_progress is not None and set(fetcher.last_progress.by_peer) == {"A", "P"}
        assert not fetcher.banned


async def test_a_requester_without_files_fetches_embedding_head_and_tokenizer(model, tmp_path, monkeypatch) -> None:
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    monkeypatch.setenv("TESSERA_MODELS", str(tmp_path / "requester"))
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"A": model})
        join = ["/memory/0/p2p/A"]  # a /memory/ multiaddr: the peer id after /p2p/ is what counts
        folder = await ensure_model(NAME, join, swarm_key=None, groups=REQUESTER_GROUPS,
                                    open_transport=lambda key: open_memory_transport(network, "R"))
        again = await ensure_model(NAME, [], swarm_key=None, groups=REQUESTER_GROUPS)  # all here: no network
    assert folder == again == tmp_path / "requester" / NAME
    assert held_tensors(folder) == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    ours = load_stage(folder, start=0, end=0, embed=True, head=True)
    theirs = load_stage(model, start=0, end=0, embed=True, head=True)
    assert torch.equal(ours.embedding, theirs.embedding) and torch.equal(ours.head, theirs.head)
    assert Tokenizer.from_folder(folder).encode("hello there") == Tokenizer.from_folder(model).encode("hello there")
    with pytest.raises(ModelFormatError, match="no model"):
        await ensure_model("elsewhere", [], swarm_key=None)  # nothing here and nowhere to fetch it from


async def test_no_holder_at_all_is_a_clear_error(model, tmp_path) -> None:
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"A": model})
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["A"], NAME, tmp_path / "models")
        await stack.enter_async_context(open_memory_transport(network, "Q"))  # a peer that serves no weights
        with pytest.raises(WeightsUnavailable, match=r"no peer serves the weights of layers \[0, 1\): asked 1"):
            await Fetcher(me, folder, registry.read_manifest(folder)).fetch_groups(["Q"], {"layer.0"}, label="layers [0, 1)")


async def test_the_upload_rate_per_peer_is_held(model, tmp_path) -> None:
    """Paced by a token bucket: a lower bound on the time (a slow machine only adds to it)."""
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    rate = 100_000.0  # bytes/s
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"A": model}, limits=WeightLimits(rate=rate))
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["A"], NAME, tmp_path / "models")
        started = trio.current_time()
        progress = await Fetcher(me, folder, registry.read_manifest(folder)).fetch_groups(["A"], {"layer.0"}, label="l0")
        elapsed = trio.current_time() - started
    assert elapsed >= (progress.total - CHUNK) / rate, (elapsed, progress.total)


async def test_a_small_file_that_does_not_match_bans_its_sender(model, liar, tmp_path) -> None:
    (liar / "tokenizer.json").write_text((model / "tokenizer.json").read_text().replace("<", "[", 1))
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    lines: list[str] = []
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"L": liar, "H": model})
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["L", "H"], NAME, tmp_path / "models", out=lines.append)
    assert (folder / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    assert any("banned peer L" in line and "tokenizer.json" in line for line in lines), lines


async def test_a_bare_folder_without_manifest_is_whole_and_not_served(model, tmp_path) -> None:
    """A Hugging Face folder given by path has no manifest: nothing to fetch, nothing served."""
    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    (bare / "manifest.json").unlink()
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with open_memory_transport(network, "A") as transport:
        assert serve_weights(transport, bare, enabled=True, rate=0.0) is None
        assert await ensure_span(transport, bare, (0, 2), []) is None
        assert await ensure_model(str(bare), [], swarm_key=None, groups=REQUESTER_GROUPS) == bare
        assert serve_weights(transport, model, enabled=False, rate=0.0) is None  # --no-serve-weights
    assert not (bare / "manifest.json").exists()  # nothing was written into the user's folder


async def test_a_fetch_dials_the_holders_the_view_names_not_only_the_connected_ones(model, tmp_path) -> None:
    """A peer that just joined is connected to the one --join peer that answered; the view names
    the other holders, and `FolderWeights.ensure` dials them first, so that the fetch draws on all
    of them (a resumed fetch in a real swarm was served by one holder of two). A holder that
    cannot be reached is left out."""
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"A": model, "B": model})
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["A"], NAME, tmp_path / "models")
        assert me.connected() == ["A"]
        weights = FolderWeights(folder, serve=False, upload_rate=0.0)
        lines: list[str] = []
        await weights.ensure(me, (0, 2), lines.append, holders=lambda: {"B": ("/memory/1/p2p/B",), "D": ("/memory/9/p2p/D",)})
        assert me.connected() == ["A", "B"]
        assert "from 2 peers" in lines[-1], lines
        # a full folder fetches nothing and does not read the view for holders
        def unread() -> dict:
            raise AssertionError("holders read for a full folder")

        await FolderWeights(model, serve=False, upload_rate=0.0).ensure(me, (0, 2), lines.append, holders=unread)
    assert set(tensors_of(folder)) == span_names(model, 0, 2)


async def test_a_folder_says_which_layers_it_holds_and_how_its_fetch_goes(model, tmp_path) -> None:
    """What the record advertises (re-claims prefer holders) and what the TUI's bar reads."""
    assert held_layers(model) == ((0, 4),)
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    async with AsyncExitStack() as stack:
        await holders(stack, network, {"A": model}, limits=WeightLimits(rate=500_000.0))  # ~0.6 s for 2 layers
        me = await stack.enter_async_context(open_memory_transport(network, "C"))
        folder = await bootstrap_model(me, ["A"], NAME, tmp_path / "models")
        weights = FolderWeights(folder, serve=True, upload_rate=0.0)
        weights.serve(me)
        assert weights.held_layers() == () and weights.fetching() is None
        readings: list[dict] = []

        async def watch() -> None:
            while True:
                reading = weights.fetching()
                if reading is not None:
                    readings.append(reading)
                await trio.sleep(0.02)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await weights.ensure(me, (2, 4), lambda line: None)
            nursery.cancel_scope.cancel()
        assert weights.fetching() is None  # the fetch is over
        assert weights.held_layers() == ((2, 4),)
        assert weights.source is not None and {"layer.2", "layer.3"} <= set(weights.source.held_groups())
        under_way = [r for r in readings if 0 < r["done"] < r["total"]]
        assert under_way, readings
        first = under_way[0]
        assert first["label"] == "layers [2, 4)" and first["peers"] == 1 and first["rate"] > 0
        assert first["eta_s"] is not None and first["eta_s"] > 0
        await weights.ensure(me, (0, 1), lambda line: None)
        assert weights.held_layers() == ((0, 1), (2, 4))
