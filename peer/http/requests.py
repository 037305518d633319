"""What an OpenAI-style request body asks for, checked field by field.

`parse_chat` and `parse_completion` turn a decoded JSON body into a
`GenerationRequest` or raise `ApiError` (HTTP 400) naming the field (`param`)
and repeating the bad value, in OpenAI's error shape:

    {"error": {"message": "temperature must be a number in [0, 2], got 7",
               "type": "invalid_request_error", "param": "temperature", "code": null}}

Defaults follow OpenAI's, not `tessera generate`'s: temperature 1.0, top_p 1.0.
A parameter that would change the answer in a way we cannot honour (n > 1,
logprobs, penalties, logit_bias, the legacy `functions`, echo, suffix) is refused
rather than ignored (`tools` are peer/http/tools.py's); a field we do not know (user, metadata ...) is ignored, as OpenAI-
compatible servers do. `response_format` (json_object, json_schema) is honoured
by constrained decoding (stages/decoding/constrained.py); a schema keyword that is not
implemented is refused with a 400 naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tessera.stages.text.json_prefix import JSON_OBJECT, Shape, UnsupportedSchema, compile_schema
from tessera.stages.decoding.sampling import SamplingParams

from tessera.peer.http.tool_request import ToolRequest
from tessera.peer.request.policy import BadPeerId, RequesterPolicy, check_peer_id

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # a stop string longer than this is a mistake, not a stop
ROLES = ("system", "user", "assistant", "tool", "developer")
# Accepted only at these "off" values: anything else would silently change the answer.
UNSUPPORTED_UNLESS = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "functions": (None, []),  # the old name of tools: send `tools` (peer/http/tools.py)
}
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
# The extension field `"tessera": {"allow": [...], "deny": [...], "prefer": [...]}` (peer ids):
# who may compute this answer, within what the gateway's own --allow/--deny permit.
POLICY_FIELDS = ("allow", "deny", "prefer")
MAX_POLICY_IDS = 1024  # per list: far more peers than a requester would name one by one
# Arrays and objects nested deeper than this are refused: a request (messages of content parts,
# a JSON schema) nests a handful of levels; each level costs the parsers behind us a stack frame.
MAX_JSON_DEPTH = 64


class ApiError(Exception):
    """A request that fails, as an HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        extra: dict | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or []  # extra response headers (e.g. Allow on a 405)
        self.extra = extra or {}  # more fields for the error object (e.g. the missing layers)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


def bad(param: str, message: str, *, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def json_depth_over(data: Any, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit` in `data` (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return False


def decode_body(body: bytes) -> dict:
    """The request body as a JSON object nested at most MAX_JSON_DEPTH deep. Raises ApiError(400)."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"We could not parse the JSON body of your request: {error}") from None
    except RecursionError:  # nested past the interpreter's stack, before our own limit could say so
        raise ApiError(400, f"the JSON body nests arrays or objects deeper than {MAX_JSON_DEPTH}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if json_depth_over(data, MAX_JSON_DEPTH):
        raise ApiError(400, f"the JSON body nests arrays or objects deeper than {MAX_JSON_DEPTH}")
    return data


@dataclass(frozen=True)
class GenerationRequest:
    """One chat or completion request, validated.

    messages:   the chat (chat endpoint) — rendered with the model's chat template; else None.
    prompt:     the text to continue, or token ids (completion endpoint); else None.
    model:      the model name asked for (None: the one this gateway serves).
    max_tokens: most tokens to generate (None: the gateway's default, within the context).
    sampling:   temperature, top_p, top_k, seed.
    stop:       strings that end the answer (not included in it).
    stream:     answer as Server-Sent Events.
    include_usage: with `stream`, send a last chunk carrying `usage` (stream_options).
    json_shape: the answer must be JSON of this shape (response_format; constrained decoding), or None.
    policy:     who may compute it (the `tessera` extension field); None: the gateway's policy.
    tools:      the tools the model may call and how (`tools`, `tool_choice`), or None.
    """

    messages: tuple[dict, ...] | None
    prompt: str | tuple[int, ...] | None
    model: str | None
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    json_shape: Shape | None = None
    policy: RequesterPolicy | None = None
    tools: ToolRequest | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional_int(data: dict, name: str, *, low: int, high: int | None = None) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < low or (high is not None and value > high):
        limits = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(name, f"{name} must be an integer {limits}, got {value!r}")
    return value


def _number(data: dict, name: str, default: float, *, low: float, high: float, low_open: bool = False) -> float:
    value = data.get(name)
    if value is None:
        return default
    ok = _is_number(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise bad(name, f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


def _bool(data: dict, name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be true or false, got {value!r}")
    return value


def _stop(data: dict) -> tuple[str, ...]:
    value = data.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"stop must be a string or a list of strings, got {value!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {s!r}")
    return tuple(stops)


def _policy(data: dict) -> RequesterPolicy | None:
    """The `tessera` extension field, checked. Raises ApiError naming e.g. `tessera.allow[2]`."""
    ext = data.get("tessera")
    if ext is None:
        return None
    if not isinstance(ext, dict):
        raise bad("tessera", f"tessera must be an object with {', '.join(POLICY_FIELDS)}, got {ext!r}")
    unknown = sorted(set(ext) - set(POLICY_FIELDS))
    if unknown:
        raise bad(f"tessera.{unknown[0]}", f"unknown field tessera.{unknown[0]}; "
                  f"the extension takes {', '.join(POLICY_FIELDS)}")
    lists: dict[str, frozenset[str]] = {}
    for name in POLICY_FIELDS:
        value = ext.get(name)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > MAX_POLICY_IDS:
            raise bad(f"tessera.{name}", f"tessera.{name} must be a list of at most {MAX_POLICY_IDS} peer ids, "
                      f"got {value!r}"[:500])
        for i, item in enumerate(value):
            try:
                check_peer_id(item, what=f"tessera.{name}[{i}]")
            except BadPeerId as error:
                raise bad(f"tessera.{name}[{i}]", str(error)) from None
        lists[name] = frozenset(v.strip() for v in value)
    return RequesterPolicy(allow=lists.get("allow"), deny=lists.get("deny", frozenset()),
                           prefer=lists.get("prefer", frozenset()))


def _refuse_unsupported(data: dict) -> None:
    for name, allowed in UNSUPPORTED_UNLESS.items():
        if name in data and data[name] not in allowed:
            raise bad(name, f"{name}={data[name]!r} is not supported by this server "
                      f"(accepted: {', '.join(repr(a) for a in allowed)})")


def required_model(data: dict) -> str:
    """The `model` field: required, a string (which model it names is the gateway's to check)."""
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"model is required: the name of the model to use, got {model!r}"[:500])
    return model


def _common(data: dict) -> dict:
    _refuse_unsupported(data)
    model = required_model(data)
    max_tokens = _optional_int(data, "max_tokens", low=1)
    if max_tokens is None:  # the chat API's newer name for the same limit
        max_tokens = _optional_int(data, "max_completion_tokens", low=1)
    sampling = SamplingParams(
        temperature=_number(data, "temperature", 1.0, low=0.0, high=2.0),
        top_p=_number(data, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=_optional_int(data, "top_k", low=0) or 0,  # not OpenAI's, but vLLM's and common
        seed=_optional_int(data, "seed", low=SEED_RANGE[0], high=SEED_RANGE[1]),
    )
    stream = _bool(data, "stream")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", f"stream_options must be an object, got {options!r}")
    include_usage = bool(options and options.get("include_usage") is True)
    return dict(model=model, max_tokens=max_tokens, sampling=sampling, stop=_stop(data), stream=stream,
                include_usage=include_usage, json_shape=response_format(data.get("response_format")),
                policy=_policy(data))


def json_shape(kind: Any, schema: Any, param: str) -> Shape | None:
    """The shape a response format asks for: "text" (None), "json_object" or "json_schema" with `schema`."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise bad(param, f"a json_schema response format needs a schema object, got {schema!r}")
        try:
            return compile_schema(schema)
        except UnsupportedSchema as error:
            raise bad(param, str(error), code="unsupported_schema") from None
    raise bad(param, f"the response format type must be text, json_object or json_schema, got {kind!r}")


def response_format(value: Any) -> Shape | None:
    """Chat Completions' `response_format`: {"type": ..., "json_schema": {"name", "schema", "strict"}}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("response_format", f"response_format must be an object, got {value!r}")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    return json_shape(value.get("type"), schema, "response_format")


# Content part types that carry an image, audio, video or a file (OpenAI's and Anthropic's names): the
# towers that read them (a multimodal checkpoint's vision encoder) are not run, only its text model.
MEDIA_PARTS = ("image_url", "image", "input_image", "input_audio", "audio", "video", "video_url", "file",
               "input_file", "document")


def refuse_media(part: Any, where: str) -> None:
    """ApiError(400) naming the kind of a content part that is not text (and not the part itself,
    which may be megabytes of base64), when it is one of MEDIA_PARTS."""
    kind = part.get("type") if isinstance(part, dict) else None
    if isinstance(kind, str) and kind in MEDIA_PARTS:
        raise bad(where, f"{where}: a content part of type {kind!r} is not supported: tessera runs the text model "
                         "of a multimodal checkpoint, not its vision or audio tower; send text only",
                  code="unsupported_content")


def _message_text(content: Any, i: int) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            refuse_media(part, f"messages[{i}].content")
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content", f"only text content parts are supported, got {part!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content", f"content must be a string or a list of text parts, got {content!r}")


def parse_chat(data: dict) -> GenerationRequest:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"messages must be a non-empty list, got {messages!r}")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", f"each message must be an object, got {message!r}")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"role must be one of {', '.join(ROLES)}, got {role!r}")
        clean.append(_chat_message(message, role, i))
    return GenerationRequest(messages=tuple(clean), prompt=None, **_common(data))


def _chat_message(message: dict, role: str, i: int) -> dict:
    """A message as chat templates take it: the text, and tool use — an assistant's `tool_calls`
    (their `arguments` parsed from JSON text into an object, as templates write them) and a tool
    result's `tool_call_id`."""
    calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    out = {"role": role, "content": "" if content is None and calls else _message_text(content, i)}
    if calls is not None:
        if not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls", f"tool_calls must be a list, got {calls!r}"[:300])
        out["tool_calls"] = [_tool_call(call, f"messages[{i}].tool_calls[{k}]") for k, call in enumerate(calls)]
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise bad(f"messages[{i}].tool_call_id", "a tool message needs the tool_call_id it answers")
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise bad(where, f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                  f"\"arguments\": JSON text}}}}, got {call!r}"[:300])
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        raise bad(where, f"{where}.function.arguments is not JSON: {fn['arguments']!r}"[:300]) from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def parse_completion(data: dict) -> GenerationRequest:
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = tuple(prompt)
    elif isinstance(prompt, list):
        raise bad("prompt", "prompt must be one string or one list of token ids (batches are not supported)")
    elif not isinstance(prompt, str):
        raise bad("prompt", f"prompt must be a string or a list of token ids, got {prompt!r}")
    if data.get("tools") not in (None, []):
        raise bad("tools", "tools are taken by /v1/chat/completions and /v1/messages, not by completions")
    return GenerationRequest(messages=None, prompt=prompt, **_common(data))
