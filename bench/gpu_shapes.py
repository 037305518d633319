"""Realistic span shapes on a GPU, for bench/gpu.py's `shapes` check: 8 layers of a Llama-3-8B and
4 layers of a Qwen3-30B-A3B (MoE: 128 experts, 8 a token), bfloat16, random weights.

A peer serving a real model holds a span like these; compute cost does not depend on the
weights' values. The specs are the families' own (read from transformers' configs of those
shapes, as `tessera model synth` and a checkpoint's config.json are), the layers built straight
on the GPU (no file: generating and reading ~4 GB would cost more of the device's time than
the measurement). Transformers runs the same number of layers of the same config (its own
random weights), through `model.model` on input embeddings, so no embedding or head is timed
on either side.

Per shape and batch (1 and 8 sessions, each at position CONTEXT): decode tok/s eager, with
CUDA graphs, and transformers'; each as a fraction of the HBM bound, the bytes a step must read
(every weight it uses: for the MoE, the attention, the router and the experts the step's rows
picked, counted from the router; plus every row's KV up to its position) / the device's
measured bandwidth (the best of a 2 GiB bf16 matrix-vector product and a 4 GiB reduction).
"""

from __future__ import annotations

import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tessera.stages.engine.compiled.build import compile_decode
from tessera.stages.engine.stage import Stage
from tessera.stages.families.catalog import spec_from_config
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.layers.block import Block
from tessera.stages.layers.moe import MoE

VOCAB = 32000  # the checkpoints' vocabularies are larger; a span holds no embedding, transformers' is unused
CONTEXT = 128  # positions each session holds before the timed steps
STEPS = 48  # timed decode steps per figure
BATCHES = (1, 8)
SHAPES = {
    "llama3-8b x8": lambda t: t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=8192,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
    "qwen3-30b-a3b x4": lambda t: t.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=40960, decoder_sparse_step=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False),
}


def synced(device: torch.device) -> Callable[[], float]:
    """A clock that first waits for the device's queued work."""
    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


def random_stage(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Stage:
    """Every layer of `spec` on `device`, normal(0, 0.02) weights (norms 1), as a Stage without edges."""
    gen = torch.Generator(device).manual_seed(seed)
    blocks = []
    for layer in spec.layers:
        with torch.device("meta"):
            block = Block(spec, layer).to(dtype)
        block = block.to_empty(device=device)
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
        blocks.append(block.requires_grad_(False))
    return Stage(spec, 0, blocks, device=device, dtype=dtype)


def device_bandwidth(device: torch.device, clock: Callable[[], float]) -> float:
    """Bytes/s the device reads: the best of a bf16 matrix-vector product over 2 GiB and a sum over 4 GiB."""
    best = 0.0
    weight = torch.randn(16384, 65536, dtype=torch.bfloat16, device=device)  # 2 GiB
    row = torch.randn(1, 65536, dtype=torch.bfloat16, device=device)
    flat = torch.ones(1 << 31, dtype=torch.bfloat16, device=device)  # 4 GiB
    for run, nbytes in ((lambda: F.linear(row, weight), weight.nbytes), (lambda: flat.sum(), flat.nbytes)):
        run()
        for _ in range(5):
            started = clock()
            run()
            best = max(best, nbytes / (clock() - started))
    del weight, flat
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return best


def step_bytes(stage: Stage, rows: int, position: int, experts_used: list[int]) -> int:
    """Bytes one decode step of `rows` sessions at `position` must read (module docstring)."""
    total = 0
    for block, used in zip(stage.blocks, experts_used):
        dense = sum(p.nbytes for name, p in block.named_parameters() if ".experts." not in name)
        expert = sum(p.nbytes for p in block.mlp.experts[0].parameters()) if isinstance(block.mlp, MoE) else 0
        total += dense + used * expert
    itemsize = torch.empty((), dtype=stage.dtype).element_size()
    kv = sum(spec.bytes(position + 1, itemsize) for spec in stage.cache_specs(stage.start, stage.end))
    return total + rows * kv


def experts_per_step(stage: Stage, rows: int, device: torch.device) -> list[int]:
    """Distinct experts each layer's router picks for `rows` random rows (0 for a dense layer)."""
    x = torch.randn(rows, stage.spec.hidden_size, dtype=stage.dtype, device=device)
    used = []
    with torch.inference_mode():
        for block in stage.blocks:
            if isinstance(block.mlp, MoE):
                _, picks = block.mlp.router.forward(block.mlp_norm.forward(x))
                used.append(int(picks.unique().numel()))
            else:
                used.append(0)
    return used


def ours_rate(stage: Stage, rows: int, clock: Callable[[], float]) -> float:
    """Decode tok/s of `rows` sessions stacked, each at CONTEXT + step (whatever stage.decode is)."""
    gen = torch.Generator().manual_seed(1)
    hidden = stage.spec.hidden_size
    sessions = [("r", i) for i in range(rows)]
    for s in sessions:
        stage.open(s, capacity=CONTEXT + STEPS + 8)
        stage.forward(s, torch.randn(CONTEXT, hidden, generator=gen), 0)
    x = torch.randn(rows, hidden, generator=gen).to(stage.device, stage.dtype)
    for w in range(3):  # warm-up
        stage.forward_batch([(s, x[i : i + 1], CONTEXT + w) for i, s in enumerate(sessions)])
    started = clock()
    for step in range(STEPS):
        stage.forward_batch([(s, x[i : i + 1], CONTEXT + 3 + step) for i, s in enumerate(sessions)])
    elapsed = clock() - started
    for s in sessions:
        stage.close(s)
    return rows * STEPS / elapsed


def hf_rate(model, rows: int, device: torch.device, clock: Callable[[], float]) -> float:
    """transformers' decoder layers (model.model, on input embeddings) over the same steps."""
    hidden = model.config.hidden_size
    with torch.inference_mode():
        embeds = torch.randn(rows, CONTEXT, hidden, dtype=torch.bfloat16, device=device)
        out = model.model(inputs_embeds=embeds, use_cache=True)
        cache = out.cache
        x = torch.randn(rows, 1, hidden, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            cache = model.model(inputs_embeds=x, cache=cache, use_cache=True).cache
        started = clock()
        for _ in range(STEPS):
            cache = model.model(inputs_embeds=x, cache=cache, use_cache=True).cache
        return rows * STEPS / (clock() - started)


def check_shapes(device: torch.device, *, shapes: dict = SHAPES, bandwidth: float | None = None,
                 with_transformers: bool = True) -> list[str]:
    """bench/gpu.py's `shapes` check: one line per (shape, batch). On a CPU (a smoke run of this code
    on small shapes) the graph runner runs uncaptured."""
    import transformers

    from tessera.stages.engine.compiled.cuda_graphs import GraphDecode

    clock = synced(device)
    bandwidth = bandwidth or device_bandwidth(device, clock)
    lines = [f"device bandwidth (best of a 2 GiB bf16 matrix-vector product and a 4 GiB sum): "
             f"{bandwidth / 1e12:.2f} TB/s"]
    for name, make in shapes.items():
        config = make(transformers)
        spec = spec_from_config(json.loads(config.to_json_string()))
        stage = random_stage(spec, device, torch.bfloat16)
        began = time.perf_counter()
        if device.type == "cuda":
            compile_decode(stage, "cuda-graphs", buckets=BATCHES)
        else:
            stage.decode = GraphDecode(stage, buckets=BATCHES, capture=False)
            stage.decode.compile()
        runner, captured = stage.decode, time.perf_counter() - began
        hf = None
        if with_transformers:
            with torch.device(device):
                hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        weights = sum(p.nbytes for p in stage.blocks.parameters())
        for rows in BATCHES:
            need = step_bytes(stage, rows, CONTEXT + 3 + STEPS // 2, experts_per_step(stage, rows, device))
            stage.decode = None
            eager = ours_rate(stage, rows, clock)
            stage.decode = runner
            graphs = ours_rate(stage, rows, clock) if runner is not None else float("nan")
            replayed = runner.steps if runner is not None else 0
            theirs = hf_rate(hf, rows, device, clock) if hf is not None else float("nan")

            def fraction(rate: float) -> float:
                return need * (rate / rows) / bandwidth  # bytes a step / seconds a step / bandwidth

            lines.append(
                f"{name} ({weights / 1e9:.2f} GB bf16; graphs captured in {captured:.0f} s, {replayed} steps "
                f"replayed so far), batch {rows}: {need / 1e9:.3f} GB a step; eager {eager:.0f} tok/s "
                f"({fraction(eager):.2f} of the HBM bound), graphs {graphs:.0f} tok/s ({fraction(graphs):.2f}), "
                f"transformers {theirs:.0f} tok/s ({fraction(theirs):.2f}); graphs/eager {graphs / eager:.2f}x, "
                f"graphs/transformers {graphs / theirs:.2f}x")
        del stage, hf, runner
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return lines
