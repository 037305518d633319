"""`--spot-check RATE` on `tessera generate` and `tessera serve`: on by default, 0 turns checks off,
a rate outside [0, 1] is one clear error before anything joins."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tessera.peer.base.errors import ConfigError
from tessera.peer.cli.main import build_parser
from tessera.peer.cli.options import spot_check_from
from tessera.peer.request.verify import DEFAULT_SPOT_CHECKS

JOIN = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWPWpekvmEfanm7YyX4mCqVJuHzPwP4YsdV4qxjHJ9WVzo"


@pytest.mark.parametrize("command", [["generate", "Hi", "--join", JOIN], ["serve", "--join", JOIN]])
def test_checks_are_on_by_default_and_zero_turns_them_off(command):
    parser = build_parser()
    default = spot_check_from(parser.parse_args(command))
    assert default is not None and default.rate == DEFAULT_SPOT_CHECKS.rate > 0
    assert spot_check_from(parser.parse_args([*command, "--spot-check", "0"])) is None
    assert spot_check_from(parser.parse_args([*command, "--spot-check", "1"])).rate == 1.0
    with pytest.raises(ConfigError, match="--spot-check must lie in"):
        spot_check_from(parser.parse_args([*command, "--spot-check", "1.5"]))


def test_a_compact_wire_form_turns_the_default_off_and_refuses_a_rate():
    """A check compares activations at float32 tolerances: bfloat16 or fp8 on the wire would make
    an honest peer fail it. So --wire turns the default off, and asking for both is an error."""
    parser = build_parser()
    command = ["generate", "Hi", "--join", JOIN, "--wire", "bfloat16"]
    assert spot_check_from(parser.parse_args(command)) is None
    assert spot_check_from(parser.parse_args([*command, "--spot-check", "0"])) is None
    with pytest.raises(ConfigError, match="exact activations on the wire"):
        spot_check_from(parser.parse_args([*command, "--spot-check", "0.05"]))


def test_a_bad_rate_fails_before_joining():
    done = subprocess.run([sys.executable, "-m", "tessera.peer.cli.main", "generate", "Hi", "--join", JOIN,
                           "--spot-check", "-0.1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "--spot-check must lie in [0, 1]" in done.stderr
