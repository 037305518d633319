"""A volunteer's peer: join, measure, claim a span, load it, advertise, serve, leave.

    node = build_peer(PeerConfig(model="smollm2-135m", join=[addr]))   # peer/node/compose.py
    await node.run()          # until cancelled; then it leaves gracefully

`PeerNode(config, parts)` is given what it stands on (peer/node/parts.py): its transport,
identity, stage loader, clock, view keeper, tracer and store. peer/node/compose.py wires
a volunteer's (libp2p, torch, sqlite, the wall clock); the simulator runs this same class
over the memory transport with a cost-model stage on trio's MockClock (peer/sim/peer.py).

The lifecycle, in order: open the transport and print the multiaddr others can join; pull the swarm
view from the join addresses; measure one layer's decode speed; pick a span
(`peer/plan/placement.py`, unless --layers forces one) that fits the memory offered;
advertise it as LOADING, load only those layers, advertise SERVING; serve, gossip,
ping, re-advertise and reconsider placement until stopped. Stopping drains:
no new sessions (refused as LEAVING), advertise it, let running sessions finish within
a grace sized to them (peer/serve/leaving.py), hand back any still running (their
requesters are told LEAVING and re-route at once), advertise LEAVING, close the host,
and only then the trace and the store: nothing a closing host ends may emit into a
closed trace.

    node.stop()        # the first Ctrl-C: leave gracefully (at once while still starting)
    node.stop_now()    # the second: hand running answers back now, then leave
"""

from __future__ import annotations

import dataclasses
import sys
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable

import trio

from tessera.protocol.crypto import sign_record
from tessera.protocol.records import MAX_HELD_SPANS, LayerSpan, Neighbour, PeerRecord, SignedRecord
from tessera.store import events
from tessera.store.trace import Tracer

from tessera.peer.base.ids import peer_id_bytes
from tessera.peer.base.errors import ConfigError
from tessera.peer.net.addresses import describe_addrs
from tessera.peer.net.gossip import Gossip, material
from tessera.peer.plan.cost import load_band, load_resign_interval
from tessera.peer.net.pinger import Pinger
from tessera.peer.node.config import (
    KV_RESERVE_FRACTION, LEAVE_RECORD_TTL, RENEW_AFTER, PeerConfig, capacity_in_layers,
)
from tessera.peer.node.parts import NodeParts
from tessera.peer.net.join import join_swarm
from tessera.peer.net.other_model import other_model_reason
from tessera.peer.net.nat.reachability import NatService
from tessera.peer.serve import faults as misbehave
from tessera.peer.request.reports import ReportBook
from tessera.peer.serve.leaving import FALLBACK_FACTOR, InFlight, in_flight
from tessera.peer.serve.limits import ServerLimits
from tessera.peer.serve.server import StageServer
from tessera.peer.serve.shard_server import ShardServer
from tessera.peer.net.transport import Transport
from tessera.peer.plan.coverage import SwarmCoverage, swarm_coverage
from tessera.peer.plan.view import DRAINING, LEAVING, LOADING, SERVING, PeerInfo, Reachability


class PeerNode:
    """One running peer (see module docstring)."""

    def __init__(self, config: PeerConfig, parts: NodeParts, *, out: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.parts = parts
        self.out = out or (lambda line: (print(line), sys.stdout.flush()))
        self.compute = parts.compute
        self.spec = self.compute.spec
        self.quant = self.compute.quant
        self.model_id = self.compute.model_id
        self.identity = parts.identity
        self.store = parts.store
        self.clock = parts.clock
        self.pacing = parts.pacing
        self.placement = parts.placement
        self.watch = parts.watch
        self._state = LOADING
        self.span: tuple[int, int] | None = None
        self.throughput = 0.0
        self.started = self.clock()
        self.seq = 0
        self.transport: Transport | None = None
        self.server: StageServer | None = None
        self.stage: Any = None  # a tessera.stages Stage (or what the stage loader loads)
        self.keeper = parts.keeper
        self.gossip: Gossip | None = None
        self._nursery: trio.Nursery | None = None  # where advertise() announces (while running)
        self.pinger: Pinger | None = None
        self._own: SignedRecord | None = None
        self._own_info: PeerInfo | None = None  # this peer as its latest record shows it
        self.stopping = trio.Event()
        self.forced = False  # stop_now: running answers are handed back without waiting for them
        self._scope: trio.CancelScope | None = None  # the whole run (a stop while starting cancels it)
        self._grace: trio.CancelScope | None = None  # the wait for running answers while leaving
        self.ready = trio.Event()
        self.tracer: Tracer | None = None
        self.nat: NatService | None = None

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, state: str) -> None:
        self._state = state
        self.watch.state_changed(self)

    @property
    def memory_bytes(self) -> int:
        """Bytes offered (the stage loader's reading of --memory: peer/node/torch_compute.py)."""
        return self.compute.memory_offered(self.config.memory_gb)

    def device_memory(self) -> dict | None:
        """Free and total memory of a CUDA device (for the record and the TUI); None elsewhere."""
        return self.compute.device_memory()

    def held_layers(self) -> tuple[tuple[int, int], ...]:
        """Layer ranges on disk here (`Weights.held_layers`; empty for a node without a Weights part)."""
        return self.parts.weights.held_layers() if self.parts.weights is not None else ()

    def fetching(self) -> dict | None:
        """The weights fetch under way for a claimed span (`Weights.fetching`), or None."""
        return self.parts.weights.fetching() if self.parts.weights is not None else None

    @property
    def itemsize(self) -> int:
        return self.compute.itemsize

    # -- advertising ------------------------------------------------------------------

    def _record(self, now: float, seq: int) -> PeerRecord:
        """What we would advertise now (unsigned)."""
        used = self.stage.weight_bytes if self.stage else 0
        server = self.server
        # a leaving peer's last word is short-lived: it is gone from every view soon after,
        # even where no neighbour saw it go (the others' departure reports usually come first)
        ttl = min(self.config.record_ttl, LEAVE_RECORD_TTL) if self.state == LEAVING else self.config.record_ttl
        return PeerRecord(
            peer_id=self.identity.peer_id, name=self.config.name[:64], model_id=self.model_id,
            start=self.span[0], end=self.span[1], shard_index=self.config.shard[0], shard_count=self.config.shard[1],
            shard_group=self.config.group,
            throughput=self.throughput, free_memory=max(0, self.memory_bytes - used),
            load=server.load if server else 0.0, max_sessions=self.config.max_sessions,
            state=self.state, reachability=self.nat.reachability if self.nat else Reachability.PUBLIC,
            addrs=tuple(self.transport.addrs()[:16]),
            neighbours=tuple(Neighbour(_peer_bytes(p), rtt) for p, rtt in sorted(self.pinger.rtt_ms.items())[:64]),
            issued_at=now, expires_at=now + ttl, seq=seq,
            dtype=self.compute.dtype_name,
            device=self.compute.device_type, device_free=(self.device_memory() or {}).get("free", 0),
            held=tuple(LayerSpan(start, end) for start, end in self.held_layers()[:MAX_HELD_SPANS]),
            context_tokens=self.context_tokens(),
        )

    def context_tokens(self) -> int:
        """The longest context one session over the claimed span fits in the session-state budget
        (ServerLimits.kv_budget), each layer per its state kind (families/spec/model.py `context_tokens`)."""
        if self.span is None:
            return 0
        kv = int(self.memory_bytes * KV_RESERVE_FRACTION)
        return self.spec.context_tokens(self.span[0], self.span[1], kv, self.itemsize)

    def make_record(self) -> SignedRecord | None:
        if self.span is None or self.transport is None:
            return None
        now = self.clock()
        self.seq = max(self.seq + 1, int(now * 1000))  # survives restarts: newer beats older
        self._own = sign_record(self.identity, self._record(now, self.seq))
        self._own_info = None  # filled from the keeper's copy on merge (one decode, not two)
        return self._own

    def _renewal_due(self, now: float) -> bool:
        """Half our record's lifetime is gone (then it is re-signed even if nothing changed)."""
        record = self._own_record
        return record is None or now >= record.issued_at + RENEW_AFTER * (record.expires_at - record.issued_at)

    @property
    def _own_record(self) -> PeerRecord | None:
        known = self.keeper.get(self.transport.peer_id) if self.transport is not None else None
        own = self._own
        return known.record if known is not None and own is not None and known.signed.signature == own.signature else None

    async def advertise(self, *, wait: bool = False, force: bool = False) -> None:
        """Re-sign our record if what placement and routing read changed (`material`), its load
        crossed a band (bounded: peer/plan/cost.py `load_resign_interval`), half its lifetime is
        gone, or `force`, and push it to our neighbours at once (the periodic
        exchanges take it further). Checked every advertise period.

        The announcement runs in the background unless `wait` (leaving: tell the swarm before
        the host closes). A neighbour that has gone silent holds its push for up to a turn's
        timeout, and nothing that advertises may wait on it: serving, moves and operator
        controls would stall.
        """
        if self.span is None or self.transport is None:
            return
        now = self.clock()
        before = self._own_record
        fresh = self._record(now, self.seq)
        changed = before is None or material(before) != material(fresh)
        if not changed and before is not None and load_band(before.load) != load_band(fresh.load):
            # a new load band, at most once per interval that keeps the swarm's re-signing bounded
            changed = now - before.issued_at >= load_resign_interval(len(self.keeper.snapshot().peers))
        if not (changed or force or self._renewal_due(now)):
            return
        signed = self.make_record()
        self.keeper.merge([signed])
        after = self.keeper.get(self.transport.peer_id)
        self._own_info = after.info if after is not None and after.signed.signature == signed.signature else None
        if self.gossip is not None:  # a renewal too: it must reach everyone well before the old one expires
            if wait or self._nursery is None:
                await self.gossip.announce()
            else:
                self._nursery.start_soon(self.gossip.announce)
        if self.tracer:
            self.tracer.emit(events.Advertise(span=self.span, state=self.state, load=self.server.load if self.server else 0.0))

    def _refute(self, seq: int) -> None:
        """A departure of our own record came back to us (a false report, a healed partition):
        answer it with a newer record."""
        self.seq = max(self.seq, seq)
        if self._nursery is not None:
            self._nursery.start_soon(partial(self.advertise, force=True))

    def _protected(self, peer_id: str) -> bool:
        """Connections gossip must not close: our relay reservations'."""
        return self.nat is not None and peer_id in self.nat.relay_addrs

    # -- lifecycle --------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with trio.CancelScope() as self._scope:
                if self.stopping.is_set():
                    self._scope.cancel()  # stopped before it started
                await self._run(task_status)
        finally:
            # After the host has closed (whatever it ended has emitted its last events), never before.
            if self.tracer is not None:
                self.tracer.close()
            if self.store is not None:
                self.store.close()
            if self.parts.data_dir_lock is not None:
                self.parts.data_dir_lock.release()  # the data dir is free for the next peer (a restart)

    async def _run(self, task_status) -> None:
        parts = self.parts
        self.compute.prepare()
        async with parts.open_transport() as transport:
            self.transport = transport
            peer_id = transport.peer_id
            if self.store is not None:
                self.store.record_identity(peer_id)
            self.tracer = parts.tracer(peer_id)
            if parts.gossip:
                self.gossip = Gossip(transport, self.keeper, own_record=lambda: self._own,
                                     interval=self.config.gossip_interval, rng=self.pacing.gossip_rng,
                                     refute=self._refute, on_connect=self._connected, protected=self._protected)
            # a neighbour that stops answering pings is looked at by membership (it may have vanished)
            self.pinger = Pinger(transport, on_failure=self.gossip.suspect if self.gossip is not None else _ignore,
                                 tracer=self.tracer,  # its echoes say its load (peer/serve/load.py)
                                 load=lambda: self.server.load_report() if self.server is not None else None)
            if parts.weights is not None:
                parts.weights.serve(transport)
            for line in describe_addrs(transport.addrs()):  # "listening on ADDR (LAN: ...)", best first
                self.out(line)
            self.tracer.emit(events.Join(addrs=transport.addrs(), model=self.model_id))
            self.watch.opened(self)
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery  # background announcements (advertise)
                    for service in parts.services:
                        nursery.start_soon(service, self)
                    if parts.nat:
                        self._start_nat(nursery)
                    await self._join()
                    await self._claim_and_load()
                    # a rank of a tensor-shard group runs the shard server (peer/serve/shard_server.py)
                    kind = partial(ShardServer, group=self.config.group) if self.config.shard[1] > 1 else StageServer
                    store = self.store
                    self.server = kind(
                        transport, self.identity, self.stage, tracer=self.tracer,
                        limits=ServerLimits(max_sessions=self.config.max_sessions, max_length=self.config.max_length,
                                            batch_rows=self.config.batch_rows, batch_wait=self.config.batch_wait,
                                            kv_budget=int(self.memory_bytes * KV_RESERVE_FRACTION)),
                        ledger=None if store is None else lambda requester, layer_tokens, nbytes: store.add_ledger(
                            requester, layer_tokens, steps=1, bytes=nbytes),
                    )
                    self.compute.serve_with(self.server)
                    self._inject_faults()
                    if parts.reports:
                        self.reports = ReportBook(transport, model_id=self.model_id, store=store)
                        nursery.start_soon(self.reports.run)
                    self.state = SERVING
                    await self.advertise()
                    rank = f" as rank {self.config.shard[0]}/{self.config.shard[1]} of group {self.config.group!r}"
                    self.out(f"serving layers [{self.span[0]}, {self.span[1]}) of {self.spec.num_layers}"
                             + (rank if self.config.shard[1] > 1 else ""))
                    for line in self.resource_lines():
                        self.out(line)
                    self.ready.set()
                    task_status.started(self)
                    if parts.reap_idle:
                        nursery.start_soon(self.server.reap_idle)
                    nursery.start_soon(self._advertise_forever)
                    nursery.start_soon(self._ping_forever)
                    if self.gossip is not None:
                        nursery.start_soon(self._gossip_forever)
                    if self.config.layers is None and self.placement.moves:  # a forced span never moves
                        nursery.start_soon(self._rebalance_forever)
                    await self.stopping.wait()
                    await self._leave()
                    nursery.cancel_scope.cancel()
            finally:
                self._nursery = None
                self.watch.closed(self)

    def stop(self) -> None:
        """Leave gracefully (the first Ctrl-C): running answers get a grace to finish. A peer
        still starting (joining, fetching, loading) serves nothing yet: it stops at once."""
        self.stopping.set()
        if not self.ready.is_set() and self._scope is not None:
            self._scope.cancel()

    def stop_now(self) -> None:
        """Stop without waiting for running answers (the second Ctrl-C): each is handed back to
        its requester (LEAVING: it re-routes at once), then the peer leaves as `stop` does."""
        self.forced = True
        self.stop()
        if self._grace is not None:
            self._grace.cancel()

    def _inject_faults(self) -> None:
        """--misbehave (tests and demos only): make this peer return wrong activations."""
        if not self.config.misbehave:
            return
        mode, probability = misbehave.parse(self.config.misbehave)
        if mode == "perturb":
            self.server.tamper = misbehave.perturber(probability, seed=self.seq)
            self.out(f"MISBEHAVING: perturbing {probability:.0%} of steps")
        else:
            self.out(f"MISBEHAVING: serving with a perturbed {misbehave.corrupt_weights(self.stage)}")

    def _start_nat(self, nursery: trio.Nursery) -> None:
        """Behind NAT (peer/net/nat/reachability.py): dial-back reachability, relays, link kinds; re-advertise on change."""
        self.nat = NatService(self.transport, self.keeper, out=self.out, tracer=self.tracer, on_change=self.advertise)
        nursery.start_soon(self.nat.run)

    async def _join(self) -> None:
        """Join through --join (peer/net/join.py: retries, one reason line per attempt, JoinFailed)."""
        if self.gossip is None:
            return  # the view is fed otherwise (a simulation's shared view): nothing to pull
        for addr in self.config.join:
            self.keeper.remember(addr)  # re-dialled whenever we are not connected to it
        if self.config.join:
            await join_swarm(
                self.config.join, self._try_join, timeout=self.config.join_timeout,
                allow_alone=self.config.allow_alone, swarm_key_given=self.config.swarm_key is not None, out=self.out,
            )
        await self._connect_known()

    async def _try_join(self, addr: str) -> str | None:
        """Connect to `addr` and pull the view: None when joined, else why not (raises PeerError if unreachable)."""
        peer = await self.transport.connect(addr)
        self.tracer.emit(events.Connect(remote=peer, link=self.transport.connection_kind(peer) or "direct"))
        if not await self.gossip.exchange(peer):
            return "unreachable (connected, but the gossip exchange failed)"
        other = self.keeper.foreign_models.get(peer)
        if other is not None:
            return "different model: " + other_model_reason([other], self.model_id, Path(str(self.config.model)).name,
                                                            requester=False)
        return None

    async def _connect_known(self) -> None:
        await self.gossip.settle_join()  # our first neighbours now, not a period from now

    def _connected(self, peer_id: str) -> None:
        self.tracer.emit(events.Connect(remote=peer_id, link=self.transport.connection_kind(peer_id) or "direct"))

    @property
    def capacity(self) -> int:
        return capacity_in_layers(self.spec, self.memory_bytes, self.itemsize, self.quant)

    async def _claim_and_load(self) -> None:
        self.throughput = await self.compute.measure()
        if self.config.layers is not None:
            start, end = self.config.layers
            if end > self.spec.num_layers:
                raise ConfigError(f"--layers {start}:{end} exceeds the model's {self.spec.num_layers} layers")
        else:
            start, end = self.spec.aligned_span(*self.placement.claim(
                self.keeper.snapshot(), me=self.transport.peer_id, capacity_layers=self.capacity,
                throughput=self.throughput, rng=self.pacing.rng, held=self.held_layers()))
        self.span = (int(start), int(end))
        if self.store is not None:
            self.store.record_claim(self.model_id, self.span, action="claim", shard=self.config.shard,
                                    reason="forced" if self.config.layers else "placement")
        self.tracer.emit(events.Claim(span=self.span, throughput=self.throughput, capacity=self.capacity))
        self.watch.claimed(self)
        await self.advertise()  # LOADING: others see the claim before the weights are in
        self.stage = await self._load(*self.span)

    async def _load(self, start: int, end: int) -> Any:
        if self.parts.weights is not None:  # a folder fetched from the swarm holds only some layers: this span's first
            def holders() -> dict[str, tuple[str, ...]]:
                return {p.peer_id: p.addrs for p in self.keeper.snapshot().peers
                        if p.peer_id != self.transport.peer_id and p.addrs and p.held_in(start, end)}

            await self.parts.weights.ensure(self.transport, (start, end), self.out, holders=holders)
        stage = await self.compute.load(start, end)
        if self.compute.last_check is not None:
            self.out(self.compute.last_check)  # hashed now, or vouched for by the cache of an earlier check
        return stage

    async def move_to(self, span: tuple[int, int], reason: str) -> None:
        """Serve another span: drain (no new sessions, a grace for running ones), load, serve.

        Only the new span's weights are read; the old stage is dropped once the new one
        is in, so for a moment both are in memory.
        """
        old = self.span
        assert self.server is not None
        self.server.accepting = False
        self.state = DRAINING
        await self.advertise()
        await self.server.drain(self.config.move_grace)
        self.span = span
        self.state = LOADING
        self.tracer.emit(events.Move(span=span, moved_from=list(old) if old else None, reason=reason))
        if self.store is not None:
            self.store.record_claim(self.model_id, span, action="move", reason=reason, moved_from=old)
        self.watch.moved(self, old, reason)
        await self.advertise()
        stage = await self._load(*span)
        for session in list(self.server.sessions.values()):
            self.server.drop(session, "peer moved its span")
        self.stage = self.server.stage = stage
        self.state = SERVING
        self.server.accepting = True
        await self.advertise()
        self.out(f"serving layers [{span[0]}, {span[1]}) of {self.spec.num_layers} (moved: {reason})")
        self.out(self.resource_lines()[0])

    async def _rebalance_forever(self) -> None:
        while True:
            await trio.sleep(self.pacing.jittered(self.config.rebalance_interval))
            if self.state != SERVING:
                continue
            plan = self.placement.rebalance(self.keeper.snapshot(), own=self._own_info, me=self.transport.peer_id,
                                            span=self.span, capacity_layers=self.capacity,
                                            throughput=self.throughput, rng=self.pacing.rng)
            plan = None if plan is None else self.spec.aligned_span(*plan)  # where sparse attention lets a span start
            if plan is not None and plan != self.span:
                await self.move_to(plan, "rebalance")

    # -- operator controls (CLI, TUI) ---------------------------------------------------

    async def set_memory_offered(self, gb: float) -> None:
        """Offer a different amount of memory; re-claim a span that fits it (if it changes)."""
        self.config.memory_gb = gb
        if self.config.layers is not None or self.state != SERVING:
            await self.advertise()
            return
        view = self.keeper.snapshot().without([self.transport.peer_id])
        span = self.placement.claim(view, me=self.transport.peer_id, capacity_layers=self.capacity,
                                    throughput=self.throughput, rng=self.pacing.rng, held=self.held_layers())
        span = self.spec.aligned_span(int(span[0]), int(span[1]))
        if span != self.span:
            await self.move_to(span, f"memory offered changed to {gb:g} GB")
        else:
            await self.advertise()

    async def drain(self) -> None:
        """Stop taking new sessions; running ones finish."""
        assert self.server is not None
        self.server.accepting = False
        self.state = DRAINING
        self.tracer.emit(events.Drain(span=self.span, sessions=len(self.server.sessions)))
        await self.advertise()

    async def pause(self) -> None:
        """Hold all compute and take no new sessions (running sessions will fail over elsewhere)."""
        assert self.server is not None
        self.server.pause()
        self.state = DRAINING
        self.tracer.emit(events.Pause(span=self.span, sessions=len(self.server.sessions)))
        await self.advertise()

    async def resume(self) -> None:
        assert self.server is not None
        self.server.resume()
        self.state = SERVING
        self.tracer.emit(events.Resume(span=self.span))
        await self.advertise()

    def in_flight(self) -> InFlight:
        """The answers running here and the grace a stop would give them now (peer/serve/leaving.py)."""
        server = self.server
        if server is None:
            return InFlight(0, 0, 0.0)
        layers = (self.span[1] - self.span[0]) if self.span else 1
        fallback = FALLBACK_FACTOR * layers / self.throughput if self.throughput > 0 else 1.0
        return in_flight(server.sessions.values(), trio.current_time(), fallback_pace=fallback,
                         cap=self.config.leave_grace)

    async def _leave(self) -> None:
        """Graceful stop: no new sessions, tell the swarm, let running ones finish within a grace
        sized to them, hand back what is left (its requesters re-route at once)."""
        with trio.CancelScope(shield=True):
            server = self.server
            self.state = LEAVING if not server or not server.sessions else DRAINING
            if server:
                server.leaving = True  # an open is refused as LEAVING from now on
                server.accepting = False
            await self.advertise(wait=True)
            if server and server.sessions:
                running = self.in_flight()
                self.out(f"leaving: no new sessions; {running.describe()}: waiting up to {running.grace:.0f} s "
                         "for them to finish (Ctrl-C again: hand them to other peers now)")
                with trio.CancelScope() as self._grace:
                    if self.forced:
                        self._grace.cancel()
                    await server.drain(running.grace)
                self._grace = None
                # Past the grace (or told to stop now): the requesters of what is left hear LEAVING
                # and re-route at once; their sessions end here, while the trace is still open.
                handed = await server.hand_over("this peer is leaving the swarm")
                if handed:
                    self.out(f"leaving: handed {handed} unfinished answer{'s' if handed != 1 else ''} back to "
                             f"{'their requesters' if handed != 1 else 'its requester'} to finish elsewhere")
            self.state = LEAVING
            await self.advertise(wait=True)
            if self.span and self.store is not None:
                self.store.record_claim(self.model_id, self.span, action="release", reason="leaving")
            self.watch.left(self)
            self.tracer.emit(events.Leave(span=self.span))
            self.out("left the swarm")

    async def _advertise_forever(self) -> None:
        while True:
            # jitter so that peers started together do not advertise in lockstep
            await trio.sleep(self.pacing.jittered(self.config.advertise_interval))
            await self.advertise()

    async def _gossip_forever(self) -> None:
        await trio.sleep(self.pacing.first_gossip(self.gossip.interval))
        await self.gossip.run()

    async def _ping_forever(self) -> None:
        interval = self.config.ping_interval
        phase = self.pacing.first_ping(interval)
        if phase is not None:
            await trio.sleep(phase)
        while True:
            await self.pinger.ping_all()
            await trio.sleep(interval)

    def resource_lines(self) -> list[str]:
        """What this peer offers and uses, and how fast it measured itself (printed at start-up).

        'memory: 0.27 GB used by the weights of layers [0, 15) + up to 0.25 GB for KV caches, of 1.00 GB offered;
         one session holds up to 8192 tokens of context'
        'compute: cpu float32, 1 thread; one layer decodes a token in 0.86 ms (77.5 tok/s through 15 layers)'
        """
        gb = 1 << 30
        used = self.stage.weight_bytes if self.stage else 0
        kv = int(self.memory_bytes * KV_RESERVE_FRACTION)  # the server's KV budget (ServerLimits.kv_budget)
        span = f"[{self.span[0]}, {self.span[1]})" if self.span else "no layers"
        n = self.span[1] - self.span[0] if self.span else 0
        speed = (f"one layer decodes a token in {1000 / self.throughput:.2f} ms "
                 f"({self.throughput / max(n, 1):.1f} tok/s through {n} layer{'s' if n != 1 else ''})"
                 if self.throughput > 0 else "speed not measured")
        # what one session over the span may hold: each layer per its state kind (a linear-attention
        # layer's is fixed, whatever the context: families/spec/model.py `context_tokens`)
        fixed = self.spec.state_fixed_bytes(*self.span, self.itemsize) if self.span else 0
        context = (f"; one session holds up to {self.context_tokens()} tokens of context"
                   + (f" ({fixed / 2**20:.1f} MB of its state fixed)" if fixed else "")) if self.span else ""
        return [
            f"memory: {used / gb:.2f} GB used by the weights of layers {span} + up to {kv / gb:.2f} GB "
            f"for KV caches, of {self.memory_bytes / gb:.2f} GB offered{context}",
            f"compute: {self.compute.describe()}; {speed}",
        ]

    # -- status (CLI, TUI) --------------------------------------------------------------

    def dedicated_status(self) -> dict | None:
        """The transport's dedicated connections (peer/net/dedicated/); None on a transport without them."""
        dedicated = getattr(self.transport, "dedicated", None)  # only the libp2p transport has them
        return dedicated.status() if dedicated is not None else None

    def coverage(self) -> SwarmCoverage:
        """The swarm's coverage as routing sees it (peer/plan/coverage.py), with this peer in the
        state it is in now: its record in the view may say "serving" a moment after a drain."""
        view = self.keeper.snapshot()
        me = self.transport.peer_id if self.transport else None
        own = (view.get(me) or self._own_info) if me else None
        if own is not None:
            own = dataclasses.replace(own, state=self.state)
        return swarm_coverage(view, own=own)

    def status(self) -> dict:
        server = self.server
        coverage = self.coverage()
        return {
            "peer_id": self.transport.peer_id if self.transport else None,
            "name": self.config.name,
            "addrs": self.transport.addrs() if self.transport else [],
            "model_id": self.model_id,
            "num_layers": self.spec.num_layers,
            "span": list(self.span) if self.span else None,
            "shard": {"index": self.config.shard[0], "count": self.config.shard[1], "group": self.config.group},
            "state": self.state,
            "throughput": self.throughput,
            "memory_offered": self.memory_bytes,
            "context_tokens": self.context_tokens(),
            "memory_used": self.stage.weight_bytes if self.stage else 0,
            "device": self.compute.device_name,
            "vram": self.device_memory(),
            "quant": self.quant.tag,
            "uptime": self.clock() - self.started,
            "sessions": len(server.sessions) if server else 0,
            "stats": vars(server.stats) if server else {},
            "coverage": list(coverage.replicas),  # per layer: replicas a new session can use now
            "gaps": [list(gap) for gap in coverage.gaps],
            "serving": coverage.serving,  # peers taking sessions (this one included, if it does)
            "neighbours": {p: {"rtt_ms": rtt, "kind": self.transport.connection_kind(p)} for p, rtt in self.pinger.rtt_ms.items()},
            "nat": self.nat.status() if self.nat else None,
            "dedicated": self.dedicated_status(),
            # neighbours dialled and accepted, connections gossip opened, exchanges, bytes sent
            "gossip": self.gossip.status() if self.gossip is not None else None,
            "held": [list(span) for span in self.held_layers()],
            "fetch": self.fetching(),
        }


def _ignore(peer_id: str) -> None:
    pass


@lru_cache(maxsize=1 << 14)
def _peer_bytes(peer_id: str) -> bytes:
    """A neighbour's id as bytes: converted once per id, not once per record (a thousand
    simulated peers re-advertise their neighbours every period)."""
    return peer_id_bytes(peer_id)
