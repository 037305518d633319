"""Shipped checkpoints through a real swarm: greedy tokens are the dequantized reference's.

Five checkpoints, each served by a swarm of two peer processes split mid-model (layers [0, 1)
and [1, 3)), the swarms started side by side in one module fixture (a swarm is one model:
a peer refuses to join peers of another model id, which covers the shipped bytes): an FP8 MoE
(its attention fp8 too), MXFP4 experts, and a GGUF Llama mixing every ggml block type tessera computes
(the k-quants, the IQ types, llama.cpp's MXFP4 and NVFP4, Q8_0, Q4_0, Q4_1) — each format, and a Llama
block and an MoE family — and two MoEs of the 4-bit safetensors forms: NVFP4 in ModelOpt's layout
and compressed-tensors' INT4 with zero points (ten processes start within CI's two cores; the
other checkpoints are held to the same reference locally, test_shipped.py). Then activations
on the wire in the compact forms a requester may ask for (bfloat16, fp8 with a scale per row):
they are not exact, and the answer is only held to run its length.
"""

from __future__ import annotations

import pytest

from tessera.stages.decoding.generate import LocalEngine

from ...swarm_helpers import layer_args
from ..families.conformance import EOS, PROMPT, until_eos

pytestmark = pytest.mark.slow

SWARMED = ["fp8-moe", "mxfp4-moe", "gguf-llama-every-type", "nvfp4-moe-modelopt", "int4-moe-asym"]
SPANS = [(0, 1), (1, 3)]
TOKENS = 10


@pytest.fixture(scope="module")
def swarms(shipped, tmp_path_factory):
    """name -> its running 2-peer LocalSwarm, all started at once."""
    from tessera.peer.cli.demo import LocalSwarm, wait_for_line

    running = {name: LocalSwarm(len(SPANS), model=str(shipped[name][0]), extra_args=layer_args(SPANS),
                                base_dir=tmp_path_factory.mktemp(name))
               for name in SWARMED}
    try:
        for one in running.values():
            one.spawn(0, [])
        for one in running.values():
            first = one.addrs[0] = wait_for_line(one.logs[0], one.procs[0], "listening on", prefix="listening on ")
            one.spawn(1, [first])
        for one in running.values():
            for i in range(len(SPANS)):
                one.wait_ready(i)
        yield running
    finally:
        for one in running.values():
            one.stop(timeout=15)


def reference_tokens(folder) -> list[int]:
    return LocalEngine(folder, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=TOKENS)


async def test_each_shipped_checkpoint_through_two_peers_is_its_reference(swarms, shipped):
    from tessera.peer.request.client import Swarm

    for name in SWARMED:
        folder, reference = shipped[name]
        want = reference_tokens(reference)
        assert want == reference_tokens(folder), f"{name}: locally"
        async with Swarm.join(swarms[name].addrs[:1], model=folder) as requester:
            got = [t async for t in requester.generate_ids(PROMPT, max_new_tokens=TOKENS)]
        assert got == until_eos(want), f"{name}: through the swarm"


@pytest.mark.parametrize("form, share", [("bfloat16", 0.6), ("fp8", 0.35)])  # of float32: 1/2 and 1/4, plus headers
async def test_compact_activations_on_the_wire(swarms, shipped, form, share):
    """A requester asking for a compact form gets an answer of its length through the same peers, and
    every activation it sends and receives is that form's size (the peers' outputs included: what they
    attest is what the next hop decodes). Not exact: its error on a real model is measured by
    bench/wire_forms.py and stated in docs/pages/quantization.md."""
    from tessera.peer.request.client import Swarm
    from tessera.peer.request.ports import CheckPolicy
    from tessera.store import events
    from tessera.store.trace import MemoryTracer

    folder = shipped["fp8-moe"][0]
    sizes = {}
    for wire in ("", form):
        tracer = MemoryTracer()
        async with Swarm.join(swarms["fp8-moe"].addrs[:1], model=folder, wire=wire, tracer=tracer) as requester:
            got = [t async for t in requester.generate_ids(PROMPT, max_new_tokens=TOKENS)]
            if wire:
                with pytest.raises(ValueError, match="spot checks need exact activations"):
                    async for _ in requester.generate_ids(PROMPT, max_new_tokens=2, spot_check=CheckPolicy(rate=1.0)):
                        pass
        assert len(got) == TOKENS or got[-1] == EOS
        # the smallest frames are one token's: the requester's input to the first peer, the peers' outputs
        sizes[wire] = [min(e.event.bytes for e in tracer.of_kind(kind)) for kind in (events.Push, events.Receive)]
    for exact, compact in zip(sizes[""], sizes[form]):
        assert compact <= share * exact, (form, sizes)
