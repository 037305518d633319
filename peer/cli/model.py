"""`tessera model ...`: fetch, import, synthesise and locate models.

Imported to print `--help`: peer/cli/model_files.py (torch, gguf) is imported when a
command runs (peer/cli/options.py says why).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tessera.stages.families.catalog import families_from_sizes
from tessera.stages.families.shapes import SHAPES
from tessera.stages.weights import registry

from tessera.peer.cli.options import UsageError

SYNTH_DTYPES = ("float32", "bfloat16", "float16")  # stages/weights/synth.py's, by name (no torch to print --help)


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
        "fetch", help="download a model: a built-in name, or ORG/NAME[@REVISION] from a Hugging Face hub "
        "(all of it, or the files of one span)",
        epilog="examples: tessera model fetch smollm2-135m; tessera model fetch Qwen/Qwen2.5-0.5B-Instruct@main "
        "(from $HF_ENDPOINT, https://huggingface.co by default; resumes an interrupted download; "
        "`tessera model list --available` says what can be fetched); tessera model fetch Qwen/Qwen3-8B "
        "--layers 18:36 --join /ip4/203.0.113.5/tcp/4001/p2p/12D3KooW... (only the files of that span: the "
        "manifest from the swarm, the span's tensors from the hub; docs/pages/weights.md)",
    )
    p.add_argument("name", help="a built-in model (smollm2-135m; `tessera model list --available`) or "
                   "ORG/NAME[@REVISION] of a hub repository with safetensors weights")
    p.add_argument("--name", dest="register_as", metavar="AS",
                   help="register a hub model under this name (default: the repository's NAME)")
    p.add_argument("--layers", type=span_arg, metavar="A:B",
                   help="a hub model: fetch only what serving layers A to B-1 needs (with the embedding for the "
                   "first span, the head and norm for the last), into a partial folder")
    p.add_argument("--requester", action="store_true",
                   help="a hub model: fetch what a requester computes with (embedding, final norm, head), alone "
                   "or with --layers")
    p.add_argument("--join", action="append", default=[], metavar="MULTIADDR",
                   help="with --layers/--requester: a peer of the swarm serving the model, to take its manifest "
                   "from (checked against the hub's files) and fetch from it too; without one, every weight "
                   "file is downloaded once to compute the manifest, and only those of the span are kept")
    p.add_argument("--id", dest="model_id", metavar="MODEL_ID",
                   help="with --layers/--requester: the model id the manifest must hash to (pins which model the "
                   "swarm's peers must serve)")
    p.add_argument("--swarm-key", default=None, help="with --join: the private swarm's key (64 hex chars or a file; "
                   "default $TESSERA_SWARM_KEY)")
    p.set_defaults(handler=_fetch)

    p = msub.add_parser("path", help="print a model's folder", epilog="example: tessera model path smollm2-135m")
    p.add_argument("name", metavar="NAME", help="a registered name (`tessera model list`)")
    p.set_defaults(handler=lambda a: print(registry.resolve(a.name)))

    p = msub.add_parser(
        "import", help="register a .gguf file (its blocks kept as they are) or a Hugging Face folder",
        epilog="example: tessera model import ~/models/Qwen3-8B-Q4_K_M.gguf --name qwen3-8b-q4km",
    )
    p.add_argument("path", type=Path, metavar="PATH", help="a .gguf file (a split one by any of its "
                   "NAME-0000i-of-0000N.gguf shards, all beside it) or a Hugging Face model folder")
    p.add_argument("--name", help="registry name (default: the file or folder name)")
    p.add_argument("--dequantize", action="store_true",
                   help="a .gguf: write float32 weights instead of keeping its blocks (4-8x the size)")
    p.set_defaults(handler=_import)

    p = msub.add_parser(
        "synth", help="write a seeded random-weight model: a published shape (--shape) or a Llama-block one",
        description="Write a model folder with random weights drawn from --seed: a published model's shape "
        "(--shape, its config as published; --layers keeps the first N layers, --experts N experts per "
        "sparse layer) or a Llama-block shape from --hidden, --layers, --heads, --kv-heads and "
        "--intermediate. Compute does not depend on the weights, so benches at real shapes measure what "
        "the real model would. The folder has a byte-level tokenizer and is registered as any model is.",
        epilog="examples: tessera model synth --shape qwen3-30b-a3b --layers 4 --seed 0 --out /tmp/qwen3-moe; "
        "tessera model synth --shape gpt-oss-120b --layers 2 --experts 16 --vocab 32000 --dtype bfloat16 "
        "--seed 0 --out /tmp/gpt-oss; tessera model synth --hidden 2048 --layers 24 --heads 16 --kv-heads 8 "
        "--intermediate 5632 --seed 0 --out /tmp/synth-1b",
    )
    p.add_argument("--shape", choices=sorted(SHAPES), metavar="NAME",
                   help=f"a published model's shape: {', '.join(sorted(SHAPES))}")
    p.add_argument("--layers", type=int, metavar="N", help="decoder layers: with --shape, keep the first N "
                   "(default: all); otherwise required")
    shape = (("--hidden", "the hidden size (model width)"),
             ("--heads", "attention (query) heads; --hidden must divide by it"),
             ("--kv-heads", "key/value heads (grouped-query attention); --heads must divide by it"),
             ("--intermediate", "the MLP's inner width"))
    for flag, what in shape:
        p.add_argument(flag, type=int, metavar="N", help=f"{what}: of a Llama-block shape (required without --shape)")
    p.add_argument("--experts", type=int, metavar="N", help="with --shape: keep N experts per sparse layer (each "
                   "token still picks as many as the model does, at most N); default: all")
    p.add_argument("--vocab", type=int, metavar="N",
                   help="vocabulary size (default: the shape's, or 32000; at least 259)")
    p.add_argument("--arch", choices=families_from_sizes(), default="llama",
                   help="the family of a Llama-block shape (its config.json names it; default llama)")
    p.add_argument("--dtype", choices=SYNTH_DTYPES, default="float32",
                   help="how the weights are stored (default float32; peers compute in their own dtype)")
    p.add_argument("--seed", type=int, required=True, help="the random weights' seed: one seed, one model id")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the model folder to write")
    p.set_defaults(handler=_synth)

    p = msub.add_parser("list", help="list registered models (with --available: what can be fetched)",
                        epilog="example: tessera model list --available")
    p.add_argument("--available", action="store_true",
                   help="list what `tessera model fetch` can download instead of what is registered")
    p.set_defaults(handler=_list)


def span_arg(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B): layers A to B-1."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants A:B (layers A to B-1), got {text!r}") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"{text!r} is empty or negative")
    return a, b


def _fetch(args: argparse.Namespace) -> None:
    from tessera.peer.cli.model_files import fetch, is_hub_name

    if args.layers is None and not args.requester:
        for flag, given in (("--join", args.join), ("--id", args.model_id), ("--swarm-key", args.swarm_key)):
            if given:
                raise UsageError(f"{flag} is for fetching a span (--layers A:B or --requester)")
        print(fetch(args.name, register_as=args.register_as, progress=progress_printer()))
        return
    if not is_hub_name(args.name):
        raise UsageError(f"--layers and --requester fetch part of a hub model (ORG/NAME), not {args.name!r}")
    from tessera.peer.cli.model_span import fetch_hub_span
    from tessera.peer.cli.options import read_swarm_key
    from tessera.peer.net.join import check_join_addrs
    from tessera.peer.weights.fetcher import is_model_id

    check_join_addrs(args.join)
    if args.model_id is not None and not is_model_id(args.model_id):
        raise UsageError(f"--id wants a model id (32 hex characters), got {args.model_id!r}")
    print(fetch_hub_span(args.name, layers=args.layers, requester=args.requester, join=args.join,
                         model_id=args.model_id, register_as=args.register_as,
                         swarm_key=read_swarm_key(args.swarm_key), progress=progress_printer()))


def _import(args: argparse.Namespace) -> None:
    from tessera.peer.cli.model_files import import_model

    path = Path(args.path).expanduser()
    before = registered_manifest(args.name or (path.stem if path.is_file() else path.resolve().name))  # import_model's name
    folder = import_model(args.path, name=args.name, dequantize=args.dequantize, progress=progress_printer())
    print(folder)
    note = id_change_note(folder.name, before, registered_manifest(folder.name))
    if note:
        print(note, file=sys.stderr)


def registered_manifest(name: str) -> dict | None:
    """The manifest of the model registered as `name`, as it is on disk (None: none)."""
    try:
        return json.loads((registry.models_root() / name / registry.MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def id_change_note(name: str, before: dict | None, after: dict | None) -> str | None:
    """What to say when registering `name` again changed its model id: peers and requesters chain
    only on identical files (the id covers every file, a chat template included), so the peers
    still running with the old files no longer match anything started now — say so, and which
    files changed. None when the id did not change (or nothing was registered before)."""
    if not before or not after or before.get("model_id") == after.get("model_id"):
        return None
    old, new = before.get("files", {}), after.get("files", {})
    changed = sorted(n for n in old.keys() | new.keys() if (old.get(n) or {}).get("sha256") != (new.get(n) or {}).get("sha256"))
    return (f"note: {name}'s model id changed, {before['model_id'][:16]}… -> {after['model_id'][:16]}… (changed: "
            f"{', '.join(changed) or 'the tensors'}). A model id covers every file, its chat template included: "
            f"peers still running with the old files no longer chain with requesters or peers started now, and "
            f"they say \"the peers there serve another model\". Restart them with these files")


def _synth(args: argparse.Namespace) -> None:
    from tessera.peer.cli.model_files import synthesise, synthesise_shape

    dims = {"--hidden": args.hidden, "--heads": args.heads, "--kv-heads": args.kv_heads,
            "--intermediate": args.intermediate}
    try:
        if args.shape is not None:
            given = [flag for flag, value in dims.items() if value is not None]
            if given:
                raise UsageError(f"{given[0]} is for a Llama-block shape, not with --shape")
            out = synthesise_shape(args.out, args.shape, layers=args.layers, experts=args.experts, vocab=args.vocab,
                                   seed=args.seed, dtype=args.dtype)
        else:
            missing = [flag for flag, value in {**dims, "--layers": args.layers}.items() if value is None]
            if missing:
                raise UsageError(f"give --shape, or {missing[0]} (and every Llama-block size)")
            if args.experts is not None:
                raise UsageError("--experts is for a --shape with sparse layers")
            out = synthesise(
                args.out, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                intermediate=args.intermediate, vocab=args.vocab or 32000, seed=args.seed, architecture=args.arch,
                dtype=args.dtype,
            )
    except ValueError as bad:  # a vocabulary the byte tokenizer cannot take
        raise UsageError(str(bad)) from None
    print(out)


def _list(args: argparse.Namespace) -> None:
    if args.available:
        from tessera.peer.cli.model_files import available

        for name, where in available():
            print(f"{name}\t{where}")
        print("(without a hub to ask, this cannot list repositories: any ORG/NAME of a family above works, "
              "e.g. Qwen/Qwen2.5-0.5B-Instruct)")
        return
    root = registry.models_root()
    for folder in sorted(root.iterdir()) if root.exists() else []:
        if (folder / "config.json").exists():
            print(f"{folder.name}\t{registry.model_id(folder)}\t{folder}")
