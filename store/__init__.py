"""What a peer remembers: its sqlite database (store.db), trace (store.trace), key file
(store.keyfile), and the merged, clock-aligned views of many peers' traces
(store.timeline, store.export, store.plot). Depends on sqlite-utils and the stdlib only
(matplotlib for store.plot, imported when a plot is drawn)."""

from .db import PeerStore
from .errors import StoreError
from .keyfile import load_or_create_key
from .reputation import Ban
from .trace import EVENT_KINDS, MemoryTracer, NullTracer, Tracer, TraceWriter

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
