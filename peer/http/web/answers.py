"""The Chat page's view of its own answers: which route served each, kept briefly by a tag.

The Chat page streams from the OpenAI endpoint like any client; the route an answer
took is known only when its swarm session ends (`Swarm.generate_ids` fills the
generation's `info`). The page sends a random tag in the `x-tessera-answer` header;
the gateway tells the web view of every answer as it ends (`Gateway.observers`), and
the page fetches `GET /web/api/answer?tag=...` once its stream is over. That fetch may
arrive before the gateway has finished closing the answer: it waits (on an event, up
to `ANSWER_WAIT` seconds) rather than missing it.
"""

from __future__ import annotations

import collections
import re

import trio

TAG_HEADER = b"x-tessera-answer"
KEPT_ANSWERS = 256  # tags remembered (a page asks right after its stream ends)
ANSWER_WAIT = 10.0  # seconds a lookup waits for its answer to end; past the end of any stream by far
TAG = re.compile(r"[A-Za-z0-9_-]{8,64}")


def valid_tag(tag: str | None) -> bool:
    return tag is not None and TAG.fullmatch(tag) is not None


def summarize(info: dict, *, prompt_tokens: int, completion_tokens: int, finish_reason: str | None,
              outcome: str) -> dict:
    """One answer as the Chat page shows it: the route (and every earlier one, after failovers)
    as hops {peer, start, end}, the token counts and how it ended."""
    return {"route": list(info.get("route") or []), "routes": list(info.get("routes") or []),
            "failovers": int(info.get("failovers") or 0), "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "finish_reason": finish_reason, "outcome": outcome}


class AnswerBook:
    """The last KEPT_ANSWERS answers' summaries by tag."""

    def __init__(self) -> None:
        self.answers: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._ended: dict[str, trio.Event] = {}

    def record(self, tag: str, summary: dict) -> None:
        self.answers[tag] = summary
        self.answers.move_to_end(tag)
        while len(self.answers) > KEPT_ANSWERS:
            self.answers.popitem(last=False)
        event = self._ended.pop(tag, None)
        if event is not None:
            event.set()

    async def get(self, tag: str, *, wait: float = ANSWER_WAIT) -> dict | None:
        """The answer tagged `tag`, waiting up to `wait` s for it to end; None if it does not."""
        if tag not in self.answers:
            event = self._ended.setdefault(tag, trio.Event())
            with trio.move_on_after(wait):
                await event.wait()
            if self._ended.get(tag) is event and not event.is_set():
                del self._ended[tag]  # nobody will set it: forget the waiter
        return self.answers.get(tag)
