"""Is this text a valid start of a JSON document (matching a schema)? For constrained decoding.

`check(text, shape)` answers COMPLETE (a whole document: only end-of-sequence
may follow), PREFIX (not finished, but some continuation is valid) or INVALID.
It is a recursive-descent parser that treats running out of text as success
so far (`_Incomplete`): simple to extend with schema rules, and exact.

    >>> shape = compile_schema({"type": "object", "properties": {"city": {"type": "string"}},
    ...                         "required": ["city"], "additionalProperties": False})
    >>> check('{"ci', shape), check('{"co', shape), check('{}', shape), check('{"city": "Paris"}', shape)
    ('prefix', 'invalid', 'invalid', 'complete')

Shapes (`compile_schema`) cover the JSON Schema most structured-output requests
use — `type` (one or a list), `properties`, `required`, `additionalProperties`
(a schema, true or false; absent = any extra key, as JSON Schema says), `items`,
`enum`, `const` — and refuse any other keyword with `UnsupportedSchema`, naming
it, rather than produce output that might not match. Annotations (`title`,
`description`, `$schema`, `examples`, `default`) are ignored.

Decisions that keep a small model from wandering: the document starts at once
(no leading whitespace) and ends at once (no trailing whitespace: the only
continuation of a complete document is end-of-sequence); a run of whitespace
between tokens is at most `MAX_WHITESPACE_RUN` characters; enum and const
values are written as `json.dumps` writes them (compact, non-ASCII as is).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

COMPLETE, PREFIX, INVALID = "complete", "prefix", "invalid"
MAX_WHITESPACE_RUN = 16  # enough for pretty-printing a few levels deep; stops endless blank runs
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
ANNOTATIONS = {"title", "description", "$schema", "examples", "default", "$comment"}
KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "enum", "const"}
NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?\Z")
INTEGER = re.compile(r"-?(0|[1-9][0-9]*)\Z")
HEX = set("0123456789abcdefABCDEF")
ESCAPES = set('"\\/bfnrtu')


class UnsupportedSchema(ValueError):
    """A JSON schema uses a keyword (or a form of one) that constrained decoding does not implement."""

    def __init__(self, keyword: str, message: str) -> None:
        super().__init__(message)
        self.keyword = keyword


@dataclass(frozen=True, eq=False)  # eq=False: ANY refers to itself
class Shape:
    """What a JSON value may be. types: the allowed JSON types (all, if empty and no literals).
    literals: the only allowed values, as json.dumps writes them (enum/const); None: any."""

    types: frozenset[str] = frozenset(TYPES)
    properties: dict[str, "Shape"] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    additional: "Shape | None" = None  # extra keys' values; None: no extra keys
    items: "Shape | None" = None  # None: any value
    literals: tuple[str, ...] | None = None


ANY = Shape()  # any value: objects with any keys (of any values), arrays of anything
object.__setattr__(ANY, "additional", ANY)
object.__setattr__(ANY, "items", ANY)
JSON_OBJECT = Shape(types=frozenset({"object"}), additional=ANY)  # response_format json_object


def compile_schema(schema: Any, path: str = "schema") -> Shape:
    """A Shape for `schema`. Raises UnsupportedSchema naming the first unsupported keyword."""
    if schema is True or schema == {}:
        return ANY
    if not isinstance(schema, dict):
        raise UnsupportedSchema("schema", f"{path} must be an object, got {schema!r}")
    for key in schema:
        if key not in KEYWORDS and key not in ANNOTATIONS:
            raise UnsupportedSchema(key, f"{path}: the JSON schema keyword {key!r} is not supported by "
                                    f"constrained decoding here (supported: {', '.join(sorted(KEYWORDS))})")
    literals = None
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise UnsupportedSchema("enum", f"{path}.enum must be a non-empty list, got {values!r}")
        literals = tuple(json.dumps(v, ensure_ascii=False, separators=(",", ":")) for v in values)
    types = schema.get("type", list(TYPES))
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or any(t not in TYPES for t in types):
        raise UnsupportedSchema("type", f"{path}.type must be one of {', '.join(TYPES)} (or a list), "
                                f"got {schema.get('type')!r}")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise UnsupportedSchema("properties", f"{path}.properties must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or any(r not in properties for r in required):
        raise UnsupportedSchema("required", f"{path}.required must list names from properties, got {required!r}")
    extra = schema.get("additionalProperties", True)
    additional = None if extra is False else compile_schema(extra, f"{path}.additionalProperties")
    items = compile_schema(schema["items"], f"{path}.items") if "items" in schema else ANY
    return Shape(types=frozenset(types),
                 properties={k: compile_schema(v, f"{path}.properties.{k}") for k, v in properties.items()},
                 required=frozenset(required), additional=additional, items=items, literals=literals)


class _Incomplete(Exception):
    """The text ended where more is needed: a valid prefix so far."""


class _Invalid(Exception):
    """No continuation makes this text valid."""


def check(text: str, shape: Shape) -> str:
    """COMPLETE, PREFIX or INVALID (see module docstring)."""
    parser = _Parser(text)
    try:
        end = parser.value(0, shape)
    except _Incomplete:
        numeric = shape.literals is None and shape.types & {"number", "integer"}
        if numeric and (INTEGER if "number" not in shape.types else NUMBER).match(text):
            return COMPLETE  # a bare number may end here (or go on)
        return PREFIX
    except _Invalid:
        return INVALID
    return COMPLETE if end == len(text) else INVALID


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text

    def at(self, i: int) -> str:
        if i >= len(self.text):
            raise _Incomplete()
        return self.text[i]

    def ws(self, i: int) -> int:
        start = i
        while self.at(i) in " \t\n\r":
            i += 1
            if i - start > MAX_WHITESPACE_RUN:
                raise _Invalid()
        return i

    def word(self, i: int, word: str) -> int:
        for ch in word:
            if self.at(i) != ch:
                raise _Invalid()
            i += 1
        return i

    def value(self, i: int, shape: Shape) -> int:
        if shape.literals is not None:
            return self.literal(i, shape.literals)
        ch = self.at(i)
        kind = {"{": "object", "[": "array", '"': "string", "t": "boolean", "f": "boolean", "n": "null"}.get(ch)
        if kind is None and (ch == "-" or ch.isdigit()):
            kind = "number" if "number" in shape.types else "integer"
        if kind is None or kind not in shape.types:
            raise _Invalid()
        if kind == "object":
            return self.object(i, shape)
        if kind == "array":
            return self.array(i, shape)
        if kind == "string":
            return self.string(i)[1]
        if kind == "boolean":
            return self.word(i, "true" if ch == "t" else "false")
        if kind == "null":
            return self.word(i, "null")
        return self.number(i, integer=kind == "integer")

    def literal(self, i: int, literals: tuple[str, ...]) -> int:
        rest = self.text[i:]
        for lit in sorted(literals, key=len, reverse=True):  # "ab" before "a": the longest that fits
            if rest.startswith(lit):
                return i + len(lit)
        if any(lit.startswith(rest) for lit in literals):
            raise _Incomplete()
        raise _Invalid()

    def number(self, i: int, *, integer: bool) -> int:
        j = i
        while j < len(self.text) and self.text[j] in "0123456789+-.eE":
            j += 1
        token = self.text[i:j]
        pattern = INTEGER if integer else NUMBER
        if j == len(self.text):  # may go on: valid if some completion of `token` matches
            if not _number_prefix(token, integer=integer):
                raise _Invalid()
            raise _Incomplete()
        if not pattern.match(token):
            raise _Invalid()
        return j

    def string(self, i: int, keys: "_KeyFilter | None" = None) -> tuple[str, int]:
        i += 1  # the opening quote
        out: list[str] = []
        while True:
            if keys is not None and not keys.may_start("".join(out)):  # every character of a key counts
                raise _Invalid()
            ch = self.at(i)
            if ch == '"':
                return "".join(out), i + 1
            if ch == "\\":
                if keys is not None and not keys.may_escape("".join(out)):
                    raise _Invalid()  # a known key is written plainly where it can be
                esc = self.at(i + 1)
                if esc not in ESCAPES:
                    raise _Invalid()
                if esc == "u":
                    digits = self.text[i + 2 : i + 6]
                    if any(d not in HEX for d in digits):
                        raise _Invalid()
                    if len(digits) < 4:
                        raise _Incomplete()
                    out.append(chr(int(digits, 16)))
                    i += 6
                else:
                    out.append(json.loads(f'"\\{esc}"'))
                    i += 2
                continue
            if ord(ch) < 0x20:
                raise _Invalid()
            out.append(ch)
            i += 1

    def array(self, i: int, shape: Shape) -> int:
        i = self.ws(i + 1)
        if self.at(i) == "]":
            return i + 1
        while True:
            i = self.ws(self.value(i, shape.items or ANY))
            ch = self.at(i)
            if ch == "]":
                return i + 1
            if ch != ",":
                raise _Invalid()
            i = self.ws(i + 1)

    def object(self, i: int, shape: Shape) -> int:
        seen: set[str] = set()
        i = self.ws(i + 1)
        if self.at(i) == "}":
            if shape.required:
                raise _Invalid()
            return i + 1
        while True:
            if self.at(i) != '"':
                raise _Invalid()
            keys = _KeyFilter(shape, seen)
            key, i = self.string(i, keys)
            if not keys.allows(key):
                raise _Invalid()
            seen.add(key)
            i = self.ws(i)
            if self.at(i) != ":":
                raise _Invalid()
            i = self.ws(self.value(self.ws(i + 1), shape.properties.get(key) or shape.additional or ANY))
            ch = self.at(i)
            if ch == "}":
                if not shape.required <= seen:
                    raise _Invalid()
                return i + 1
            if ch != "," or not _KeyFilter(shape, seen).any_left():
                raise _Invalid()
            i = self.ws(i + 1)


@dataclass
class _KeyFilter:
    """Which keys may still come in an object."""

    shape: Shape
    seen: set[str]

    def allows(self, key: str) -> bool:
        return key not in self.seen and (key in self.shape.properties or self.shape.additional is not None)

    def may_start(self, partial: str) -> bool:
        if self.shape.additional is not None:
            return True
        return any(k.startswith(partial) and k not in self.seen for k in self.shape.properties)

    def may_escape(self, partial: str) -> bool:
        """Whether a key may go on with an escape: only where a known key's next character needs one."""
        if self.shape.additional is not None:
            return True
        return any(k[len(partial)] in '"\\' or ord(k[len(partial)]) < 0x20 for k in self.shape.properties
                   if k not in self.seen and k.startswith(partial) and len(k) > len(partial))

    def any_left(self) -> bool:
        return self.shape.additional is not None or any(k not in self.seen for k in self.shape.properties)


def _number_prefix(token: str, *, integer: bool) -> bool:
    """Whether some continuation of `token` is a JSON number (an integer if `integer`)."""
    for tail in ("", "0", "1", "e1", "0e1"):
        if (INTEGER if integer else NUMBER).match(token + tail):
            return True
    return False
