"""`--config FILE` / `--print-config` for `tessera peer` and `tessera serve`: keys from the parser,
flags over the file, a round trip through --print-config, one clear error per bad key."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tessera.peer.cli.main import build_parser, command_parser, with_config
from tessera.peer.cli.config import config_actions
from tessera.peer.base.errors import ConfigError


def load(argv: list[str]):
    parser = build_parser()
    args = parser.parse_args([*argv, "--print-config"])
    printed = with_config(parser, args, [*argv, "--print-config"])
    return args, printed


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_long_option_is_a_key():
    parser = build_parser()
    for command in ("peer", "serve"):
        sub = command_parser(parser, command)
        keys = config_actions(sub)
        flags = {s[2:] for a in sub._actions for s in a.option_strings if s.startswith("--")}
        assert set(keys) == flags - {"help", "config", "print-config", "verbose"}  # -v is the console's, not a setting
    assert {"max-sessions", "layers", "join", "tui", "data-dir"} <= set(config_actions(command_parser(parser, "peer")))
    assert {"port", "api-key", "cors-origin", "route-wait"} <= set(config_actions(command_parser(parser, "serve")))


def test_file_values_are_typed_and_flags_override(tmp_path):
    path = write(tmp_path, 'model = "smollm2-135m"\njoin = ["/ip4/192.0.2.1/tcp/1/p2p/a", "/ip4/192.0.2.2/tcp/1/p2p/b"]\n'
                 'memory = 2\nlayers = "0:15"\nmax_sessions = 4\ntui = true\ndata-dir = "~/p0"\nname = "attic"\n')
    args, _ = load(["peer", "--config", str(path)])
    assert args.memory == 2.0 and args.layers == (0, 15) and args.max_sessions == 4 and args.tui is True
    assert args.join == ["/ip4/192.0.2.1/tcp/1/p2p/a", "/ip4/192.0.2.2/tcp/1/p2p/b"]
    assert args.data_dir == Path("~/p0") and args.name == "attic"
    args, _ = load(["peer", "--config", str(path), "--max-sessions", "9", "--join", "/ip4/192.0.2.9/tcp/1/p2p/c",
                    "--name", "cellar"])
    assert args.max_sessions == 9 and args.name == "cellar"
    assert args.join == ["/ip4/192.0.2.9/tcp/1/p2p/c"]  # a repeatable flag replaces the file's list
    assert args.memory == 2.0 and args.layers == (0, 15)  # the rest still from the file


def test_print_config_round_trips(tmp_path):
    first = write(tmp_path, 'layers = "3:9"\nmemory = 1.5\nlisten = ["/ip4/127.0.0.1/tcp/0"]\n')
    args, printed = load(["peer", "--config", str(first), "--threads", "2", "--emulate-link", "delay=5ms"])
    table = tomllib.loads(printed)
    assert table["layers"] == "3:9" and table["threads"] == 2 and table["emulate-link"] == "delay=5ms"
    assert table["max-sessions"] == 16 and "memory = 1.5" in printed and "# shard = (unset)" in printed
    again, reprinted = load(["peer", "--config", str(write(tmp_path, printed, "again.toml"))])
    assert reprinted == printed
    assert vars(again) | {"config": None} == vars(args) | {"config": None}
    _, served = load(["serve", "--port", "0", "--cors-origin", "*"])
    assert tomllib.loads(served)["cors-origin"] == ["*"] and tomllib.loads(served)["port"] == 0


@pytest.mark.parametrize("text, needle", [
    ("max_sesions = 3\n", "line 1: unknown key 'max_sesions'"),
    ('name = "x"\n\nmemory = "lots"\n', "line 3: bad value for 'memory': wants a number, got 'lots'"),
    ("max-sessions = 2.5\n", "bad value for 'max-sessions': wants an integer, got 2.5"),
    ("max-sessions = true\n", "bad value for 'max-sessions': wants an integer, got True"),
    ('tui = "yes"\n', "bad value for 'tui': wants true or false"),
    ('device = "tpu"\n', "bad value for 'device': --device wants auto, cpu, cuda, cuda:N or mps, got 'tpu'"),
    ('layers = "a:b"\n', "bad value for 'layers'"),
    ("join = [1, 2]\n", "bad value for 'join': wants a list of strings"),
    ("[peer]\nmodel = 'x'\n", "line 1: unknown key 'peer'"),
    ("memory = \n", "not valid TOML"),
])
def test_bad_config_is_one_error_naming_the_key(tmp_path, text, needle):
    path = write(tmp_path, text)
    parser = build_parser()
    argv = ["peer", "--config", str(path)]
    args = parser.parse_args(argv)
    with pytest.raises(ConfigError) as raised:
        with_config(parser, args, argv)
    assert needle in str(raised.value) and str(path) in str(raised.value)


def test_missing_file_is_an_error(tmp_path):
    parser = build_parser()
    argv = ["serve", "--config", str(tmp_path / "nope.toml")]
    with pytest.raises(ConfigError, match="cannot read config file"):
        with_config(parser, parser.parse_args(argv), argv)


def tessera(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera.peer.cli.main", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command, text, needle", [
    ("peer", "max_sesions = 3\n", "unknown key 'max_sesions'"),
    ("serve", 'port = "http"\n', "bad value for 'port'"),
])
def test_command_line_error_paths(tmp_path, command, text, needle):
    done = tessera(command, "--config", str(write(tmp_path, text)))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ") and needle in done.stderr and done.stdout == ""


def test_command_line_print_config(tmp_path):
    done = tessera("serve", "--config", str(write(tmp_path, "port = 9000\njoin = ['/ip4/192.0.2.1/tcp/1/p2p/a']\n")),
                   "--host", "0.0.0.0", "--print-config")
    assert done.returncode == 0, done.stderr
    table = tomllib.loads(done.stdout)
    assert (table["port"], table["host"], table["join"]) == (9000, "0.0.0.0", ["/ip4/192.0.2.1/tcp/1/p2p/a"])
