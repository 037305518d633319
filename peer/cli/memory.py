"""A peer process gives freed memory back to the system (glibc's malloc, tuned once at start).

glibc serves an allocation of 128 KiB or more with its own mmap, returned on free — until a
freed mmapped block raises the threshold to that block's size (up to 32 MiB) and the trim
threshold to twice that. From then on a peer's KV chunks (a few MB), prefill activations and
frame buffers come from the heap, and what a session frees stays resident: fragments between
live objects are never trimmed. Worker threads add arenas of their own (8 per core), each
keeping its high-water mark. Measured with bench/soak.py --minutes 3 (3 peers, an answer a
minute, a peer killed and one stopped mid-answer): RSS growth after the warm-up answer was
+144 MB on the peer that took over the failed sessions, +81 MB on the stopped one in a
second run; with the thresholds fixed here, +0.4 MB at most.

Fixing the mmap threshold (which also turns the dynamic adjustment off) costs a page-fault
pass over each large block it serves: a few milliseconds for a 2,000-token prefill's
activations, against the hundreds that computing them takes; decode steps allocate far below
it. Elsewhere than glibc (macOS, musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 256 * 1024  # blocks from this size up are mmapped, and unmapped when freed
TRIM_THRESHOLD = 1024 * 1024  # free memory at the heap's top past this is given back
ARENA_MAX = 2  # the event loop's and the workers' (compute runs one step at a time)


def return_freed_memory() -> bool:
    """Tune glibc's malloc as the module docstring says; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_ARENA_MAX, ARENA_MAX)))
