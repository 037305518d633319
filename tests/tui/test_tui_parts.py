"""The TUI's pure parts: the span bar, the coverage strip, rates, the event filter and the
trace tail, the memory input. No peer and no screen: what the panels draw is computed here
(tests/tui/test_tui.py drives the screens over a real peer)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.store.db import PeerStore
from tessera.store.events import EVENT_TYPES, Advertise, Audit, Ban, Claim, Forward, Push, Receive, Result, Rtt
from tessera.store.trace import TraceWriter
from tessera.tui.events import EventFilter, last_id, read_backlog
from tessera.tui.rates import RECENT, RateHistory
from tessera.tui.render import coverage_strip, event_line, gaps_text, span_bar
from tessera.tui.screens import parse_gb


def test_span_bar_draws_the_claim_against_every_layer():
    assert span_bar((0, 15), 30, 40).plain == "█" * 15 + "░" * 15  # one cell per layer when it fits
    assert span_bar((10, 20), 30, 40).plain == "░" * 10 + "█" * 10 + "░" * 10
    assert span_bar((0, 30), 60, 10).plain == "█" * 5 + "░" * 5  # two layers per cell when not
    assert span_bar(None, 30, 40).plain == "░" * 30


def test_coverage_strip_counts_peers_and_marks_gaps():
    coverage = [1] * 10 + [2] * 5 + [0] * 3 + [1] * 2 + [12] * 10
    text = coverage_strip(coverage, 80)
    assert text.plain == "1" * 10 + "2" * 5 + "0" * 3 + "1" * 2 + "+" * 10
    gap_styles = {str(span.style) for span in text.spans if text.plain[span.start:span.end].strip("0") == ""}
    assert "bold reverse red" in gap_styles
    assert coverage_strip([1, 1, 0, 1], 2).plain == "10"  # a cell shows its least covered layer
    assert gaps_text([[15, 18]]).plain == "GAPS: [15, 18)"
    assert gaps_text([]).plain == "gaps: none"


def test_rate_history_derives_tokens_per_second_from_cumulative_counts():
    history = RateHistory(window=4.0)
    assert history.series(4) == [0.0] * 4 and history.current() == 0.0
    for at, total in [(10.0, 0), (10.5, 0), (11.0, 10), (11.5, 30), (12.0, 30)]:
        assert history.add(at, total)
    # buckets [8, 9), [9, 10), [10, 11), [11, 12): the counter at each edge is the last sample before it
    assert history.series(4) == [0.0, 0.0, 10.0, 20.0]
    assert history.current(recent=1.0) == pytest.approx((30 - 10) / (12.0 - 11.0))
    assert not history.add(12.0, 31)  # not newer: ignored
    history.add(100.0, 40)
    assert all(at >= 100.0 - 4.0 for at, _ in list(history.samples)[1:])  # older samples age out
    assert history.series(2) == [0.0, 5.0]  # tokens seen late count in the bucket where they were seen
    history.add(101.0, 0)  # a new counter (smaller): the old history is dropped
    assert list(history.samples) == [(101.0, 0)]


@settings(max_examples=60, deadline=None)
@given(
    burst=st.lists(st.tuples(st.floats(0.05, 3.0), st.integers(0, 400)), min_size=1, max_size=30),
    idle=st.lists(st.floats(0.05, 40.0), min_size=1, max_size=60),
)
def test_peak_rate_moves_only_when_tokens_are_served(burst, idle):
    """Samples at irregular times while tokens flow, then a still counter for minutes: the peak
    stays put (it used to be the best of the sparkline's buckets, which slide and age out) and
    the headline rate never rises."""
    history, at, total = RateHistory(window=60.0), 100.0, 0
    history.add(at, total)
    for gap, tokens in burst:
        at, total = at + gap, total + tokens
        history.add(at, total)
        assert history.peak >= history.current()  # "served X (peak Y)": Y is never below X
    peak, rate = history.peak, history.current()
    for gap in idle:
        at += gap
        assert history.add(at, total)
        assert history.peak == peak, "the peak changed with no traffic"
        assert history.current() <= rate + 1e-9, "the rate rose with no traffic"
        rate = history.current()
    if sum(idle) >= RECENT:
        assert history.current() == 0.0


def test_peak_rate_counts_a_burst_once():
    history = RateHistory()
    for at, total in [(0.0, 0), (1.0, 0), (1.5, 50), (2.0, 100), (2.5, 100)]:
        history.add(at, total)
    assert history.current() == pytest.approx(100 / 2.5)  # less than 5 s of samples: over what there is
    assert history.peak == pytest.approx(100 / 2.0)  # at t=2.0: 100 tokens in the 2 s seen
    for i in range(1, 200):
        history.add(2.5 + i * 0.5, 100)
    assert history.current() == 0.0 and history.peak == pytest.approx(50.0)
    history.add(200.0, 600)  # traffic again: 500 tokens in the last 5 s
    assert history.current() == pytest.approx(100.0) and history.peak == pytest.approx(100.0)


def test_event_filter_parses_kinds_words_and_all():
    default = EventFilter.parse("")
    # every kind but the routine ones: not per-step, not an RTT per neighbour per ping (issue 46: the list was mostly rtt lines)
    assert set(default.kinds) == set(EVENT_TYPES) - {Forward, Push, Receive, Advertise, Result, Audit, Rtt}
    assert EventFilter.parse("claim  ban").kinds == (Claim, Ban)
    everything = EventFilter.parse("all x3f2")
    assert everything.kinds == EVENT_TYPES and everything.words == ("x3f2",)
    assert everything.keeps("10:00:00 ban peer X3F2abcd") and not everything.keeps("10:00:00 ban peer zzz")


def test_trace_tail_is_found_without_reading_the_whole_trace(tmp_path):
    with PeerStore(tmp_path / "t.db") as store:
        tracer = TraceWriter(store, peer="me")
        for i in range(1000):
            tracer.emit(Forward(session="5e55", step=i, span=(0, 1), duration=0.0))
            if i % 100 == 7:
                tracer.emit(Claim(span=(0, i + 1), throughput=1.0, capacity=i + 1))
        tracer.close()
        store.flush()
        assert last_id(store, (Forward,)) == 1010  # 1000 forwards + 10 claims, the last row a forward
        claims = last_id(store, (Claim,))
        assert store.events(after_id=claims - 1)[0].kind == "claim"
        assert store.events(after_id=claims, kinds=(Claim,)) == []
        rows, tail = read_backlog(store, EventFilter.parse("claim"), keep=3)
        assert [r.event.span[1] for r in rows] == [708, 808, 908] and tail == claims
        assert last_id(store, (Ban,)) == 0
        line = event_line(rows[-1])
        assert "claim" in line and "[0, 908)" in line


def test_memory_input_is_checked():
    assert parse_gb(" 2.5 ") == 2.5 and parse_gb("3GB") == 3.0
    for bad in ("abc", "0", "-1", "nan", "inf", ""):
        with pytest.raises(ValueError):
            parse_gb(bad)
