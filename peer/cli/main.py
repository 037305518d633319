"""`tessera`: one command group for volunteers, requesters and maintainers.

Each sub-command lives in a small module of this package (`peer/cli/`) that registers its
parser; this module builds the group and turns domain errors into one clean
line on stderr and a non-zero exit status — never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from typing import Callable, Sequence

from tessera.protocol.errors import WireError
from tessera.stages.errors import StageError
from tessera.store.errors import StoreError

from tessera.peer.base.errors import PeerError
from tessera.peer.cli import generate as cli_generate
from tessera.peer.cli import model as cli_model
from tessera.peer.cli import peer as cli_peer
from tessera.peer.cli import revoke as cli_revoke
from tessera.peer.cli import serve as cli_serve
from tessera.peer.cli import sim as cli_sim
from tessera.peer.cli import store as cli_store

from tessera.peer.cli.log_setup import install as install_logging

EXAMPLES = """examples:
  tessera model fetch smollm2-135m
  tessera generate "What is the capital of France?" --local
  tessera demo --peers 3
  tessera peer --model smollm2-135m --join /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...
"""


def domain_errors() -> tuple[type[BaseException], ...]:
    """The error bases every layer raises on purpose."""
    return (StageError, WireError, StoreError, PeerError)


def installed_version() -> str:
    """The installed distribution's version (pyproject.toml's, read back from its metadata)."""
    try:
        return importlib.metadata.version("tessera")
    except importlib.metadata.PackageNotFoundError:  # the source tree on PYTHONPATH, not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Run large language models on a swarm of volunteer peers, exactly.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="say more on stderr: -v INFO (and py-libp2p's failures, one line each), "
                             "-vv DEBUG (py-libp2p's lines as it writes them)")
    parser.add_argument("--version", action="version", version=f"tessera {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (cli_model, cli_generate, cli_peer, cli_store, cli_serve, cli_revoke, cli_sim):
        module.register(sub)
    add_verbose_everywhere(sub)
    return parser


def add_verbose_everywhere(sub: argparse._SubParsersAction) -> None:
    """`-v` after the command too (`tessera peer -v`); SUPPRESS keeps one given before it."""
    for command in dict.fromkeys(sub.choices.values()):
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            add_verbose_everywhere(nested[0])
        else:
            command.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                                 help="say more on stderr (-vv: DEBUG)")


# Commands that reach the network through py-libp2p (whose logging `install_logging` tames).
NETWORK_COMMANDS = ("peer", "swarm", "demo", "serve")


def first_domain_error(group: BaseExceptionGroup, errors: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first domain error inside a (nested) exception group from trio nurseries."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            found = first_domain_error(error, errors)
            if found is not None:
                return found
        elif isinstance(error, errors):
            return error
    return None


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices[command]


def with_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> str | None:
    """Apply `--config FILE` for a command that takes one; the TOML to print for `--print-config`."""
    from tessera.peer.cli.config import apply_config, format_config, has_config

    sub = command_parser(parser, args.command)
    if not has_config(sub):
        return None
    rest = list(argv)[list(argv).index(args.command) + 1 :]  # the group itself has no options but -h
    raw = apply_config(sub, args, rest)
    return format_config(sub, args, raw) if args.print_config else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int | None] = args.handler
    # py-libp2p logs every failed dial at ERROR, some in 8-line dumps: none unless -v (one line each)
    verbose = max(args.verbose, 2 if os.environ.get("TESSERA_DEBUG") else 0)
    install_logging(verbose, import_libp2p=args.command in NETWORK_COMMANDS or bool(getattr(args, "join", None)))
    errors = domain_errors()
    try:
        printed = with_config(parser, args, argv)
        if printed is not None:
            print(printed, end="")
            return 0
        return int(handler(args) or 0)
    except errors as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        found = first_domain_error(group, errors)
        if found is None:
            raise
        print(f"error: {found}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
