"""Text <-> token ids, and the chat template — with `tokenizers` and jinja2 only.

The chat template is rendered in jinja2's immutable sandbox, as Hugging Face
renders it, so a template from a model folder cannot touch anything but the
messages it is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from tessera.stages.errors import ModelFormatError

Message = dict[str, str]


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@dataclass
class Tokenizer:
    """A model folder's tokenizer and chat template."""

    backend: HFTokenizer
    chat_template: str | None = None
    special: dict[str, Any] = field(default_factory=dict)  # bos_token, eos_token, ...

    @staticmethod
    def from_folder(folder: Path) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as bad:  # tokenizers raises a bare Exception for every failure
            raise ModelFormatError(f"cannot read {str(path)!r}: {bad}") from None
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.exists():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as bad:
                raise ModelFormatError(f"{str(config_path)!r} is not valid JSON: {bad}") from None
        template = config.get("chat_template")
        template_path = folder / "chat_template.jinja"
        if template_path.exists():
            template = template_path.read_text()
        special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, (str, type(None)))}
        return Tokenizer(backend, template if isinstance(template, str) else None, special)

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids; special tokens written in the text are recognised."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> str:
        """The chat template applied to `messages` (a list of {"role", "content"}, and the
        `tool_calls` / `tool_call_id` of tool use), with `tools` (JSON schemas of functions,
        as Hugging Face passes them) when given."""
        if not self.chat_template:
            raise ModelFormatError("this model has no chat template; use raw mode")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson  # as transformers renders it: no HTML escaping, key order kept
        extra = {"tools": list(tools)} if tools else {}
        try:
            return env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **extra, **self.special
            )
        except TemplateError as bad:
            raise ModelFormatError(f"chat template failed: {bad}") from None

    def encode_chat(self, messages: Sequence[Message], *, tools: Sequence[dict] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, tools=tools))


class TextStream:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    Decoding ids one by one would break multi-byte characters spread over several
    byte-level tokens; we decode the whole answer and emit what is new, holding
    back a trailing replacement character until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta
