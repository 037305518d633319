"""A real peer's stage loader: the model's files, torch, the device and dtype it computes in.

The `Compute` (peer/node/parts.py) that peer/node/compose.py gives a `PeerNode`: it resolves
the model, refuses a memory offer that cannot hold one layer, a tensor-shard rank of a
model its group cannot split (a MoE family: ShardError, one line) and a --compile mode the
device cannot run before anything starts, measures one layer's decode speed, loads only the
claimed span's weights — checked against the model's manifest as they are read
(peer/weights/verify.py): a span that differs is refused — and compiles its decode steps
(stages/engine/compiled/; a tensor-shard rank's steps run eagerly), saying what runs eagerly and why.
"""

from __future__ import annotations

from typing import Callable

import psutil
import torch

from tessera.peer.base.errors import ConfigError
from tessera.peer.base.threads import in_worker
from tessera.stages.weights import registry
from tessera.stages.engine.devices import cuda_offer, cuda_reserve, read_device_memory
from tessera.stages.decoding.generate import pick_device, pick_dtype
from tessera.stages.kernels.quant import model_tag
from tessera.stages.shards.sharded import ShardedStage, check_shardable
from tessera.stages.families.catalog import spec_from_file
from tessera.stages.engine.compiled.build import compile_decode, row_buckets
from tessera.stages.engine.compiled.modes import CompileChoiceError, plan_compile
from tessera.stages.engine.speed import measure_layer_throughput
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage

from tessera.peer.node.config import DEFAULT_MEMORY_FRACTION, PeerConfig, check_memory_offer
from tessera.peer.weights.verify import WeightCheck


class TorchCompute:
    """Layers of a model on this machine's device (see the module docstring)."""

    def __init__(self, config: PeerConfig, *, out: Callable[[str], None] | None = None) -> None:
        self.out = out or (lambda line: print(line, flush=True))  # as PeerNode's lines (compile progress)
        self.folder = registry.resolve(config.model)
        # the manifest must hash to its model id (raises ModelFormatError), and config.json and the
        # other small files must be the ones it lists (raises WeightsMismatch) before one is read;
        # what was checked of the weights is remembered in the data dir, so an untouched file is
        # not hashed again at every start
        self.weight_check = WeightCheck.for_peer(self.folder, config.data_dir)
        self.spec = spec_from_file(self.folder / "config.json")
        self.quant = config.quant
        self.shard = config.shard
        if self.shard[1] > 1:  # a model whose layers a group cannot split is refused before anything starts
            check_shardable(self.spec, self.shard[1], self.shard[0])
        # the advertised id carries the quantization: requesters chain only what they accept
        self.model_id = model_tag(registry.model_id(self.folder), self.quant)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device, self.quant)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.device_type = self.device.type
        self.device_name = str(self.device)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        if config.memory_gb is not None:  # refused before anything starts (raises ConfigError)
            check_memory_offer(self.spec, config.memory_gb, self.itemsize, self.dtype_name,
                               layers=config.layers, quant=self.quant)
        self.threads = config.threads
        self.compile = config.compile
        self.compile_rows = row_buckets(config.batch_rows)  # a peer that never stacks more compiles no more
        try:  # a mode this device cannot run is refused before anything starts
            plan_compile(self.compile, self.device.type, quantized=self.quant.active)
        except CompileChoiceError as bad:
            raise ConfigError(str(bad)) from None
        self._vram_offer: int | None = None
        self.last_check: str | None = None  # what the last load's weight check did (a line for the log)

    def prepare(self) -> None:
        """--threads, set in the thread the peer runs in (torch's setting is per process, OpenMP's per thread)."""
        if self.threads:
            torch.set_num_threads(self.threads)

    def memory_offered(self, memory_gb: float | None) -> int:
        """Bytes offered: --memory; on CUDA the card's free memory less a reserve (read once, before
        anything is loaded: afterwards our own weights would count as taken); else half the free RAM."""
        if memory_gb is not None:
            return int(memory_gb * (1 << 30))
        if self.device.type == "cuda":
            if self._vram_offer is None:
                card = read_device_memory(self.device)
                self._vram_offer = cuda_offer(card.free, card.total, cuda_reserve(card.total))
            return self._vram_offer
        return int(psutil.virtual_memory().available * DEFAULT_MEMORY_FRACTION)

    def device_memory(self) -> dict | None:
        """Free and total memory of a CUDA device (for the record and the TUI); None elsewhere."""
        card = read_device_memory(self.device)
        return {"free": card.free, "total": card.total} if card.kind == "cuda" else None

    async def measure(self) -> float:
        """One layer's decode speed, tokens/s (in a worker thread: it runs torch)."""
        return await in_worker(
            lambda: measure_layer_throughput(self.spec, device=self.device, dtype=self.dtype, quant=self.quant)
        )

    async def load(self, start: int, end: int) -> Stage | ShardedStage:
        """The span's stage, its weights checked against the manifest. Raises WeightsMismatch."""
        return await in_worker(lambda: self._load_checked(start, end))

    def _load_checked(self, start: int, end: int) -> Stage | ShardedStage:
        check = self.weight_check.begin()
        index, count = self.shard
        if count > 1:  # only this rank's slices (stages/shards/sharded.py): hashed from the files first
            if check is not None:
                layers = {f"layer.{i}" for i in range(start, end)}
                check.verify_files(n for n, e in check.entries.items() if e["group"] in layers)
            stage = ShardedStage.load(self.folder, start=start, end=end, index=index, count=count,
                                      device=self.device, dtype=self.dtype)
            if self.compile != "off":  # decoded eagerly
                self.out("decode steps: eager (a tensor-shard rank's steps have no compiled form)")
        else:
            stage = load_stage(self.folder, start=start, end=end, device=self.device, dtype=self.dtype,
                               quant=self.quant, check=check)
        if check is not None:
            check.commit()
            self.last_check = check.summary()
        if count == 1:  # compiled once the weights are known good
            plan = compile_decode(stage, self.compile, say=self.out, buckets=self.compile_rows)
            self.out(f"decode steps: {plan.backend or 'eager'} ({plan.reason})")
        return stage

    def serve_with(self, server) -> None:
        """A real server computes in worker threads (its default `run_compute`)."""

    def describe(self) -> str:
        """'cpu float32, 1 thread' (for the start-up lines)."""
        threads = torch.get_num_threads()
        return f"{self.device} {self.dtype_name}, {threads} thread{'s' if threads != 1 else ''}"


__all__ = ["TorchCompute"]
