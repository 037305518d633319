"""The gateway's limits (peer/http/api.py, exchange.py, capacity.py) on a real `tessera serve`
in front of one real peer that takes at most 4 sessions: many more concurrent streams than
that are queued and all answered exactly, nothing is left behind; and the bad inputs an
attacker tries are answered with a 4xx, fast, without a traceback."""

from __future__ import annotations

import json
import socket
import time
from typing import Iterator
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import trio

from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.http.requests import MAX_JSON_DEPTH
from tessera.store.events import SessionClose, SessionOpen

from ..swarm_helpers import local_swarm
from .test_http import HTTP_TIMEOUT, MODEL, assert_error, chat_of, gateway_process, peer_store, post, reference

pytestmark = pytest.mark.slow

MAX_SESSIONS = 4
STREAMS = 32
BODY_TIMEOUT = 2.0  # the gateway's --body-timeout here: a slow body is cut after this
PROMPTS = [("1, 2, 3,", True), ("Name three colours.", False), ("The quick brown fox", True),
           ("What is 2 + 2?", False)]


@pytest.fixture(scope="module")
def small(smol_dir) -> Iterator[LocalSwarm]:
    with local_swarm([(0, 30)], extra=["--max-sessions", str(MAX_SESSIONS)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def small_url(small) -> Iterator[str]:
    with gateway_process(small.addrs[0], small.base_dir / "serve.log", "--body-timeout", str(BODY_TIMEOUT)) as (base, _):
        yield base


async def test_32_streams_on_a_4_session_peer_are_queued_and_all_answered(small_url, small, local_engine):
    """32 concurrent streams against a peer that takes 4 sessions: the gateway runs as many as
    the swarm holds (4) and queues the rest; every answer is exact, and afterwards no session,
    slot or queue place is left. (Before: a busy refusal became a ban and half got 503.)"""
    n = 6
    expected = {p: reference(local_engine, p, raw=raw, n=n)[0] for p, raw in PROMPTS}
    assert httpx.get(small_url + "/health").json()["gateway"]["concurrency"] == MAX_SESSIONS
    client = openai.AsyncOpenAI(base_url=small_url + "/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT)
    got: dict[int, str] = {}

    async def one(i: int) -> None:
        prompt, raw = PROMPTS[i % len(PROMPTS)]
        if raw:
            stream = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=n,
                                                     stream=True)
            got[i] = "".join([c.choices[0].text async for c in stream])
        else:
            stream = await client.chat.completions.create(model=MODEL, messages=chat_of(prompt), temperature=0,
                                                          max_tokens=n, stream=True)
            got[i] = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async with trio.open_nursery() as nursery:
        for i in range(STREAMS):
            nursery.start_soon(one, i)
    assert [got[i] for i in range(STREAMS)] == [expected[PROMPTS[i % len(PROMPTS)][0]] for i in range(STREAMS)]
    health = httpx.get(small_url + "/health").json()["gateway"]
    assert health["completed"] == STREAMS and health["failed"] == 0
    assert health["active"] == 0 and health["queued"] == 0
    # on the peer: every session opened was closed, and never more than it takes ran at once
    deadline = time.monotonic() + 20
    while True:
        events = peer_store(small, 0).events(kinds=(SessionOpen, SessionClose))
        opens = [e for e in events if isinstance(e.event, SessionOpen)]
        closes = [e for e in events if isinstance(e.event, SessionClose)]
        if len(closes) >= len(opens) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(opens) == len(closes) >= STREAMS, (len(opens), len(closes))
    running = peak = 0
    for e in events:
        running += 1 if isinstance(e.event, SessionOpen) else -1
        peak = max(peak, running)
    assert peak <= MAX_SESSIONS, peak
    assert "refused" not in (small.base_dir / "serve.log").read_text()


def raw_request(url: str, head: bytes, body: bytes, *, wait: float) -> tuple[int, float]:
    """Send a request's head and part of its body over a bare socket, keep the connection open,
    and return (the status line's code, seconds until it came)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=wait) as sock:
        started = time.monotonic()
        sock.sendall(head + body)
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        return int(reply.split(b" ", 2)[1]), time.monotonic() - started


def test_bad_inputs_are_4xx(small_url, small):
    """Deep JSON, a missing, null or non-string model, an announced body past the limit, a body
    that never arrives, a bad content-length: each a 4xx naming what, none a 500."""
    deep = b'{"model": "smollm2-135m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = assert_error(post(small_url, "/v1/chat/completions", deep, headers={}), 400)
    assert "deeper than" in error["message"]
    nested = {"model": MODEL, "messages": chat_of("Hi"), "metadata": json.loads("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))}
    assert_error(post(small_url, "/v1/chat/completions", nested, headers={}), 400)
    bodies = {"/v1/chat/completions": {"messages": chat_of("Hi"), "max_tokens": 2},
              "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
              "/v1/responses": {"input": "Hi", "max_output_tokens": 2}}
    for path, body in bodies.items():
        for model in (None, 7, ""):
            assert_error(post(small_url, path, {**body, "model": model}, headers={}), 400, param="model")
        assert_error(post(small_url, path, body, headers={}), 400, param="model")  # missing
    for model in (None, 7):
        claude = post(small_url, "/v1/messages", {"model": model, "max_tokens": 2, "messages": chat_of("Hi")},
                      headers={})
        assert claude.status_code == 400 and claude.json()["error"]["type"] == "invalid_request_error"

    host = urlsplit(small_url).netloc.encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: " + host + b"\r\ncontent-type: application/json\r\n"
    status, seconds = raw_request(small_url, head + b"content-length: 52428800\r\n\r\n", b'{"model": ', wait=30)
    assert status == 413 and seconds < BODY_TIMEOUT, (status, seconds)  # refused on the announcement
    status, seconds = raw_request(small_url, head + b"content-length: 100\r\n\r\n", b'{"model": ', wait=30)
    assert status == 408 and BODY_TIMEOUT <= seconds < BODY_TIMEOUT + 10, (status, seconds)
    log = (small.base_dir / "serve.log").read_text()
    assert "Traceback" not in log and "RecursionError" not in log, log
