"""What a peer remembers: its sqlite database (tessera.store.db), trace (tessera.store.trace), key file
(tessera.store.keyfile), and the merged, clock-aligned views of many peers' traces
(tessera.store.timeline, tessera.store.export, tessera.store.plot). Depends on sqlite-utils and the stdlib only
(matplotlib for tessera.store.plot, imported when a plot is drawn)."""

from tessera.store.db import PeerStore
from tessera.store.errors import StoreError
from tessera.store.keyfile import load_or_create_key
from tessera.store.reputation import Ban
from tessera.store.trace import EVENT_KINDS, MemoryTracer, NullTracer, Tracer, TraceWriter

__all__ = [
    "Ban",
    "EVENT_KINDS",
    "MemoryTracer",
    "NullTracer",
    "PeerStore",
    "StoreError",
    "TraceWriter",
    "Tracer",
    "load_or_create_key",
]
