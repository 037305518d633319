"""`--config FILE` and `--print-config` for a sub-command: its options from a TOML file.

Every long option of the sub-command's parser is a key, named like the flag
without its dashes (`--max-sessions 8` is `max-sessions = 8`; `max_sessions`
is accepted too). Keys sit at the top level of the file:

    # peer.toml
    model = "smollm2-135m"
    join = ["/ip4/192.0.2.7/tcp/4001/p2p/12D3KooW..."]
    memory = 2.5
    layers = "0:15"
    tui = false

The keys are derived from the parser, so an option added to the parser is a
key at once. Precedence: a flag given on the command line > the file > the
option's default (a repeatable flag given on the command line replaces the
file's whole list). Values are checked as the flag's would be — the same
type and choices — plus the TOML type: an integer option wants a TOML
integer, a flag wants true/false, a repeatable option a list of strings,
anything else a string. An unknown key or a bad value is one `ConfigError`
naming the file, the line and the key.

`--print-config` prints the effective options as TOML and exits; feeding the
output back with `--config` gives the same options. Unset options (no value,
no default) are listed as comments.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from pathlib import Path
from typing import Any, Sequence

from tessera.peer.base.errors import ConfigError

NOT_KEYS = {"help", "config", "print_config", "verbose"}  # options about the config itself or the console, not in it


def add_config_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, metavar="FILE",
                   help="read options from a TOML file (flags given here override it)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective options as TOML (for --config) and exit")


def has_config(p: argparse.ArgumentParser) -> bool:
    return any(a.dest == "config" for a in p._actions)


def config_actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """key -> action, for every long option of `p` that a config file may set."""
    keys = {}
    for action in p._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest not in NOT_KEYS:
            keys[longs[0][2:]] = action
    return keys


def given_on_command_line(p: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, Any]:
    """dest -> the raw value (string, list of strings, or a flag's constant) of each option in argv.

    Parsed again with no defaults and no conversions, so only what was typed appears."""
    saved = [(a, a.default, a.type, a.choices, a.required) for a in p._actions]
    try:
        for action in p._actions:
            action.default, action.type, action.choices, action.required = argparse.SUPPRESS, None, None, False
        given, _ = p.parse_known_args(list(argv))
    finally:
        for action, default, type_, choices, required in saved:
            action.default, action.type, action.choices, action.required = default, type_, choices, required
    names = {a.dest for a in p._actions}
    return {k: v for k, v in vars(given).items() if k in names}


def read_config(path: Path) -> tuple[dict, str]:
    """The TOML table in `path`, and its text (for line numbers). Raises ConfigError."""
    try:
        text = path.expanduser().read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None


def line_of(text: str, key: str) -> int | None:
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(rf"\s*(\[\s*)?[\"']?{re.escape(key)}[\"']?\s*[=\]]", line):
            return number
    return None


def convert(p: argparse.ArgumentParser, action: argparse.Action, key: str, value: Any) -> Any:
    """A TOML value for `action`, typed and checked as argparse would. Raises ValueError."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"wants true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ValueError(f"wants a list of strings, got {value!r}")
        return [one(p, action, v) for v in items]
    return one(p, action, value)


def one(p: argparse.ArgumentParser, action: argparse.Action, value: Any) -> Any:
    if action.type is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"wants an integer, got {value!r}")
        value = str(value)
    elif action.type is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"wants a number, got {value!r}")
        value = str(value)
    elif not isinstance(value, str):
        raise ValueError(f"wants a string, got {value!r}")
    try:
        return p._get_values(action, [value])
    except argparse.ArgumentError as error:
        raise ValueError(error.message) from None
    except ConfigError as error:  # a type function that checks more than the type (e.g. --layers)
        raise ValueError(str(error)) from None


def apply_config(p: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Fill `args` from `args.config` where argv did not give the option; returns key -> raw value
    (what --print-config prints). Raises ConfigError."""
    keys = config_actions(p)
    given = given_on_command_line(p, argv)
    raw: dict[str, Any] = {}
    for key, action in keys.items():
        if action.dest in given:
            raw[key] = given[action.dest]
        elif action.default is not None and action.default is not argparse.SUPPRESS:
            raw[key] = action.default
    if args.config is None:
        return raw
    table, text = read_config(args.config)
    for name, value in table.items():
        key = name.replace("_", "-")
        where = f"{args.config}" + (f", line {n}" if (n := line_of(text, name)) else "")
        if key not in keys:
            near = ", ".join(sorted(keys))
            table_note = "; options sit at the top level, not in a table" if isinstance(value, dict) else ""
            raise ConfigError(f"{where}: unknown key {name!r}{table_note} (known keys: {near})")
        action = keys[key]
        try:
            typed = convert(p, action, key, value)
        except ValueError as error:
            raise ConfigError(f"{where}: bad value for {name!r}: {error}") from None
        if action.dest not in given:
            setattr(args, action.dest, typed)
            raw[key] = value
    return raw


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def format_config(p: argparse.ArgumentParser, args: argparse.Namespace, raw: dict[str, Any]) -> str:
    """The effective options as TOML: typed where TOML has the type, else as typed on the command line."""
    lines = []
    for key, action in config_actions(p).items():
        value = getattr(args, action.dest, None)
        if value is None:
            lines.append(f"# {key} = (unset)")
            continue
        if isinstance(value, (bool, int, float, str)) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            lines.append(f"{key} = {toml_value(value)}")
        else:  # a converted value (a span, a path ...): print what was typed, which converts back to it
            lines.append(f"{key} = {toml_value(raw.get(key, str(value)))}")
    return "\n".join(lines) + "\n"
