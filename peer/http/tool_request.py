"""What a request's tools are: the functions offered and how the model may use them. Parsed from
each dialect's fields and turned into constrained decoding by peer/http/tools.py; carried by
`GenerationRequest` (peer/http/requests.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolRequest:
    """The tools a request offers, and `choice`: none, auto, required, or a tool's name."""

    tools: tuple[Tool, ...]
    choice: str

    def schemas(self) -> list[dict]:
        """The tools as chat templates take them (Hugging Face's convention: OpenAI's shape)."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.tools]
