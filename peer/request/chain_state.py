"""The requester's bookkeeping for a route: its context, each hop's end, and steps in flight."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch
import trio

from tessera.protocol.admission import solve_work
from tessera.protocol.keys import Identity
from tessera.protocol.links import LinkCipher
from tessera.protocol.messages import LoadReport, Result
from tessera.store.trace import NullTracer, Tracer

from tessera.peer.base.backoff import Failure
from tessera.peer.base.ids import peer_id_bytes
from tessera.peer.base.errors import PeerError
from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.plan.routing import Hop
from tessera.peer.net.transport import Channel, Transport
from tessera.peer.request.loads import LoadBook


@dataclass
class RequesterContext:
    """What a route session needs from the requester that owns it."""

    transport: Transport
    identity: Identity
    keeper: ViewKeeper
    nursery: trio.Nursery
    num_layers: int
    hidden_size: int
    tracer: Tracer = field(default_factory=NullTracer)
    wire: str = ""  # the activations' wire form the requester asks its peers for (protocol/tensors.py WIRE_FORMS)
    # values per token a hop into layer l carries (ModelSpec.hop_width: DeepSeek-V4's hc_mult streams and token
    # ids, Gemma 4's per-layer inputs of the layers from l on); None: the hidden size at every layer, as most
    # models'. `hidden_size` is what a tensor-shard group splits
    hop_widths: Callable[[int], int] | None = None
    # This requester's open sessions per peer, all its answers together: routing prices each
    # as a step queued ahead of ours (peer/plan/cost.py OWN_SESSION_PENALTY).
    running: Counter[str] = field(default_factory=Counter)
    # What peers said of their load in answers to this requester (peer/request/loads.py); the
    # owner gives it its clock (the default: a live requester's).
    loads: LoadBook = field(default_factory=lambda: LoadBook(time.monotonic))
    # What a peer that reset the link from its previous hop counts as (the requester's
    # `Bans.link_reset`: lack of room the first time, a drop when repeated); the default: a drop.
    link_reset: Callable[[str], Failure] = lambda peer: Failure.DROPPED

    def hop_width(self, layer: int) -> int:
        """Values per token a hop into layer `layer` carries (`hop_widths`)."""
        return self.hidden_size if self.hop_widths is None else self.hop_widths(layer)

    def hold(self, peer: str) -> None:
        """Count a session on `peer` from the moment a route is chosen for opening (so that opens
        started at the same time see each other), until `release` or `drop`."""
        self.running[peer] += 1

    def drop(self, peer: str) -> None:
        """Stop counting one session on `peer` (its open failed)."""
        self.running[peer] -= 1
        if self.running[peer] <= 0:
            del self.running[peer]

    def release(self, state: "HopState") -> None:
        """Stop counting `state`'s session: it closed, failed or was revoked (idempotent)."""
        if state.held:
            state.held = False
            self.drop(state.peer)

    @cached_property
    def work(self) -> bytes:
        """This identity's proof of work, shown in every session open (protocol/admission.py):
        solved at the first open, once per identity (~0.1 s, on the loop: a thread would let a
        simulation's MockClock jump while it runs)."""
        return solve_work(self.identity.peer_id)


def began_before(began: float | None) -> float | None:
    """Seconds since `began` (trio's clock): how long before a session's traced open its answer
    began (None: not said). A replay's request arrives then (peer/sim/replay.py)."""
    return None if began is None else round(max(0.0, trio.current_time() - began), 6)


def peer_bytes(peer_id: str) -> bytes:
    return peer_id_bytes(peer_id)


@dataclass
class HopState:
    """The requester's end of one peer's session."""

    hop: Hop
    channel: Channel
    send: LinkCipher | None = None  # requester -> this peer (first hop, or an inject link)
    tap: LinkCipher | None = None  # this peer -> requester, copy of its output
    result: LinkCipher | None = None  # last hop -> requester
    failure: str | None = None
    failed_as: Failure = Failure.DROPPED  # the kind of `failure` (peer/base/backoff.py)
    revoked: bool = False  # the requester took this peer out of the session (RouteSession.revoke_hop)
    held: bool = True  # counted in the requester's `running` sessions until released (RequesterContext)
    accepted: LoadReport | None = None  # the load it reported as it accepted the session (None: not said)
    attested: list[AttestedStep] = field(default_factory=list)
    acked: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    @property
    def peer(self) -> str:
        return self.hop.peer_id


@dataclass(frozen=True)
class AttestedStep:
    """What a peer signed about one step it computed (see tessera.protocol.attest)."""

    peer: str
    step: int
    start_pos: int
    n_tokens: int
    start: int
    end: int
    inputs_hash: bytes
    outputs_hash: bytes
    attestation: bytes

    @staticmethod
    def of(state: "HopState", msg: Result) -> "AttestedStep":
        return AttestedStep(state.peer, msg.step, msg.start_pos, msg.n_tokens, state.hop.start, state.hop.end,
                            msg.inputs_hash, msg.outputs_hash, msg.attestation)


@dataclass
class StepSlot:
    """A step waiting for its end: the chain's result, or the tap of `tap_from`
    (its output tensor, or — when `fingerprint` — the fingerprint bytes in `raw`).

    `progress` is set when it ends and when a peer says where the step is in its queue
    (`notices`: (peer, started, seconds to wait), taken by the waiter, which then replaces it)."""

    tap_from: str | None = None
    fingerprint: bool = False
    raw: bytes | None = None
    sent_at: float = 0.0
    done: trio.Event = field(default_factory=trio.Event)
    value: torch.Tensor | None = None
    error: PeerError | None = None
    progress: trio.Event = field(default_factory=trio.Event)
    notices: list[tuple[str, bool, float]] = field(default_factory=list)

    def complete(self, value: torch.Tensor) -> None:
        if not self.done.is_set():
            self.value = value.clone()  # the decoded tensor views a read-only buffer
            self.done.set()
            self.progress.set()

    def complete_raw(self, raw: bytes) -> None:
        if not self.done.is_set():
            self.raw = raw
            self.done.set()
            self.progress.set()

    def fail(self, error: PeerError) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()
            self.progress.set()

    def notice(self, peer: str, started: bool, wait: float) -> None:
        """`peer` said the step is queued there (`wait` s more) or has started (`started`)."""
        if not self.done.is_set():
            self.notices.append((peer, started, wait))
            self.progress.set()
