"""Collectives of a tensor-shard group, over any all-to-all exchange, with an audit trail.

A group of n ranks runs one span together (`stages/shards/sharded.py`). Every collective is
ONE round of an all-to-all **exchange**: rank r hands over n tensors (one per
destination, None for itself) and gets back one from each source (None for itself).
The exchange is the only thing that differs between an in-process group of threads
(`ThreadGroup`, for tests and benchmarks) and peers on a network
(`peer/serve/shard_links.py`); the arithmetic and the audit trail live here, once.

On top of it:

    all_reduce_scalar(x [T])    -> [T], the sum over ranks     (RMSNorm: sums of squares)
    reduce_scatter(x [T, n C])  -> [T, C], the sum over ranks of column chunk r
    norm_reduce_scatter(x, squares [T]) -> both at once, in ONE round (a norm, then a projection)
    all_gather(x [T, C])        -> [T, n C]   (the deliberately broken variant only)

Sums are taken in rank order 0, 1, ..., n-1 on every rank, whatever order the
contributions arrive in, so a step is reproducible bit for bit.

Audit. Each rank reports to its `audit` sink, as plain JSON-ready dicts, every tensor
it holds (`held`: which coordinates of which logical tensor, and whether they are
final values or one rank's partial contribution) and every collective it took part
in (what it sent to whom and what it received from whom). `peer/plan/audit.py`
reads these records back and proves that no rank ever held the full hidden state.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

import torch

from tessera.stages.errors import StageError

Exchange = Callable[[int, list["torch.Tensor | None"]], list["torch.Tensor | None"]]
"""(sequence number of the collective within the step, one tensor per destination) -> one per source."""

AuditSink = Callable[[dict], None]


T = TypeVar("T")


class CollectiveError(StageError):
    """A collective could not complete: a member of the group failed, hung or sent garbage."""


class Collectives:
    """The collectives of rank `rank` of `count`, for ONE step of one session.

    `layer` is set by the stage as it goes, so that every record says where it was made.
    """

    def __init__(self, rank: int, count: int, exchange: Exchange, *, audit: AuditSink | None = None) -> None:
        if not 0 <= rank < count:
            raise ValueError(f"rank {rank!r} is outside [0, {count})")
        self.rank = rank
        self.count = count
        self._exchange = exchange
        self._audit = audit
        self.seq = 0
        self.layer = -1
        self.bytes_sent = 0  # tensor bytes this rank sent in the step (the wire adds a small header)
        self.last_bytes = 0

    # -- audit ------------------------------------------------------------------------

    def record(self, entry: dict) -> None:
        if self._audit is not None:
            self._audit({"layer": self.layer, **entry})

    def held(
        self, op: str, space: str, cols: tuple[int, int], width: int, rows: int, *, reduced: bool = True
    ) -> None:
        """Note that this rank holds columns [cols) of the `width`-wide tensor `op` lives in.

        reduced=False: the tensor is only this rank's partial contribution (one term of a
        sum over ranks), not the value itself.
        """
        self.record({
            "event": "held", "op": op, "space": space, "cols": [cols[0], cols[1]], "width": width,
            "rows": rows, "reduced": reduced, "source": self.rank,
        })

    # -- the collectives ----------------------------------------------------------------

    def _round(self, outgoing: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        self.seq += 1
        self.last_bytes = sum(t.numel() * t.element_size() for t in outgoing if t is not None)
        self.bytes_sent += self.last_bytes
        incoming = self._exchange(self.seq, outgoing)
        if len(incoming) != self.count:
            raise CollectiveError(f"exchange returned {len(incoming)} tensors for a group of {self.count}")
        return incoming

    def _expect(self, incoming: list[torch.Tensor | None], shape: tuple[int, ...], what: str) -> None:
        for src, t in enumerate(incoming):
            if src == self.rank:
                continue
            if t is None or tuple(t.shape) != shape:
                got = None if t is None else tuple(t.shape)
                raise CollectiveError(f"{what}: rank {src} sent shape {got!r}, expected {shape!r}")

    def all_reduce_scalar(self, x: torch.Tensor, *, op: str) -> torch.Tensor:
        """x [T] (one number per token, e.g. a partial sum of squares) -> the sum over ranks [T]."""
        incoming = self._round([None if r == self.rank else x for r in range(self.count)])
        self._expect(incoming, tuple(x.shape), f"all_reduce_scalar {op}")
        parts = [x if r == self.rank else incoming[r] for r in range(self.count)]
        others = [r for r in range(self.count) if r != self.rank]
        self.record({
            "event": "all_reduce_scalar", "op": op, "seq": self.seq, "bytes": self.last_bytes, "space": "scalar",
            "width": 1, "rows": int(x.shape[0]), "sent": [[r, 0, 1] for r in others],
            "received": [[r, 0, 1] for r in others],
        })
        return _sum_in_order(parts)

    def reduce_scatter(self, x: torch.Tensor, *, op: str, space: str) -> torch.Tensor:
        """x [T, n C], this rank's partial contribution -> [T, C]: the sum over ranks of chunk `rank`.

        Only partials cross the wire, and each rank receives only the chunk it owns. Audited
        as: the partial held (all columns, not reduced), the exchange, the chunk held (reduced).
        """
        return self._reduce_scatter(x, None, op=op, space=space)[0]

    def norm_reduce_scatter(
        self, x: torch.Tensor, squares: torch.Tensor, *, op: str, space: str, norm: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A reduce-scatter of x [T, n C] that also all-reduces squares [T] in the same round.

        For an RMSNorm followed by a projection: the norm's per-token scale commutes with the
        projection, so ranks reduce-scatter the unscaled product and the sums of squares
        travel with it (one round instead of two). Returns (chunk sum [T, C], squares sum [T]);
        audited as an all_reduce_scalar of `norm` and a reduce_scatter of `op`, one round.
        """
        return self._reduce_scatter(x, squares, op=op, space=space, norm=norm)  # type: ignore[return-value]

    def _reduce_scatter(
        self, x: torch.Tensor, squares: torch.Tensor | None, *, op: str, space: str, norm: str = ""
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t, width = x.shape
        if width % self.count:
            raise CollectiveError(f"reduce_scatter {op}: width {width} is not divisible by {self.count}")
        c = width // self.count
        chunks = [x[:, r * c : (r + 1) * c] for r in range(self.count)]
        if squares is not None:  # one extra column: this rank's sum of squares, per token
            chunks = [torch.cat([chunk, squares[:, None].to(x.dtype)], dim=1) for chunk in chunks]
        chunks = [chunk.contiguous() for chunk in chunks]
        incoming = self._round([None if r == self.rank else chunks[r] for r in range(self.count)])
        self._expect(incoming, tuple(chunks[0].shape), f"reduce_scatter {op}")
        mine = (self.rank * c, (self.rank + 1) * c)
        others = [r for r in range(self.count) if r != self.rank]
        self.held(op, space, (0, width), width, t, reduced=False)
        if squares is not None:
            self.record({
                "event": "all_reduce_scalar", "op": norm, "seq": self.seq, "bytes": 0, "space": "scalar",
                "width": 1, "rows": t, "sent": [[r, 0, 1] for r in others], "received": [[r, 0, 1] for r in others],
            })
        self.record({
            "event": "reduce_scatter", "op": op, "seq": self.seq, "bytes": self.last_bytes, "space": space,
            "width": width, "rows": t, "sent": [[r, r * c, (r + 1) * c] for r in others],
            "received": [[r, mine[0], mine[1]] for r in others],  # partials of this rank's chunk
        })
        total = _sum_in_order([chunks[self.rank] if r == self.rank else incoming[r] for r in range(self.count)])
        self.held(op, space, mine, width, t)
        if squares is None:
            return total, None
        return total[:, :c], total[:, c]

    def all_gather(self, x: torch.Tensor, *, op: str, space: str) -> torch.Tensor:
        """x [T, C], this rank's final values -> [T, n C], every rank's (a full copy everywhere).

        Inside a sharded span this is exactly what must never happen to the hidden state;
        it exists for the deliberately broken variant that the audit must catch.
        """
        t, c = x.shape
        incoming = self._round([None if r == self.rank else x.contiguous() for r in range(self.count)])
        self._expect(incoming, (t, c), f"all_gather {op}")
        others = [r for r in range(self.count) if r != self.rank]
        self.record({
            "event": "all_gather", "op": op, "seq": self.seq, "bytes": self.last_bytes, "space": space,
            "width": c * self.count, "rows": t,
            "sent": [[r, self.rank * c, (self.rank + 1) * c] for r in others],
            "received": [[r, r * c, (r + 1) * c] for r in others],
        })
        self.held(op, space, (0, c * self.count), c * self.count, t)
        return torch.cat([x if r == self.rank else incoming[r] for r in range(self.count)], dim=1)


def _sum_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """((p0 + p1) + p2) + ...: the same order on every rank, for bit-identical results."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


class ThreadGroup:
    """n ranks as n threads of one process, exchanging through shared slots.

    The in-process stand-in for a group of peers (tests, benchmarks): `exchange_for(r)`
    is rank r's `Exchange`; `run(fns)` runs one callable per rank, each in its own
    thread, and returns their results (or raises the first error, having released
    the others from the barrier).
    """

    def __init__(self, count: int, *, timeout: float = 120.0) -> None:
        self.count = count
        self._barrier = threading.Barrier(count, timeout=timeout)
        self._slots: list[tuple[int, list[torch.Tensor | None]] | None] = [None] * count

    def exchange_for(self, rank: int) -> Exchange:
        def exchange(seq: int, outgoing: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
            self._slots[rank] = (seq, outgoing)
            self._wait()
            incoming: list[torch.Tensor | None] = []
            for src in range(self.count):
                slot = self._slots[src]
                assert slot is not None, "every rank filled its slot before the barrier"
                if slot[0] != seq:
                    raise CollectiveError(f"rank {src} is at collective {slot[0]}, rank {rank} at {seq}")
                incoming.append(None if src == rank else slot[1][rank])
            self._wait()  # nobody overwrites a slot until everyone has read it
            return incoming

        return exchange

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise CollectiveError("another rank of the group failed") from None

    def run(self, fns: Sequence[Callable[[], T]]) -> list[T]:
        if len(fns) != self.count:
            raise ValueError(f"{len(fns)} callables for a group of {self.count}")
        results: list = [None] * self.count
        errors: list[BaseException | None] = [None] * self.count

        def body(rank: int) -> None:
            try:
                results[rank] = fns[rank]()
            except BaseException as error:  # handed to the caller below
                errors[rank] = error
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"shard-rank-{r}") for r in range(self.count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        first = next((e for e in errors if e is not None and not isinstance(e, CollectiveError)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            self._barrier.reset()
            raise first
        return results
