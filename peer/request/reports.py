"""Sharing misbehaviour reports, so that one requester's catch protects everyone.

A report (protocol/attest.py) is accepted only if every signature and hash in it
verifies AND it holds on its merits (`tessera.peer.request.verify.judge_report`: the accused's
rows differ from the witnesses' beyond their dtypes' tolerance, and the
witnesses agree). Accepted reports are kept, recorded in the store, and flooded
once to every connected peer; requesters pull them when they join and avoid
the accused. A forged or unconvincing report is dropped and never relayed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable

import trio

from tessera.protocol.attest import (
    REPORT_FRAME_LIMIT, MisbehaviourReport, ReportBatch, ReportBody, ReportQuery, verify_report,
)
from tessera.protocol.codec import encode
from tessera.protocol.framing import DEFAULT_MAX_FRAME
from tessera.protocol.errors import WireError
from tessera.store.errors import StoreError

from tessera.peer.base.protocols import REPORT_PROTOCOL
from tessera.peer.base.ids import peer_id_text
from tessera.peer.base.errors import PeerError
from tessera.peer.net.transport import Channel, Stream, Transport
from tessera.peer.request.verify import judge_report

log = logging.getLogger(__name__)

EXCHANGE_TIMEOUT = 10.0  # a report is one frame each way; generous for relayed links


class ReportBook:
    """The misbehaviour reports one node has accepted."""

    def __init__(self, transport: Transport, *, model_id: str, store=None, clock: Callable[[], float] = time.time,
                 on_accept: Callable[[ReportBody], None] | None = None) -> None:
        self.transport = transport
        self.model_id = model_id
        self.store = store
        self.clock = clock
        self.on_accept = on_accept
        self.reports: dict[bytes, tuple[MisbehaviourReport, ReportBody]] = {}
        self.rejected = 0
        # reports to forward, drained by `run` (a handler must not block on other peers)
        self._pending_floods: list[tuple[MisbehaviourReport, str | None]] = []
        self._wake = trio.Event()
        transport.set_handler(REPORT_PROTOCOL, self.handle)

    def accused(self) -> set[str]:
        return {peer_id_text(body.accused.peer_id) for _, body in self.reports.values()}

    def accept(self, report: MisbehaviourReport) -> ReportBody | None:
        """Verify and judge a report; keep it if it holds. Returns its body, or None (dropped)."""
        key = hashlib.sha256(encode(report)).digest()
        if key in self.reports:
            return None
        try:
            body = verify_report(report)
            holds = body.model_id == self.model_id and judge_report(body)
        except WireError as bad:
            self.rejected += 1
            log.info("rejected a misbehaviour report: %s", bad)
            return None
        if not holds:
            self.rejected += 1
            return None
        self.reports[key] = (report, body)
        log.warning("misbehaviour report accepted: peer %s returned wrong activations for layers [%d, %d) "
                    "(reported by %s); avoiding it", peer_id_text(body.accused.peer_id), body.start, body.end,
                    peer_id_text(body.reporter))
        if self.store is not None:
            self._record(report, body)
        if self.on_accept is not None:
            self.on_accept(body)
        return body

    def _record(self, report: MisbehaviourReport, body: ReportBody) -> None:
        try:
            self.store.add_report(
                peer_id_text(body.reporter), peer_id_text(body.accused.peer_id),
                span=(body.start, body.end), step=body.accused.step, inputs_hash=body.inputs_hash,
                outputs_hash=body.accused.outputs_hash, signature=report.signature, raw=encode(report),
                session=body.accused.session_id, model_id=body.model_id, verified=True,
            )
        except StoreError as error:  # e.g. larger than the store keeps raw: record without it
            log.info("report stored without its raw bytes: %s", error)
            self.store.add_report(
                peer_id_text(body.reporter), peer_id_text(body.accused.peer_id),
                span=(body.start, body.end), step=body.accused.step, inputs_hash=body.inputs_hash,
                outputs_hash=body.accused.outputs_hash, signature=report.signature,
                session=body.accused.session_id, model_id=body.model_id, verified=True,
            )

    async def handle(self, stream: Stream) -> None:
        ticket = self.transport.intake.enter(stream)  # a stranger's stream throughout (peer/net/intake.py)
        if ticket is None:
            await stream.reset()
            return
        with ticket:
            await self._answer(stream, Channel(stream, max_frame=REPORT_FRAME_LIMIT, on_frame=ticket.charge,
                                               max_send=DEFAULT_MAX_FRAME))
        if ticket.evicted:
            await stream.reset()

    async def _answer(self, stream: Stream, channel: Channel) -> None:
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                msg = await channel.receive()
                if isinstance(msg, MisbehaviourReport):
                    if self.accept(msg) is not None:
                        self.flood(msg, skip=stream.remote)
                    await channel.send(ReportBatch(()))
                elif isinstance(msg, ReportQuery):
                    fresh = [r for r, body in self.reports.values() if body.issued_at >= msg.since]
                    await channel.send(ReportBatch(tuple(fresh[-64:])))
                else:
                    raise WireError(f"unexpected {type(msg).__name__} on the reports protocol")
            await channel.close()
        except (trio.TooSlowError, PeerError, WireError):
            await channel.reset()  # a stalled or garbled exchange is dropped; nothing was accepted from it

    async def send(self, peer: str, report: MisbehaviourReport) -> bool:
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                channel = Channel(await self.transport.open_stream(peer, REPORT_PROTOCOL))
                await channel.send(report)
                await channel.receive()
                await channel.close()
            return True
        except (trio.TooSlowError, PeerError, WireError):
            return False

    def flood(self, report: MisbehaviourReport, *, skip: str | None = None) -> None:
        """Forward a newly accepted report to every connected peer, in the background."""
        self._pending_floods.append((report, skip))
        self._wake.set()

    async def publish(self, report: MisbehaviourReport) -> int:
        """Accept our own report and push it to every connected peer; returns how many took it."""
        self.accept(report)
        sent = 0
        for peer in self.transport.connected():
            sent += await self.send(peer, report)
        return sent

    async def pull(self, peer: str) -> int:
        """Fetch a peer's reports; returns how many were new and held."""
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                channel = Channel(await self.transport.open_stream(peer, REPORT_PROTOCOL))
                await channel.send(ReportQuery(0.0))
                batch = await channel.receive()
                await channel.close()
        except (trio.TooSlowError, PeerError, WireError):
            return 0
        if not isinstance(batch, ReportBatch):
            return 0
        return sum(self.accept(r) is not None for r in batch.reports)

    async def run(self) -> None:
        """Forward accepted reports to neighbours as they come."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            batch, self._pending_floods = self._pending_floods, []
            for report, skip in batch:
                for peer in self.transport.connected():
                    if peer != skip:
                        await self.send(peer, report)
