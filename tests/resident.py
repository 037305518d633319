"""What a process holds in memory for a model, read from /proc.

Resident set size (RSS) also counts pages the kernel maps for reasons of its own:
shared libraries' code and data that a first call touches (libtorch_cpu.so is
~500 MB of text; its first matmul maps ~10 MiB here, more on a kernel whose page
cache uses large folios or collapses text into huge pages), and transparent huge
pages that round a sparsely touched region up to 2 MiB (khugepaged collapses a
range holding a single touched page under its default `max_ptes_none`). Neither
depends on the span a peer loaded, and both differ between machines: CI saw about
+56 MiB on every span load that this machine does not show.

So the memory tests measure `held_bytes`: anonymous pages (the heap, torch's
allocations, the KV cache) plus the pages mapped from weight files (a float
span's tensors are views of the memory-mapped safetensors file until written),
in processes that asked the kernel for no huge pages (`no_huge_pages`).

The measuring scripts run in subprocesses with the repository root as their
working directory (`ROOT`), so they can `import tests.resident`.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEIGHT_FILE = re.compile(r"\.(safetensors|gguf)$")
MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
KERNEL_PAGES = ("[vdso]", "[vvar]", "[vvar_vclock]", "[vsyscall]")
PR_SET_THP_DISABLE = 41  # linux/prctl.h; inherited by children across fork and exec


def no_huge_pages(disable: bool = True) -> None:
    """Ask the kernel not to back this process (and the children it starts from now on) with
    transparent huge pages. Raises OSError where the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_THP_DISABLE, int(disable), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE) failed")


def resident_parts(pid: int | str = "self") -> dict[str, int]:
    """Resident bytes by kind of mapping: "anonymous", "weights" (weight files), "other files"
    (libraries, the interpreter), and "huge pages" (anonymous ones, a part of "anonymous")."""
    parts = dict.fromkeys(("anonymous", "weights", "other files", "huge pages"), 0)
    kind = None
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            if MAPPING.match(line):
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) > 5 else ""
                if not path or (path.startswith("[") and path not in KERNEL_PAGES):
                    kind = "anonymous"
                elif WEIGHT_FILE.search(path):
                    kind = "weights"
                else:
                    kind = None if path in KERNEL_PAGES else "other files"
            elif kind is not None and line.startswith("Rss:"):
                parts[kind] += int(line.split()[1]) * 1024
            elif kind == "anonymous" and line.startswith("AnonHugePages:"):
                parts["huge pages"] += int(line.split()[1]) * 1024
    return parts


def held_bytes(pid: int | str = "self") -> int:
    """Resident bytes of the process's anonymous mappings and of its weight-file mappings."""
    parts = resident_parts(pid)
    return parts["anonymous"] + parts["weights"]


def mib(parts: dict[str, int]) -> str:
    """`resident_parts` as one line, for a test's output (read when a memory test fails on
    another machine)."""
    return ", ".join(f"{kind} {size / 2**20:.1f} MiB" for kind, size in parts.items())


# A span of a model folder (argv: folder, start, end) loaded and run in a fresh process: prints the bytes
# it then holds (held_bytes growth), the weights it says it holds, and its KV cache for 64 positions.
SPAN_RSS = """
import gc, sys, torch
from pathlib import Path
from tessera.stages.assembly.stage import load_stage
from tests.resident import held_bytes, mib, no_huge_pages, resident_parts
no_huge_pages()
torch.set_num_threads(1)
folder, start, end = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
warm = load_stage(folder, start=start, end=start + 1)
warm.open("w", capacity=4)
warm.forward("w", torch.zeros(1, warm.spec.hidden_size), 0)  # torch's lazy kernel set-up, not the span
del warm
import tessera.stages.kernels.chunked as chunked
chunked.SCRATCH.__dict__.clear()  # the dequantization buffers count: this thread's made anew for the span
gc.collect()
held_before = held_bytes()
stage = load_stage(folder, start=start, end=end)
stage.open("s", capacity=64)
stage.forward("s", torch.zeros(1, stage.spec.hidden_size), 0)  # every weight touched, the scratch grown
gc.collect()
print('after the span:', mib(resident_parts()), file=sys.stderr)
print(held_bytes() - held_before, stage.weight_bytes, stage.session_bytes(64))
"""


def span_on_disk(folder: Path, start: int, end: int) -> int:
    """Bytes the tensors of layers [start, end) take in the folder's file (its safetensors header)."""
    from tessera.stages.weights.tensor_table import read_header

    _, header = read_header(folder / "model.safetensors")
    prefixes = tuple(f"model.layers.{i}." for i in range(start, end))
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for n, e in header.items() if n.startswith(prefixes))
