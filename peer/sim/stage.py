"""What a simulated peer computes: nothing, at the price its advertised speed says.

`SimStage` has `tessera.stages.engine.stage.Stage`'s interface (open / forward / rollback /
close / session_bytes, spec, start, end, weight_bytes) and its checks (spans,
capacity, positions), but holds no weights: `forward` returns its input and
counts the work — tokens x layers. `cost_model` is the `StageServer.run_compute`
that a simulation plugs in: it runs the step (decrypt, check, "compute",
encrypt — the real peer code) and then sleeps, on trio's clock, the time the
work takes at the peer's throughput::

    seconds = n_tokens * n_layers / throughput     (throughput: tokens/s through one layer)

The same formula that `peer/plan/routing.py` prices a hop with, so a simulated swarm
runs exactly as fast as its advertisements claim.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Awaitable, Callable, Hashable, Sequence

import torch
import trio

from tessera.stages.errors import ContextOverflow, SpanError, UnknownSession
from tessera.stages.kernels.quant import NO_QUANT
from tessera.stages.engine.sessions import check_session
from tessera.stages.families.models.llama import llama_spec
from tessera.stages.families.spec.model import ModelSpec

FLOAT32_BYTES = 4


def sim_spec(num_layers: int = 30, hidden_size: int = 576, *, max_position: int = 8192) -> ModelSpec:
    """A model shape for simulation (by default SmolLM2-135M's: 30 layers, hidden 576)."""
    heads = max(1, hidden_size // 64)
    kv_heads = 3 if heads % 3 == 0 else 1
    return llama_spec(
        vocab_size=49152, hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3, num_layers=num_layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=max(2, hidden_size // heads) // 2 * 2, max_position=max_position,
    )


def sim_model_id(spec: ModelSpec) -> str:
    """A model id for a weightless model: the hash of its shape."""
    blob = json.dumps(spec.as_dict(), sort_keys=True, default=str).encode()
    return "sim-" + hashlib.sha256(blob).hexdigest()[:32]


@dataclass
class _Session:
    start: int
    end: int
    capacity: int
    length: int = 0


class SimStage:
    """Layers [start, end) of a weightless model: Stage's interface and checks, no math."""

    def __init__(self, spec: ModelSpec, start: int, end: int) -> None:
        if not 0 <= start <= end <= spec.num_layers:
            raise SpanError(f"span [{start}, {end}) is outside [0, {spec.num_layers})")
        self.spec = spec
        self.start = start
        self.end = end
        self.sessions: dict[Hashable, _Session] = {}
        self.embedding = self.norm = self.head = None
        self.work = 0  # layer-tokens computed since the last take_work()

    def open(self, session: Hashable, *, capacity: int, start: int | None = None, end: int | None = None) -> None:
        start, end = check_session((self.start, self.end), start, end, capacity, self.spec.max_position)
        self.sessions[session] = _Session(start, end, capacity)

    def close(self, session: Hashable) -> None:
        self.sessions.pop(session, None)

    def _session(self, session: Hashable) -> _Session:
        try:
            return self.sessions[session]
        except KeyError:
            raise UnknownSession(f"no session {session!r} on this stage") from None

    def position(self, session: Hashable) -> int:
        return self._session(session).length

    def rollback(self, session: Hashable, position: int) -> None:
        state = self._session(session)
        if not 0 <= position <= state.length:
            raise ContextOverflow(f"cannot roll back to {position!r}: the cache holds positions [0, {state.length})")
        state.length = position

    def session_bytes(self, capacity: int, start: int | None = None, end: int | None = None) -> int:
        start = self.start if start is None else start
        end = self.end if end is None else end
        return self.spec.state_bytes(start, end, capacity, FLOAT32_BYTES)  # fixed + per position, per layer kind

    def forward(self, session: Hashable, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Check like Stage.forward, count tokens x layers, return the input as wide as the hop out of the
        span (unchanged but for the per-layer inputs its layers would have used: ModelSpec.hop_width)."""
        state = self._session(session)
        width = self.spec.hop_width(state.start)
        if hidden.dim() != 2 or hidden.shape[1] != width:
            raise SpanError(f"hidden states have shape {tuple(hidden.shape)!r}, expected [T, {width}]")
        t = hidden.shape[0]
        if start_pos < 0 or start_pos > state.length:
            raise ContextOverflow(f"write at position {start_pos!r} but the cache holds positions [0, {state.length})")
        if start_pos + t > state.capacity:
            raise ContextOverflow(f"positions up to {start_pos + t} exceed this session's capacity of {state.capacity}")
        state.length = start_pos + t
        self.work += t * (state.end - state.start)
        return hidden[:, : self.spec.hop_width(state.end)]

    def take_work(self) -> int:
        work, self.work = self.work, 0
        return work

    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        raise SpanError("a simulated stage holds no embedding")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise SpanError("a simulated stage holds no head")

    @property
    def weight_bytes(self) -> int:
        return self.spec.layer_bytes(FLOAT32_BYTES) * (self.end - self.start)


def cost_model(stage_of: Callable[[], SimStage], throughput: float) -> Callable[[Callable[[], object]], Awaitable[object]]:
    """A `StageServer.run_compute`: run the step, then sleep work / throughput on trio's clock.

    `stage_of` returns the server's current stage (a peer that moves swaps it).
    The step's own report of compute seconds (wall time of a no-op) is replaced
    by the modelled seconds, so traces show simulated durations.
    """
    if not throughput > 0:
        raise ValueError(f"throughput must be > 0 tokens/s per layer, got {throughput!r}")

    async def run(step: Callable[[], object]) -> object:
        frames, _wall = step()  # type: ignore[misc]
        seconds = stage_of().take_work() / throughput
        await trio.sleep(seconds)
        return frames, seconds

    return run


class SimCompute:
    """A simulated peer's stage loader (peer/node/parts.py `Compute`): weightless `SimStage`s,
    "loaded" in a modelled delay, computed by the cost model at `compute_throughput` (default:
    `throughput`, what `measure` reports and the peer advertises).

    It advertises what a default record says (float32 on a CPU, no device memory), and
    measures nothing: the peer's speed is the scenario's.
    """

    quant = NO_QUANT
    itemsize = FLOAT32_BYTES
    dtype_name = "float32"
    device_type = "cpu"
    device_name = "simulated"
    last_check = None  # no weights, nothing checked

    def __init__(self, spec: ModelSpec, model_id: str, throughput: float, *, load_seconds_per_layer: float,
                 first_load_seconds: float | None = None, compute_throughput: float | None = None) -> None:
        self.spec = spec
        self.model_id = model_id
        self.throughput = throughput
        self.compute_throughput = compute_throughput or throughput
        self.load_seconds_per_layer = load_seconds_per_layer
        self._first_load = first_load_seconds  # the scenario's time for the first span, if it says

    def prepare(self) -> None:
        pass

    def memory_offered(self, memory_gb: float | None) -> int:
        return int((memory_gb or 0.0) * (1 << 30))

    def device_memory(self) -> dict | None:
        return None

    async def measure(self) -> float:
        return self.throughput  # no checkpoint: measuring takes no simulated time

    async def load(self, start: int, end: int) -> SimStage:
        seconds, self._first_load = self._first_load, None
        await trio.sleep(seconds if seconds is not None else (end - start) * self.load_seconds_per_layer)
        return SimStage(self.spec, start, end)

    def serve_with(self, server) -> None:
        server.run_compute = cost_model(lambda: server.stage, self.compute_throughput)

    def describe(self) -> str:
        return (f"simulated at {self.compute_throughput:g} tokens/s per layer"
                + (f" (advertising {self.throughput:g})" if self.compute_throughput != self.throughput else ""))


__all__ = ["SimStage", "SimCompute", "sim_spec", "sim_model_id", "cost_model"]
