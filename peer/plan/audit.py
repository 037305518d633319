"""The shard audit: proof from the logs that a sharded span never held the full hidden state.

Every rank of a tensor-shard group logs, per step, what it held and every collective
it took part in (`stages/shards/collectives.py`, `stages/shards/sharded.py`); a peer writes one
trace event `Audit` (store/events.py) per step (`peer/serve/shard_server.py`), and so does the
requester for the slices it scattered into the group and the output it gathered.
`check(logs)` reads them back and, step by step, proves:

1. **complete**: every rank 0..n-1 of the group logged the step exactly once, from
   distinct nodes (each slice held exactly once), every layer of the session's span in
   order, each with exactly the operators of `LAYER_AUDIT_OPS`;
2. **consistent**: every collective pairs up — what rank i says it sent to rank j (which
   columns, which collective, which layer) is what rank j says it received from i;
3. **sharded**: inside the declared interval no rank held the full hidden state. For
   every logical tensor of hidden width (layer, operator) a rank *knows* a column if it
   held its final value, or held every rank's partial term of it (it could add them);
   knowing every column of one such tensor is a violation. A partial of full width (one
   rank's term of a sum, before the reduce-scatter) is not the state;
4. **gathers only outside**: an AllGather inside the interval is a violation; the
   requester's compatibility gather is allowed only at the span's end (where the chain
   leaves the group for an unsharded consumer), and only by a node outside the group.

Closure is audited steps / steps (the seed reports 250/250); `AuditReport.ok` needs 100%.
When the requester's logs are given, "steps" are the steps it completed; a step some
rank logged but the requester never got (a rank died mid-step: a failover) is
*aborted* — it does not count, but a full state or a gather in it still fails the audit.

Why the trace: a peer already writes every event it sees to its store, off the hot path,
crash-safe (WAL), with session and step columns; the audit is more events of the same
kind of fact, so it lands in the same timeline (`tessera trace export` shows it) and
needs no second log format, rotation or writer. One event per rank per step keeps the
row count at the scale of "forward" events.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from tessera.stages.shards.layout import HIDDEN, LAYER_AUDIT_OPS
from tessera.store.events import Audit, Stamped

SHARD = "shard"  # a log written by a rank of the group
REQUESTER = "requester"  # a log written by the node that scattered into / gathered from the group
GATHERS = ("all_gather", "compat_gather")
MAX_PROBLEMS_PER_STEP = 10


@dataclass(frozen=True)
class StepLog:
    """One node's audit of one step (the detail of one trace event of kind "audit")."""

    node: str
    session: str
    step: int
    role: str  # SHARD or REQUESTER
    group: str
    index: int  # the rank; -1 for the requester
    count: int
    start: int  # the session's layers on the group, [start, end)
    end: int
    hidden: int
    records: tuple[dict, ...]

    @staticmethod
    def from_event(node: str, event: Audit) -> "StepLog":
        """From the audit event `node` wrote (read back from a `MemoryTracer` or a store)."""
        return StepLog(
            node=node, session=str(event.session), step=event.step, role=event.role, group=event.group,
            index=-1 if event.index is None else event.index, count=event.count, start=event.span[0],
            end=event.span[1], hidden=event.hidden, records=tuple(event.records),
        )

    def event(self) -> Audit:
        """The trace event `from_event` reads back; emit it with ``peer=self.node``."""
        return Audit(session=self.session, step=self.step, span=(self.start, self.end), role=self.role,
                     group=self.group, count=self.count, hidden=self.hidden, records=list(self.records),
                     index=self.index if self.role == SHARD else None)


@dataclass
class AuditReport:
    """The verdict: how many steps were audited clean, and what was wrong with the others."""

    steps: int = 0
    audited: int = 0
    problems: list[str] = field(default_factory=list)
    collectives: int = 0
    bytes_exchanged: int = 0  # tensor bytes the ranks sent each other (from their records)
    aborted: int = 0  # steps the requester never completed (not counted in `steps`)
    aborted_violations: int = 0  # of those, steps where a rank held the full state or gathered

    @property
    def ok(self) -> bool:
        return self.steps > 0 and self.audited == self.steps and not self.aborted_violations

    @property
    def closure(self) -> str:
        return f"{self.audited}/{self.steps}"

    def summary(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        lines = [f"shard audit {verdict}: closure {self.closure} audited steps, {self.collectives} collectives"
                 + (f", {self.aborted} aborted steps ({self.aborted_violations} with violations)" if self.aborted else "")]
        lines += [f"  {p}" for p in self.problems[:20]]
        if len(self.problems) > 20:
            lines.append(f"  ... and {len(self.problems) - 20} more")
        return "\n".join(lines)


def load_events(events: Iterable[Stamped]) -> list[StepLog]:
    """The audit logs among trace events (e.g. a requester's `MemoryTracer.events`)."""
    return [StepLog.from_event(e.peer, e.event) for e in events if isinstance(e.event, Audit)]


def check(logs: Iterable[StepLog]) -> AuditReport:
    """Audit every step the logs mention (see the module docstring)."""
    by_step: dict[tuple[str, int], list[StepLog]] = defaultdict(list)
    for log in logs:
        by_step[(log.session, log.step)].append(log)
    report = AuditReport()
    gathered = {session for (session, _), entries in by_step.items() if any(e.role == REQUESTER for e in entries)}
    for (session, step), entries in sorted(by_step.items()):
        problems = sorted(_check_step(entries, report), key=_severity)
        where = f"session {session[:8]} step {step}"
        if session in gathered and not any(e.role == REQUESTER for e in entries):
            report.aborted += 1  # the requester never got this step: only violations count
            violations = [p for p in problems if _severity(p) < 2]
            report.aborted_violations += bool(violations)
            report.problems += [f"{where} (aborted): {p}" for p in violations[:MAX_PROBLEMS_PER_STEP]]
            continue
        report.steps += 1
        if problems:
            report.problems += [f"{where}: {p}" for p in problems[:MAX_PROBLEMS_PER_STEP]]
        else:
            report.audited += 1
    return report


def _severity(problem: str) -> int:
    """The worst first: a rank holding the full state, then gathers inside, then the rest."""
    return 0 if "FULL" in problem else 1 if "gather" in problem else 2


def _check_step(entries: list[StepLog], report: AuditReport) -> list[str]:
    ranks = [e for e in entries if e.role == SHARD]
    requesters = [e for e in entries if e.role == REQUESTER]
    if not ranks:
        return ["no rank of the group logged this step"]
    first = ranks[0]
    shape = (first.group, first.count, first.start, first.end, first.hidden)
    problems = [f"rank {e.index} logged {(e.group, e.count, e.start, e.end, e.hidden)}, rank {first.index} {shape}"
                for e in ranks if (e.group, e.count, e.start, e.end, e.hidden) != shape]
    counts = Counter(e.index for e in ranks)
    problems += [f"slice {i} was logged {counts[i]} times" for i in sorted(counts) if counts[i] > 1]
    problems += [f"no log from rank {i}" for i in range(first.count) if i not in counts]
    problems += [f"rank index {i} is outside [0, {first.count})" for i in counts if not 0 <= i < first.count]
    slices_of: dict[str, set[int]] = defaultdict(set)
    for e in ranks:
        slices_of[e.node].add(e.index)
    problems += [f"node {node[-8:]} held slices {sorted(s)}" for node, s in slices_of.items() if len(s) > 1]
    for e in ranks:
        problems += _check_rank(e, report)
    problems += _check_pairs(ranks)
    for r in requesters:
        problems += _check_requester(r, first, set(slices_of))
    return problems


def _check_rank(log: StepLog, report: AuditReport) -> list[str]:
    """One rank's log: its layers and operators, its gathers, and what it knew of the hidden state."""
    problems: list[str] = []
    who = f"rank {log.index} ({log.node[-8:]})"
    by_layer: dict[int, list[dict]] = defaultdict(list)
    order: list[int] = []
    for rec in log.records:
        layer = rec.get("layer")
        if layer not in by_layer:
            order.append(layer)
        by_layer[layer].append(rec)
        if rec.get("event") in GATHERS:
            problems.append(f"{who} did an {rec['event']} of {rec.get('op')} at layer {layer}, "
                            f"inside the declared interval [{log.start}, {log.end})")
        if "seq" in rec:  # a collective
            report.collectives += 1
            report.bytes_exchanged += rec.get("bytes", 0)
    if order != list(range(log.start, log.end)):
        problems.append(f"{who} logged layers {order}, expected {log.start}..{log.end - 1}")
    for layer in order:
        ops = tuple((r.get("event"), r.get("op")) for r in by_layer[layer])
        if ops != LAYER_AUDIT_OPS:
            missing = [o for o in LAYER_AUDIT_OPS if o not in ops]
            extra = [o for o in ops if o not in LAYER_AUDIT_OPS]
            problems.append(f"{who} layer {layer}: operators differ from the sharded layer "
                            f"(missing {missing}, unexpected {extra})")
        problems += _knowledge(who, layer, by_layer[layer], log.count, log.hidden)
    return problems


def _knowledge(who: str, layer: int, records: list[dict], count: int, hidden: int) -> list[str]:
    """Whether the rank knew every column of some hidden-width tensor of this layer."""
    finals: dict[str, np.ndarray] = {}
    partials: dict[str, dict[int, np.ndarray]] = {}
    for rec in records:
        if rec.get("space") != HIDDEN:
            continue
        op = rec["op"]
        final = finals.setdefault(op, np.zeros(hidden, dtype=bool))
        terms = partials.setdefault(op, {})
        event = rec["event"]
        if event == "held":
            lo, hi = rec["cols"]
            if rec["reduced"]:
                final[lo:hi] = True
            else:
                terms.setdefault(rec["source"], np.zeros(hidden, dtype=bool))[lo:hi] = True
        elif event == "reduce_scatter":
            for src, lo, hi in rec["received"]:
                terms.setdefault(src, np.zeros(hidden, dtype=bool))[lo:hi] = True
        elif event in GATHERS:
            for _src, lo, hi in rec["received"]:
                final[lo:hi] = True
    problems = []
    for op, final in finals.items():
        terms = partials[op]
        summable = np.ones(hidden, dtype=bool)
        for src in range(count):
            summable &= terms.get(src, np.zeros(hidden, dtype=bool))
        if (final | summable).all():
            problems.append(f"{who} held the FULL hidden state at layer {layer} ({op})")
    return problems


def _check_pairs(ranks: list[StepLog]) -> list[str]:
    """Each collective's sends match the receiver's receives, column for column."""
    index: dict[tuple[int, int, int, str], dict] = {}  # a fused round logs two events with one seq
    for e in ranks:
        for rec in e.records:
            if "seq" in rec:
                index[(e.index, rec["layer"], rec["seq"], rec["event"])] = rec
    problems = []
    for (rank, layer, seq, event), rec in sorted(index.items(), key=lambda kv: kv[0]):
        for dst, lo, hi in rec.get("sent", ()):
            other = index.get((dst, layer, seq, event))
            if other is None or other["op"] != rec["op"]:
                problems.append(f"rank {rank} sent {rec['event']} {rec['op']} #{seq} at layer {layer} to rank {dst}, "
                                f"which logged {None if other is None else (other['event'], other['op'])}")
            elif [rank, lo, hi] not in [list(x) for x in other.get("received", ())]:
                problems.append(f"rank {rank} sent columns [{lo}, {hi}) of {rec['op']} at layer {layer} to rank "
                                f"{dst}, which did not log receiving them")
    return problems


def _check_requester(log: StepLog, group: StepLog, members: set[str]) -> list[str]:
    problems = []
    if log.node in members:
        problems.append(f"node {log.node[-8:]} is a rank of the group and also gathered its output")
    for rec in log.records:
        if rec.get("event") == "compat_gather" and rec.get("layer") != group.end:
            problems.append(f"compatibility gather at layer {rec.get('layer')}, inside the declared interval "
                            f"[{group.start}, {group.end}); allowed only at {group.end}")
    return problems
