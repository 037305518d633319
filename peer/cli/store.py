"""`tessera ledger`, `tessera trace export`, `tessera trace plot`: what a peer's database remembers.

A peer keeps one sqlite database in its data dir (`DATA_DIR/tessera.db`): its
contribution ledger and the trace of every event it saw. These commands only
read (a running peer may keep writing; sqlite's WAL lets both happen at once).
Wherever a command takes databases it also takes folders: every ``*.db`` under them.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.peer.plan.audit import StepLog

DB_NAME = "tessera.db"

LEDGER_EXAMPLES = """examples:
  tessera ledger                                   # the peer of this machine (the only one, or --name's)
  tessera ledger --name first                      # the peer started with --name first
  tessera ledger --data-dir ~/.local/share/tessera/attic-pc --json
"""


def data_root() -> Path:
    """Where `tessera peer` keeps each peer's data dir by default: ~/.local/share/tessera/NAME."""
    return Path.home() / ".local" / "share" / "tessera"


def peer_data_dir(name: str | None) -> Path:
    """`tessera peer --name NAME`'s default data dir (NAME "peer" when no --name was given)."""
    return data_root() / (name or "peer")
EXPORT_EXAMPLES = """examples:
  tessera trace export peer0/tessera.db peer1/tessera.db requester.db --format perfetto -o swarm.json
      # then open https://ui.perfetto.dev and drop swarm.json on it
  tessera trace export /tmp/tessera-swarm-abc123/ --format jsonl -o events.jsonl
"""
PLOT_EXAMPLES = """examples:
  tessera trace plot peer0/tessera.db peer1/tessera.db peer2/tessera.db requester.db -o timeline.png
  tessera trace plot /tmp/tessera-swarm-abc123/ requester.db --since 14:03 --until 14:05 -o two-minutes.png
  tessera trace plot peer*/tessera.db requester.db --session 3f2a9c01 -o one-answer.png
      # times: seconds on the plot's axis (12.5), a clock time today (14:03:20) or ISO (2026-12-05T14:03)
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ledger", help="what this peer contributed: layer-tokens, steps and bytes, per requester",
        epilog=LEDGER_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--name", default=None, metavar="NAME",
                       help="the peer started with --name NAME (its data dir ~/.local/share/tessera/NAME)")
    which.add_argument("--data-dir", type=Path, default=None,
                       help="the peer's data dir, or its database file (default: the peer of this machine: "
                            "~/.local/share/tessera/peer, or the only peer there is)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=run_ledger)

    trace = sub.add_parser("trace", help="export or draw the merged trace of several peers")
    tsub = trace.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    p = tsub.add_parser(
        "export", help="merge peer databases into one clock-aligned timeline: JSONL or Perfetto JSON",
        epilog=EXPORT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dbs", nargs="+", type=Path, metavar="DB", help="peer databases, or folders holding them")
    p.add_argument("--format", choices=("jsonl", "perfetto"), required=True,
                   help="jsonl: one event per line; perfetto: Chrome trace-event JSON (opens in ui.perfetto.dev)")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="OUT", help="the file to write")
    p.set_defaults(handler=run_export)

    p = tsub.add_parser(
        "plot", help="draw a generation across peers (matplotlib, PNG)",
        epilog=PLOT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dbs", nargs="+", type=Path, metavar="DB", help="peer databases, or folders holding them")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="timeline.png", help="the PNG to write")
    p.add_argument("--title", default=None, help="the plot's title (default: what was drawn)")
    p.add_argument("--since", default=None, metavar="TIME",
                   help="draw from TIME: seconds since the first event (as on the axis), HH:MM[:SS] today, or ISO")
    p.add_argument("--until", default=None, metavar="TIME", help="draw up to TIME (as --since)")
    p.add_argument("--session", action="append", default=[], metavar="ID",
                   help="only this session's events (an id or its first hex digits, as the TUI and Perfetto show "
                        "them; repeatable)")
    p.set_defaults(handler=run_plot)


def database_of(data_dir: Path) -> Path:
    """DATA_DIR/tessera.db, or the file itself if a database file was given. Raises NotATraceDatabase."""
    from tessera.store.errors import NotATraceDatabase

    path = data_dir.expanduser()
    db = path if path.is_file() else path / DB_NAME
    if not db.is_file():
        raise NotATraceDatabase(f"no peer database at {str(db)!r} (is --data-dir the peer's data dir?)")
    return db


def ledger_database(name: str | None, data_dir: Path | None) -> Path:
    """The database `tessera ledger` reads: --data-dir's, --name's, or — given neither — the
    unnamed peer's, else the only peer of this machine's (a tour's `tessera peer --name first`).
    Several, and none unnamed: a NotATraceDatabase naming the --name of each."""
    from tessera.store.errors import NotATraceDatabase

    if data_dir is not None:
        return database_of(data_dir)
    if name is not None:
        folder = peer_data_dir(name)
        if not (folder / DB_NAME).is_file():
            raise NotATraceDatabase(f"no peer named {name!r} on this machine (no {str(folder / DB_NAME)!r}); "
                                    f"{_names_here()}")
        return folder / DB_NAME
    if (peer_data_dir(None) / DB_NAME).is_file():
        return peer_data_dir(None) / DB_NAME
    found = _peers_here()
    if len(found) == 1:
        return data_root() / found[0] / DB_NAME
    raise NotATraceDatabase(f"which peer? {_names_here()}")


def _peers_here() -> list[str]:
    root = data_root()
    return sorted(d.name for d in root.iterdir() if (d / DB_NAME).is_file()) if root.is_dir() else []


def _names_here() -> str:
    names = _peers_here()
    if not names:
        return (f"no peer has run on this machine under {str(data_root())!r} (give --data-dir DIR for a peer "
                "started with one)")
    return "peers here: " + ", ".join(f"--name {n}" for n in names) + " (or --data-dir DIR)"


def run_ledger(args: argparse.Namespace) -> int:
    from tessera.store.db import PeerStore

    db = ledger_database(args.name, args.data_dir)
    with PeerStore(db, readonly=True) as store:
        summary = store.ledger_summary()
        peer = store.identity()
    if args.json:
        print(json.dumps({"peer": peer, "database": str(db), **summary}, indent=2, sort_keys=True))
        return 0
    print(format_ledger(peer, db, summary))
    return 0


def format_ledger(peer: str | None, db: Path, summary: dict) -> str:
    def row(label: str, sums: dict) -> str:
        return f"  {label:<24} {sums['layer_tokens']:>14,} {sums['steps']:>10,} {_bytes(sums['bytes']):>10}"

    lines = [f"peer {peer or '(unknown)'} — {db}", f"  {'':<24} {'layer-tokens':>14} {'steps':>10} {'bytes':>10}",
             row("today", summary["today"]), row("total", summary["total"])]
    if summary["by_requester"]:
        lines.append("by requester (largest first):")
        for requester, sums in summary["by_requester"].items():
            last = datetime.fromtimestamp(sums["last"]).strftime("%Y-%m-%d %H:%M:%S")
            lines.append(row(requester[-24:], sums) + f"   last {last}")
    else:
        lines.append("nothing served yet")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover


def _databases(paths: list[Path]) -> list[Path]:
    from tessera.store.errors import NotATraceDatabase

    from tessera.peer.sim.replay import find_databases

    found = find_databases(paths)
    if not found:
        raise NotATraceDatabase(f"no *.db files in {[str(p) for p in paths]}")
    return found


def run_export(args: argparse.Namespace) -> int:
    from tessera.store.export import export_jsonl, export_perfetto

    dbs = _databases(args.dbs)
    export = export_perfetto if args.format == "perfetto" else export_jsonl
    summary = export(dbs, args.out)
    print(f"{summary['events']} events from {len(summary['peers'])} peers ({len(dbs)} databases), "
          f"{summary['pairs']} matched pushes -> {args.out}")
    if summary["non_causal"]:
        print(f"warning: {summary['non_causal']} receives still precede their push after clock alignment")
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from tessera.store.plot import plot_timeline
    from tessera.store.timeline import parse_when

    dbs = _databases(args.dbs)
    since = parse_when(args.since) if args.since is not None else None  # a bad time fails before reading
    until = parse_when(args.until) if args.until is not None else None
    drawn = plot_timeline(dbs, args.out, title=args.title, since=since, until=until, sessions=args.session)
    window = f" between {drawn['window'][0]:.3f} and {drawn['window'][1]:.3f} s" if drawn["window"] else ""
    print(f"{drawn['forward_steps']} forward steps on {len(drawn['peers'])} peers{window}, "
          f"{drawn['pushes']} pushes -> {args.out}")
    return 0


def load_audit_logs(path: Path | str) -> list["StepLog"]:
    """Every tensor-shard audit log in one peer's database (read-only; the peer may still be running)."""
    from tessera.store.db import PeerStore
    from tessera.store.events import Audit

    from tessera.peer.plan.audit import load_events

    store = PeerStore(path, readonly=True)
    try:
        return load_events(store.events(kinds=(Audit,)))
    finally:
        store.close()
