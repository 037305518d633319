"""The web view's parts without a browser: the coverage it shows, what it remembers, who may read it.

The Swarm page must show the truth `tessera swarm status` prints: its coverage is checked
against routing's own definition (replicas of the routable view) on random views
(hypothesis), shard groups and unroutable states included. The ASGI app is called directly (no server, no swarm)
for its rules: the pages need no key, the data does; a file outside the static table is a
404 whatever the path says; admin calls come from loopback only.
"""

from __future__ import annotations

import json
import re

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.peer.http.web.access import KeyAccess
from tessera.peer.http.web.answers import AnswerBook
from tessera.peer.http.web.app import PAGES, WebApp
from tessera.peer.http.web.report import headline, swarm_report
from tessera.peer.http.web.static import STATIC_DIR, load_static
from tessera.peer.http.web.watch import GONE_KEPT, RateSeries, SwarmWatch, changes
from tessera.peer.plan.groups import replica_coverage
from tessera.peer.plan.routing import routable_view
from tessera.peer.plan.view import STATES, PeerInfo, SwarmView

MODEL = "m" * 16
L = 12


def peer(pid: str, start: int, end: int, **kw) -> PeerInfo:
    return PeerInfo(pid, MODEL, start, end, kw.pop("throughput", 100.0), name=kw.pop("name", pid), **kw)


@st.composite
def views(draw) -> SwarmView:
    peers = []
    for i in range(draw(st.integers(0, 7))):
        start = draw(st.integers(0, L - 1))
        end = draw(st.integers(start, L))
        shard = draw(st.sampled_from([(0, 1), (0, 2), (1, 2)]))
        peers.append(peer(f"p{i:02d}", start, end, state=draw(st.sampled_from(STATES)),
                          throughput=draw(st.sampled_from([0.0, 50.0, 200.0])), load=draw(st.sampled_from([0.0, 0.5, 1.0])),
                          shard_index=shard[0], shard_count=shard[1], shard_group="g" if shard[1] > 1 else ""))
    return SwarmView.of(L, peers)


@settings(max_examples=300, deadline=None)
@given(views())
def test_coverage_is_what_swarm_status_counts(view):
    counts = replica_coverage(routable_view(view))  # routing's view: what a requester can use
    report = report_of(view)
    assert report["coverage"] == counts and report["routable"] == (min(counts) > 0)
    zero = [layer for layer, c in enumerate(counts) if c == 0]
    assert [layer for a, b in report["gaps"] for layer in range(a, b)] == zero
    assert {p["peer_id"] for p in report["peers"]} == {p.peer_id for p in view.peers}  # listed, counted or not
    json.dumps(report, allow_nan=False)  # what the page gets parses in a browser


def report_of(view: SwarmView, **kw) -> dict:
    return swarm_report(view, model="m", model_id=MODEL, observer="me", role="gateway", now=100.0,
                        rtt_ms={"a": 1.234}, link_of=lambda pid: "direct" if pid == "a" else None,
                        weights_of=lambda p: 1000 * (p.end - p.start), **kw)


def test_a_peer_not_taking_sessions_is_listed_and_not_counted():
    view = SwarmView.of(30, [peer("a", 0, 10), peer("b", 10, 20), peer("c", 20, 30, state="draining")])
    report = report_of(view)
    assert report["coverage"] == [1] * 20 + [0] * 10 and report["gaps"] == [[20, 30]]
    assert report["headline"] == "no route: layers [20, 30) missing"
    c = next(p for p in report["peers"] if p["peer_id"] == "c")
    assert c["not_routable"] == "draining" and c["state"] == "draining"
    a = next(p for p in report["peers"] if p["peer_id"] == "a")
    assert (a["link"], a["rtt_ms"], a["weights"], a["token_ms"]) == ("direct", 1.23, 10_000, 100.0)
    whole = report_of(SwarmView.of(30, [peer("a", 0, 30), peer("b", 0, 30)]))
    assert whole["headline"] == "routable: every layer is served (2 replicas at the thinnest)"
    assert headline([1, 0, 0, 1, 0], [[1, 3], [4, 5]]) == "no route: layers [1, 3) and [4, 5) missing"


def test_changes_between_views_name_what_happened():
    a, b = peer("a", 0, 6), peer("b", 6, 12)
    first = changes(None, SwarmView.of(L, [a, b]), 1.0)
    assert [(c.peer_id, c.what) for c in first] == [("a", "joined"), ("b", "joined")]
    later = SwarmView.of(L, [peer("a", 0, 8, state="draining")])
    found = {(c.peer_id, c.what): c.text for c in changes(SwarmView.of(L, [a, b]), later, 2.0)}
    assert found[("a", "moved")] == "moved: [0, 6) -> [0, 8)"
    assert found[("a", "state")] == "serving -> draining"
    assert found[("b", "gone")].startswith("gone: its advertisement expired")
    back = changes(later, SwarmView.of(L, [later.peers[0], b]), 3.0, known_gone=frozenset({"b"}))
    assert [(c.peer_id, c.what) for c in back] == [("b", "back")]


class FakeSource:
    """A view that a test changes, and a counter; what SwarmWatch and WebApp read of a source."""

    role, chat, model, model_id, spec = "peer", False, "m", MODEL, None

    def __init__(self, view: SwarmView) -> None:
        self.current = view
        self.tokens: dict[str, int] = {}
        self.me = "a"

    def view(self) -> SwarmView:
        return self.current

    def rtt_ms(self) -> dict:
        return {}

    def link_of(self, peer_id: str) -> str | None:
        return None

    def token_counts(self, view: SwarmView) -> dict:
        return self.tokens

    def sessions_of(self, peer_id: str) -> list:
        return []

    def local_status(self) -> dict:
        return {}

    async def recent_events(self) -> list:
        return []

    def close(self) -> None:
        pass


def test_the_watch_keeps_a_gone_peer_for_a_while_and_rates_from_counters():
    now = [0.0]
    source = FakeSource(SwarmView.of(L, [peer("a", 0, 6), peer("b", 6, 12)]))
    watch = SwarmWatch(source, clock=lambda: now[0])
    source.tokens = {"a": 0}
    watch.tick()
    now[0], source.tokens, source.current = 2.0, {"a": 50}, SwarmView.of(L, [peer("a", 0, 6)])
    watch.tick()
    assert [g["peer_id"] for g in watch.gone_entries()] == ["b"] and watch.gone_entries()[0]["gone_at"] == 2.0
    assert watch.rate_of("a") == {"points": [[2.0, 25.0]], "now": 25.0, "peak": 25.0, "total": 50}
    assert [c["what"] for c in watch.changes_of("b")] == ["joined", "gone"]
    now[0] = 2.0 + GONE_KEPT + 1
    watch.tick()
    assert watch.gone_entries() == []
    assert watch.version == 3


def test_a_rate_series_starts_over_when_the_counter_does():
    series = RateSeries(keep=3)
    for at, total in [(0.0, 0), (1.0, 10), (1.0, 99), (3.0, 30), (4.0, 5), (5.0, 9)]:
        series.add(at, total)
    assert list(series.points) == [(5.0, 4.0)] and series.peak == 4.0  # (1.0, 99) was not newer: ignored


async def test_an_answer_lookup_waits_for_the_answer_to_end():
    book = AnswerBook()

    async def later() -> None:
        await trio.sleep(0.05)
        book.record("tag-0123456789", {"route": []})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(later)
        assert await book.get("tag-0123456789", wait=5.0) == {"route": []}
    assert await book.get("never-answered", wait=0.01) is None and not book._ended


def test_pages_load_only_files_of_this_server():
    files = load_static()
    assert {"swarm.html", "chat.html", "peer.html", "style.css", "common.js"} <= set(files)
    assert set(PAGES.values()) <= set(files)
    for name, found in files.items():
        text = found.body.decode()
        for url in re.findall(r"""(?:https?:)?//[^\s"'`)]+""", text):
            assert url.startswith("http://www.w3.org/"), f"{name} names another host: {url}"  # SVG's namespace only
        for ref in re.findall(r"""(?:src|href)="([^"]*)\"""", text) + re.findall(r"""from "([^"]+)\"""", text):
            assert ref.startswith(("/", "#", "./")), f"{name}: {ref!r}"
            if ref.startswith(("/static/", "./")):
                assert ref.rsplit("/", 1)[-1] in files, f"{name} loads {ref}, which is not served"
    assert not any(p.name.startswith(".") for p in STATIC_DIR.iterdir())


async def call(app: WebApp, method: str, path: str, *, headers: dict | None = None,
               client: tuple[str, int] = ("127.0.0.1", 50000)) -> tuple[int, dict, bytes]:
    """One request through the ASGI app, as hypercorn would make it."""
    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict:
        if incoming:
            return incoming.pop()
        await trio.sleep_forever()

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "client": client,
             "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()]}
    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def web_app(key: str | None) -> WebApp:
    source = FakeSource(SwarmView.of(L, [peer("a", 0, 12)]))
    app = WebApp(source, access=KeyAccess(key))
    app.swarm_data = lambda: report_of(source.current)  # FakeSource has no model spec to estimate weights from
    return app


async def test_pages_need_no_key_and_the_data_does():
    app = web_app("sekret")
    status, headers, body = await call(app, "GET", "/swarm")
    assert status == 200 and headers[b"content-type"].startswith(b"text/html") and b"<main" in body
    assert b"default-src 'self'" in headers[b"content-security-policy"]
    assert (await call(app, "GET", "/static/swarm.js"))[0] == 200
    status, _, body = await call(app, "GET", "/web/api/info")
    assert status == 200 and json.loads(body)["key_required"] is True
    status, _, body = await call(app, "GET", "/web/api/swarm")
    assert status == 401 and "missing API key" in json.loads(body)["error"]["message"]
    assert (await call(app, "GET", "/web/api/swarm", headers={"authorization": "Bearer nope"}))[0] == 401
    status, _, body = await call(app, "GET", "/web/api/swarm", headers={"authorization": "Bearer sekret"})
    assert status == 200 and [p["peer_id"] for p in json.loads(body)["peers"]] == ["a"]
    assert (await call(app, "GET", "/web/api/peer", headers={"x-api-key": "sekret"}))[0] == 200
    assert (await call(web_app(None), "GET", "/web/api/swarm"))[0] == 200  # no key set: open, as the API


@pytest.mark.parametrize("path", ["/static/../app.py", "/static/app.py", "/static/", "/static/%2e%2e/app.py",
                                  "/static//etc/passwd", "/static/swarm.html/../../report.py"])
async def test_only_the_static_table_is_served(path):
    status, _, body = await call(web_app(None), "GET", path)
    assert status == 404 and b"no such file" in body


async def test_admin_actions_come_from_this_machine_only():
    app = web_app("sekret")
    key = {"authorization": "Bearer sekret"}
    status, _, body = await call(app, "POST", "/web/api/peer/drain", headers=key, client=("192.0.2.9", 4000))
    assert status == 403 and "loopback" in json.loads(body)["error"]["message"]
    assert (await call(app, "POST", "/web/api/peer/drain", client=("127.0.0.1", 4000)))[0] == 401  # and the key
    status, _, body = await call(app, "GET", "/web/api/info", client=("192.0.2.9", 4000))
    assert json.loads(body)["admin"] is False
    assert (await call(app, "GET", "/web/api/peer/drain", headers=key))[0] == 405


async def test_a_sessions_idle_time_is_read_on_the_clock_it_was_stamped_on():
    """`last_active` is stamped on trio's clock (peer/serve/admission.py), which trio offsets from
    time.monotonic at random: a session idle 20 s showed 0.0 (or days) when the two were mixed."""
    from types import SimpleNamespace

    from tessera.peer.http.web.sources import NodeSource

    session = SimpleNamespace(short_id="s1", session_id=b"s1", requester="r", start=0, end=2, steps=3, tokens=4,
                              last_active=trio.current_time() - 20.0)
    server = SimpleNamespace(admission=SimpleNamespace(clock=trio.current_time), sessions={b"s1": session})
    node = SimpleNamespace(config=SimpleNamespace(model="m"), model_id=MODEL, spec=None, server=server,
                           transport=SimpleNamespace(peer_id="me"))
    (row,) = NodeSource(node).sessions_of("me")
    assert 20.0 <= row["idle_s"] <= 21.0, row


async def test_a_peers_events_leave_out_rtts_which_the_trace_keeps(tmp_path):
    """Issue 46, item 5: the Peer page's events were mostly `rtt duration 0.0039…` lines (one per
    neighbour per ping round). They stay in the trace; the page lists what happened."""
    from types import SimpleNamespace

    from tessera.peer.http.web.sources import NodeSource
    from tessera.store.db import PeerStore
    from tessera.store.events import Claim, Rtt
    from tessera.store.trace import TraceWriter

    with PeerStore(tmp_path / "t.db") as store:
        tracer = TraceWriter(store, peer="me")
        tracer.emit(Claim(span=(0, 10), throughput=1.0, capacity=10))
        for i in range(20):
            tracer.emit(Rtt(remote="other", duration=0.004 + i * 1e-4))
        tracer.close()
        store.flush()
        assert len(store.events(kinds=(Rtt,))) == 20  # kept in the trace
        source = NodeSource(SimpleNamespace(store=store, config=SimpleNamespace(model="m"), model_id="m", spec=None))
        try:
            listed = await source.recent_events()
        finally:
            source.close()
    assert [e["kind"] for e in listed] == ["claim"], listed


def test_the_gone_bound_is_the_swarms_agreement_not_a_records_lifetime():
    """Issue 46, item 5: records live a day, so the Swarm page said a silent peer is shown gone
    "within 86401 s". A dead peer goes by its neighbours' departure report, which the swarm
    agrees on within B(N) (peer/net/gossip.py); a record that expires sooner bounds it too."""
    from tessera.peer.http.web.app import gone_within
    from tessera.peer.net.gossip import bound_seconds

    assert gone_within(86400.0, 3, 1.0) == round(bound_seconds(4) + 1.0, 1) < 60
    assert gone_within(86400.0, 999, 1.0) == round(bound_seconds(1000) + 1.0, 1) < 60
    assert gone_within(15.0, 3, 1.0) == 16.0
    assert gone_within(None, 0, 1.0) is None
