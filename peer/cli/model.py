"""`tessera model ...`: fetch, import, synthesise and locate models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tessera.stages.weights import registry

from tessera.peer.cli.model_files import KNOWN_MODELS, fetch, import_model, synthesise


def progress_printer(stream=sys.stderr):
    """A progress callback: one redrawn line per phase on a terminal, one line per phase otherwise."""
    live = stream.isatty()

    def show(done: int, total: int, what: str) -> None:
        if live:
            stream.write(f"\r  {what}: {done}/{total}" + ("\n" if done == total else ""))
        elif done == total:
            stream.write(f"  {what}: {total}/{total}\n")
        stream.flush()

    return show


def register(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="fetch, import, synthesise and locate models")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")

    p = msub.add_parser(
        "fetch", help="download and convert a known model",
        epilog="example: tessera model fetch smollm2-135m",
    )
    p.add_argument("name", choices=sorted(KNOWN_MODELS))
    p.set_defaults(handler=lambda a: fetch(a.name, progress=progress_printer()) and None)

    p = msub.add_parser("path", help="print a model's folder", epilog="example: tessera model path smollm2-135m")
    p.add_argument("name")
    p.set_defaults(handler=lambda a: print(registry.resolve(a.name)))

    p = msub.add_parser(
        "import", help="register a .gguf file or a Hugging Face Llama-family folder",
        epilog="example: tessera model import ~/models/Qwen2-0.5B --name qwen2-0.5b",
    )
    p.add_argument("path", type=Path)
    p.add_argument("--name", help="registry name (default: the file or folder name)")
    p.set_defaults(handler=_import)

    p = msub.add_parser(
        "synth", help="write a seeded random-weight model of a given shape",
        epilog="example: tessera model synth --hidden 2048 --layers 24 --heads 16 --kv-heads 8 "
        "--intermediate 5632 --seed 0 --out /tmp/synth-1b",
    )
    for flag in ("--hidden", "--layers", "--heads", "--kv-heads", "--intermediate"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--arch", choices=("llama", "mistral", "qwen2"), default="llama")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(handler=_synth)

    p = msub.add_parser("list", help="list registered models", epilog="example: tessera model list")
    p.set_defaults(handler=_list)


def _import(args: argparse.Namespace) -> None:
    folder = import_model(args.path, name=args.name, progress=progress_printer())
    print(folder)


def _synth(args: argparse.Namespace) -> None:
    out = synthesise(
        args.out, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        intermediate=args.intermediate, vocab=args.vocab, seed=args.seed, architecture=args.arch,
    )
    print(out)


def _list(args: argparse.Namespace) -> None:
    root = registry.models_root()
    for folder in sorted(root.iterdir()) if root.exists() else []:
        if (folder / "config.json").exists():
            print(f"{folder.name}\t{registry.model_id(folder)}\t{folder}")
