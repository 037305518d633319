"""What a peer is told to do: `PeerConfig` (every `tessera peer` option) and its timings.

The numbers here are the knobs of a peer's life cycle; each says where it comes from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from stages.spec import ModelSpec

from .emulated_link import LinkEmulation
from .errors import ConfigError

# An advertisement is valid this long; re-advertised (re-signed, a later expiry) every
# ADVERTISE_INTERVAL, at most a fifth of it, so several refreshes in a row may be lost before
# it expires. TESSERA_RECORD_TTL (tests only) shortens both, to cover idle periods longer
# than a TTL in seconds.
RECORD_TTL = float(os.environ.get("TESSERA_RECORD_TTL", "15.0"))
ADVERTISE_INTERVAL = min(3.0, RECORD_TTL / 5)
PING_INTERVAL = 5.0
LEAVE_GRACE = 10.0  # seconds running sessions get to finish when the peer stops
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
    """Everything `tessera peer` accepts (see `peer/cli_peer.py` for the flags)."""

    model: str = "smollm2-135m"
    join: list[str] = field(default_factory=list)
    listen: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    memory_gb: float | None = None
    layers: tuple[int, int] | None = None
    data_dir: Path = Path.home() / ".local" / "share" / "tessera" / "peer"
    name: str = ""
    threads: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    swarm_key: bytes | None = None
    max_sessions: int = 16
    max_length: int = 4096
    record_ttl: float = RECORD_TTL
    advertise_interval: float = ADVERTISE_INTERVAL
    leave_grace: float = LEAVE_GRACE
    rebalance_interval: float = REBALANCE_INTERVAL
    emulate_link: LinkEmulation | None = None  # benchmarks only: delay/pace every frame sent
    misbehave: str | None = None  # fault injection (tests, demos): "perturb:P" or "wrong-weights"
    shard: tuple[int, int] = (0, 1)  # (rank, group size): a rank of a tensor-shard group (needs layers, group)
    group: str = ""  # the shard group's name


def parse_layers(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B), layers A to B-1."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--layers wants A:B (layers A to B-1), got {text!r}") from None
    if not 0 <= a < b:
        raise ConfigError(f"--layers {text!r} is empty or negative")
    return a, b


def capacity_in_layers(spec: ModelSpec, memory_bytes: int, itemsize: int) -> int:
    """How many layers fit in the memory offered, keeping a share for KV caches."""
    usable = memory_bytes * (1 - KV_RESERVE_FRACTION)
    return max(1, min(spec.num_layers, int(usable // spec.layer_bytes(itemsize))))
