"""One HTTP request's answer: tokens from the swarm turned into text, stop strings applied.

`Generation` drives one answer (`Swarm.answer_ids`) a token at a time and hands
back text deltas. An answer rewound after a peer was caught returning wrong
activations goes on from the last right token: the whole text (`text()`) is the
corrected one; a stream, which cannot take back what it sent, goes on with a
newline and the corrected text so far (as `tessera generate` prints it). Stop strings are matched on the text, not on
tokens: a stop string may span several tokens, and a token may hold a stop
string's start, so the tail of the text that could still become a stop string
is held back until the next token settles it (`StopMatcher`). When a stop
string appears, the text is cut before it and the swarm session is closed at
once — the peers free their caches instead of computing tokens nobody reads.

The OpenAI response shapes (`chat_object`, `completion_object`, `chunk`) are
built here too, so that the streamed and the whole answers cannot drift apart.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Sequence

import trio

from tessera.stages.decoding.constrained import JsonConstraint
from tessera.stages.decoding.sampling import SamplingParams
from tessera.stages.text.tokenizer import TextStream

from tessera.peer.http.defaults import DEFAULT_ROUTE_WAIT

if TYPE_CHECKING:
    from tessera.peer.request.answer import Rewind
    from tessera.peer.request.client import Swarm
    from tessera.peer.request.policy import RequesterPolicy

STOP = "stop"  # finish_reason: end-of-sequence token or a stop string
LENGTH = "length"  # finish_reason: max_tokens (or the context) reached


class StopMatcher:
    """Cuts a growing text at the first stop string, holding back what could start one.

    >>> m = StopMatcher(("\\n\\n",))
    >>> m.push("Paris.\\n"), m.push("\\nNext")
    (('Paris.', False), ('', True))
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""
        self.matched: str | None = None  # the stop string found

    def push(self, delta: str) -> tuple[str, bool]:
        """(text that is safe to emit, whether a stop string ended the answer)."""
        text = self.held + delta
        found = [(i, s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            at, self.matched = min(found, key=lambda f: f[0])
            return text[:at], True
        keep = self._partial_stop(text)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """What is held back, once no more text will come."""
        out, self.held = self.held, ""
        return out

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that is the start of a stop string."""
        longest = max((len(s) for s in self.stops), default=0)
        for k in range(min(len(text), longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


@dataclass
class Generation:
    """One request's session on the swarm; `step()` returns text deltas until None.

    Call `start()` first: it opens the session (routing, every hop) and computes
    the first token, so that "no route" is known before any HTTP header is sent.
    Always `close()` (idempotent): it ends the swarm session, early or not.
    """

    swarm: "Swarm"
    ids: Sequence[int]
    max_tokens: int
    sampling: SamplingParams
    stop: Sequence[str] = ()
    route_wait: float = DEFAULT_ROUTE_WAIT
    busy_wait: float = 0.0  # past route_wait, how long its open queues while only busy peers block it
    completion_tokens: int = 0
    finish_reason: str | None = None
    info: dict = field(default_factory=dict)
    constraint: JsonConstraint | None = None  # response_format: the mask over the next token
    policy: "RequesterPolicy | None" = None  # who may compute it, within the gateway's own policy

    def __post_init__(self) -> None:
        self._tokens: AsyncIterator["int | Rewind"] = self.swarm.answer_ids(
            self.ids, max_new_tokens=self.max_tokens, sampling=self.sampling, route_wait=self.route_wait,
            busy_wait=self.busy_wait,
            info=self.info, constraint=self.constraint, policy=self.policy,
        )
        self._text = TextStream(self.swarm.tokenizer)
        self._stops = StopMatcher(self.stop)
        self.stop_sequence: str | None = None  # the stop string that ended the answer (Anthropic reports it)
        self._next: "int | Rewind | None" = None
        self._given: list[int] = []  # the answer's tokens so far
        self.emitted = ""  # the text handed out so far, as it stands (a rewind resets it)
        self.rewinds = 0
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def start(self) -> None:
        """Open the session and compute the first token. Raises NoRoute, PeerError."""
        self._next = await self._tokens.__anext__()

    async def step(self) -> str | None:
        """The next text delta ("" while a character or a possible stop string is incomplete),
        or None once the answer is over (then `finish_reason` is set and the session closed)."""
        if self.finish_reason is not None:
            return None
        assert self._next is not None, "start() first"
        item, self._next = self._next, None
        if not isinstance(item, int):  # a Rewind
            self._next = await self._tokens.__anext__()
            return self._rewind(item.kept)
        token = item
        self._given.append(token)
        self.completion_tokens += 1
        delta, stopped = self._stops.push(self._text.push(token))
        self.emitted += delta
        if stopped:
            self.stop_sequence = self._stops.matched
            return await self._finish(STOP, delta)
        if token in self.swarm.spec.eos_token_ids:
            return await self._finish(STOP, delta + self._tail())
        if self.completion_tokens >= self.max_tokens:
            return await self._finish(LENGTH, delta + self._tail())
        self._next = await self._tokens.__anext__()
        return delta

    def _rewind(self, kept: int) -> str:
        """Only the first `kept` tokens stand: the text is rebuilt from them (held-back text
        held back again), and what a stream is handed is a newline and that text."""
        self.rewinds += 1
        del self._given[kept:]
        self.completion_tokens = kept
        self._text, self._stops = TextStream(self.swarm.tokenizer), StopMatcher(self.stop)
        self.emitted = "".join(self._stops.push(self._text.push(t))[0] for t in self._given)
        return "\n" + self.emitted

    def _tail(self) -> str:
        delta, stopped = self._stops.push(self._text.flush())
        if stopped:
            self.stop_sequence = self._stops.matched
        tail = delta if stopped else delta + self._stops.flush()
        self.emitted += tail
        return tail

    async def _finish(self, reason: str, delta: str) -> str:
        self.finish_reason = reason
        await self.close()
        return delta

    async def text(self) -> str:
        """The whole answer (for a non-streaming response): after a rewind, the corrected one."""
        await self.start()
        parts = []
        while (delta := await self.step()) is not None:
            parts.append(delta)
        return self.emitted

    async def close(self) -> None:
        """End the swarm session (now, if the answer is not over). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):  # a cancelled request must still release its peers
            await self._tokens.aclose()


# -- OpenAI's response shapes ------------------------------------------------------------


@dataclass(frozen=True)
class Envelope:
    """What every object and chunk of one response shares."""

    id: str
    created: int
    model: str
    fingerprint: str

    @staticmethod
    def new(prefix: str, model: str, fingerprint: str) -> "Envelope":
        return Envelope(f"{prefix}-{secrets.token_hex(12)}", int(time.time()), model, fingerprint)

    def head(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}


def chat_object(env: Envelope, text: str, gen: Generation) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
              "logprobs": None, "finish_reason": gen.finish_reason}
    return {**env.head("chat.completion"), "choices": [choice], "usage": gen.usage}


def completion_object(env: Envelope, text: str, gen: Generation) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason}
    return {**env.head("text_completion"), "choices": [choice], "usage": gen.usage}


def chat_chunk(env: Envelope, delta: dict, finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {**env.head("chat.completion.chunk"), "choices": [choice]}


def completion_chunk(env: Envelope, text: str, finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**env.head("text_completion"), "choices": [choice]}


def usage_chunk(env: Envelope, object: str, gen: Generation) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    return {**env.head(object), "choices": [], "usage": gen.usage}
