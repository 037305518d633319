"""Tool calling on `tessera serve`, with the official `openai` and `anthropic` clients, on a tiny
random-weight model whose chat template takes tools in Hermes' format (as Qwen2.5's does).

The weights are random, so what the model *wants* is noise; with `tool_choice` required (or a
named tool) the answer is held to the call format, so it is a valid call whatever the weights —
and, greedy, the very call `LocalEngine` makes under the same mask (the swarm's exactness holds
for constrained answers too). `auto` is compared with the local answer the same way. A model
whose template has no tools (SmolLM2) is a 400: tests/http/test_http.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import openai
import pytest

from tessera.peer.cli.model_files import synthesise
from tessera.peer.http import tools as http_tools
from tessera.peer.http.tool_request import ToolRequest
from tessera.peer.http.tools import HERMES, split_answer
from tessera.stages.weights import registry
from tessera.stages.decoding.generate import LocalEngine
from tessera.stages.text.tokenizer import Tokenizer

from ..swarm_helpers import local_swarm
from .test_http import gateway_process

pytestmark = pytest.mark.slow

# Qwen2.5-Instruct's chat template, as far as tools go (its system prompt shortened)
HERMES_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 160  # a call is ~90 byte tokens
MODEL = "tool-model"  # the gateway serves it by its folder's name


def tool_model(folder: Path) -> Path:
    """A tiny random-weight Qwen2-shaped model with a byte tokenizer and a Hermes tool template."""
    synthesise(folder, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=300, seed=11,
               architecture="qwen2")
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    registry.write_manifest(folder, source={"synth_seed": 11, "template": "hermes tools (test)"})
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tool_model(tmp_path_factory.mktemp("tools") / MODEL)


@pytest.fixture(scope="module")
def engine(model_dir) -> LocalEngine:
    return LocalEngine(model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def url(model_dir) -> Iterator[str]:
    with local_swarm([(0, 1), (1, 2)], model=str(model_dir)) as peers:
        with gateway_process(peers.addrs[0], peers.base_dir / "serve.log", "--model", str(model_dir)) as (base, _):
            yield base


@pytest.fixture
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def local_answer(engine: LocalEngine, messages: list[dict], tools: list[dict], choice, *, anthropic_ids=False) -> str:
    """`LocalEngine` greedy under the same tool mask: what the swarm must answer."""
    request = http_tools.openai_tools({"tools": tools, "tool_choice": choice})
    constraint = http_tools.constraint(request, HERMES, engine.tokenizer, engine.spec.eos_token_ids)
    ids = engine.tokenizer.encode_chat(messages, tools=request.schemas())
    out = engine.generate_ids(ids, max_new_tokens=MAX_TOKENS, constraint=constraint)
    return engine.tokenizer.decode(out)


def test_required_is_a_valid_call_and_the_local_one(client, engine):
    want = local_answer(engine, ASK, [WEATHER, TIME], "required")
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                            temperature=0, max_tokens=MAX_TOKENS)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) <= {"city", "days", "unit"} and isinstance(arguments["city"], str)
        assert isinstance(arguments["days"], int) and arguments.get("unit", "celsius") in ("celsius", "fahrenheit")
    else:
        assert set(arguments) == {"zone"} and isinstance(arguments["zone"], str)
    _, (local,) = split_answer(want, ToolRequest(http_tools.openai_tools({"tools": [WEATHER, TIME]}).tools, "required"),
                               HERMES, "call_")
    assert (local.name, local.arguments) == (call.function.name, arguments)


def test_a_named_tool_streamed_is_the_whole_answer(client, engine):
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                           temperature=0, max_tokens=MAX_TOKENS)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_time" and set(json.loads(call.function.arguments)) == {"zone"}
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                            temperature=0, max_tokens=MAX_TOKENS, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls == {0: {"name": "get_time", "arguments": call.function.arguments}}


def test_auto_answers_as_the_local_engine_does(client, engine):
    want = local_answer(engine, ASK, [WEATHER], "auto")
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                            max_tokens=MAX_TOKENS)
    message = answer.choices[0].message
    content, calls = split_answer(want, http_tools.openai_tools({"tools": [WEATHER]}), HERMES, "call_")
    assert (message.content or "") == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == \
        [(c.name, c.arguments) for c in calls]


def test_a_conversation_with_tool_results_goes_on(client):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None


def test_anthropic_tools(url, engine):
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=300)
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    message = claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=ASK, tools=tools,
                                     tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.id.startswith("toolu_") and isinstance(block.input["city"], str)
    want = local_answer(engine, ASK, [WEATHER], "required")
    assert split_answer(want, http_tools.openai_tools({"tools": [WEATHER]}), HERMES, "x")[1][0].arguments == block.input
    with claude.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, messages=ASK, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content if b.type == "tool_use"] == [block.input]
    # the result goes back as a tool_result block, and the conversation goes on
    follow = claude.messages.create(model=MODEL, max_tokens=8, tools=tools, extra_body={"temperature": 0}, messages=[
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": block.id, "name": block.name,
                                                  "input": block.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "clear sky"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}}}], "tool_choice": "required"},
     "tools[0]", "pattern"),
    ({"tools": [WEATHER], "tool_choice": "required", "max_tokens": 20}, "max_tokens", "at least"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tools"),
])
def test_bad_tool_requests_are_400(url, body, param, needle):
    response = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"]


def test_the_template_gets_the_tools_as_transformers_renders_them(model_dir):
    """The oracle for rendering: transformers' apply_chat_template, tools and tool use included."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    reference.chat_template = HERMES_TEMPLATE
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris <&>", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "c", "content": "clear"}]
    schemas = http_tools.openai_tools({"tools": [WEATHER, TIME]}).schemas()
    ours = Tokenizer.from_folder(model_dir).render_chat(messages, tools=schemas)
    assert ours == reference.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <&>", "days": 2}}' in ours


def test_calls_are_split_from_text():
    request = http_tools.openai_tools({"tools": [WEATHER]})
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    content, calls = split_answer(text, request, HERMES, "call_")
    assert content == "Let me look." and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo", "days": 2})]
    for junk in ('<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>', "<tool_call>\n{broken\n</tool_call>",
                 "<tool_call>\n{\"name\": \"get_weather\""):
        assert split_answer(junk, request, HERMES, "call_") == (junk, [])  # not a call of ours: text
    splitter = http_tools.CallSplitter(request, HERMES, "call_")
    pieces = [splitter.push(ch) for ch in text]
    assert "".join(p[0] for p in pieces) == "Let me look.\n" and sum(len(p[1]) for p in pieces) == 1
