"""Tool (function) calling: OpenAI's `tools`/`tool_choice` and Anthropic's `tools`, in the model's
own tool-call format.

A model calls a tool by writing it in the format its chat template teaches. The one
format read here is Hermes' (Qwen2.5, Qwen3, Hermes and many fine-tunes):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

It is recognised in the template itself (it takes `tools` and writes `<tool_call>`); a
template without tools is a 400 saying so, as is one whose call format is another.

The tools go to the template as Hugging Face passes them (`tools=[{"type": "function",
"function": {...}}]`), and the answer is held to the format by constrained decoding
(stages/decoding/constrained.py), with each tool's `parameters` as the schema of its arguments
— as JSON Schema reads it: without `additionalProperties`, keys it does not name are allowed
(a call's arguments may hold them); `"additionalProperties": false` allows exactly its keys:

- `tool_choice: "required"` (Anthropic `any`) or a named tool: the answer *is* a call — to
  one of the tools, or to the named one — valid whatever the weights, closed within
  max_tokens (too small a budget is a 400, as for `response_format`).
- `"auto"` (the default): the model may answer in words; if it begins `<tool_call>`, the
  rest is held to the forms, so a call it starts is a valid call.
- `"none"`: the tools are described to the model but nothing is constrained; a call it
  writes anyway stays text.

One call per answer is constrained (a call ends the answer: end-of-sequence is all that
may follow). Calls written freely (the text after a plain answer) are parsed too, when
they name a known tool and hold a JSON object of arguments; anything else stays text.
Streams hold back text that could be the start of `<tool_call>` and send each call whole
once it is closed: one `tool_calls` delta (OpenAI) or one `input_json_delta` (Anthropic).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Sequence

from tessera.stages.decoding.constrained import Form, JsonConstraint
from tessera.stages.text.json_prefix import JSON_OBJECT, UnsupportedSchema, compile_schema
from tessera.stages.text.tokenizer import Tokenizer

from tessera.peer.http.exchange import SSE_HEADERS, Exchange
from tessera.peer.http.generation import Envelope, Generation, chat_chunk, chat_object, usage_chunk
from tessera.peer.http.requests import ApiError, GenerationRequest, bad
from tessera.peer.http.tool_request import Tool, ToolRequest

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")  # OpenAI's and Anthropic's rule for function names
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolFormat:
    """How a model's template writes a call: `start` + {"name": ..., "arguments": {...}} + `end`."""

    name: str
    start: str
    end: str

    @property
    def opener(self) -> str:
        return self.start.rstrip()


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>")


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: dict

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def new_call_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


# -- what the request asks ---------------------------------------------------------------------


def _tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    if not isinstance(name, str) or not NAME.match(name):
        raise bad(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}.description", f"{where}.description must be a string, got {description!r}")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad(f"{where}.parameters", f"{where}: the parameters must be a JSON schema object, got {parameters!r}")
    return Tool(name, description or "", parameters)


def _unique(tools: list[Tool], param: str) -> tuple[Tool, ...]:
    if len(tools) > MAX_TOOLS:
        raise bad(param, f"{param} takes at most {MAX_TOOLS} tools, got {len(tools)}")
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise bad(param, f"{param}: the tool name {twice[0]!r} is given twice")
    return tuple(tools)


def openai_tools(data: dict) -> ToolRequest | None:
    """Chat Completions' `tools` and `tool_choice` (None: no tools offered)."""
    tools, choice = data.get("tools"), data.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad("tool_choice", f"tool_choice {choice!r} needs tools")
        return None
    if not isinstance(tools, list):
        raise bad("tools", f"tools must be a list of {{\"type\": \"function\", \"function\": ...}}, got {tools!r}"[:300])
    parsed = []
    for i, item in enumerate(tools):
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}]", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}, "
                      f"got {item!r}"[:300])
        parsed.append(_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools[{i}].function"))
    result = _unique(parsed, "tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad("tool_choice", f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
                      f"\"function\": {{\"name\": ...}}}}, got {choice!r}")
        choice = fn["name"]
        if choice not in [t.name for t in result]:
            raise bad("tool_choice", f"tool_choice names {choice!r}, which is not among the tools")
    elif choice not in CHOICES:
        raise bad("tool_choice", f"tool_choice must be none, auto, required or a function, got {choice!r}")
    return ToolRequest(result, choice)


def anthropic_tools(data: dict) -> ToolRequest | None:
    """Messages' `tools` ({"name", "description", "input_schema"}) and `tool_choice`
    ({"type": "auto" | "any" | "tool" | "none", "name"})."""
    tools, choice = data.get("tools"), data.get("tool_choice")
    if tools in (None, []):
        if choice is not None and not (isinstance(choice, dict) and choice.get("type") == "none"):
            raise bad("tool_choice", f"tool_choice {choice!r} needs tools")
        return None
    if not isinstance(tools, list):
        raise bad("tools", f"tools must be a list of tools, got {tools!r}"[:300])
    parsed = []
    for i, item in enumerate(tools):
        if not isinstance(item, dict) or item.get("type") not in (None, "custom"):
            raise bad(f"tools.{i}", f"tools.{i}: only custom tools (name, description, input_schema) are "
                      f"supported here, got {item!r}"[:300])
        parsed.append(_tool(item.get("name"), item.get("description"), item.get("input_schema"), f"tools.{i}"))
    result = _unique(parsed, "tools")
    kind = "auto" if choice is None else choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        name = choice.get("name")
        if name not in [t.name for t in result]:
            raise bad("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
        return ToolRequest(result, name)
    if kind not in ("auto", "any", "none"):
        raise bad("tool_choice", f"tool_choice must be {{\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}}, "
                  f"got {choice!r}")
    return ToolRequest(result, "required" if kind == "any" else kind)


def tool_format(tokenizer: Tokenizer) -> ToolFormat:
    """The model's tool-call format, read from its chat template. Raises ApiError(400)."""
    template = tokenizer.chat_template or ""
    if not re.search(r"\btools\b", template):
        raise ApiError(400, "this model's chat template does not support tools (it never reads `tools`): "
                       "serve a model whose template does, e.g. Qwen2.5-Instruct", param="tools",
                       code="tools_not_supported")
    if HERMES.opener not in template:
        raise ApiError(400, "this model's chat template takes tools, but writes calls in a format this server "
                       "does not read (it reads Hermes' <tool_call>{json}</tool_call>)", param="tools",
                       code="tools_not_supported")
    return HERMES


def constraint(request: ToolRequest, fmt: ToolFormat, tokenizer: Tokenizer, eos: Sequence[int]) -> JsonConstraint | None:
    """The mask that holds an answer to the format (see module docstring); None for `none`."""
    if request.choice == "none":
        return None
    forms = []
    for i, tool in enumerate(request.tools):
        if request.choice not in ("auto", "required", tool.name):
            continue
        try:
            shape = compile_schema(tool.parameters) if tool.parameters.get("properties") or \
                tool.parameters.get("required") else JSON_OBJECT
        except UnsupportedSchema as error:
            raise bad(f"tools[{i}]", f"the parameters of tool {tool.name!r}: {error}", code="unsupported_schema") from None
        if "object" not in shape.types:
            raise bad(f"tools[{i}]", f"the parameters of tool {tool.name!r} must be an object schema")
        head = fmt.start + '{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
        forms.append(Form(shape, head, "}" + fmt.end))
    return JsonConstraint(forms, tokenizer, eos, opener=fmt.opener if request.choice == "auto" else None)


# -- what the model wrote -----------------------------------------------------------------------


def parse_call(body: str, request: ToolRequest, prefix: str) -> Call | None:
    """A call from the JSON between the markers, if it names an offered tool with object arguments."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in [t.name for t in request.tools]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return Call(new_call_id(prefix), value["name"], arguments) if isinstance(arguments, dict) else None


class CallSplitter:
    """Splits a growing answer into text and calls: `push(delta)` -> (text safe to show, calls
    closed by this delta). Text that could be the start of a call is held back until it is
    known; a call that never closes is text at `flush()`."""

    def __init__(self, request: ToolRequest, fmt: ToolFormat, id_prefix: str) -> None:
        self.request, self.fmt, self.id_prefix = request, fmt, id_prefix
        self.held = ""
        self.calls: list[Call] = []
        self.text: list[str] = []  # everything shown as text

    def push(self, delta: str) -> tuple[str, list[Call]]:
        self.held += delta
        shown, calls = [], []
        while True:
            at = self.held.find(self.fmt.opener)
            if at < 0:
                keep = _partial_tail(self.held, self.fmt.opener)
                shown.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            end = self.held.find(self.fmt.end.strip(), at)
            if end < 0:
                shown.append(self.held[:at])
                self.held = self.held[at:]
                break
            call = parse_call(self.held[at + len(self.fmt.opener) : end], self.request, self.id_prefix)
            stop = end + len(self.fmt.end.strip())
            if call is None:  # not a call of ours: it stays text
                shown.append(self.held[:stop])
            else:
                shown.append(self.held[:at])
                calls.append(call)
            self.held = self.held[stop:]
        text = "".join(shown)
        if self.calls or calls:  # text around calls: the whitespace between them is no answer
            text = text if text.strip() else ""
        self.text.append(text)
        self.calls.extend(calls)
        return text, calls

    def flush(self) -> str:
        out, self.held = self.held, ""
        self.text.append(out)
        return out

    def content(self) -> str:
        return "".join(self.text).strip() if self.calls else "".join(self.text)


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that begins `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def split_answer(text: str, request: ToolRequest, fmt: ToolFormat, id_prefix: str) -> tuple[str, list[Call]]:
    """(the text outside calls, the calls) of a whole answer."""
    splitter = CallSplitter(request, fmt, id_prefix)
    splitter.push(text)
    splitter.flush()
    return splitter.content(), splitter.calls


# -- the answer, in each dialect -----------------------------------------------------------------


def openai_message(content: str, calls: list[Call]) -> dict:
    return {"role": "assistant", "content": content or None, "refusal": None,
            "tool_calls": [openai_call(c) for c in calls] if calls else None}


def openai_call(call: Call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}
    return out if index is None else {"index": index, **out}


def anthropic_blocks(content: str, calls: list[Call]) -> list[dict]:
    blocks = [{"type": "text", "text": content}] if content or not calls else []
    return blocks + [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in calls]


def anthropic_message(message: dict, i: int) -> dict:
    """An Anthropic message whose content has tool blocks, as chat templates take it: an
    assistant's `tool_use` blocks become `tool_calls`; a user's `tool_result` blocks become
    `tool` messages (returned as {"role": "tool", ...}; several: `split_tool_results`)."""
    role, content = message["role"], message.get("content")
    texts, calls, results = [], [], []
    for k, block in enumerate(content if isinstance(content, list) else []):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages.{i}.content.{k}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("input"), dict):
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": block["input"]}})
        elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _result_text(block.get("content"), where)})
        else:
            raise bad(where, f"{where}: only text, tool_use (assistant) and tool_result (user) blocks are "
                      f"supported, got {block!r}"[:300])
    out = {"role": role, "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    return {"results": results, "message": out}


def _result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise bad(where, f"{where}: a tool_result's content must be text, got {content!r}"[:300])


async def openai_answer(http: Exchange, gen: Generation, env: Envelope, request: GenerationRequest,
                        fmt: ToolFormat) -> None:
    """A chat completion that may call tools: whole, or streamed with `tool_calls` deltas."""
    tools = request.tools
    splitter = CallSplitter(tools, fmt, "call_") if tools.choice != "none" else None
    if not request.stream:
        text = await gen.text()
        content, calls = split_answer(text, tools, fmt, "call_") if splitter else (text, [])
        body = chat_object(env, content, gen)
        body["choices"][0]["message"] = openai_message(content, calls)
        if calls:
            body["choices"][0]["finish_reason"] = "tool_calls"
        await http.json(200, body)
        return
    await gen.start()  # no route is still an HTTP error: no header sent yet
    await http.start(200, SSE_HEADERS)
    await http.event(chat_chunk(env, {"role": "assistant", "content": ""}))
    sent = 0
    while (delta := await gen.step()) is not None:
        text, calls = splitter.push(delta) if splitter else (delta, [])
        if text:
            await http.event(chat_chunk(env, {"content": text}))
        for call in calls:  # each call whole, once it is closed
            await http.event(chat_chunk(env, {"tool_calls": [openai_call(call, sent)]}))
            sent += 1
    tail = splitter.flush() if splitter else ""
    if tail:
        await http.event(chat_chunk(env, {"content": tail}))
    finish = "tool_calls" if splitter and splitter.calls else gen.finish_reason
    await http.event(chat_chunk(env, {}, finish))
    if request.include_usage:
        await http.event(usage_chunk(env, "chat.completion.chunk", gen))
    await http.event("[DONE]")
    await http.write(b"", more=False)
