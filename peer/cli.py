"""`tessera`: one command group for volunteers, requesters and maintainers.

Each sub-command lives in a small module (`peer/cli_*.py`) that registers its
parser; this module builds the group and turns domain errors into one clean
line on stderr and a non-zero exit status — never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Sequence

from stages.errors import StageError

EXAMPLES = """examples:
  tessera model fetch smollm2-135m
  tessera generate "What is the capital of France?" --local
  tessera demo --peers 3
  tessera peer --model smollm2-135m --join /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...
"""


def domain_errors() -> tuple[type[BaseException], ...]:
    """The error bases every layer raises on purpose (imported lazily: some layers are heavy)."""
    errors: list[type[BaseException]] = [StageError]
    for module, name in (("protocol.errors", "WireError"), ("store.errors", "StoreError"), ("peer.errors", "PeerError")):
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def build_parser() -> argparse.ArgumentParser:
    from . import cli_generate, cli_model

    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Run large language models on a swarm of volunteer peers, exactly.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (cli_model, cli_generate, *optional_command_modules()):
        module.register(sub)
    return parser


def optional_command_modules() -> list:
    """Command modules of later layers, registered when present."""
    modules = []
    for name in ("cli_peer", "cli_store", "cli_serve", "cli_revoke", "cli_sim"):
        try:
            modules.append(__import__(f"peer.{name}", fromlist=["register"]))
        except ModuleNotFoundError as missing:
            if missing.name != f"peer.{name}":
                raise
    return modules


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int | None] = args.handler
    # py-libp2p logs every failed handshake at ERROR; our own messages say what matters
    logging.getLogger("libp2p").setLevel(logging.DEBUG if os.environ.get("TESSERA_DEBUG") else logging.CRITICAL)
    errors = domain_errors()
    try:
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
