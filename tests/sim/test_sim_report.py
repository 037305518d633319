"""`simulate`'s summary holds its failures against its coverage (issue 34): it said "coverage 100 %"
beside seven failed requests and no word on why."""

from __future__ import annotations

from types import SimpleNamespace

from tessera.peer.sim.report import Recorder, format_summary


def test_failures_while_every_layer_was_served_are_counted_and_said():
    now = [0.0]
    recorder = Recorder(2, lambda: now[0])
    peer = SimpleNamespace(label="a", alive=True, state="serving", span=(0, 2), throughput=100.0, capacity=2, exit=None)
    now[0] = 1.0
    early = recorder.request_started(SimpleNamespace(id=0, requester="r", at=0.5, prompt_tokens=3, new_tokens=2,
                                                     recorded_route=None, recorded=None))
    early.error = "NoRoute: nobody serves layers [0, 2)"
    recorder.request_finished(early)  # before any peer served: a gap, not counted
    now[0] = 2.0
    recorder.peer_changed(peer)
    now[0] = 5.0
    busy = recorder.request_started(SimpleNamespace(id=1, requester="r", at=4.0, prompt_tokens=3, new_tokens=2,
                                                    recorded_route=None, recorded=None))
    busy.error = "NoRoute: peer a refused: busy"
    recorder.request_finished(busy)
    report = recorder.report(scenario={}, settings={"handler_errors": 0}, end=10.0)
    assert report["summary"]["failed"] == 2 and report["summary"]["failed_while_covered"] == 1
    assert "1 of them while every layer was served" in format_summary(report)
