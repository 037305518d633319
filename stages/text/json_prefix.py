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
    """The text ended where more is needed: a valid prefix so far. `tail` is the shortest text
    that closes everything open (None until the innermost construct that knows it fills it in)."""

    def __init__(self, tail: str | None = None) -> None:
        self.tail = tail


class _Invalid(Exception):
    """No continuation makes this text valid."""


def check(text: str, shape: Shape) -> str:
    """COMPLETE, PREFIX or INVALID (see module docstring)."""
    return parse(text, shape)[0]


def closing(text: str, shape: Shape) -> str | None:
    """The shortest text that makes `text` a complete document of `shape` ("" if it is one already;
    None if nothing does). Required keys come in the schema's order, each with its shortest value.

    >>> shape = compile_schema({"type": "object", "required": ["n", "tags"], "additionalProperties": False,
    ...                         "properties": {"n": {"type": "integer"}, "tags": {"type": "array"}}})
    >>> closing('', shape), closing('{"n": 12', shape), closing('{"n":-', shape)
    ('{"n":0,"tags":[]}', ',"tags":[]}', '0,"tags":[]}')
    """
    return parse(text, shape)[1]


def parse(text: str, shape: Shape, *, prefix: str = "", suffix: str = "") -> tuple[str, str | None]:
    """(check's verdict, closing's text) from one pass over `text`, which must be `prefix`, then a
    document of `shape`, then `suffix` (literal texts around it: a tool call's markers)."""
    if len(text) < len(prefix) or not text.startswith(prefix):
        if prefix.startswith(text):
            return PREFIX, prefix[len(text):] + minimal(shape) + suffix
        return INVALID, None
    body = text[len(prefix):]
    parser = _Parser(body)
    try:
        end = parser.value(0, shape)
    except _Incomplete as incomplete:
        tail = incomplete.tail if incomplete.tail is not None else minimal(shape)
        numeric = shape.literals is None and shape.types & {"number", "integer"}
        if numeric and not suffix and (INTEGER if "number" not in shape.types else NUMBER).match(body):
            return COMPLETE, ""  # a bare number may end here (or go on)
        return PREFIX, tail + suffix
    except _Invalid:
        return INVALID, None
    after = body[end:]
    if after == suffix:
        return COMPLETE, ""
    return (PREFIX, suffix[len(after):]) if suffix.startswith(after) else (INVALID, None)


def minimal(shape: Shape) -> str:
    """The shortest JSON text of `shape` (ties: the first of literals in order, then TYPES' order)."""
    if shape.literals is not None:
        return min(shape.literals, key=len)
    options = {"object": lambda: "{" + ",".join(_member(shape, k) for k in _required(shape)) + "}",
               "array": lambda: "[]", "string": lambda: '""', "integer": lambda: "0", "number": lambda: "0",
               "boolean": lambda: "true", "null": lambda: "null"}
    return min((options[t]() for t in TYPES if t in shape.types), key=len)


def _required(shape: Shape, seen: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The required keys still to write, in the schema's order."""
    return [k for k in shape.properties if k in shape.required and k not in seen]


def _value_shape(shape: Shape, key: str) -> Shape:
    return shape.properties.get(key) or shape.additional or ANY


def _member(shape: Shape, key: str) -> str:
    """`"key":value` with the value's shortest text."""
    return json.dumps(key, ensure_ascii=False) + ":" + minimal(_value_shape(shape, key))


def _object_rest(shape: Shape, seen: set[str]) -> str:
    """What closes an object after a complete member: the required keys not yet written, then `}`."""
    return "".join("," + _member(shape, k) for k in _required(shape, seen)) + "}"


def _escape_bodies(ch: str) -> list[str]:
    """The ways to write `ch` after a backslash in a JSON string."""
    short = {'"': '"', "\\": "\\", "/": "/", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}.get(ch)
    return ([short] if short else []) + ([f"u{ord(ch):04x}", f"u{ord(ch):04X}"] if ord(ch) < 0x10000 else [])


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
        for k, ch in enumerate(word):
            if i >= len(self.text):
                raise _Incomplete(word[k:])
            if self.text[i] != ch:
                raise _Invalid()
            i += 1
        return i

    def value(self, i: int, shape: Shape) -> int:
        if shape.literals is not None:
            return self.literal(i, shape.literals)
        if i >= len(self.text):
            raise _Incomplete(minimal(shape))
        ch = self.text[i]
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
        started = [lit for lit in literals if lit.startswith(rest)]
        if started:
            raise _Incomplete(min(started, key=len)[len(rest):])
        raise _Invalid()

    def number(self, i: int, *, integer: bool) -> int:
        j = i
        while j < len(self.text) and self.text[j] in "0123456789+-.eE":
            j += 1
        token = self.text[i:j]
        pattern = INTEGER if integer else NUMBER
        if j == len(self.text):  # may go on: valid if some completion of `token` matches
            tail = _number_tail(token, integer=integer)
            if tail is None:
                raise _Invalid()
            raise _Incomplete(tail)
        if not pattern.match(token):
            raise _Invalid()
        return j

    def string(self, i: int, keys: "_KeyFilter | None" = None) -> tuple[str, int]:
        i += 1  # the opening quote
        out: list[str] = []
        while True:
            if keys is not None and not keys.may_start("".join(out)):  # every character of a key counts
                raise _Invalid()
            if i >= len(self.text):
                raise _Incomplete('"') if keys is None else _PartialKey("".join(out), None)
            ch = self.text[i]
            if ch == '"':
                return "".join(out), i + 1
            if ch == "\\":
                if keys is not None and not keys.may_escape("".join(out)):
                    raise _Invalid()  # a known key is written plainly where it can be
                if i + 1 >= len(self.text):
                    raise _Incomplete('n"') if keys is None else _PartialKey("".join(out), "")
                esc = self.text[i + 1]
                if esc not in ESCAPES:
                    raise _Invalid()
                if esc == "u":
                    digits = self.text[i + 2 : i + 6]
                    if any(d not in HEX for d in digits):
                        raise _Invalid()
                    if len(digits) < 4:
                        if keys is None:
                            raise _Incomplete("0" * (4 - len(digits)) + '"')
                        raise _PartialKey("".join(out), "u" + digits)
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
        items = shape.items or ANY
        phase = "open"  # what closes the array if the text ends here (see `_array_tail`)
        try:
            i = self.ws(i + 1)
            if self.at(i) == "]":
                return i + 1
            while True:
                phase = "value"
                i = self.value(i, items)
                phase = "after"
                i = self.ws(i)
                ch = self.at(i)
                if ch == "]":
                    return i + 1
                if ch != ",":
                    raise _Invalid()
                phase = "next"
                i = self.ws(i + 1)
        except _Incomplete as incomplete:
            inner = incomplete.tail if incomplete.tail is not None else minimal(items)
            incomplete.tail = {"open": "]", "value": inner + "]", "after": "]", "next": minimal(items) + "]"}[phase]
            raise

    def object(self, i: int, shape: Shape) -> int:
        seen: set[str] = set()
        key = ""
        phase = "open"  # what closes the object if the text ends here (see `_object_tail`)
        try:
            i = self.ws(i + 1)
            if self.at(i) == "}":
                if shape.required:
                    raise _Invalid()
                return i + 1
            while True:
                if self.at(i) != '"':
                    raise _Invalid()
                phase = "key"
                keys = _KeyFilter(shape, seen)
                key, i = self.string(i, keys)
                if not keys.allows(key):
                    raise _Invalid()
                seen.add(key)
                phase = "colon"
                i = self.ws(i)
                if self.at(i) != ":":
                    raise _Invalid()
                phase = "value"
                i = self.value(self.ws(i + 1), _value_shape(shape, key))
                phase = "after"
                i = self.ws(i)
                ch = self.at(i)
                if ch == "}":
                    if not shape.required <= seen:
                        raise _Invalid()
                    return i + 1
                if ch != "," or not _KeyFilter(shape, seen).any_left():
                    raise _Invalid()
                phase = "next"
                i = self.ws(i + 1)
        except _PartialKey as partial:
            raise _Incomplete(_key_tail(shape, seen, partial)) from None
        except _Incomplete as incomplete:
            incomplete.tail = _object_tail(shape, seen, key, phase, incomplete.tail)
            raise


class _PartialKey(Exception):
    """The text ended inside an object key: `partial` is the key so far (decoded), `escape` the
    text after a trailing backslash (None: not inside an escape)."""

    def __init__(self, partial: str, escape: str | None) -> None:
        self.partial, self.escape = partial, escape


def _object_tail(shape: Shape, seen: set[str], key: str, phase: str, inner: str | None) -> str:
    """What closes an object whose text ended in `phase` (`key`: the member being written)."""
    if phase == "open":  # after `{`: the required members, or just `}`
        return ",".join(_member(shape, k) for k in _required(shape)) + "}"
    if phase == "colon":
        return ":" + minimal(_value_shape(shape, key)) + _object_rest(shape, seen)
    if phase == "value":
        return (inner if inner is not None else minimal(_value_shape(shape, key))) + _object_rest(shape, seen)
    if phase == "after":
        return _object_rest(shape, seen)
    # "next": after a comma another member must come: the required ones, or the shortest one allowed
    left = _required(shape, seen)
    if left:
        return ",".join(_member(shape, k) for k in left) + "}"
    options = [_member(shape, k) for k in shape.properties if k not in seen]
    if shape.additional is not None:
        options.append(_member(shape, _fresh_key(seen | set(shape.properties))))
    return min(options, key=len) + "}"


def _fresh_key(taken: set[str]) -> str:
    """A shortest key not in `taken` ("", then "0", "1" ...)."""
    key, n = "", 0
    while key in taken:
        key, n = str(n), n + 1
    return key


def _key_tail(shape: Shape, seen: set[str], partial: _PartialKey) -> str:
    """What closes an object whose text ended inside a key: the shortest way over every key the
    text may still become (a known one, or — with additional keys allowed — the key written so far)."""
    options = []
    for key in shape.properties:
        if key in seen or not key.startswith(partial.partial) or len(key) == len(partial.partial) and partial.escape is not None:
            continue
        rest = key[len(partial.partial):]
        if partial.escape is None:
            written = json.dumps(rest, ensure_ascii=False)[1:]
        else:
            bodies = [b for b in _escape_bodies(rest[0]) if b.startswith(partial.escape)]
            if not bodies:
                continue
            written = bodies[0][len(partial.escape):] + json.dumps(rest[1:], ensure_ascii=False)[1:]
        options.append(written + ":" + minimal(_value_shape(shape, key)) + _object_rest(shape, seen | {key}))
    if shape.additional is not None:  # end the key here (a pending escape finished the shortest way)
        escape = partial.escape
        finish = "" if escape is None else "n" if escape == "" else "0" * (5 - len(escape))  # `\n`, `\u..00`
        key = partial.partial if escape is None else partial.partial + json.loads(f'"\\{escape}{finish}"')
        taken = {k[len(key):] for k in seen | set(shape.properties) if k.startswith(key)}
        more = _fresh_key(taken)  # the key so far may be taken: go on to the shortest one free
        options.append(finish + more + '":' + minimal(shape.additional) + _object_rest(shape, seen | {key + more}))
    if not options:  # _KeyFilter let the text through, so some key completes it
        raise _Invalid()
    return min(options, key=len)


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


def _number_tail(token: str, *, integer: bool) -> str | None:
    """The shortest continuation of `token` that is a JSON number (an integer if `integer`), or None."""
    for tail in ("", "0", "1", "e1", "0e1"):
        if (INTEGER if integer else NUMBER).match(token + tail):
            return tail
    return None
