"""The cost of checking a span against the manifest as it loads (peer/weights/verify.py), one run.

Loads the whole model (every layer, the embedding and the head) three ways, in alternating rounds (the file is in the page
cache after the first read, for all three alike): unchecked, checked (every tensor hashed,
chunk by chunk, as it is read), and checked with the cache of an earlier complete check
(nothing hashed). Prints the load-time ratios against unchecked last.

    .venv/bin/python bench/weight_check.py [--model smollm2-135m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tessera.peer.weights.verify import VerifiedCache, WeightCheck  # noqa: E402
from tessera.stages.assembly.stage import load_stage  # noqa: E402
from tessera.stages.weights import registry  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = registry.resolve(args.model)
    if not WeightCheck(folder, VerifiedCache(None)).active:
        sys.exit(f"{folder} has no manifest.json: there is nothing to check it against")
    with tempfile.TemporaryDirectory() as tmp:
        warm = VerifiedCache(Path(tmp) / "warm.json")
        first = WeightCheck(folder, warm).begin()
        load_stage(folder, embed=True, head=True, check=first)  # fills the page cache and the warm cache
        first.commit()
        times: dict[str, list[float]] = {"unchecked": [], "checked": [], "cached": []}
        hashed = {"checked": 0, "cached": 0}
        for _ in range(args.rounds):
            for kind in times:
                check = None
                if kind == "checked":
                    check = WeightCheck(folder, VerifiedCache(None)).begin()
                elif kind == "cached":
                    check = WeightCheck(folder, warm).begin()
                started = time.perf_counter()
                load_stage(folder, embed=True, head=True, check=check)
                times[kind].append(time.perf_counter() - started)
                if check is not None:
                    hashed[kind] = check.stats.hashed_bytes
        for kind, values in times.items():
            print(f"{kind}: median {statistics.median(values):.3f} s over {len(values)} loads")
        mib = 1 << 20
        print(f"hashed per load: checked {hashed['checked'] / mib:.0f} MiB, cached {hashed['cached'] / mib:.0f} MiB")
        base = statistics.median(times["unchecked"])
        print(f"weight check load time / unchecked: {statistics.median(times['checked']) / base:.2f}")
        print(f"cached check load time / unchecked: {statistics.median(times['cached']) / base:.2f}")


if __name__ == "__main__":
    main()
