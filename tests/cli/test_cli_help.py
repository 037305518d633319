"""`tessera --help` (and every command's) is quick and complete: no torch or libp2p to print it,
and every option says what it does (issue 34, item 9)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from tessera.peer.cli import options as cli_options
from tessera.peer.cli import serve as cli_serve
from tessera.peer.cli import sim as cli_sim
from tessera.peer.cli.main import build_parser

# What takes seconds to import (torch alone ~2 s on a cold start here; py-libp2p ~0.6 s).
HEAVY = ("torch", "libp2p", "numpy", "safetensors", "gguf", "textual", "sqlite_utils", "transformers")


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command's parser, with the words that reach it: [(("peer",), ...), (("swarm", "status"), ...)]."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += commands(sub, path + (name,))
    return found


ALL = [path for path, _ in commands(build_parser())]


def imported_for_help(argv: list[str]) -> tuple[str, list[str]]:
    """Run `tessera ARGV --help` in a fresh interpreter: its output, and the heavy packages it imported."""
    script = (
        "import contextlib, io, json, sys\n"
        "from tessera.peer.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        f"        main({argv + ['--help']!r})\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))\n"
        "print(json.dumps([out.getvalue(), heavy]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text, heavy = json.loads(done.stdout.splitlines()[-1])
    return text, heavy


@pytest.mark.parametrize("argv", [[], ["peer"], ["generate"], ["serve"], ["model", "synth"], ["simulate"],
                                  ["trace", "plot"], ["swarm", "status"], ["demo"]])
def test_help_imports_nothing_heavy(argv):
    text, heavy = imported_for_help(argv)
    assert text.startswith("usage: tessera"), text[:200]
    assert heavy == [], f"`tessera {' '.join(argv)} --help` imported {heavy}"


def test_every_option_of_every_command_says_what_it_does():
    undocumented = []
    for path, parser in commands(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                undocumented.append(f"tessera {' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    assert undocumented == []


def test_the_flags_the_issue_named_have_help_text():
    parser = build_parser()
    by_path = dict(commands(parser))
    help_of = {path: by_path[path].format_help() for path in (("peer",), ("model", "synth"))}
    peer = help_of[("peer",)]
    assert "--model NAME|FOLDER" in peer and "--max-sessions N" in peer and "refused as busy" in peer
    synth = help_of[("model", "synth")]
    for flag in ("--hidden", "--layers", "--heads", "--kv-heads", "--intermediate", "--vocab", "--seed", "--arch", "--out"):
        assert flag in synth
    assert "key/value heads" in synth and "the MLP's inner width" in synth


def test_the_choices_repeated_for_a_light_help_agree_with_their_sources():
    from tessera.peer.request.verify import DEFAULT_SPOT_CHECKS
    from tessera.peer.sim.policies import POLICIES, VIEW_MODES
    from tessera.stages.kernels import quant

    assert cli_options.QUANT_KINDS == quant.QUANT_KINDS
    assert cli_options.INT4_GROUP_SIZES == quant.INT4_GROUP_SIZES
    assert cli_options.DEFAULT_INT4_GROUP == quant.DEFAULT_INT4_GROUP
    assert cli_options.DEFAULT_SPOT_CHECK_RATE == DEFAULT_SPOT_CHECKS.rate
    assert sorted(cli_sim.POLICY_NAMES) == sorted(POLICIES) and set(cli_sim.VIEW_MODES) == set(VIEW_MODES)


def test_commands_still_turn_options_into_objects():
    """What the light parsers no longer import at the top is imported when a command runs."""
    from tessera.peer.cli.peer import config_from
    from tessera.stages.kernels.quant import Quant

    args = build_parser().parse_args(["peer", "--quant", "int4", "--layers", "0:4", "--emulate-link", "delay=5ms"])
    config = config_from(args)
    assert config.quant == Quant("int4", 32) and config.layers == (0, 4) and config.listen == []
    assert config.emulate_link is not None
    assert ALL  # every command was walked
