"""Only this machine's own pages drive a peer's web view (peer/http/guard.py), over real HTTP.

One real `tessera peer --web 0` (a tiny synthesised model, the whole span, `--web-allow-origin
http://tessera.lan`), asked with httpx as a page of another site would ask it. Before the
guard, a page of any site paused the peer with a `text/plain` POST, and a name rebound to
127.0.0.1 read its data. Now:

- a cross-site POST (text/plain or JSON, another site or another port of this machine) is
  refused and the peer keeps serving; a request without Origin needs the JSON type;
- a Host that is a name nobody allowed (DNS rebinding) gets a 403, pages and data alike;
- this server's own pages (Origin = its own address), curl without Origin, localhost, and the
  name given with --web-allow-origin work.
"""

from __future__ import annotations

import re
from typing import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.cli.model_files import synthesise

pytestmark = pytest.mark.slow

HTTP_TIMEOUT = 30.0
ALLOWED = "http://tessera.lan"  # the peer's --web-allow-origin: a LAN name exposed on purpose


@pytest.fixture(scope="module")
def peer_web(tmp_path_factory) -> Iterator[str]:
    folder = synthesise(tmp_path_factory.mktemp("guard") / "tiny", hidden=64, layers=2, heads=4, kv_heads=2,
                        intermediate=128, vocab=300, seed=5)
    swarm = LocalSwarm(1, model=str(folder), extra_args=[["--layers", "0:2", "--web", "0",
                                                          "--web-allow-origin", ALLOWED]])
    try:
        swarm.start()
        found = re.search(r"web view: (http://\S+?)/?\s", swarm.log(0) + "\n")
        assert found, swarm.log(0)
        yield found.group(1)
    finally:
        swarm.stop(timeout=15)


def state(base: str) -> dict:
    status = httpx.get(base + "/web/api/peer", timeout=HTTP_TIMEOUT).json()["status"]
    return {"state": status["state"], "paused": status["paused"]}


def post(base: str, action: str, *, content_type: str | None = "application/json", **headers: str) -> httpx.Response:
    sent = {k.replace("_", "-"): v for k, v in headers.items()}
    if content_type is not None:
        sent["content-type"] = content_type
    return httpx.post(f"{base}/web/api/peer/{action}", content=b"{}", headers=sent, timeout=HTTP_TIMEOUT)


def test_a_page_of_another_site_cannot_pause_the_peer(peer_web):
    port = urlsplit(peer_web).port
    assert state(peer_web) == {"state": "serving", "paused": False}
    attacks = [
        post(peer_web, "pause", content_type="text/plain", origin="http://evil.example"),  # what worked before
        post(peer_web, "pause", origin="http://evil.example"),
        post(peer_web, "pause", origin=f"http://127.0.0.1:{port + 1}"),  # another page on this machine
        post(peer_web, "pause", origin="null"),  # a sandboxed frame, a file:// page
        post(peer_web, "drain", content_type="text/plain"),  # a browser that sends no Origin: still no JSON
        post(peer_web, "pause", content_type="application/x-www-form-urlencoded"),  # a plain HTML form
    ]
    assert [a.status_code for a in attacks] == [403, 403, 403, 403, 415, 415], [a.text for a in attacks]
    assert attacks[0].json()["error"]["code"] == "origin_not_allowed"
    assert "Content-Type: application/json" in attacks[4].json()["error"]["message"]
    assert state(peer_web) == {"state": "serving", "paused": False}


def test_a_rebound_name_is_not_answered(peer_web):
    """DNS rebinding: a page at http://rebind.example:PORT whose name now resolves to 127.0.0.1."""
    port = urlsplit(peer_web).port
    rebound = {"host": f"rebind.example:{port}"}
    for path in ("/", "/peer", "/web/api/info", "/web/api/peer", "/web/api/swarm"):
        answer = httpx.get(peer_web + path, headers=rebound, timeout=HTTP_TIMEOUT)
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "host_not_allowed", (path, answer.text)
    answer = post(peer_web, "pause", origin=f"http://rebind.example:{port}", **rebound)
    assert answer.status_code == 403
    assert state(peer_web)["paused"] is False


def test_own_pages_curl_localhost_and_the_allowed_name_work(peer_web):
    port = urlsplit(peer_web).port
    assert post(peer_web, "pause", origin=peer_web).status_code == 200  # the peer's own page
    assert state(peer_web)["paused"] is True
    assert post(peer_web, "resume").status_code == 200  # curl: no Origin, a JSON body
    assert state(peer_web) == {"state": "serving", "paused": False}
    local = {"host": f"localhost:{port}"}
    assert httpx.get(peer_web + "/web/api/info", headers=local, timeout=HTTP_TIMEOUT).status_code == 200
    named = {"host": f"tessera.lan:{port}"}
    assert httpx.get(peer_web + "/peer", headers=named, timeout=HTTP_TIMEOUT).status_code == 200
    assert post(peer_web, "pause", origin=f"http://tessera.lan:{port}", **named).status_code == 200
    assert post(peer_web, "resume", origin=ALLOWED, **named).status_code == 200
    assert state(peer_web) == {"state": "serving", "paused": False}
