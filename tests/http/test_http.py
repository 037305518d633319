"""`tessera serve` — the OpenAI- and Anthropic-compatible HTTP gateway — on a real loopback swarm.

The gateway runs as a real `tessera serve` subprocess (the command users run,
signal handling and shutdown included), shared by the module with one 2-peer
swarm; clients are the official `openai` and `anthropic` packages and plain
httpx. Every greedy answer — Chat Completions, Completions, Responses, Messages,
and JSON-constrained ones (against `LocalEngine` under the same mask) — is
compared with `LocalEngine`, what `tessera generate --local` prints.
A second gateway in front of a swarm that lacks layers [15, 30) answers the
"no route" cases.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import openai
import pytest
import trio

from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.http.exchange import MAX_BODY_BYTES
from tessera.peer.http.generation import StopMatcher
from tessera.stages.decoding.constrained import JsonConstraint
from tessera.stages.decoding.generate import prompt_ids
from tessera.stages.text.json_prefix import JSON_OBJECT, compile_schema
from tessera.stages.decoding.sampling import SamplingParams
from tessera.store.db import PeerStore
from tessera.store.events import SessionClose, SessionOpen, Stamped

from ..conftest import FRANCE
from ..swarm_helpers import local_swarm

pytestmark = pytest.mark.slow

KEY = "test-key-7f3a"
ORIGIN = "https://app.example"  # the browser origin the module's gateway allows
MODEL = "smollm2-135m"
GATEWAY_STARTUP = 120.0  # import torch, load the embedding and head, join the swarm
PEER_EVENT_WAIT = 20.0  # a peer's trace is flushed every 0.25 s; generous for a busy machine
HTTP_TIMEOUT = 120.0


@contextmanager
def gateway_process(join: str, log: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`tessera serve` on a free port; yields its base URL. Stopped with SIGTERM, which must be graceful."""
    cmd = [sys.executable, "-m", "tessera.peer.cli.main", "serve", "--join", join, "--port", "0", "--threads", "1", *extra]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + GATEWAY_STARTUP
        while not (found := re.search(r"on (http://\S+)/v1", log.read_text())):
            assert proc.poll() is None, f"tessera serve exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"tessera serve not listening:\n{log.read_text()}"
            time.sleep(0.1)
        yield found.group(1), proc
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
def peers(smol_dir) -> Iterator[LocalSwarm]:
    with local_swarm([(0, 15), (15, 30)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def url(peers) -> Iterator[str]:
    with gateway_process(peers.addrs[0], peers.base_dir / "serve.log", "--api-key", KEY,
                         "--cors-origin", ORIGIN) as (base, _):
        yield base


@pytest.fixture(scope="module")
def half_url(smol_dir, tmp_path_factory) -> Iterator[str]:
    """A gateway in front of one peer serving [0, 15): no route covers [15, 30)."""
    with local_swarm([(0, 15)]) as half:
        with gateway_process(half.addrs[0], half.base_dir / "serve.log", "--route-wait", "1") as (base, _):
            yield base


@pytest.fixture
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def reference(local_engine, prompt: str, *, raw: bool, n: int, sampling=SamplingParams()) -> tuple[str, list[int]]:
    """What `tessera generate --local` answers: the text and the token ids."""
    tokenizer = local_engine.tokenizer
    ids = local_engine.generate_ids(prompt_ids(tokenizer, prompt, raw=raw), max_new_tokens=n, sampling=sampling)
    return tokenizer.decode(ids), ids


def chat_of(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


# -- the official openai client -------------------------------------------------------------


def test_chat_completion_equals_local(client, local_engine):
    answer = client.chat.completions.create(model=MODEL, messages=chat_of(FRANCE), temperature=0, max_tokens=24)
    text, ids = reference(local_engine, FRANCE, raw=False, n=24)
    assert answer.choices[0].message.content == text == "The capital of France is Paris."
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "stop"  # end-of-sequence before 24 tokens
    assert answer.object == "chat.completion" and answer.model == MODEL
    n_prompt = len(prompt_ids(local_engine.tokenizer, FRANCE, raw=False))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (n_prompt, len(ids))
    assert answer.usage.total_tokens == n_prompt + len(ids)


def test_streamed_chat_equals_local(client, local_engine):
    prompt = "Write a haiku about the sea."
    stream = client.chat.completions.create(model=MODEL, messages=chat_of(prompt), temperature=0, max_tokens=20,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text, ids = reference(local_engine, prompt, raw=False, n=20)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 5  # token by token, not one lump
    assert "".join(content) == text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == ("stop" if len(ids) < 20 else "length") and set(finish[:-1]) == {None}
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)


def test_completion_equals_local(client, local_engine):
    prompt = "The quick brown fox"
    answer = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    text, ids = reference(local_engine, prompt, raw=True, n=16)
    assert len(ids) == 16 and answer.choices[0].finish_reason == "length"
    assert answer.choices[0].text == text
    assert answer.object == "text_completion" and answer.usage.completion_tokens == 16


def test_streamed_completion_with_token_ids_and_seeded_sampling(client, local_engine):
    """A prompt given as token ids; temperature 0.8 with a seed is reproducible and equals the local sampler."""
    prompt = "Once upon a time"
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    text, _ = reference(local_engine, prompt, raw=True, n=12, sampling=sampling)
    ids = local_engine.tokenizer.encode(prompt)
    got = []
    for _ in range(2):
        stream = client.completions.create(model=MODEL, prompt=ids, temperature=0.8, top_p=0.9, seed=1234,
                                           max_tokens=12, stream=True)
        got.append("".join(c.choices[0].text for c in stream))
    assert got == [text, text]


def test_stop_string_cuts_the_text_and_ends_the_session(client, local_engine, peers):
    prompt = "1, 2, 3,"  # counts on: " 4, 5, 6, ..."
    full, ids = reference(local_engine, prompt, raw=True, n=40)
    assert " 9," in full
    before = last_event_id(peers, 0)
    answer = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=[" 9", "xyz"])
    assert answer.choices[0].text == full[: full.index(" 9")]
    assert answer.choices[0].finish_reason == "stop"
    used = answer.usage.completion_tokens
    assert used < 40 and " 9" in local_engine.tokenizer.decode(ids[:used])
    assert " 9" not in local_engine.tokenizer.decode(ids[: used - 1])
    # The peer's session ended at the stop: it saw the prompt and the tokens fed back, no more.
    closed = wait_session_closes(peers, 0, after=before, count=1)
    assert closed[0].event.tokens == answer.usage.prompt_tokens + used - 1

    stream = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=" 9",
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == full[: full.index(" 9")]


def test_models_and_health(url):
    models = httpx.get(url + "/v1/models", headers=auth()).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    card = models["data"][0]
    assert card["coverage"] == {"layers": 30, "complete": True, "missing": [], "peers": 2, "min_replicas": 1}
    assert httpx.get(url + f"/v1/models/{MODEL}", headers=auth()).json()["id"] == MODEL
    health = httpx.get(url + "/health")  # no key needed: load balancers probe it
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and body["swarm"]["routable"] and body["swarm"]["missing"] == []
    assert body["gateway"]["peer_id"].startswith("12D3KooW") and body["gateway"]["max_concurrent"] == 8


# -- errors, at the HTTP level ---------------------------------------------------------------


def assert_error(response: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= error.keys() and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    return error


def post(url: str, path: str, body, *, headers: dict | None = None) -> httpx.Response:
    """POST `body` (JSON, as the clients send it: 'Content-Type: application/json')."""
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    sent = {"content-type": "application/json", **(headers if headers is not None else auth())}
    return httpx.post(url + path, content=content, headers=sent, timeout=HTTP_TIMEOUT)


CHAT = {"model": MODEL, "messages": chat_of("Hi"), "max_tokens": 4}


def test_invalid_json_is_400(url):
    error = assert_error(post(url, "/v1/chat/completions", b'{"model": "smollm2-135m", "messages": ['), 400)
    assert "JSON" in error["message"] and error["type"] == "invalid_request_error"
    assert_error(post(url, "/v1/completions", b"[1, 2]"), 400)
    assert_error(post(url, "/v1/completions", b'{"prompt": "x", "temperature": NaN}'), 400)


def test_unknown_model_is_400(url):
    error = assert_error(post(url, "/v1/chat/completions", {**CHAT, "model": "gpt-4o"}), 400,
                         param="model", code="model_not_found")
    assert "gpt-4o" in error["message"]
    assert_error(httpx.get(url + "/v1/models/gpt-4o", headers=auth()), 404, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):  # models.retrieve of an unknown model, as OpenAI answers it
        openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).models.retrieve("gpt-4o")


@pytest.mark.parametrize("field, value, param", [
    ("temperature", 2.5, None), ("temperature", "hot", None), ("top_p", 0, None), ("top_p", 1.5, None),
    ("max_tokens", 0, None), ("max_tokens", 2.5, None), ("n", 2, None), ("seed", "lucky", None),
    ("stop", ["a", "b", "c", "d", "e"], None), ("stop", [""], None), ("stop", 7, None), ("stream", "yes", None),
    ("logprobs", True, None), ("presence_penalty", 0.5, None), ("messages", [], None),
    ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
    ("messages", [{"role": "user", "content": [{"type": "wizardry"}]}], "messages[0].content"),
])
def test_bad_parameter_is_400(url, field, value, param):
    error = assert_error(post(url, "/v1/chat/completions", {**CHAT, field: value}), 400, param=param or field)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("part", ["image_url", "input_audio"])
def test_an_image_or_audio_part_is_refused_by_name(url, part):
    # The text model of a multimodal family is what a peer runs: a part it cannot see is named, not dropped.
    value = [{"role": "user", "content": [{"type": part}]}]
    error = assert_error(post(url, "/v1/chat/completions", {**CHAT, "messages": value}), 400,
                         param="messages[0].content", code="unsupported_content")
    assert part in error["message"]


def test_bad_completion_prompt_is_400(url):
    for prompt in (None, 5, ["a", "b"], [1, "x"]):
        assert_error(post(url, "/v1/completions", {"prompt": prompt}), 400, param="prompt")
    error = assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}), 400, param="prompt")
    assert "vocabulary" in error["message"]
    assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": ""}), 400, param="prompt")


def test_prompt_too_long_is_400(url):
    long_prompt = "hello " * 9000  # ~9000 tokens; the context is 8192
    error = assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 4}), 400,
                         param="prompt", code="context_length_exceeded")
    assert "8192" in error["message"]
    chat = {**CHAT, "messages": chat_of(long_prompt)}
    assert_error(post(url, "/v1/chat/completions", chat), 400, param="messages", code="context_length_exceeded")
    assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 8192}), 400,
                 param="max_tokens", code="context_length_exceeded")


def test_api_key_is_required(url):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
        assert_error(post(url, "/v1/chat/completions", CHAT, headers=headers), 401, code="invalid_api_key")
        assert_error(httpx.get(url + "/v1/models", headers=headers), 401, code="invalid_api_key")
    bad_client = openai.OpenAI(base_url=url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()


def test_unknown_endpoint_method_and_oversized_body(url):
    assert_error(httpx.get(url + "/v1/engines", headers=auth()), 404, code="unknown_url")
    wrong_method = httpx.get(url + "/v1/chat/completions", headers=auth())
    assert_error(wrong_method, 405)
    assert wrong_method.headers["allow"] == "POST"
    huge = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10)})
    assert_error(post(url, "/v1/completions", huge), 413)


@pytest.mark.parametrize("stops, pieces, emitted, stopped", [
    (["\n\n"], ["Paris.\n", "\nNext"], ["Paris.", ""], True),  # a stop string across two tokens
    (["END"], ["abc E", "N", "x"], ["abc ", "", "ENx"], False),  # a false start is released
    (["lo w", "o"], ["hel", "lo world"], ["he", "l"], True),  # "l" may start "lo w"; the earliest stop wins
    (["zz"], ["a", "b"], ["a", "b"], False),
])
def test_stop_matcher(stops, pieces, emitted, stopped):
    matcher = StopMatcher(stops)
    results = [matcher.push(p) for p in pieces]
    assert [text for text, _ in results] == emitted
    assert results[-1][1] is stopped and not any(done for _, done in results[:-1])


def test_no_route_is_503_naming_the_missing_layers(half_url):
    for stream in (False, True):
        response = post(half_url, "/v1/chat/completions", {**CHAT, "stream": stream}, headers={})
        error = assert_error(response, 503, code="no_route")
        assert "[15, 30)" in error["message"] and error["missing"] == [[15, 30]]
    claude = post(half_url, "/v1/messages", {"model": MODEL, "max_tokens": 4, "stream": True,
                                             "messages": [{"role": "user", "content": "Hi"}]}, headers={})
    assert claude.status_code == 503, claude.text
    assert claude.json()["type"] == "error" and claude.json()["error"]["type"] == "overloaded_error"
    assert claude.json()["error"]["missing"] == [[15, 30]]
    health = httpx.get(half_url + "/health")
    assert health.status_code == 503
    assert health.json()["swarm"]["missing"] == [[15, 30]] and health.json()["status"] == "unavailable"
    assert health.json()["gateway"]["failed"] == 3
    with pytest.raises(openai.InternalServerError) as raised:  # what an openai client sees
        openai.OpenAI(base_url=half_url + "/v1", api_key="none", max_retries=0).completions.create(
            model=MODEL, prompt="Hi", max_tokens=2)
    assert raised.value.status_code == 503


# -- cancellation and concurrency ------------------------------------------------------------


def peer_store(peers: LocalSwarm, i: int) -> PeerStore:
    return PeerStore(peers.base_dir / f"peer{i}" / "tessera.db", readonly=True)


def last_event_id(peers: LocalSwarm, i: int) -> int:
    events = peer_store(peers, i).events()
    return events[-1].id if events else 0


def wait_session_closes(peers: LocalSwarm, i: int, *, after: int, count: int) -> list[Stamped]:
    """The first `count` session_close events peer i recorded after event `after`."""
    deadline = time.monotonic() + PEER_EVENT_WAIT
    while True:
        closes = peer_store(peers, i).events(after_id=after, kinds=(SessionClose,))
        if len(closes) >= count or time.monotonic() > deadline:
            return closes
        time.sleep(0.2)


def test_client_disconnect_mid_stream_closes_the_swarm_session(url, peers, local_engine):
    prompt, n = "1, 2, 3,", 64
    _, ids = reference(local_engine, prompt, raw=True, n=n)
    assert len(ids) == n  # left alone, the session would run all 64 tokens
    n_prompt = len(local_engine.tokenizer.encode(prompt))
    cancelled_before = httpx.get(url + "/health").json()["gateway"]["cancelled"]
    before = [last_event_id(peers, i) for i in range(2)]
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": n, "stream": True}
    with httpx.Client(timeout=HTTP_TIMEOUT) as http:
        with http.stream("POST", url + "/v1/completions", json=body, headers=auth()) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # leaving the block closes the connection mid-stream
    for i in range(2):
        closes = wait_session_closes(peers, i, after=before[i], count=1)
        assert len(closes) == 1, f"peer{i} did not close the session"
        assert closes[0].event.tokens < n_prompt + n - 1, closes[0]  # it stopped early
    health = httpx.get(url + "/health").json()["gateway"]
    assert health["cancelled"] == cancelled_before + 1 and health["active"] == 0


async def test_eight_concurrent_streams_are_exact(url, peers, local_engine):
    cases = [(FRANCE, False), ("Name three colours.", False), ("Once upon a time", True), ("1, 2, 3,", True),
             ("Write a haiku about the sea.", False), ("The quick brown fox", True), ("What is 2 + 2?", False),
             ("def fibonacci(n):", True)]
    n = 12
    expected = [reference(local_engine, p, raw=raw, n=n)[0] for p, raw in cases]
    before = last_event_id(peers, 0)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT)
    got: dict[int, str] = {}

    async def one(i: int) -> None:
        prompt, raw = cases[i]
        if raw:
            stream = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=n,
                                                     stream=True)
            got[i] = "".join([c.choices[0].text async for c in stream])
        else:
            stream = await client.chat.completions.create(model=MODEL, messages=chat_of(prompt), temperature=0,
                                                          max_tokens=n, stream=True)
            got[i] = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async with trio.open_nursery() as nursery:
        for i in range(len(cases)):
            nursery.start_soon(one, i)
    assert [got[i] for i in range(len(cases))] == expected
    # Each request had its own session on the peers, and they ran side by side. (An open that met a
    # queue it was not priced with is routed again, so a request may have opened more than one.)
    events = peer_store(peers, 0).events(after_id=before, kinds=(SessionOpen, SessionClose))
    assert len({e.event.session for e in events if isinstance(e.event, SessionOpen)}) >= len(cases)
    running = peak = 0
    for e in events:
        running += 1 if isinstance(e.event, SessionOpen) else -1
        peak = max(peak, running)
    print(f"sessions running at once on peer0: {peak} of {len(cases)}")
    assert peak >= 2, events


# -- the Anthropic Messages and OpenAI Responses dialects -------------------------------------


GREEDY = {"temperature": 0}  # Anthropic's current SDK has no temperature argument; the API still takes it


@pytest.fixture
def claude(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT)


def test_anthropic_messages_equal_local(claude, local_engine):
    text, ids = reference(local_engine, FRANCE, raw=False, n=24)
    answer = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                    messages=[{"role": "user", "content": FRANCE}])
    assert answer.content[0].type == "text" and answer.content[0].text == text == "The capital of France is Paris."
    assert answer.role == "assistant" and answer.stop_reason == "end_turn" and answer.stop_sequence is None
    n_prompt = len(prompt_ids(local_engine.tokenizer, FRANCE, raw=False))
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (n_prompt, len(ids))

    with claude.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                messages=[{"role": "user", "content": FRANCE}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 3 and "".join(pieces) == text and final.content[0].text == text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(ids)


def test_anthropic_stream_events_and_stop_sequences(claude, local_engine):
    prompt = "Count from one to ten."
    full, _ = reference(local_engine, prompt, raw=False, n=30)  # "123456789012..."
    assert "5" in full
    events = list(claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, stream=True,
                                         stop_sequences=["5", "xyz"], messages=[{"role": "user", "content": prompt}]))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]  # (the SDK drops the ping that follows)
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == full[: full.index("5")]
    delta = events[-2]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", "5")
    short = claude.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": prompt}])
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_anthropic_errors_have_anthropic_shape(url, claude):
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 1.5}, messages=[{"role": "user", "content": "x"}])
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in raised.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}])
    missing = post(url, "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.json()["error"]["message"]
    tools = post(url, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                                       "tools": [{"name": "f", "input_schema": {}}]})
    assert tools.status_code == 400 and "does not support tools" in tools.json()["error"]["message"]


def test_tools_on_a_model_whose_template_has_none_are_400(client, url):
    """SmolLM2's chat template never reads `tools` (tool calling itself: tests/http/test_tools.py)."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=chat_of("Hi"), tools=[weather], max_tokens=4)
    assert raised.value.code == "tools_not_supported" and "chat template does not support tools" in str(raised.value)
    assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "tools": [weather]}), 400, param="tools")


def test_responses_api_equals_local(client, local_engine):
    text, ids = reference(local_engine, FRANCE, raw=False, n=24)
    answer = client.responses.create(model=MODEL, input=FRANCE, temperature=0, max_output_tokens=24)
    assert answer.output_text == text and answer.status == "completed"
    assert answer.output[0].role == "assistant" and answer.usage.output_tokens == len(ids)

    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": FRANCE}], temperature=0,
                                          max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == len(ids)
    short = client.responses.create(model=MODEL, input=FRANCE, temperature=0, max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_responses_api_refuses_what_needs_state(url):
    body = {"model": MODEL, "input": "Hi", "previous_response_id": "resp_123"}
    assert_error(post(url, "/v1/responses", body), 400, param="previous_response_id")
    assert_error(post(url, "/v1/responses", {"model": MODEL, "input": [{"type": "function_call"}]}), 400,
                 param="input[0]")


# -- response_format: JSON by constrained decoding ----------------------------------------------

CAPITAL = {"type": "object", "additionalProperties": False, "required": ["country", "capital"],
           "properties": {"country": {"type": "string"}, "capital": {"type": "string"}}}
JSON_PROMPT = "Give the capital of France as JSON."


def constrained_reference(local_engine, prompt: str, shape, n: int) -> str:
    """`LocalEngine` greedy under the same mask: what the swarm must answer token for token."""
    tokenizer = local_engine.tokenizer
    constraint = JsonConstraint(shape, tokenizer, local_engine.spec.eos_token_ids)
    ids = local_engine.generate_ids(prompt_ids(tokenizer, prompt, raw=False), max_new_tokens=n,
                                    constraint=constraint)
    return tokenizer.decode(ids)


def test_response_format_json_schema_is_honoured(client, claude, local_engine):
    want = constrained_reference(local_engine, JSON_PROMPT, compile_schema(CAPITAL), 40)
    answer = client.chat.completions.create(
        model=MODEL, messages=chat_of(JSON_PROMPT), temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL, "strict": True}})
    text = answer.choices[0].message.content
    assert text == want and answer.choices[0].finish_reason == "stop"
    value = json.loads(text)
    assert set(value) == {"country", "capital"} and all(isinstance(v, str) for v in value.values())
    unconstrained, _ = reference(local_engine, JSON_PROMPT, raw=False, n=40)
    assert unconstrained != text  # the mask changed the answer: the test can fail

    streamed = client.responses.create(model=MODEL, input=JSON_PROMPT, temperature=0, max_output_tokens=40,
                                       stream=True, text={"format": {"type": "json_schema", "name": "capital",
                                                                     "schema": CAPITAL, "strict": True}})
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == want
    structured = claude.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": JSON_PROMPT}],
                                        extra_body=GREEDY, output_config={"format": {"type": "json_schema",
                                                                                     "schema": CAPITAL}})
    assert structured.content[0].text == want


def test_a_format_that_cannot_close_in_max_tokens_is_400(url):
    """Issue 34: the shortest CAPITAL document is ~10 tokens; 5 cannot hold it (refused before any peer works)."""
    body = {**CHAT, "max_tokens": 5, "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "capital", "schema": CAPITAL}}}
    error = assert_error(post(url, "/v1/chat/completions", body), 400, param="max_tokens", code="max_tokens_too_small")
    assert '{"country":"","capital":""}' in error["message"]
    claude = post(url, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": CHAT["messages"],
                                        "output_config": {"format": {"type": "json_schema", "schema": CAPITAL}}})
    assert claude.status_code == 400 and "max_tokens" in claude.json()["error"]["message"]


def test_response_format_json_object_is_honoured(client, local_engine):
    prompt = "What is the capital of France? Answer in JSON."
    want = constrained_reference(local_engine, prompt, JSON_OBJECT, 40)
    stream = client.chat.completions.create(model=MODEL, messages=chat_of(prompt), temperature=0, max_tokens=40,
                                            stream=True, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == want and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("response_format, needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^a"}}}, "pattern"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": [{"type": "string"}]}}}, "anyOf"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "yaml"}, "yaml"),
])
def test_unsupported_response_format_is_400(url, response_format, needle):
    error = assert_error(post(url, "/v1/chat/completions", {**CHAT, "response_format": response_format}), 400,
                         param="response_format", code=error_code(response_format))
    assert needle in error["message"]


def error_code(response_format: dict) -> str | None:
    schema = response_format.get("json_schema", {}).get("schema")
    return "unsupported_schema" if schema else None


# -- CORS ------------------------------------------------------------------------------------------


def test_cors_preflight_and_headers(url, half_url):
    asked = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
    preflight = httpx.options(url + "/v1/chat/completions", headers=asked)  # no API key: browsers send none
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    models = httpx.get(url + "/v1/models", headers={**auth(), "Origin": ORIGIN})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == ORIGIN
    refused = assert_error(httpx.get(url + "/v1/models", headers={"Origin": ORIGIN}), 401, code="invalid_api_key")
    assert refused  # an error still carries the CORS header, so the page can read it:
    assert httpx.get(url + "/v1/models", headers={"Origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN
    stranger = {**asked, "Origin": "https://evil.example"}
    assert httpx.options(url + "/v1/chat/completions", headers=stranger).status_code == 403
    assert "access-control-allow-origin" not in httpx.get(url + "/v1/models", headers={**auth(), **stranger}).headers
    off = httpx.options(half_url + "/v1/chat/completions", headers=asked)  # no --cors-origin: CORS is off
    assert off.status_code == 405 and "access-control-allow-origin" not in off.headers


def test_pages_of_other_sites_cannot_use_the_gateway(url):
    """peer/http/guard.py in front of the gateway: before it, a page of any site ran a `text/plain`
    chat completion on the swarm (a "simple" request: the browser sends it without asking), and a
    name rebound to 127.0.0.1 read the answers. Nothing of it reaches the swarm now."""
    port = url.rsplit(":", 1)[1]
    before = httpx.get(url + "/health").json()["gateway"]["requests"]
    body = json.dumps({**CHAT, "max_tokens": 1})
    simple = httpx.post(url + "/v1/chat/completions", content=body, timeout=HTTP_TIMEOUT,
                        headers={**auth(), "content-type": "text/plain", "origin": "https://evil.example"})
    assert_error(simple, 403, code="origin_not_allowed")
    no_origin = httpx.post(url + "/v1/chat/completions", content=body, timeout=HTTP_TIMEOUT,
                           headers={**auth(), "content-type": "text/plain"})
    assert_error(no_origin, 415, code="unsupported_media_type")
    rebound = {"host": f"rebind.example:{port}"}
    assert_error(httpx.get(url + "/v1/models", headers={**auth(), **rebound}), 403, code="host_not_allowed")
    assert_error(post(url, "/v1/chat/completions", CHAT, headers={**auth(), **rebound}), 403, code="host_not_allowed")
    assert httpx.get(url + "/", headers=rebound).status_code == 403  # the pages too
    messages = httpx.post(url + "/v1/messages", content=body, timeout=HTTP_TIMEOUT,
                          headers={**auth(), "content-type": "text/plain"})
    assert messages.status_code == 415 and messages.json()["type"] == "error"  # in Anthropic's shape there
    assert httpx.get(url + "/health").json()["gateway"]["requests"] == before  # nothing ran on the swarm
    # this server's own pages (the web view's chat), the --cors-origin's, and clients without a browser may
    for origin in (url, ORIGIN, None):
        headers = {**auth(), **({"origin": origin} if origin else {})}
        answer = post(url, "/v1/chat/completions", {**CHAT, "max_tokens": 1}, headers=headers)
        assert answer.status_code == 200, (origin, answer.text)


# -- choosing who computes: the request's policy and the admin revocation ----------------------


NOBODY = "12D3KooWNvSZnPi3RrhrTwEY4LuuBeB6K6facKUCJcyWG1aoDd2p"  # a valid peer id no peer has


def test_request_policy_extension_field_narrows_the_route(half_url):
    body = {**CHAT, "tessera": {"allow": [NOBODY]}}
    error = assert_error(post(half_url, "/v1/chat/completions", body, headers={}), 503, code="no_route")
    assert "no allowed peer covers layers [0, 15)" in error["message"]
    assert "no peer at all covers layers [15, 30)" in error["message"]
    assert error["missing"] == [[0, 15], [15, 30]]
    bad = {**CHAT, "tessera": {"deny": ["12D3KooWtypo"]}}
    assert_error(post(half_url, "/v1/chat/completions", bad, headers={}), 400, param="tessera.deny[0]")


def test_admin_revoke_of_an_unknown_or_bad_peer_costs_nothing(url, capsys):
    from tessera.peer.cli.main import main

    error = assert_error(post(url, "/admin/revoke", {"peer": NOBODY}), 404, param="peer", code="unknown_peer")
    assert NOBODY in error["message"]
    assert_error(post(url, "/admin/revoke", {"peer": "12D3KooWtypo"}), 400, param="peer")
    assert_error(post(url, "/admin/revoke", {"peer": NOBODY}, headers={}), 401, code="invalid_api_key")
    assert main(["revoke", NOBODY, "--url", url, "--api-key", KEY]) == 1
    assert "answered 404" in capsys.readouterr().err
    assert httpx.get(url + "/health").json()["status"] == "ok"  # the gateway serves on


# -- a swarm failure mid-stream (LAST in this file: it kills a peer of the module's swarm) ----------------


def test_a_peer_dying_mid_stream_ends_the_stream_with_swarm_error(url, peers):
    """No other peer serves [15, 30): the stream ends with one 502-style `swarm_error` event naming them."""
    body = {"model": MODEL, "prompt": "1, 2, 3,", "temperature": 0, "max_tokens": 64, "stream": True}
    events = []
    with httpx.Client(timeout=HTTP_TIMEOUT) as http:
        with http.stream("POST", url + "/v1/completions", json=body, headers=auth()) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]")
                if len(events) == 2:
                    peers.stop(1, sig=signal.SIGKILL)  # mid-stream, after tokens went out
    assert "[DONE]" not in events and len(events) < 64, events[-3:]
    error = events[-1]["error"]
    assert error["code"] == "swarm_error" and error["type"] == "upstream_error", error
    assert error["missing"] == [[15, 30]] and "[15, 30)" in error["message"], error
    health = httpx.get(url + "/health").json()
    assert health["gateway"]["failed"] >= 1 and health["gateway"]["active"] == 0
