"""A long fuzzing campaign against every decoder in protocol/.

The same seeded mutation fuzzer as tests/protocol/test_protocol_fuzz.py (`tests/protocol/fuzz.py`:
bit flips, truncation, insertion, splicing, random CBOR, huge claimed lengths and
dimensions, deep nesting, and structure-aware replacement of decoded fields), but
for as long as you like and with a fresh seed per round, so it keeps finding new
inputs. Anything other than a WireError escaping a decoder is a failure; the
offending inputs are printed in hex (feed one back with `target.run(bytes.fromhex(...))`).
Prints per-target totals, then the cases run and failures found as the last lines.

    .venv/bin/python bench/fuzz.py [--seconds 300] [--seed 1] [--targets message tensor ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fuzzer is the tests' (tests/protocol/fuzz.py)

import tessera.peer.net.nat.dialback  # noqa: E402,F401  (the NAT protocols' messages join the corpus)
import tessera.peer.net.nat.links  # noqa: E402,F401
from tests.protocol.fuzz import build_targets, run_target  # noqa: E402

ROUND_CASES = 5_000  # cases per target per round (a round takes about a second per target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0, help="how long to run (default 300)")
    parser.add_argument("--seed", type=int, default=1, help="first seed; round r uses seed + r")
    parser.add_argument("--targets", nargs="*", help="only these targets (default: all)")
    args = parser.parse_args()

    targets = [t for t in build_targets(args.seed) if not args.targets or t.name in args.targets]
    cases: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    outcomes: dict[str, Counter[str]] = {t.name: Counter() for t in targets}
    examples: list[tuple[str, bytes, str]] = []
    started = last_report = time.perf_counter()
    round_ = 0
    while time.perf_counter() - started < args.seconds:
        for target in targets:
            report = run_target(target, cases=ROUND_CASES, seed=args.seed + round_)
            cases[target.name] += report.cases
            failures[target.name] += report.failures
            outcomes[target.name].update(report.outcomes)
            examples += [(target.name, data, error) for data, error in report.examples][: max(0, 50 - len(examples))]
        round_ += 1
        if time.perf_counter() - last_report > 30:
            last_report = time.perf_counter()
            print(f"[{last_report - started:6.0f} s] {sum(cases.values()):,} cases, {sum(failures.values())} failures", flush=True)

    elapsed = time.perf_counter() - started
    print()
    for target in targets:
        common = ", ".join(f"{name} {count}" for name, count in outcomes[target.name].most_common(5))
        print(f"{target.name:12} {cases[target.name]:>10,} cases  {failures[target.name]:>3} failures   ({common}, ...)")
    for name, data, error in examples:
        print(f"FAILURE {name}: {data[:256].hex()} -> {error}")
    total = sum(cases.values())
    print(f"fuzz: {round_} rounds, seeds {args.seed}..{args.seed + round_ - 1}, {elapsed:.0f} s, {total / elapsed:,.0f} cases/s")
    print(f"fuzz cases run: {total}")
    print(f"fuzz failures found: {sum(failures.values())}")


if __name__ == "__main__":
    main()
