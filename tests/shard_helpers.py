"""Helpers for tensor-shard tests: an in-process group of ranks (threads), and the reference run."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Hashable, Sequence

import torch

from tessera.peer.plan.audit import REQUESTER, SHARD, StepLog
from tessera.stages.shards.layout import HIDDEN
from tessera.stages.shards.collectives import Collectives, ThreadGroup
from tessera.stages.shards.sharded import ShardedStage
from tessera.stages.engine.stage import Stage

DECODE_STEPS = 32
LOGITS_TOLERANCE = 5e-4  # float32; only the order of summation differs


class InProcessGroup:
    """n `ShardedStage`s of one span run as threads, with the requester's scatter and gather,
    writing the same audit logs a network run writes."""

    def __init__(self, folder: Path, *, start: int, end: int, count: int, gather_full: bool = False,
                 group: str = "local") -> None:
        self.ranks = [ShardedStage.load(folder, start=start, end=end, index=i, count=count, gather_full=gather_full)
                      for i in range(count)]
        self.count = count
        self.group = group
        self.logs: list[StepLog] = []
        self._steps: dict[Hashable, int] = {}

    def open(self, session: Hashable, *, capacity: int) -> None:
        for rank in self.ranks:
            rank.open(session, capacity=capacity)
        self._steps[session] = 0

    def forward(self, session: Hashable, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Scatter [T, H] into the ranks, run them together, gather [T, H]."""
        self._steps[session] += 1
        step = self._steps[session]
        threads = ThreadGroup(self.count)
        records: list[list[dict]] = [[] for _ in self.ranks]

        def run(i: int) -> Callable[[], torch.Tensor]:
            rank = self.ranks[i]
            lo, hi = rank.cols
            group = Collectives(i, self.count, threads.exchange_for(i), audit=records[i].append)
            return lambda: rank.forward(session, hidden[:, lo:hi].contiguous(), start_pos, group)

        outputs = threads.run([run(i) for i in range(self.count)])
        first = self.ranks[0]
        start, end = first.sessions[session].start, first.sessions[session].end
        for i, rank in enumerate(self.ranks):
            self.logs.append(StepLog(
                node=f"rank-node-{i}", session=str(session), step=step, role=SHARD, group=self.group, index=i,
                count=self.count, start=start, end=end, hidden=first.spec.hidden_size,
                records=tuple(records[i]),
            ))
        h = first.spec.hidden_size
        slices = [[i, *r.cols] for i, r in enumerate(self.ranks)]
        self.logs.append(StepLog(
            node="requester", session=str(session), step=step, role=REQUESTER, group=self.group, index=-1,
            count=self.count, start=start, end=end, hidden=h,
            records=({"layer": start, "event": "scatter", "op": "input", "space": HIDDEN, "width": h,
                      "rows": hidden.shape[0], "sent": slices},
                     {"layer": end, "event": "compat_gather", "op": "output", "space": HIDDEN, "width": h,
                      "rows": hidden.shape[0], "received": slices}),
        ))
        return torch.cat(outputs, dim=1)


def greedy_run(
    head: Stage, spans: Sequence[Stage | InProcessGroup], prompt: Sequence[int], steps: int = DECODE_STEPS,
    session: Hashable = "s",
) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill + `steps` greedy decode steps through `spans` in order; the tokens and every step's logits."""
    capacity = len(prompt) + steps + 1
    for span in spans:
        span.open(session, capacity=capacity)

    def through(x: torch.Tensor, pos: int) -> torch.Tensor:
        for span in spans:
            x = span.forward(session, x, pos)
        return head.logits(x)

    logits = [through(head.embed(list(prompt)), 0)[-1:]]
    tokens = [int(logits[-1][-1].argmax())]
    for k in range(steps):
        logits.append(through(head.embed([tokens[-1]]), len(prompt) + k))
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, logits


# -- real processes ----------------------------------------------------------------------------


def rank_args(span: tuple[int, int], group: str, count: int) -> list[list[str]]:
    return [["--layers", f"{span[0]}:{span[1]}", "--shard", f"{i}/{count}", "--group", group] for i in range(count)]


async def wait_for_peers(swarm, names: Sequence[str], timeout: float = 60.0) -> dict[str, str]:
    """Peer ids by name (`--name peerN`), once the requester's view holds all of them."""
    import trio

    with trio.fail_after(timeout):
        while True:
            found = {p.name: p.peer_id for p in swarm.keeper.snapshot().peers}
            if all(n in found for n in names):
                return found
            with trio.move_on_after(1.0):
                await swarm.keeper.wait_changed()
            await swarm.refresh()


def group_hop(ids: dict[str, str], names: Sequence[str], group: str, start: int, end: int):
    from tessera.peer.plan.routing import Hop
    from tessera.peer.plan.groups import group_hop_id

    return Hop(group_hop_id(group, start, end, len(names)), start, end, group=group,
               members=tuple(ids[n] for n in names))


async def open_forced(swarm, hops):
    """A resilient session whose first route is `hops` (a peer dropping out under a loaded
    machine fails over as in any generation; the answer must stay exact all the same)."""
    from tessera.peer.request.repair import ResilientSession
    from tessera.peer.plan.routing import Route
    from tessera.peer.request.segmented import SegmentedSession

    route = Route(tuple(hops), 0.0)
    resilient = ResilientSession(swarm, max_length=64, route_wait=30.0)
    resilient.current = SegmentedSession(swarm.ctx, route, max_length=64)
    await resilient.current.open()
    resilient.routes.append(route)
    return resilient


async def network_greedy(swarm, session, prompt: Sequence[int], steps: int = DECODE_STEPS):
    """Prefill + `steps` greedy decode steps through `session` (anything with `step`); tokens and logits."""
    out = await session.step(await swarm._embed(list(prompt)), 0)
    logits = [swarm.head.logits(out[-1:])]
    tokens = [int(logits[-1][-1].argmax())]
    for k in range(steps):
        out = await session.step(await swarm._embed([tokens[-1]]), len(prompt) + k)
        logits.append(swarm.head.logits(out))
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, logits


def group_sessions(session) -> list[str]:
    """Hex ids of every group session a `SegmentedSession` used (replaced ones too)."""
    return [s.session_id.hex() for s in [*session.segments, *session.retired] if hasattr(s, "members")]


def collect_audit(local_swarm, tracer, sessions: Sequence[str], *, timeout: float = 20.0) -> list[StepLog]:
    """The audit logs of `sessions` (hex ids) from the requester's tracer and every peer's store,
    waiting (briefly) until each step the requester completed has all its ranks' logs on disk."""
    import time
    from collections import Counter

    from tessera.peer.cli.store import load_audit_logs
    from tessera.peer.plan.audit import load_events

    mine = [log for log in load_events(tracer.events) if log.session in sessions]
    wanted = {(log.session, log.step): log.count for log in mine}
    deadline = time.monotonic() + timeout
    while True:
        logs = list(mine)
        for i in range(len(local_swarm.procs)):
            db = local_swarm.base_dir / f"peer{i}" / "tessera.db"
            if db.exists():
                logs += [log for log in load_audit_logs(db) if log.session in sessions]
        have = Counter((log.session, log.step) for log in logs if log.role == SHARD)
        if all(have[key] >= count for key, count in wanted.items()) or time.monotonic() > deadline:
            return logs
        time.sleep(0.5)
