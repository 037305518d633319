"""Anthropic's Messages API (`POST /v1/messages`) over the gateway's one generation core.

The request becomes a `GenerationRequest` (a `system` prompt, then the
`messages`, through the model's chat template); the answer comes back as a
`message` object or, with `stream: true`, as the named Server-Sent Events
Anthropic's SDK reads:

    message_start          the message, content empty, usage.input_tokens
    content_block_start    one text block (index 0)
    ping
    content_block_delta    {"type": "text_delta", "text": ...} per piece of text
    content_block_stop
    message_delta          stop_reason, stop_sequence, usage.output_tokens
    message_stop

stop_reason is `end_turn` (end-of-sequence), `stop_sequence` (one of
`stop_sequences`, named in `stop_sequence`) or `max_tokens`. Errors have
Anthropic's shape, `{"type": "error", "error": {"type": ..., "message": ...}}`,
with its type names for each status; mid-stream, one `error` event.

As Anthropic's API: `max_tokens` is required, temperature lies in [0, 1]
(default 1), and `top_k` is native — Anthropic's current SDK no longer sends
sampling parameters, so ask for the greedy answer with
`extra_body={"temperature": 0}`. Structured outputs
(`output_config.format`, a JSON schema) are honoured by constrained decoding,
as on the OpenAI endpoints; `output_config.effort` is ignored. Tools (`tools`, `tool_choice`,
`tool_use` and `tool_result` blocks) are peer/http/tools.py's: calls come back as
`tool_use` blocks with stop_reason `tool_use`. Images and extended thinking are
refused with a 400 naming the field; `metadata` and unknown fields are ignored.
"""

from __future__ import annotations

import secrets
from typing import Any, Awaitable, Callable

from tessera.stages.text.json_prefix import Shape
from tessera.stages.decoding.sampling import SamplingParams
from tessera.stages.text.tokenizer import Tokenizer

from tessera.peer.http import tools as http_tools
from tessera.peer.http.exchange import SSE_HEADERS, Exchange
from tessera.peer.http.generation import LENGTH, Generation
from tessera.peer.http.requests import (
    ApiError, GenerationRequest, _bool, _number, _optional_int, bad, json_shape, refuse_media, required_model,
)

MAX_STOP_SEQUENCES = 16  # Anthropic sets no small limit; this keeps matching cheap
MAX_STOP_CHARS = 256
ROLES = ("user", "assistant")
# Accepted only at these "off" values: anything else would change the answer in a way we cannot honour.
UNSUPPORTED_UNLESS = {"thinking": (None,)}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error"}


def error_body(error: ApiError) -> dict:
    """An ApiError in Anthropic's shape (the swarm's extras, e.g. the missing layers, kept)."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"),
                                       "message": error.message, **error.extra}}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            refuse_media(block, where)
            if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
                raise bad(where, f"{where}: only text content blocks are supported, got {block!r}")
            parts.append(block["text"])
        return "".join(parts)
    raise bad(where, f"{where} must be a string or a list of text blocks, got {content!r}")


def parse_messages(data: dict) -> GenerationRequest:
    """A Messages API body as a GenerationRequest. Raises ApiError(400) naming the field."""
    for name, allowed in UNSUPPORTED_UNLESS.items():
        if name in data and data[name] not in allowed and not (name == "thinking" and _thinking_off(data[name])):
            raise bad(name, f"{name} is not supported by this server")
    model = required_model(data)
    max_tokens = _optional_int(data, "max_tokens", low=1)
    if max_tokens is None:
        raise bad("max_tokens", "max_tokens: Field required")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"messages must be a non-empty list, got {messages!r}")
    chat = []
    system = data.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"messages.{i}.role", f"messages.{i}: each message needs a role, user or assistant, "
                      f"got {message!r}")
        if _has_tool_blocks(message.get("content")):  # tool use and results, as templates take them
            converted = http_tools.anthropic_message(message, i)
            chat.extend(converted["results"])
            if converted["message"]["content"] or "tool_calls" in converted["message"]:
                chat.append(converted["message"])
            continue
        chat.append({"role": message["role"], "content": _text(message.get("content"), f"messages.{i}.content")})
    stops = data.get("stop_sequences") or []
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise bad("stop_sequences", f"stop_sequences must be a list of at most {MAX_STOP_SEQUENCES} strings of "
                  f"1 to {MAX_STOP_CHARS} characters, got {stops!r}")
    sampling = SamplingParams(
        temperature=_number(data, "temperature", 1.0, low=0.0, high=1.0),
        top_p=_number(data, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=_optional_int(data, "top_k", low=0) or 0,
    )
    return GenerationRequest(messages=tuple(chat), prompt=None, model=model, max_tokens=max_tokens,
                             sampling=sampling, stop=tuple(stops), stream=_bool(data, "stream"),
                             include_usage=False, json_shape=_output_format(data.get("output_config")),
                             tools=http_tools.anthropic_tools(data))


def _has_tool_blocks(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result")
                                             for b in content)


def _output_format(config: Any) -> Shape | None:
    """Structured outputs: output_config.format = {"type": "json_schema", "schema": {...}}."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad("output_config", f"output_config must be an object, got {config!r}")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad("output_config.format", f"output_config.format must be {{\"type\": \"json_schema\", "
                  f"\"schema\": ...}}, got {fmt!r}")
    return json_shape("json_schema", fmt.get("schema"), "output_config.format")


def _thinking_off(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "disabled"


def stop_reason(gen: Generation, calls: list | None = None) -> str:
    if calls:
        return "tool_use"
    if gen.finish_reason == LENGTH:
        return "max_tokens"
    return "stop_sequence" if gen.stop_sequence is not None else "end_turn"


def message(id: str, model: str, text: str | None, gen: Generation) -> dict:
    """The message object: whole (text given, the answer over) or as message_start carries it."""
    done = text is not None
    return {"id": id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}] if done else [],
            "stop_reason": stop_reason(gen) if done else None,
            "stop_sequence": gen.stop_sequence if done else None,
            "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens}}


def responder(model: str, tokenizer: Tokenizer) -> Callable[[Exchange, Generation, GenerationRequest], Awaitable[None]]:
    id = f"msg_{secrets.token_hex(12)}"

    async def respond(http: Exchange, gen: Generation, request: GenerationRequest) -> None:
        if request.tools is not None and request.tools.choice != "none":
            await tool_answer(http, gen, request, id, model, http_tools.tool_format(tokenizer))
            return
        if not request.stream:
            text = await gen.text()
            await http.json(200, message(id, model, text, gen))
            return
        await gen.start()  # no route is still an HTTP error: no header sent yet
        await http.start(200, SSE_HEADERS)
        await http.event({"type": "message_start", "message": message(id, model, None, gen)}, name="message_start")
        await http.event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                         name="content_block_start")
        await http.event({"type": "ping"}, name="ping")
        while (delta := await gen.step()) is not None:
            if delta:
                await http.event({"type": "content_block_delta", "index": 0,
                                  "delta": {"type": "text_delta", "text": delta}}, name="content_block_delta")
        await http.event({"type": "content_block_stop", "index": 0}, name="content_block_stop")
        await http.event({"type": "message_delta",
                          "delta": {"stop_reason": stop_reason(gen), "stop_sequence": gen.stop_sequence},
                          "usage": {"output_tokens": gen.completion_tokens}}, name="message_delta")
        await http.event({"type": "message_stop"}, name="message_stop")
        await http.write(b"", more=False)

    return respond


async def tool_answer(http: Exchange, gen: Generation, request: GenerationRequest, id: str, model: str,
                      fmt: http_tools.ToolFormat) -> None:
    """A message that may hold `tool_use` blocks: whole, or streamed, each call as one block
    (`content_block_start` with the id and name, one `input_json_delta`, `content_block_stop`)."""
    splitter = http_tools.CallSplitter(request.tools, fmt, "toolu_")
    if not request.stream:
        content, calls = http_tools.split_answer(await gen.text(), request.tools, fmt, "toolu_")
        body = message(id, model, content, gen)
        body["content"], body["stop_reason"] = http_tools.anthropic_blocks(content, calls), stop_reason(gen, calls)
        await http.json(200, body)
        return
    await gen.start()
    await http.start(200, SSE_HEADERS)
    await http.event({"type": "message_start", "message": message(id, model, None, gen)}, name="message_start")
    await http.event({"type": "ping"}, name="ping")
    index, text_open = 0, False

    async def text(delta: str) -> None:
        nonlocal text_open
        if not text_open:
            await http.event({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
                             name="content_block_start")
            text_open = True
        await http.event({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": delta}},
                         name="content_block_delta")

    async def close_text() -> None:
        nonlocal text_open, index
        if text_open:
            await http.event({"type": "content_block_stop", "index": index}, name="content_block_stop")
            text_open, index = False, index + 1

    while (delta := await gen.step()) is not None:
        shown, calls = splitter.push(delta)
        if shown:
            await text(shown)
        for call in calls:
            await close_text()
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            await http.event({"type": "content_block_start", "index": index, "content_block": block},
                             name="content_block_start")
            await http.event({"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments_json()}}, name="content_block_delta")
            await http.event({"type": "content_block_stop", "index": index}, name="content_block_stop")
            index += 1
    tail = splitter.flush()
    if tail or (index == 0 and not text_open):
        await text(tail)
    await close_text()
    await http.event({"type": "message_delta", "delta": {"stop_reason": stop_reason(gen, splitter.calls),
                                                         "stop_sequence": gen.stop_sequence},
                      "usage": {"output_tokens": gen.completion_tokens}}, name="message_delta")
    await http.event({"type": "message_stop"}, name="message_stop")
    await http.write(b"", more=False)
