"""VRAM-aware offers (stages/engine/devices.py) and what a peer advertises and shows about its device.

No GPU here: the CUDA arithmetic is a pure function of (free, total, reserve), tested with
those numbers; the one torch.cuda call sits in `read_device_memory`."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import torch
from textual.app import App, ComposeResult

from tessera.peer.cli.options import device_arg
from tessera.protocol.codec import decode, encode
from tessera.protocol.records import PeerRecord
from tessera.stages.engine.devices import CUDA_RESERVE_MIN, cuda_offer, cuda_reserve, read_device_memory
from tessera.stages.decoding.generate import pick_dtype
from tessera.tui.panels import PeerPanel

GIB = 1 << 30


def test_cuda_offer_is_free_memory_less_the_reserve():
    assert cuda_reserve(8 * GIB) == CUDA_RESERVE_MIN  # small card: the 1 GiB floor
    assert cuda_reserve(80 * GIB) == 8 * GIB  # large card: 10%
    assert cuda_offer(20 * GIB, 24 * GIB, cuda_reserve(24 * GIB)) == 20 * GIB - int(2.4 * GIB)
    assert cuda_offer(GIB // 2, 24 * GIB, cuda_reserve(24 * GIB)) == 0  # a busy card offers nothing
    with pytest.raises(ValueError, match="free 5"):
        cuda_offer(5, 4, 0)


def test_cpu_and_mps_rules_stay():
    assert read_device_memory(torch.device("cpu")).kind == "cpu"
    assert read_device_memory(torch.device("cpu")).free == 0
    assert pick_dtype("auto", torch.device("cuda", 1)) == torch.bfloat16
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32


def test_device_option_takes_one_card_of_several():
    assert device_arg("cuda:1") == "cuda:1" and device_arg("auto") == "auto"
    for bad in ("cuda:x", "cpu:0", "tpu"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            device_arg(bad)


def _record(**extra) -> PeerRecord:
    return PeerRecord(
        peer_id=b"\x00" * 38, name="n", model_id="m+int8", start=0, end=4, shard_index=0, shard_count=1,
        throughput=1.0, free_memory=1, load=0.0, max_sessions=1, state="serving", reachability="direct",
        addrs=(), neighbours=(), issued_at=100.0, expires_at=160.0, seq=1, **extra,
    )


def test_record_carries_device_kind_and_free_memory_compatibly():
    gpu = _record(device="cuda", device_free=7 * GIB, dtype="bfloat16")
    back = decode(encode(gpu), expect=PeerRecord)
    assert (back.device, back.device_free, back.model_id) == ("cuda", 7 * GIB, "m+int8")
    old = _record()  # a peer that never sets them: the defaults, and they decode the same
    assert decode(encode(old), expect=PeerRecord) == old and (old.device, old.device_free) == ("cpu", 0)


SNAP = {"model": "smollm2-135m", "model_id": "abcdef0123", "device": "cuda:0", "span": [0, 10], "shard": None,
        "num_layers": 30, "forced_layers": False, "memory_used": 3 * GIB, "memory_offered": 20 * GIB,
        "throughput": 900.0, "quant": "int4g32", "vram": {"free": 17 * GIB, "total": 24 * GIB}}


class OnePanel(App):
    def compose(self) -> ComposeResult:
        yield PeerPanel()


def test_this_peer_panel_shows_vram_on_cuda_only():
    async def scenario() -> tuple[str, str]:  # Textual runs on asyncio (this suite's async tests on trio)
        app = OnePanel()
        async with app.run_test(size=(80, 24)) as pilot:
            panel = app.query_one(PeerPanel)
            panel.snapshot = SNAP
            await pilot.pause()
            gpu = panel.render().plain
            panel.snapshot = {**SNAP, "device": "cpu", "vram": None, "quant": "none"}
            await pilot.pause()
            return gpu, panel.render().plain

    gpu, cpu = asyncio.run(scenario())
    assert "VRAM 17.00 GB free of 24.00 GB" in gpu and "(int4g32)" in gpu
    assert "VRAM" not in cpu and "int4" not in cpu
