"""`tessera generate --json`: the answer as JSON lines on stdout, streamed as it is generated.

    {"piece": "The", "token": 504}
    {"piece": " capital", "token": 3575}
    …
    {"text": "The capital of France is Paris.", "tokens": […], …, "done": true}

One object per token as it arrives, then one for the whole answer, with `"done": true`, which
holds what `--json` printed alone before (text, tokens, timing and, through a swarm, the route):
a script that wants only the whole answer reads the last line. Used by the local path
(peer/cli/generate.py) and the swarm's (peer/cli/swarm_generate.py).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.stages.decoding.generate import GenerationResult
    from tessera.stages.text.tokenizer import Tokenizer


class JsonLines:
    """`--json`: the answer as JSON lines on stdout, one per token as it comes, then the whole
    (see the module docstring). A piece's text may be empty: a token that ends inside a
    multi-byte character shows with the next. After a rewind (a spot check caught a peer and
    the answer is computed again from token N), one `{"rewind": N}` line: the pieces after
    the N-th are void, and the ones that follow replace them."""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        from tessera.stages.text.tokenizer import TextStream  # imports tokenizers: only when a command runs

        self.tokenizer = tokenizer
        self.stream = TextStream(tokenizer)

    def token(self, token: int) -> None:
        self._line({"piece": self.stream.push(token), "token": token})

    def rewind(self, kept: list[int]) -> None:
        from tessera.stages.text.tokenizer import TextStream

        self._line({"rewind": len(kept)})
        self.stream = TextStream(self.tokenizer)
        for token in kept:
            self.stream.push(token)
        self.stream.flush()

    def done(self, result: "GenerationResult") -> None:
        tail = self.stream.flush()
        if tail:
            self._line({"piece": tail})
        self._line({**result.as_json(), "done": True})

    @staticmethod
    def _line(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
