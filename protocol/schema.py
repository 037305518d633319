"""Field types and limits: how a message dataclass's annotations become a validator.

A message is a frozen dataclass whose fields are annotated with a small closed set of
types. Each annotation compiles once, at registration, into a tree of nodes:

    int, float, bool, str, bytes         -> Int, Float, Bool, Str, Bytes
    tuple[X, ...]                         -> Tuple(item=X)
    Optional[X]  (or X | None)            -> Optional(inner=X)
    a registered message dataclass        -> Message (its fields, recursively)

Each node checks a value both ways: `load` takes what the CBOR decoder produced
(lists, dicts, plain scalars) and returns the Python value (tuples, dataclasses), and
`dump` takes a Python value and returns the CBOR-ready tree. Both check the type
exactly (a bool is not an int, an int is not a float) and the limits.

Limits are declared per field with `wire(...)`, which wraps `dataclasses.field`:

    payload: bytes = wire(max_len=MAX_PAYLOAD)
    addrs: tuple[str, ...] = wire(max_items=32, max_len=256)   # per-item max_len

Every field is bounded even without `wire`: ints default to [0, 2**63 - 1], floats
must be finite, str and bytes hold at most 1024 characters/bytes, tuples at most 64
items, and str may not hold control characters (C0, DEL, C1) — they would reach
logs and the operator's terminal. `min`/`max`/`finite` apply to numbers, `size`/
`max_len`/`control_chars` to str and bytes, `max_items` to tuples; inside a tuple
or Optional they apply to the items.

The test-suite derives hypothesis strategies from these nodes, so a new message or
field is round-trip tested and fuzzed without writing a test for it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Union

from tessera.protocol.errors import (
    FieldOutOfRange,
    MissingField,
    UnknownField,
    WireError,
    WrongFieldType,
    show,
)

INT64_MAX = 2**63 - 1
DEFAULT_MAX_LEN = 1024
DEFAULT_MAX_ITEMS = 64
_WIRE = "tessera.wire"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class Limits:
    """The limits that `wire(...)` attaches to one field.

    Attributes:
        min: smallest allowed number (None: 0 for int, unbounded for float).
        max: largest allowed number (None: 2**63 - 1 for int, unbounded for float).
        size: exact length of a str/bytes (None: any length up to `max_len`).
        max_len: largest str length in characters / bytes length.
        max_items: largest tuple length.
        finite: floats must not be NaN or infinite.
        control_chars: str may hold control characters.
    """

    min: int | float | None = None
    max: int | float | None = None
    size: int | None = None
    max_len: int = DEFAULT_MAX_LEN
    max_items: int = DEFAULT_MAX_ITEMS
    finite: bool = True
    control_chars: bool = False


def wire(
    *,
    default: Any = dataclasses.MISSING,
    min: int | float | None = None,  # noqa: A002 - reads naturally at the call site
    max: int | float | None = None,  # noqa: A002
    size: int | None = None,
    max_len: int | None = None,
    max_items: int = DEFAULT_MAX_ITEMS,
    finite: bool = True,
    control_chars: bool = False,
) -> Any:
    """A dataclass field with wire limits (see `Limits`); `default` as in `field`."""
    limits = Limits(
        min=min,
        max=max,
        size=size,
        max_len=size if size is not None else (DEFAULT_MAX_LEN if max_len is None else max_len),
        max_items=max_items,
        finite=finite,
        control_chars=control_chars,
    )
    return dataclasses.field(default=default, metadata={_WIRE: limits})


# --- nodes ---------------------------------------------------------------------------


class Node:
    """One annotation, compiled. `where` names the field for error messages."""

    where: str

    def load(self, value: Any) -> Any:
        raise NotImplementedError

    def dump(self, value: Any) -> Any:
        raise NotImplementedError

    def _type_error(self, value: Any, expected: str) -> WrongFieldType:
        return WrongFieldType(f"{self.where}: expected {expected}, got {type(value).__name__} {show(value)}")


@dataclass(frozen=True)
class Int(Node):
    """An int (never a bool) in [lo, hi]."""

    where: str
    lo: int
    hi: int

    def load(self, value: Any) -> int:
        if type(value) is not int:
            raise self._type_error(value, "int")
        if not self.lo <= value <= self.hi:
            raise FieldOutOfRange(f"{self.where}: {value!r} is outside [{self.lo}, {self.hi}]")
        return value

    dump = load


@dataclass(frozen=True)
class Float(Node):
    """A float (never an int) in [lo, hi] (None: unbounded); NaN/inf only if not `finite`."""

    where: str
    lo: float | None
    hi: float | None
    finite: bool

    def load(self, value: Any) -> float:
        if type(value) is not float:
            raise self._type_error(value, "float")
        if self.finite and not math.isfinite(value):
            raise FieldOutOfRange(f"{self.where}: {value!r} is not finite")
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise FieldOutOfRange(f"{self.where}: {value!r} is outside [{self.lo}, {self.hi}]")
        return value

    dump = load


@dataclass(frozen=True)
class Bool(Node):
    """true or false."""

    where: str

    def load(self, value: Any) -> bool:
        if type(value) is not bool:
            raise self._type_error(value, "bool")
        return value

    dump = load


@dataclass(frozen=True)
class Bytes(Node):
    """A byte string of min_len..max_len bytes (equal for a fixed size)."""

    where: str
    min_len: int
    max_len: int

    def load(self, value: Any) -> bytes:
        if type(value) is not bytes:
            raise self._type_error(value, "bytes")
        if not self.min_len <= len(value) <= self.max_len:
            raise FieldOutOfRange(
                f"{self.where}: {show(value)} is {len(value)} bytes, expected {self._span()}"
            )
        return value

    dump = load

    def _span(self) -> str:
        return f"exactly {self.max_len}" if self.min_len == self.max_len else f"at most {self.max_len}"


@dataclass(frozen=True)
class Str(Node):
    """A text string of min_len..max_len characters; control characters only if allowed."""

    where: str
    min_len: int
    max_len: int
    control_chars: bool

    def load(self, value: Any) -> str:
        if type(value) is not str:
            raise self._type_error(value, "str")
        if not self.min_len <= len(value) <= self.max_len:
            raise FieldOutOfRange(
                f"{self.where}: {show(value)} is {len(value)} characters, expected "
                f"{'exactly' if self.min_len == self.max_len else 'at most'} {self.max_len}"
            )
        if not self.control_chars and (found := _CONTROL.search(value)):
            raise FieldOutOfRange(f"{self.where}: {show(value)} holds control character {found.group()!r}")
        return value

    def dump(self, value: Any) -> str:
        # A str subclass (an enum.StrEnum member such as an ErrorCode or PeerState) goes out as
        # the plain string it equals, so the wire never sees the subclass; loading stays strict.
        if isinstance(value, str) and type(value) is not str:
            value = str.__str__(value)
        return self.load(value)


@dataclass(frozen=True)
class Tuple(Node):
    """An array of at most max_items items, each checked by `item`; a tuple in Python."""

    where: str
    item: Node
    max_items: int

    def load(self, value: Any) -> tuple[Any, ...]:
        if type(value) is not list:
            raise self._type_error(value, "array")
        self._check_len(value)
        items = []
        for index, item in enumerate(value):
            try:
                items.append(self.item.load(item))
            except WireError as exc:
                exc.add_note(f"at {self.where}[{index}]")
                raise
        return tuple(items)

    def dump(self, value: Any) -> list[Any]:
        if type(value) is not tuple:
            raise self._type_error(value, "tuple")
        self._check_len(value)
        return [self.item.dump(item) for item in value]

    def _check_len(self, value: list[Any] | tuple[Any, ...]) -> None:
        if len(value) > self.max_items:
            raise FieldOutOfRange(f"{self.where}: {len(value)} items, expected at most {self.max_items}")


@dataclass(frozen=True)
class Optional(Node):
    """null, or what `inner` accepts."""

    where: str
    inner: Node

    def load(self, value: Any) -> Any:
        return None if value is None else self.inner.load(value)

    def dump(self, value: Any) -> Any:
        return None if value is None else self.inner.dump(value)


@dataclass(frozen=True)
class FieldSpec:
    """One field of a message.

    Attributes:
        name: the dataclass field name, which is also its CBOR map key.
        node: the compiled type and limits.
        required: the field has no default, so a message without it is malformed.
        nested: the node holds other nodes (an error inside gets a note saying where).
    """

    name: str
    node: Node
    required: bool
    nested: bool


@dataclass(frozen=True)
class Message(Node):
    """A registered dataclass: `load` takes a CBOR map with one key per field name."""

    where: str
    cls: type
    tag: str
    fields: tuple[FieldSpec, ...]
    names: frozenset[str]

    def load(self, value: Any) -> Any:
        if type(value) is not dict:
            raise self._type_error(value, f"map for {self.cls.__name__}")
        kwargs = {}
        for spec in self.fields:
            if spec.name in value:
                try:
                    kwargs[spec.name] = spec.node.load(value[spec.name])
                except WireError as exc:
                    if spec.nested:
                        exc.add_note(f"in {self.cls.__name__}.{spec.name}")
                    raise
            elif spec.required:
                raise MissingField(f"{self.cls.__name__}.{spec.name} is missing")
        if len(kwargs) != len(value):
            extra = sorted(set(value) - self.names)
            raise UnknownField(f"{self.cls.__name__} has no field {show(extra[0])} (fields: {sorted(self.names)})")
        return self.cls(**kwargs)

    def dump(self, value: Any) -> dict[str, Any]:
        if type(value) is not self.cls:
            raise self._type_error(value, self.cls.__name__)
        return {spec.name: spec.node.dump(getattr(value, spec.name)) for spec in self.fields}


# --- the registry and the compiler ---------------------------------------------------


_BY_TAG: dict[str, type] = {}
_BY_CLASS: dict[type, Message] = {}


def message_types() -> Mapping[str, type]:
    """Every registered message class, by tag (a read-only view)."""
    return MappingProxyType(_BY_TAG)


def schema_of(cls: type) -> Message:
    """The compiled schema of a registered message class.

    Raises:
        KeyError: `cls` is not registered.
    """
    return _BY_CLASS[cls]


def register(cls: type, tag: str) -> Message:
    """Compile `cls`'s annotations and enter it in the registry under `tag`.

    Raises:
        TypeError: `cls` is not a frozen dataclass, `tag` is taken, or a field's
            annotation or limits are outside the supported set. (At import time:
            these are mistakes in our code, not in wire data.)
    """
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__}: a message must be a frozen dataclass")
    if not tag or tag in _BY_TAG:
        raise TypeError(f"{cls.__name__}: message tag {tag!r} is empty or already registered")
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if not f.init:
            raise TypeError(f"{cls.__name__}.{f.name}: init=False fields cannot cross the wire")
        limits = f.metadata.get(_WIRE, Limits())
        node = _compile(hints[f.name], limits, f"{cls.__name__}.{f.name}")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        fields.append(FieldSpec(f.name, node, required, isinstance(node, (Optional, Message))))
    schema = Message(cls.__name__, cls, tag, tuple(fields), frozenset(f.name for f in fields))
    _BY_TAG[tag] = cls
    _BY_CLASS[cls] = schema
    return schema


def _compile(tp: Any, limits: Limits, where: str) -> Node:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return Bool(where)
    if tp is int:
        lo = 0 if limits.min is None else int(limits.min)
        hi = INT64_MAX if limits.max is None else int(limits.max)
        if not -(2**64) <= lo <= hi < 2**64:
            raise TypeError(f"{where}: int limits [{lo}, {hi}] exceed what CBOR encodes without tags")
        return Int(where, lo, hi)
    if tp is float:
        return Float(where, limits.min, limits.max, limits.finite)
    if tp is bytes or tp is str:
        min_len = limits.size if limits.size is not None else 0
        if tp is bytes:
            return Bytes(where, min_len, limits.max_len)
        return Str(where, min_len, limits.max_len, limits.control_chars)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return Tuple(where, _compile(args[0], limits, f"{where}[]"), limits.max_items)
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = args[0] if args[1] is type(None) else args[1]
        return Optional(where, _compile(inner, limits, where))
    if isinstance(tp, type) and tp in _BY_CLASS:
        return _BY_CLASS[tp]
    raise TypeError(f"{where}: annotation {tp!r} is not a wire type (register nested messages first)")
