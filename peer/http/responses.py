"""OpenAI's Responses API (`POST /v1/responses`) over the gateway's one generation core.

The request's `instructions` (a system message) and `input` (a string, or a
list of messages whose content is a string or `input_text` parts) go through
the model's chat template. The answer is a `response` object whose `output`
holds one assistant message with one `output_text` part; `status` is
`completed`, or `incomplete` (`incomplete_details.reason` =
`max_output_tokens`) when the budget ran out. With `stream: true`, the named
Server-Sent Events OpenAI sends, each with a `sequence_number`:

    response.created, response.in_progress
    response.output_item.added, response.content_part.added
    response.output_text.delta  (one per piece of text)
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed  (or response.incomplete)

`text.format` takes `text`, `json_object` or `json_schema` (with `schema`),
honoured by constrained decoding as Chat Completions' `response_format` is.
Nothing is stored: `previous_response_id`, `conversation` and `prompt` are
refused, as are tools and log probabilities; `store`, `metadata`, `user` and
unknown fields are ignored. Errors have OpenAI's shape.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Awaitable, Callable

from tessera.stages.decoding.sampling import SamplingParams

from tessera.peer.http.exchange import SSE_HEADERS, Exchange
from tessera.peer.http.generation import LENGTH, Generation
from tessera.peer.http.requests import (
    ROLES, SEED_RANGE, GenerationRequest, _bool, _number, _optional_int, bad, json_shape, required_model,
)

TEXT_PARTS = ("input_text", "output_text", "text")
# Accepted only at these "off" values: anything else would need state or tools we do not have.
UNSUPPORTED_UNLESS = {"previous_response_id": (None,), "conversation": (None,), "prompt": (None,),
                      "tools": (None, []), "top_logprobs": (None, 0), "background": (None, False)}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str)):
                raise bad(where, f"only text content parts are supported, got {part!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(where, f"content must be a string or a list of text parts, got {content!r}")


def _input(data: dict) -> list[dict]:
    chat = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", f"instructions must be a string, got {instructions!r}")
        chat.append({"role": "system", "content": instructions})
    value = data.get("input")
    if isinstance(value, str) and value:
        return [*chat, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", f"input must be a non-empty string or list of messages, got {value!r}")
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in ROLES:
            raise bad(f"input[{i}]", f"each input item must be a message with a role ({', '.join(ROLES)}), "
                      f"got {item!r}")
        chat.append({"role": item["role"], "content": _content(item.get("content"), f"input[{i}].content")})
    return chat


def _format(data: dict) -> tuple[Any, dict]:
    """(the shape text.format asks for, the format to echo back)."""
    text = data.get("text")
    if text is None:
        return None, {"type": "text"}
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None, {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad("text.format", f"text.format must be an object, got {fmt!r}")
    return json_shape(fmt.get("type"), fmt.get("schema"), "text.format"), fmt


def parse_responses(data: dict) -> GenerationRequest:
    """A Responses API body as a GenerationRequest. Raises ApiError(400) naming the field."""
    for name, allowed in UNSUPPORTED_UNLESS.items():
        if name in data and data[name] not in allowed:
            raise bad(name, f"{name}={data[name]!r} is not supported by this server")
    model = required_model(data)
    shape, _ = _format(data)
    sampling = SamplingParams(
        temperature=_number(data, "temperature", 1.0, low=0.0, high=2.0),
        top_p=_number(data, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=_optional_int(data, "top_k", low=0) or 0,  # extensions, as on Chat Completions
        seed=_optional_int(data, "seed", low=SEED_RANGE[0], high=SEED_RANGE[1]),
    )
    return GenerationRequest(messages=tuple(_input(data)), prompt=None, model=model,
                             max_tokens=_optional_int(data, "max_output_tokens", low=1), sampling=sampling,
                             stop=(), stream=_bool(data, "stream"), include_usage=False, json_shape=shape)


class _Ids:
    def __init__(self) -> None:
        self.response = f"resp_{secrets.token_hex(12)}"
        self.message = f"msg_{secrets.token_hex(12)}"
        self.created = int(time.time())


def item(ids: _Ids, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"id": ids.message, "type": "message", "status": status, "role": "assistant", "content": content}


def response(ids: _Ids, model: str, data: dict, gen: Generation, text: str | None) -> dict:
    """The response object: in progress (text None) or finished."""
    status = "in_progress" if text is None else ("incomplete" if gen.finish_reason == LENGTH else "completed")
    finished = text is not None
    return {
        "id": ids.response, "object": "response", "created_at": ids.created, "status": status,
        "model": model, "output": [item(ids, text, "completed" if status == "completed" else "incomplete")]
        if finished else [],
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": data.get("instructions"), "max_output_tokens": data.get("max_output_tokens"),
        "temperature": data.get("temperature", 1.0), "top_p": data.get("top_p", 1.0),
        "parallel_tool_calls": False, "tool_choice": "auto", "tools": [], "store": False,
        "text": {"format": _format(data)[1]}, "metadata": data.get("metadata") or {},
        "usage": {"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": gen.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": gen.prompt_tokens + gen.completion_tokens} if finished else None,
    }


def responder(model: str, data: dict) -> Callable[[Exchange, Generation, GenerationRequest], Awaitable[None]]:
    ids = _Ids()

    async def respond(http: Exchange, gen: Generation, request: GenerationRequest) -> None:
        if not request.stream:
            text = await gen.text()
            await http.json(200, response(ids, model, data, gen, text))
            return
        await gen.start()  # no route is still an HTTP error: no header sent yet
        await http.start(200, SSE_HEADERS)
        sequence = 0

        async def event(kind: str, **fields: Any) -> None:
            nonlocal sequence
            await http.event({"type": kind, "sequence_number": sequence, **fields}, name=kind)
            sequence += 1

        where = {"item_id": ids.message, "output_index": 0, "content_index": 0}
        await event("response.created", response=response(ids, model, data, gen, None))
        await event("response.in_progress", response=response(ids, model, data, gen, None))
        await event("response.output_item.added", output_index=0, item=item(ids, "", "in_progress"))
        await event("response.content_part.added", **where,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        parts = []
        while (delta := await gen.step()) is not None:
            if delta:
                parts.append(delta)
                await event("response.output_text.delta", **where, delta=delta, logprobs=[])
        text = "".join(parts)
        final = response(ids, model, data, gen, text)
        await event("response.output_text.done", **where, text=text, logprobs=[])
        await event("response.content_part.done", **where, part=final["output"][0]["content"][0])
        await event("response.output_item.done", output_index=0, item=final["output"][0])
        await event("response.completed" if final["status"] == "completed" else "response.incomplete",
                    response=final)
        await http.write(b"", more=False)

    return respond
