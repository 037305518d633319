"""The web view in a real browser: Debian's chromium, headless, driven by Playwright, on a real swarm.

One module swarm: three `tessera peer` processes serving [0, 10), [10, 20) and [20, 30)
(the first with `--web 0`, its own web view), and a `tessera serve` gateway with an API
key in front of them. The pages are loaded as a person would load them — the key typed
into the page's form on first visit — and every request a page makes is checked to go
to the server that served it (nothing from a CDN: the view works offline).

- Swarm: the three peers serving and no gap, the same coverage `tessera swarm status`
  reports for the same swarm;
- Chat: a message streams (the text grows in several steps) to the text `tessera generate
  --join` prints for the same prompt, over the same route; denying the only peer of
  [10, 20) leaves no route, and the page says which layers;
- Peer: the first peer's own page shows its sessions' events and a tokens/s sparkline;
- other sites: a page of another origin cannot pause the first peer, a name rebound to
  127.0.0.1 gets a 403, and the peer's own page still pauses and resumes it;
- last, a peer is killed: the Swarm page shows it gone and "no route: layers [20, 30)
  missing" within the bound the page states (its record's lifetime plus one sample).

With TESSERA_SCREENSHOTS set (`make screenshots`), the pages' screenshots are written for
the docs. Without chromium installed (`apt-get install chromium`) the module is skipped.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import trio

from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.cli.status import gather_status

from ..conftest import FRANCE, MODEL
from ..screenshots import screenshot_dir

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("chromium is not installed (apt-get install chromium): the web view's browser tests are skipped",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")

pytestmark = pytest.mark.slow

# Headless flags that work on a closed network: without the background-networking ones, chromium's
# own connections (component updates, sync) are refused here and slow every page down.
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "web-test-key-4b1d"
RECORD_TTL = 6  # the peers' advertisement lifetime here (TESSERA_RECORD_TTL; 15 s by default)
STARTUP = 120.0  # a gateway imports torch, loads the embedding and head, joins
ANSWER = 120_000  # ms a page waits for an answer on a loaded 2-core machine
SETTLE = 60_000  # ms a page waits for the swarm to look as expected
LATE = 8.0  # s a loaded machine may add to the page's stated bound (gossip, a busy loop, the browser)
N_TOKENS = 12
SPANS = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture(scope="module")
def swarm(smol_dir) -> Iterator[LocalSwarm]:
    args = [["--layers", f"{a}:{b}"] for a, b in SPANS]
    args[0] += ["--web", "0"]
    peers = LocalSwarm(len(SPANS), model=MODEL, extra_args=args, env={"TESSERA_RECORD_TTL": str(RECORD_TTL)})
    try:
        peers.start(together=True)
        yield peers
    finally:
        peers.stop(timeout=15)


@pytest.fixture(scope="module")
def peer_web(swarm) -> str:
    found = re.search(r"web view: (http://\S+/)", swarm.log(0))
    assert found, swarm.log(0)
    return found.group(1)


@contextmanager
def gateway_process(join: str, log: Path) -> Iterator[str]:
    """`tessera serve` with an API key; yields its web view's URL. SIGTERM must stop it cleanly."""
    cmd = [sys.executable, "-m", "tessera.peer.cli.main", "serve", "--join", join, "--port", "0", "--threads", "1",
           "--api-key", KEY, "--route-wait", "3"]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP
        while not (found := re.search(r"web view: (http://\S+/)", log.read_text())):
            assert proc.poll() is None, f"tessera serve exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"tessera serve not listening:\n{log.read_text()}"
            time.sleep(0.1)
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert code == 0 and "stopped" in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def gateway(swarm) -> Iterator[str]:
    with gateway_process(swarm.addrs[0], swarm.base_dir / "serve.log") as base:
        yield base


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as driver:
        # a fresh profile (user data dir) per launch; nothing is downloaded: Debian's chromium is used
        chromium = driver.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        yield chromium
        chromium.close()


class Visit:
    """One page in its own browser context, with every request and page error it caused."""

    def __init__(self, browser, base: str, path: str, *, key: str | None = KEY) -> None:
        self.base = base
        self.context = browser.new_context(viewport={"width": 1280, "height": 860})
        if key is not None:  # as if typed into the key form before (the first test types it)
            self.context.add_init_script(f"sessionStorage.setItem('tessera.api-key', {json.dumps(key)})")
        self.page = self.context.new_page()
        self.page.set_default_timeout(SETTLE)
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("console", self._console)
        self.page.goto(base + path.lstrip("/"))

    def _console(self, message) -> None:
        # an HTTP error the page handles (a 503 "no route") is logged by the browser too: not a page error
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            self.errors.append(message.text)

    def shot(self, name: str) -> None:
        folder = screenshot_dir()
        if folder is not None:
            self.page.screenshot(path=str(folder / name), full_page=True)

    def close(self) -> None:
        self.context.close()
        foreign = [url for url in self.requests if not url.startswith(self.base)]
        assert not foreign, f"the page loaded from elsewhere: {foreign}"
        assert not self.errors, f"the page reported errors: {self.errors}"


@contextmanager
def visit(browser, base: str, path: str, **kw) -> Iterator[Visit]:
    page = Visit(browser, base, path, **kw)
    try:
        yield page
    finally:
        page.close()


def expect(locator):
    return sync_api.expect(locator)


def status_report(addr: str) -> dict:
    """What `tessera swarm status --json` reports for the same swarm."""
    return trio.run(lambda: gather_status([addr], model=MODEL))


def test_swarm_page_shows_the_three_peers_and_no_gap(gateway, swarm, browser):
    with visit(browser, gateway, "/swarm", key=None) as v:
        page = v.page
        form = page.locator("#key-form")
        expect(form).to_be_visible()  # the gateway has a key, the tab none yet
        page.fill("input[name=key]", KEY)
        page.click("#key-form button[type=submit]")
        rows = page.locator("#peers tbody tr[data-state=serving]")
        expect(rows).to_have_count(3)
        expect(form).to_be_hidden()
        expect(page.locator("#headline")).to_have_text(re.compile(r"^routable: every layer is served"))
        expect(page.locator("#headline")).to_have_attribute("data-ok", "true")
        names = rows.locator("td:first-child a").all_text_contents()
        assert sorted(names) == ["peer0", "peer1", "peer2"]
        assert page.locator("#lanes .span[data-state=serving]").count() == 3
        cells = page.eval_on_selector_all("#coverage .cell", "cells => cells.map(c => Number(c.textContent))")
        report = status_report(swarm.addrs[0])
        assert cells == report["coverage"] == [1] * 30 and report["gaps"] == []
        assert page.locator("#coverage .cell[data-count='0']").count() == 0
        page.wait_for_timeout(300)  # the last layout settles before the picture
        v.shot("web-swarm.png")


def test_chat_streams_what_tessera_generate_answers(gateway, swarm, browser):
    # `tessera generate` through the same swarm, running while the page asks
    generate = subprocess.Popen(
        [sys.executable, "-m", "tessera.peer.cli.main", "generate", FRANCE, "--join", swarm.addrs[0], "--json",
         "--max-tokens", str(N_TOKENS), "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with visit(browser, gateway, "/chat") as v:
        page = v.page
        expect(page.locator("#policy select")).to_have_count(3)
        page.fill("#max-tokens", str(N_TOKENS))
        page.fill("#temperature", "0")
        # every text the answer shows as it arrives: streamed, it grows through several prefixes
        page.evaluate("""() => {
            window.answerTexts = [];
            new MutationObserver(() => {
                const text = document.querySelector("li.assistant .text")?.textContent;
                if (text && text !== window.answerTexts.at(-1)) window.answerTexts.push(text);
            }).observe(document.getElementById("messages"), {subtree: true, childList: true, characterData: true});
        }""")
        page.fill("#prompt", FRANCE)
        page.press("#prompt", "Enter")
        answer = page.locator("li.assistant[data-done]")
        expect(answer).to_have_count(1, timeout=ANSWER)
        assert page.locator("li.assistant.error").count() == 0, page.text_content("li.assistant")
        text = answer.locator(".text").text_content()
        expect(answer.locator("[data-route]")).to_be_visible()
        route = answer.locator("[data-route]").text_content()
        assert route == "route: peer0 [0, 10) → peer1 [10, 20) → peer2 [20, 30)"
        assert re.fullmatch(r"\d+ tokens in [\d.]+ s · [\d.]+ tokens/s · first token after \d+ ms · ended: \w[\w ]*",
                            answer.locator("[data-speed]").text_content())
        shown = page.evaluate("window.answerTexts")
        assert len(shown) >= 3 and shown[-1] == text and all(text.startswith(t) for t in shown), shown
        v.shot("web-chat.png")
    out, err = generate.communicate(timeout=STARTUP)
    assert generate.returncode == 0, err[-2000:]
    expected = json.loads(out.strip().splitlines()[-1])
    assert text == expected["text"] and text.startswith("The capital of France is Paris")
    assert [(h["start"], h["end"]) for h in expected["route"]] == SPANS


def test_chat_policy_deny_leaves_no_route_and_says_which_layers(gateway, browser):
    with visit(browser, gateway, "/chat") as v:
        page = v.page
        expect(page.locator("#policy select")).to_have_count(3)
        peer1 = page.locator("#policy label", has_text="peer1").locator("select")
        peer1.select_option("deny")
        page.fill("#max-tokens", "4")
        page.fill("#prompt", "Hello")
        page.click("#send")
        failed = page.locator("li.assistant.error[data-done]")
        expect(failed).to_have_count(1, timeout=ANSWER)
        assert "[10, 20)" in failed.locator(".meta").text_content()


def test_the_peers_own_page_shows_its_sessions_and_tokens(gateway, peer_web, browser):
    # an answer through the swarm (every route crosses peer0, the only one serving layer 0)
    answer = httpx.post(gateway + "v1/chat/completions", timeout=ANSWER / 1000,
                        headers={"authorization": f"Bearer {KEY}"},
                        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6})
    assert answer.status_code == 200, answer.text
    with visit(browser, peer_web, "/peer", key=None) as v:  # the peer was started without a key
        page = v.page
        expect(page.locator("#peer-title")).to_have_text("Peer peer0 (this peer)")
        expect(page.locator("#peer-state")).to_have_text(re.compile(r"^serving · layers \[0, 10\) of 30"))
        expect(page.locator("#events li[data-kind=session_close]")).not_to_have_count(0)
        assert page.locator("#events li[data-kind=session_open]").count() >= 1
        expect(page.locator("#rate-text")).to_have_attribute("data-total", re.compile(r"^[1-9]\d*$"))
        expect(page.locator("#spark polyline")).to_have_count(1)
        expect(page.locator("#actions")).to_be_visible()  # drain, pause, resume: this client is on this machine
        assert page.locator("#actions button").all_text_contents() == ["Drain", "Pause", "Resume"]
        assert page.locator("#sessions thead th").all_text_contents()[:2] == ["Session", "Requester"]
        page.wait_for_timeout(300)
        v.shot("web-peer.png")


@contextmanager
def another_site() -> Iterator[str]:
    """A page of another origin on this machine (a plain HTTP server on its own port); yields its URL."""
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>another site</title><p>another site"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


ATTACK = """async (target) => {
  const sent = [];
  for (const [body, type] of [["{}", "text/plain"], ["{}", "application/json"]]) {
    try {  // no-cors: the page cannot read the answer, but the request is sent (and was served)
      await fetch(target, { method: "POST", mode: "no-cors", body, headers: { "content-type": type } });
      sent.push("sent");
    } catch (error) { sent.push("blocked"); }
  }
  return sent;
}"""


def test_pages_of_other_sites_cannot_drive_the_peer_and_its_own_page_can(peer_web, browser):
    """The attacks of issue 45 in chromium (peer/http/guard.py): a page of another origin (another
    port of this machine) POSTs pause to the peer's web view, as a simple request and as JSON, and
    a name rebound to 127.0.0.1 (chromium's resolver maps it) loads the peer's page: the peer keeps
    serving and the rebound name gets a 403. The peer's own page still pauses and resumes it."""
    port = int(peer_web.rstrip("/").rsplit(":", 1)[1])
    with another_site() as other:
        context = browser.new_context()
        try:
            page = context.new_page()
            page.goto(other)
            sent = page.evaluate(ATTACK, peer_web + "web/api/peer/pause")
        finally:
            context.close()
    assert sent[0] == "sent", sent  # the simple request left the browser: the server had to refuse it
    status = httpx.get(peer_web + "web/api/peer", timeout=30).json()["status"]
    assert (status["state"], status["paused"]) == ("serving", False)
    resolver = browser.browser_type.launch(
        executable_path=CHROMIUM, args=[*LAUNCH_ARGS, "--host-resolver-rules=MAP rebind.example 127.0.0.1",
                                        "--disable-features=HttpsUpgrades"])
    try:
        page = resolver.new_page()
        answer = page.goto(f"http://rebind.example:{port}/peer")
        assert answer is not None and answer.status == 403, answer and answer.text()
        assert "host_not_allowed" in answer.text()
    finally:
        resolver.close()
    with visit(browser, peer_web, "/peer", key=None) as v:  # the peer's own page: its buttons still act
        page = v.page
        expect(page.locator("#actions")).to_be_visible()
        page.click("#actions button[data-action=pause]")
        expect(page.locator("#action-result")).to_have_text(re.compile(r"^pause: now"))
        assert httpx.get(peer_web + "web/api/peer", timeout=30).json()["status"]["paused"] is True
        page.click("#actions button[data-action=resume]")
        expect(page.locator("#action-result")).to_have_text(re.compile(r"^resume: now"))


def test_a_killed_peer_shows_gone_and_its_layers_missing_within_the_bound(gateway, swarm, browser):
    with visit(browser, gateway, "/swarm") as v:
        page = v.page
        expect(page.locator("#peers tbody tr[data-state=serving]")).to_have_count(3)
        bound = float(re.search(r"within ([\d.]+) s", page.text_content("#bound")).group(1))
        assert RECORD_TTL <= bound <= RECORD_TTL + 2
        victim = page.locator("#peers tbody tr", has_text="peer2").get_attribute("data-peer")
        swarm.kill(2)
        killed = time.monotonic()
        expect(page.locator("#headline")).to_have_text("no route: layers [20, 30) missing",
                                                       timeout=(bound + LATE) * 1000)
        took = time.monotonic() - killed
        expect(page.locator(f"#peers tbody tr[data-peer='{victim}']")).to_have_attribute("data-state", "gone")
        expect(page.locator(f"#lanes .lane[data-peer='{victim}'] .span")).to_have_attribute("data-state", "gone")
        assert page.locator("#coverage .cell[data-count='0']").count() == 10
        assert took <= bound + LATE, f"the gap showed {took:.1f} s after the kill; the page's bound is {bound} s"
        v.shot("web-swarm-gap.png")
