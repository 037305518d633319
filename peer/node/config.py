"""What a peer is told to do: `PeerConfig` (every `tessera peer` option) and its timings.

The numbers here are the knobs of a peer's life cycle; each says where it comes from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

from tessera.stages.kernels.quant import NO_QUANT, Quant, span_bytes
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.engine.compiled.modes import DEFAULT_COMPILE

from tessera.peer.net.emulated import LinkEmulation
from tessera.peer.base.errors import ConfigError
from tessera.peer.serve.batcher import MAX_BATCH_ROWS, MAX_BATCH_WAIT
from tessera.peer.serve.leaving import MAX_LEAVE_GRACE
from tessera.peer.net.gossip import GOSSIP_INTERVAL
from tessera.peer.net.join import JOIN_TIMEOUT

# An advertisement is valid this long. A peer re-signs it when what it says changes (checked
# every ADVERTISE_INTERVAL) and when RENEW_AFTER of its lifetime is gone; a dead peer's record
# is removed by its neighbours' departure reports, not by expiry (peer/net/gossip.py). A day:
# at ten thousand peers every peer then hears about seven renewals a minute, where a
# 15-second lifetime re-signed every 3 s made it hear 3,300 a second. TESSERA_RECORD_TTL
# (tests only) shortens it, to cover idle periods longer than a lifetime in seconds.
RECORD_TTL = float(os.environ.get("TESSERA_RECORD_TTL", "86400.0"))
ADVERTISE_INTERVAL = min(3.0, RECORD_TTL / 5)
RENEW_AFTER = 0.5  # of a record's lifetime: re-signed then even if nothing changed
# A leaving peer's last record lives this long (or RECORD_TTL, if shorter): long enough to
# reach everyone (B(N) in peer/net/gossip.py is about a minute at 10,000 peers), short enough
# that it does not linger where no neighbour reported the peer gone.
LEAVE_RECORD_TTL = 120.0
PING_INTERVAL = 5.0
# The most seconds running sessions get to finish when the peer stops; each stop sizes its
# grace to the answers in flight, up to this (peer/serve/leaving.py).
LEAVE_GRACE = MAX_LEAVE_GRACE
# How often a peer reconsiders its span. Petals checks every ~2 minutes; a small
# swarm recovers faster with a shorter period, and plan_move's 25% threshold (see
# placement.py) keeps a stable swarm from moving at all. Jittered, so that peers
# judging the same view do not all move at once.
REBALANCE_INTERVAL = 10.0
MOVE_GRACE = 5.0  # seconds running sessions get to finish before a peer moves its span
KV_RESERVE_FRACTION = 0.25  # of the memory offered, kept for sessions' KV caches
DEFAULT_MEMORY_FRACTION = 0.5  # of available RAM, when --memory is not given


@dataclass
class PeerConfig:
    """Everything `tessera peer` accepts (see `peer/cli/peer.py` for the flags)."""

    model: str = "smollm2-135m"
    join: list[str] = field(default_factory=list)
    # where to listen; empty: every interface at port 4001, or a free port if that is taken
    # (peer/net/addresses.py `default_listen`: a volunteer is there to be reached from other machines)
    listen: list[str] = field(default_factory=list)
    dedicated: bool = True  # hot streams on connections of their own where they work (peer/net/dedicated/)
    dedicated_port: int = 0  # where those are taken (0: any free port)
    memory_gb: float | None = None
    layers: tuple[int, int] | None = None
    data_dir: Path = Path.home() / ".local" / "share" / "tessera" / "peer"
    name: str = ""
    threads: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    quant: Quant = NO_QUANT  # how the span's matrices are stored (stages/kernels/quant.py)
    compile: str = DEFAULT_COMPILE  # how decode steps run: auto, off, inductor, cuda-graphs
    swarm_key: bytes | None = None
    max_sessions: int = 16
    max_length: int = 4096
    batch_rows: int = MAX_BATCH_ROWS  # rows of a stacked step of several sessions (peer/serve/batcher.py)
    batch_wait: float = MAX_BATCH_WAIT  # seconds a batch waits for the sessions of the last one
    record_ttl: float = RECORD_TTL
    advertise_interval: float = ADVERTISE_INTERVAL
    leave_grace: float = LEAVE_GRACE  # the cap of the grace a stop gives running answers (--leave-grace)
    rebalance_interval: float = REBALANCE_INTERVAL
    # Periods with no flag of their own (a simulation sets them from its Timings, peer/sim/world.py)
    ping_interval: float = PING_INTERVAL
    gossip_interval: float = GOSSIP_INTERVAL
    move_grace: float = MOVE_GRACE
    emulate_link: LinkEmulation | None = None  # benchmarks only: delay/pace every frame sent
    misbehave: str | None = None  # fault injection (tests, demos): "perturb:P" or "wrong-weights"
    join_timeout: float = JOIN_TIMEOUT  # seconds --join may take before the peer gives up (peer/net/join.py)
    allow_alone: bool = False  # when no --join address answers in time: serve alone instead of exiting
    shard: tuple[int, int] = (0, 1)  # (rank, group size): a rank of a tensor-shard group (needs layers, group)
    group: str = ""  # the shard group's name
    serve_weights: bool = True  # answer other peers' weight fetches from our model folder (peer/weights/)
    weights_upload_rate: float = 0.0  # bytes/s of weights uploaded per fetching peer; 0 = unlimited


@lru_cache(maxsize=256)  # pure, and asked at every advertisement (a simulation: thousands a minute)
def capacity_in_layers(spec: ModelSpec, memory_bytes: int, itemsize: int, quant: Quant = NO_QUANT) -> int:
    """How many layers fit in the memory offered, keeping a share for KV caches: the longest k such
    that EVERY run of k consecutive layers fits, each layer counted at its own bytes (a quantized
    layer its integers and scales: stages/kernels/quant.py `layer_bytes`; a sparse layer all its
    experts, a dense one of the same model far less). Placement may claim any window of that
    length, so none may overflow the memory; a window of lighter layers could hold a few more,
    which placement does not yet use. At least 1."""
    usable = memory_bytes * (1 - KV_RESERVE_FRACTION)
    ends = list(accumulate((span_bytes(spec, i, i + 1, itemsize, quant) for i in range(spec.num_layers)), initial=0))
    k = 0  # ends[s + k] - ends[s]: the bytes of layers [s, s + k)
    while k < spec.num_layers and max(ends[s + k + 1] - ends[s] for s in range(spec.num_layers - k)) <= usable:
        k += 1
    return max(1, k)


def check_memory_offer(spec: ModelSpec, memory_gb: float, itemsize: int, dtype: str,
                       *, layers: tuple[int, int] | None = None, quant: Quant = NO_QUANT) -> None:
    """Raise ConfigError when `memory_gb` cannot hold one layer (its largest: any span holds at least
    one) or the forced span, plus the KV share, saying how many GB it needs — before a peer loads
    weights that do not fit."""
    count = (layers[1] - layers[0]) if layers else 1
    weights = span_bytes(spec, layers[0], min(layers[1], spec.num_layers), itemsize, quant) if layers else max(
        span_bytes(spec, i, i + 1, itemsize, quant) for i in range(spec.num_layers))
    need = weights / (1 - KV_RESERVE_FRACTION)
    if not memory_gb > 0 or memory_gb * (1 << 30) < need:
        what = f"{count} layers" if layers else "one layer"
        raise ConfigError(
            f"--memory {memory_gb:g} GB is too small: {what} of this model in {dtype} needs "
            f"{need / (1 << 30):.3g} GB (weights plus {KV_RESERVE_FRACTION:.0%} kept for KV caches)"
        )
