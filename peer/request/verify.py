"""Trust but verify: spot checks, tie-breaks, bans and misbehaviour reports.

For a configurable fraction of steps the requester picks one hop of its route
and has a **checker** — another peer serving the same span, of the same or
better precision — recompute it. The checker keeps a shadow session: each check
first catches it up on every position since the last one, in one
prefill-shaped step, and it answers with fingerprints only (protocol/fingerprint.py),
which the requester compares with fingerprints of the outputs it already holds
(the taps). So a check covers every step since the previous check, not just one.

On a mismatch the suspicious step is recomputed with full outputs; a real
difference (beyond the tolerance of the two peers' dtypes) goes to a tie-break
against a third peer. The peer the other two disagree with is banned, a signed
report with every party's attested output is recorded and shared, and — if it
is in the route — the session that owns the answer (`ResilientSession`, told by a
`Conviction`) bans it and fails over, replaying through to the end so that the
caches after it are rebuilt from clean inputs too.

With no third peer for a tie-break (two holders of a span: most small swarms), the
requester decides the dispute itself by recomputing the span (peer/request/dispute.py):
whoever differs from its recomputation is convicted and banned as above (not reported to
the swarm: the proof is a computation only this requester made, and a report needs two
independent witnesses). If it cannot recompute, both peers are handed to the session as
*unproven* convictions: it avoids both and goes on without them, or ends the answer naming
them (`DisputeUndecided`) — never on one side, unverified.

On a route with tensor-shard groups, every plain hop is checked as on any route
(each run of plain hops is a chain segment with its own taps and attestations); a
group hop is not, and `GroupSession.checkable` says precisely why. Its span is
recorded in `unchecked` (and the summary), so a caller can tell what went unchecked.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tessera.store import events
from tessera.protocol.attest import MAX_ROWS, MisbehaviourReport, ReportBody, Witness, sha256, sign_report
from tessera.protocol.errors import WireError
from tessera.protocol.fingerprint import (
    fingerprint_bytes, full_rows_agree, row_differences, rows_agree, rows_conflict, tolerance,
)
from tessera.protocol.messages import REPLY_FINGERPRINT, REPLY_FULL
from tessera.protocol.tensors import decode_tensor, encode_tensor

from tessera.peer.base.backoff import GUILTY_BAN
from tessera.peer.base.ids import peer_id_bytes
from tessera.peer.base.errors import PeerError, PeerFailed
from tessera.peer.request.chain_state import AttestedStep, HopState
from tessera.peer.request.chain import RouteSession
from tessera.peer.request.dispute import BY_TIE_BREAKER, Dispute, Ruling, settle
from tessera.peer.request.ports import CheckPolicy, Checkable, RouteRun, SwarmPort
from tessera.peer.plan.routing import route
from tessera.peer.plan.view import PeerInfo, SwarmView

# Every swarm answer is spot-checked unless its requester turns checks off (`tessera generate
# --spot-check 0`): at each step, with probability 1/20, one hop of the route is recomputed by
# another peer holding its span. The checker's shadow session catches up every position since
# its previous check in one prefill-shaped step, so a check covers all the steps before it: a
# hop of a 3-hop route is checked at least once in a 128-token answer with probability
# 1 - (1 - 0.05 / 3) ** 128 = 88%, and a peer that lies on every step is caught within an
# answer or two — and then avoided by everyone its report reaches. The cost: about one
# prefill-shaped pass of the answer on a checker per hop checked (cheap beside decoding, which
# pays a round trip per token), and one session slot there while the answer runs. No closing
# check by default: it would recompute every unchecked position of every hop, a second full pass.
DEFAULT_SPOT_CHECKS = CheckPolicy(rate=0.05, final_check=False)
log = logging.getLogger(__name__)

PRECISION = {"float32": 3, "float16": 2, "bfloat16": 1}  # higher = more exact
# Why a span of the route went unchecked (`SpotChecker.unchecked`); see GroupSession.checkable.
GROUP_UNCHECKED = "a tensor-shard group: no one rank can be blamed for its output, and its ranks do not attest"
CHECK_WAIT = 5.0  # seconds to wait for the taps a check compares against
# Peers asked for a disputed span's weights (the fetch surveys each): those whose span overlaps
# it, the most overlap first; a swarm's holders of one span are a handful, and each costs a dial.
MAX_WEIGHT_HOLDERS = 16


@dataclass
class Shadow:
    """A checker's session over a span: positions [0, upto) are in its cache and compared."""

    session: RouteSession
    checker: str
    dtype: str
    upto: int = 0


@dataclass
class Verdict:
    """A mismatch judged: `guilty` the peer convicted first (None: nobody), `convicted` every
    peer convicted (both sides, when a recomputation finds both wrong), `undecided` why a
    dispute could not be decided (then both sides are avoided, unproven)."""

    guilty: str | None
    detail: dict = field(default_factory=dict)
    convicted: tuple[str, ...] = ()
    undecided: str | None = None


@dataclass(frozen=True)
class Conviction:
    """A peer proven to have returned wrong activations (reported and shared already, where a
    third peer witnessed it): what the checker hands the session that owns the answer, which
    bans it and repairs around it. `proven` False: one side of a dispute nobody could decide
    (`reason` says which, and why): avoided as disputed, never used unverified."""

    peer: str
    reason: str = "returned wrong activations"
    proven: bool = True


def peer_bytes(peer: str) -> bytes:
    return peer_id_bytes(peer)


class SpotChecker:
    """Checks one generation's peers (see module docstring)."""

    def __init__(self, swarm: SwarmPort, policy: CheckPolicy, *, max_length: int,
                 admits: Callable[[str], bool] = lambda peer: True) -> None:
        """`max_length`: the answer's capacity (a shadow session's); `admits`: whether the answer's
        policy lets a peer see its activations (read at every check: a revocation counts at once)."""
        self.swarm = swarm
        self.max_length = max_length
        self.admits = admits
        self.policy = policy
        self.rng = random.Random(policy.seed)
        self.shadows: dict[tuple[int, int, str], Shadow] = {}
        self.checks = 0
        self.rows_compared = 0
        self.fingerprint_bytes = 0
        self.verdicts: list[Verdict] = []
        self.unchecked: dict[tuple[int, int], str] = {}  # spans of the route no check can cover, and why

    # -- when to check --------------------------------------------------------------------

    def chains(self, run: RouteRun) -> list[Checkable]:
        """The checkable parts of the route `run` carries (its runs of plain hops); the spans of
        the others (tensor-shard groups) are recorded in `unchecked`."""
        chains = []
        for segment in run.segments:
            chain = segment.checkable()
            if chain is None:
                self.unchecked[segment.span] = GROUP_UNCHECKED
            else:
                chains.append(chain)
        return chains

    async def after_step(self, run: RouteRun, end_pos: int) -> list[Conviction]:
        """With probability `rate`, check one hop of `run` — one that some other peer can check.
        Returns the peers the check convicted (none, one, or both sides of a dispute)."""
        if self.rng.random() >= self.policy.rate:
            return []
        hops = [(chain, hop) for chain in self.chains(run) for hop in chain.hops]
        self.rng.shuffle(hops)
        for chain, hop in hops:
            checked, convicted = await self.check(chain, hop, end_pos)
            if checked:
                return convicted
        return []

    async def final(self, run: RouteRun, end_pos: int) -> list[Conviction]:
        """Compare what no check has covered yet, hop by hop (at the session's end), until a
        check convicts a peer (returned: the caller repairs, then asks again)."""
        if end_pos == 0:
            return []
        for chain, hop in [(chain, hop) for chain in self.chains(run) for hop in list(chain.hops)]:
            if not any(k[0] == hop.hop.start and k[1] == hop.hop.end and s.upto >= end_pos for k, s in self.shadows.items()):
                _, convicted = await self.check(chain, hop, end_pos)
                if convicted:
                    return convicted
        return []

    # -- checking -------------------------------------------------------------------------

    def view_dtype(self, peer: str) -> str:
        info = self.swarm.keeper.snapshot().get(peer)
        return info.dtype if info else "float32"

    def candidates(self, view: SwarmView, start: int, end: int, suspect: str, *,
                   exclude: set[str] = frozenset()) -> list[PeerInfo]:
        """Peers that could check `suspect` over [start, end): each holds the whole span (its
        attestation then covers exactly the suspect's), at the suspect's precision or better."""
        want = PRECISION.get(self.view_dtype(suspect), 1)
        suspect_info = view.get(suspect)
        # a quantized span is checked only by peers holding the same integers (same model id):
        # a float checker's honest difference from it is the quantization error, not roundoff
        model = suspect_info.model_id if suspect_info else self.swarm.model_id
        banned = set(self.swarm.bans.banned(self.swarm.clock()))
        return [
            p for p in view.peers
            if p.routable and p.shard_count == 1 and p.start <= start and end <= p.end
            and p.peer_id not in {suspect, *exclude, *banned} and PRECISION.get(p.dtype, 1) >= want
            and self.admits(p.peer_id)  # a checker sees the activations too
            and p.model_id == model
        ]

    def checkable_now(self, hop: HopState) -> bool:
        """Whether a check of `hop` could run now: a shadow over its span, or a peer to open one on
        (no wait for taps, no session opened, where no other peer serves the span: checks are on
        by default, and most spans of a small swarm have no second peer)."""
        start, end = hop.hop.start, hop.hop.end
        if any(key[:2] == (start, end) and shadow.checker != hop.peer for key, shadow in self.shadows.items()):
            return True
        return bool(self.candidates(self.swarm.view(), start, end, hop.peer))

    async def shadow_for(self, start: int, end: int, suspect: str, *, exclude: set[str] = frozenset()) -> Shadow | None:
        """A checker session over [start, end): a route avoiding the suspect, at its precision or better."""
        for key, shadow in self.shadows.items():
            if key[:2] == (start, end) and shadow.checker not in exclude | {suspect}:
                return shadow
        view = self.swarm.view()
        candidates = self.candidates(view, start, end, suspect, exclude=exclude)
        if not candidates:
            return None
        me = view.get(self.swarm.peer_id)
        chosen = route(SwarmView.of(view.num_layers, [*candidates, *([me] if me else [])]),
                       start=start, end=end, source=self.swarm.peer_id)
        if not chosen.ok:
            return None
        session = RouteSession(self.swarm.ctx, chosen, max_length=self.max_length, keep_history=False)
        try:
            await session.open()
        except PeerError:
            return None
        checker = chosen.hops[-1].peer_id
        shadow = Shadow(session, checker, self.view_dtype(checker))
        self.shadows[(start, end, checker)] = shadow
        return shadow

    async def recompute(self, shadow: Shadow, inputs: torch.Tensor, start_pos: int, *, reply: int):
        """Send rows at [start_pos, start_pos + T) to the checker (its cache rolls back there)."""
        first = shadow.session.hops[0]
        step, slot = await shadow.session.send(first, inputs, start_pos, stop_layer=self.swarm.spec.num_layers, reply=reply)
        out = await shadow.session.wait(step, slot, inputs.shape[0], start_pos)
        shadow.upto = start_pos + inputs.shape[0]
        if reply == REPLY_FINGERPRINT:
            self.fingerprint_bytes += len(out)
        return step, out

    async def check(self, session: Checkable, hop: HopState, end_pos: int) -> tuple[bool, list[Conviction]]:
        """Compare `hop`'s outputs up to `end_pos` with a checker's: (whether it could be checked,
        the peer convicted). `session`: the chain of plain hops `hop` belongs to (its history
        holds both ends)."""
        start, end = hop.hop.start, hop.hop.end
        if not self.checkable_now(hop):
            return False, []  # no independent peer serves this span now
        if not (await session.wait_known(start, end_pos) and await session.wait_known(end, end_pos)):
            return False, []  # the taps to compare with never came; the failover machinery deals with that peer
        shadow = await self.shadow_for(start, end, hop.peer)
        if shadow is None:
            return False, []  # no independent peer serves this span now
        self.checks += 1
        begin = min(shadow.upto, end_pos)
        inputs = session.history.at(start).upto(end_pos)
        try:
            _, theirs = await self.recompute(shadow, inputs[begin:end_pos], begin, reply=REPLY_FINGERPRINT)
        except PeerFailed as failure:
            self.swarm.ctx.tracer.emit(events.Error(remote=failure.peer, check="checker failed", reason=failure.reason[:200]))
            self.shadows.pop((start, end, shadow.checker), None)
            return False, []
        ours = fingerprint_bytes(session.history.at(end).upto(end_pos)[begin:end_pos])
        tol = tolerance(self.view_dtype(hop.peer), shadow.dtype, end - start)
        agree = rows_agree(theirs, ours, tol)
        self.rows_compared += int(agree.numel())
        if bool(agree.all()):
            return True, []
        first_bad = begin + int((~agree).nonzero()[0])
        verdict = await self.investigate(session, start, end, first_bad, end_pos, shadow, tol)
        if verdict is None:
            return True, []
        if verdict.undecided is not None:
            return True, [Conviction(peer, verdict.undecided, proven=False) for peer in verdict.detail["disputed"]]
        return True, [Conviction(peer) for peer in verdict.convicted]

    # -- a mismatch -----------------------------------------------------------------------

    def producer(self, session: Checkable, end: int, position: int) -> AttestedStep | None:
        """The latest attested step whose output at layer `end` covers `position`."""
        steps = [a for h in session.hops for a in h.attested] + session.retired_attestations
        covering = [a for a in steps if a.end == end and a.start_pos <= position < a.start_pos + a.n_tokens]
        return covering[-1] if covering else None

    async def investigate(self, session: Checkable, start: int, end: int, position: int, end_pos: int,
                          shadow: Shadow, tol: float) -> Verdict | None:
        """Recompute a mismatch in full and, if it holds, put it to a third peer; the verdict
        (None: nothing to judge). A peer found guilty is reported and shared here; banning it
        and repairing around it is the caller's."""
        step = self.producer(session, end, position)
        if step is None or step.start != start:
            return None  # produced under an earlier route with other cuts; a later check of that span covers it
        rows = slice(step.start_pos, step.start_pos + step.n_tokens)
        inputs = session.history.at(start).upto(end_pos)[rows]
        accused_rows = session.history.at(end).upto(end_pos)[rows]
        await self.go_back(session, shadow, start, end, step.start_pos)
        checker_step, checker_rows = await self.recompute(shadow, inputs, step.start_pos, reply=REPLY_FULL)
        if bool(full_rows_agree(checker_rows, accused_rows, tol).all()):
            return None  # the fingerprints differed by an honest boundary swap
        tie = await self.shadow_for(start, end, step.peer, exclude={shadow.checker})
        detail = {"span": [start, end], "positions": [rows.start, rows.stop], "tolerance": tol,
                  "accused_vs_checker": float(row_differences(accused_rows, checker_rows).max())}
        if tie is None:
            # no third peer to break the tie: the requester recomputes the span itself (dispute.py)
            ruling = await self.settle(session, step, shadow, end_pos, accused_rows, checker_rows)
            verdict = self.ruled(ruling, detail)
        else:
            if tie.upto < step.start_pos:
                await self.recompute(tie, session.history.at(start).upto(step.start_pos)[tie.upto:], tie.upto,
                                     reply=REPLY_FINGERPRINT)
            await self.go_back(session, tie, start, end, step.start_pos)
            tie_step, tie_rows = await self.recompute(tie, inputs, step.start_pos, reply=REPLY_FULL)
            tie_tol = max(tol, tolerance(tie.dtype, shadow.dtype, end - start))
            with_checker = bool(full_rows_agree(tie_rows, checker_rows, tie_tol).all())
            with_accused = bool(full_rows_agree(tie_rows, accused_rows, tie_tol).all())
            guilty = step.peer if with_checker and not with_accused else shadow.checker if with_accused and not with_checker else None
            convicted = (guilty,) if guilty is not None else ()
            verdict = Verdict(guilty, {**detail, "decided": BY_TIE_BREAKER, "convicted": list(convicted),
                                       "tie_breaker": tie.checker, "tie_agrees_with_checker": with_checker,
                                       "tie_agrees_with_accused": with_accused}, convicted=convicted)
            if guilty is not None:
                await self.convict(session, guilty, step, inputs, {
                    step.peer: (accused_rows, step),
                    shadow.checker: (checker_rows, self.attested(shadow, checker_step)),
                    tie.checker: (tie_rows, self.attested(tie, tie_step)),
                })
        self.verdicts.append(verdict)
        for guilty in verdict.convicted:
            # what an operator looks for first: who, which layers, by how much, and how it was decided
            sided_with = shadow.checker if guilty == step.peer else step.peer
            how = (f"a tie-breaker, peer {verdict.detail['tie_breaker']}, sides against it and agrees with {sided_with}"
                   if verdict.detail["decided"] == BY_TIE_BREAKER
                   else f"decided by recomputing locally in {verdict.detail['duration']:.1f} s: this requester's own "
                        f"computation of those layers differs from its rows by up to "
                        f"{dict(verdict.detail['recomputed_vs'])[guilty]:.3g}")
            shared = "reported" if verdict.detail["decided"] == BY_TIE_BREAKER else "not reported (no third witness)"
            log.warning("spot check: peer %s returned wrong activations for layers [%d, %d) at positions [%d, %d) "
                        "(route peer %s and checker %s differ by up to %.3g, tolerance %.3g; %s): banned for %.0f h, %s",
                        guilty, start, end, rows.start, rows.stop, step.peer, shadow.checker,
                        detail["accused_vs_checker"], tol, how, GUILTY_BAN / 3600, shared)
        if verdict.undecided is not None:
            log.warning("spot check: %s; both are avoided, and the answer goes on without either or stops",
                        verdict.undecided)
        for peer in [*verdict.convicted, *verdict.detail.get("disputed", ())]:
            self.drop_shadows(peer)  # a convicted or disputed checker checks nothing more
        self.swarm.ctx.tracer.emit(events.Misbehaviour(session=session.session_id, remote=verdict.guilty, **verdict.detail))
        return verdict

    async def settle(self, session: Checkable, step: AttestedStep, shadow: Shadow, end_pos: int,
                     accused_rows: torch.Tensor, checker_rows: torch.Tensor) -> Ruling:
        """Decide a dispute between `step`'s peer and `shadow`'s checker by recomputing the span
        here (peer/request/dispute.py), the weights fetched from the peers that overlap it."""
        start, end = step.start, step.end
        stop = step.start_pos + step.n_tokens
        dispute = Dispute(step.peer, shadow.checker, start, end, step.start_pos, stop)
        log.info("spot check: %s and no third peer holds them: deciding by recomputing locally", dispute.words())
        view = self.swarm.keeper.snapshot()
        overlapping = sorted((p for p in view.peers if p.start < end and start < p.end and p.peer_id != self.swarm.peer_id),
                             key=lambda p: (-min(p.end, end) + max(p.start, start), p.peer_id))
        holders = {p.peer_id: tuple(self.swarm.keeper.addrs(p.peer_id)) for p in overlapping[:MAX_WEIGHT_HOLDERS]}
        return await settle(
            dispute, self.swarm.span_weights, transport=self.swarm.ctx.transport, holders=holders,
            model_id=self.swarm.model_id, inputs=session.history.at(start).upto(end_pos)[:stop],
            accused_rows=accused_rows, checker_rows=checker_rows,
            accused_tol=tolerance(self.view_dtype(step.peer), "float32", end - start),
            checker_tol=tolerance(shadow.dtype, "float32", end - start),
            budget=self.swarm.dispute_memory, hidden_size=self.swarm.spec.hidden_size)

    @staticmethod
    def ruled(ruling: Ruling, detail: dict) -> Verdict:
        """The verdict a local recomputation gave (`ruling`), with the mismatch's `detail`."""
        dispute = ruling.dispute
        if not ruling.settled:
            return Verdict(None, {**detail, "outcome": "undecided", "why": ruling.why,
                                  "disputed": [dispute.accused, dispute.checker]}, undecided=ruling.undecided_words())
        guilty = ruling.guilty[0] if ruling.guilty else None
        return Verdict(guilty, {**detail, "decided": ruling.decided, "convicted": list(ruling.guilty),
                                "recomputed_vs": [[p, d] for p, d in ruling.differences.items()],
                                "duration": round(ruling.seconds, 3)},
                       convicted=ruling.guilty)

    def drop_shadows(self, peer: str) -> None:
        """Stop checking with `peer`: its shadow sessions are closed (in the background)."""
        for key in [k for k, s in self.shadows.items() if s.checker == peer]:
            self.swarm.ctx.nursery.start_soon(self.shadows.pop(key).session.close, "checker avoided")

    async def go_back(self, session: Checkable, shadow: Shadow, start: int, end: int, position: int) -> None:
        """Ready `shadow` for a step written at `position`, behind what it holds. A KV cache goes back
        by itself (a write at p is a rollback to p); a span with a recurrent layer keeps its state only
        at its last steps (stages/layers/state.py), so the checker is fed the history [0, position)
        again from position 0 (which every state reaches), fingerprints only."""
        if position >= shadow.upto or position == 0 or self.swarm.spec.rolls_back_anywhere(start, end):
            return
        await self.recompute(shadow, session.history.at(start).upto(position), 0, reply=REPLY_FINGERPRINT)

    def attested(self, shadow: Shadow, step: int) -> AttestedStep | None:
        steps = [a for h in shadow.session.hops for a in h.attested if a.step == step and a.peer == shadow.checker]
        return steps[-1] if steps else None

    async def convict(self, session: Checkable, guilty: str, step: AttestedStep, inputs: torch.Tensor,
                      parties: dict[str, tuple[torch.Tensor, AttestedStep | None]]) -> None:
        """Report `guilty` with every party's attestation, and share the report."""
        report = self.build_report(guilty, step, inputs, parties, session)
        if report is not None:
            await self.swarm.publish_report(report)

    def build_report(self, guilty: str, step: AttestedStep, inputs: torch.Tensor,
                     parties: dict[str, tuple[torch.Tensor, AttestedStep | None]],
                     session: Checkable) -> MisbehaviourReport | None:
        witnesses = []
        for peer, (rows, attested) in parties.items():
            if attested is None or attested.inputs_hash != sha256(encode_tensor(inputs.contiguous())):
                return None  # a party's attestation is missing or for other inputs: no verifiable report
            encoded = encode_tensor(rows.contiguous())
            witnesses.append(Witness(peer_bytes(peer), attested_session(self, attested, session), attested.step,
                                     attested.outputs_hash, attested.attestation, fingerprint_bytes(rows),
                                     self.view_dtype(peer), encoded if len(encoded) <= MAX_ROWS else b""))
        accused = next(w for w in witnesses if w.peer_id == peer_bytes(guilty))
        body = ReportBody(
            reporter=self.swarm.ctx.identity.peer_id, model_id=self.swarm.model_id, start=step.start, end=step.end,
            start_pos=step.start_pos, n_tokens=step.n_tokens, inputs_hash=sha256(encode_tensor(inputs.contiguous())),
            accused=accused, witnesses=tuple(w for w in witnesses if w is not accused), issued_at=time.time(),
            reason="returned activations unlike two other peers'",
        )
        return sign_report(self.swarm.ctx.identity, body)

    async def close(self) -> None:
        for shadow in self.shadows.values():
            await shadow.session.close("check done")

    def summary(self) -> dict:
        return {"checks": self.checks, "rows_compared": self.rows_compared,
                "fingerprint_bytes": self.fingerprint_bytes,
                "verdicts": [{"guilty": v.guilty, **v.detail} for v in self.verdicts],
                "unchecked": [{"span": list(span), "why": why} for span, why in sorted(self.unchecked.items())]}


def attested_session(checker: SpotChecker, step: AttestedStep, chain: Checkable) -> bytes:
    """The session id an attested step belongs to (a shadow, or `chain`, the chain of the route
    that computed it: the session id its peer signed)."""
    for shadow in checker.shadows.values():
        if any(step in h.attested for h in shadow.session.hops):
            return shadow.session.session_id
    return chain.session_id


def judge_report(body: ReportBody) -> bool:
    """True when a (signature-verified) report holds: the accused's output differs from
    every witness's beyond their dtypes' tolerance, and the witnesses agree with each other.

    Full rows decide when every party carries them (and they must fingerprint to what
    each attested); otherwise fingerprints decide, counting only proven conflicts.
    """
    n_layers = body.end - body.start
    parties = [body.accused, *body.witnesses]
    if len(body.witnesses) < 2:
        return False

    def tol(a: Witness, b: Witness) -> float:
        return tolerance(a.dtype, b.dtype, n_layers)

    if all(p.output for p in parties):
        rows = {}
        for p in parties:
            rows[p.peer_id] = decode_tensor(p.output).float()
            if fingerprint_bytes(rows[p.peer_id]) != p.fingerprint:
                raise WireError("a party's rows do not match its attested fingerprint")

        def differ(a: Witness, b: Witness) -> bool:
            return not bool(full_rows_agree(rows[a.peer_id], rows[b.peer_id], tol(a, b)).all())
    else:
        def differ(a: Witness, b: Witness) -> bool:
            return bool(rows_conflict(a.fingerprint, b.fingerprint, tol(a, b)).any())

    w1, w2 = body.witnesses[:2]
    return all(differ(body.accused, w) for w in body.witnesses) and not differ(w1, w2)


__all__ = ["CheckPolicy", "Conviction", "DEFAULT_SPOT_CHECKS", "SpotChecker", "judge_report", "Verdict"]
