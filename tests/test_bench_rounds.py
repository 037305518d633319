"""bench/rounds.py: when a bench refuses to print a fraction (a pure rule), and what the core watch counts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

_spec = importlib.util.spec_from_file_location("bench_rounds", Path(__file__).parent.parent / "bench" / "rounds.py")
rounds = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = rounds  # a dataclass reads its module's namespace while it is built
_spec.loader.exec_module(rounds)


def test_spread_is_range_over_median():
    s = rounds.spread([20.0, 25.0, 22.0])
    assert (s.low, s.median, s.high) == (20.0, 22.0, 25.0)
    assert s.fraction == pytest.approx(5 / 22)
    with pytest.raises(ValueError):
        rounds.spread([])


def test_tight_rounds_on_a_quiet_machine_are_printed():
    assert rounds.refusal({"eager": [18.3, 18.9, 18.5], "compiled": [30.1, 30.9, 31.2]}, 0.03) is None
    assert rounds.refusal({"eager": [18.3, 18.9]}, None) is None  # no watch: only the spread decides


def test_a_wide_configuration_is_named():
    reason = rounds.refusal({"eager": [18.3, 18.9, 18.5], "compiled": [18.6, 24.1, 21.0]}, 0.0)
    assert reason == "rounds of compiled spread 26% (> 15%)"
    assert rounds.figure_line("memory-bound fraction", "eager 0.36, compiled 0.46", reason) == \
        "memory-bound fraction: not printed: rounds of compiled spread 26% (> 15%)"


def test_a_busy_neighbour_refuses_before_the_spread():
    reason = rounds.refusal({"compiled": [30.0, 30.1]}, 0.93)
    assert reason == "other processes kept 0.93 cores busy (> 0.2)"
    assert rounds.figure_line("x", "1.00", None) == "x: 1.00"


@given(st.lists(st.floats(min_value=0.1, max_value=1e4), min_size=1, max_size=9),
       st.floats(min_value=0, max_value=4))
def test_refusal_is_exactly_the_two_limits(values, others):
    reason = rounds.refusal({"c": values}, others)
    wide = (max(values) - min(values)) / sorted(values)[len(values) // 2] if len(values) % 2 else None
    if others > rounds.OTHERS_LIMIT:
        assert reason is not None and reason.startswith("other processes")
    elif rounds.spread(values).fraction > rounds.SPREAD_LIMIT:
        assert reason is not None and reason.startswith("rounds of c spread")
    else:
        assert reason is None
    if wide is not None:
        assert rounds.spread(values).fraction == pytest.approx(wide)


BURN = ("import sys, time\n"
        "end = time.process_time() + float(sys.argv[1])\n"
        "while time.process_time() < end: pass\n")  # a fixed amount of CPU, however loaded the machine


def test_our_children_are_ours_and_a_stranger_is_not():
    """CPU time a child of this process burns is counted as ours (so a swarm's peers are not 'other
    processes'); a process we did not start (a grandchild re-parented away by a double fork) is not."""
    before = rounds.tree_cpu_seconds()
    subprocess.run([sys.executable, "-c", BURN, "0.5"], check=True)
    assert rounds.tree_cpu_seconds() - before >= 0.5
    stranger = ("import os, subprocess, sys\n"
                "if os.fork() == 0:\n    os.setsid()\n    subprocess.Popen([sys.executable, '-c', sys.argv[1], '0.5'])\n"
                "    os._exit(0)\n")
    before = rounds.tree_cpu_seconds()
    # the grandchild holds the output pipe: run() returns once it has burnt its 0.5 s
    subprocess.run([sys.executable, "-c", stranger, BURN], check=True, capture_output=True)
    assert rounds.tree_cpu_seconds() - before < 0.4  # two interpreters starting, not the stranger's burn


def test_others_are_busy_less_ours_per_wall_second():
    assert rounds.others_busy((0.0, 10.0, 3.0), (2.0, 12.0, 4.0)) == pytest.approx(0.5)
    assert rounds.others_busy((0.0, 10.0, 3.0), (2.0, 10.5, 4.0)) == 0.0  # never below zero (sampling skew)
    assert rounds.others_busy((1.0, 0.0, 0.0), (1.0, 5.0, 0.0)) == 0.0
    with rounds.CoreWatch(every=0.02) as watch:
        time.sleep(0.1)
    assert watch.others is not None and watch.busiest >= watch.others >= 0.0


def test_machine_lines_name_the_processor_and_instruction_sets():
    lines = rounds.machine_lines(1)
    assert lines[0].startswith("machine: ") and "logical CPUs" in lines[0]
    assert "kernels " in lines[1] and "inductor " in lines[1] and "BLAS " in lines[1]


def test_shipped_forms_line_names_a_wide_form_and_is_withheld_on_a_busy_machine(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "bench"))  # as a bench script runs
    shipped = importlib.import_module("shipped")
    rates = {"float32": [40.0, 40.4, 41.1], "fp8": [32.5, 32.2, 33.3], "int4": [30.0, 48.6, 50.5]}
    label = "smollm2 decode vs float32 (as shipped), compiled"
    assert shipped.ratio_line(label, rates, 0.01) == (
        f"{label}: fp8 0.80x, int4: not printed, rounds of int4 spread 42% (> 15%) (float32 40.4 tok/s)")
    assert shipped.ratio_line(label, {k: rates[k] for k in ("float32", "fp8")}, None) == \
        f"{label}: fp8 0.80x (float32 40.4 tok/s)"  # no watch: the spreads decide
    assert shipped.ratio_line(label, rates, 0.5) == f"{label}: not printed: other processes kept 0.50 cores busy (> 0.2)"
    wide_float32 = {"float32": [30.0, 40.4, 41.1], "fp8": [32.5, 32.2, 33.3]}  # float32's rounds are every ratio's
    assert shipped.ratio_line(label, wide_float32, 0.0) == \
        f"{label}: fp8: not printed, rounds of float32 spread 27% (> 15%) (float32 40.4 tok/s)"
