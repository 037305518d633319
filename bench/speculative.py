"""How many drafts of the model's own MTP module are accepted, on the tiny models the tests build.

For each family whose MTP layers `--speculate mtp` drafts with (Qwen3.5-MoE, DeepSeek-V3, GLM-4.5,
GLM-5), a tiny random model as the tests build it (transformers' config, seeded weights, one MTP
module written into its checkpoint: tests/stages/mtp_helpers.py) answers one prompt greedily,
decoded locally as the requester decodes through a swarm (peer/request/decode.py over a local
chain, K pinned so that every block drafts) with the MTP module drafting, and with n-gram drafts
beside it; both answers are checked equal to the plain local answer. Printed per model, then in
the issue's form as the last lines, one per model:

    mtp: qwen3_5_moe: accepted 0 of 48 drafted

Random weights: the module was never trained to agree with the model, so it guesses the token
after next about as well as a uniform draw over the vocabulary (1 in 320) would: expect ~0.
A trained checkpoint's MTP module is what makes the figure worth having (DeepSeek-V3 reports
85-90% for its second token); these figures say only that the drafts run and are verified.

    .venv/bin/python bench/speculative.py [--tokens 48] [--k 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tiny models are the tests' (tests/stages/)

import transformers  # noqa: E402  (the tiny models' builder, as in the tests)

from tessera.peer.request.decode import Speculation, speculative_tokens  # noqa: E402
from tessera.stages.assembly.mtp import load_mtp  # noqa: E402
from tessera.stages.assembly.stage import load_stage  # noqa: E402
from tessera.stages.decoding.generate import LocalEngine  # noqa: E402
from tessera.stages.decoding.mtp import MtpDrafter  # noqa: E402
from tessera.stages.decoding.sampling import Sampler, SamplingParams  # noqa: E402
from tessera.stages.decoding.speculative import AdaptiveK, NgramDrafter  # noqa: E402
from tests.request.test_speculation import LocalChain  # noqa: E402
from tests.stages.families.conformance import build  # noqa: E402
from tests.stages.families.rows import ROWS  # noqa: E402
from tests.stages.mtp_helpers import add_mtp  # noqa: E402
from tests.stages.test_mtp import HYBRID_MOE, PROMPT  # noqa: E402

MODELS = {  # family -> (its transformers config, seed)
    "qwen3_5_moe": (lambda: transformers.Qwen3_5MoeTextConfig(**HYBRID_MOE), 71),
    "deepseek_v3": (ROWS["deepseek_v3/lora-groups-shared-yarn"].config, 30),
    "glm4_moe": (ROWS["glm4_moe/qknorm-bias-groups-shared"].config, 50),
    "glm_moe_dsa": (ROWS["glm_moe_dsa/shared-groups-yarn"].config, 70),
}


async def drafted(folder: Path, tokens: int, k: int, kind: str) -> tuple[list[int], Speculation]:
    stage = load_stage(folder, embed=True, head=True)

    async def embed(t):
        return stage.embed(list(t))

    async def head(h):
        return stage.logits(h)

    drafter = MtpDrafter(load_mtp(folder, stage), capacity=256) if kind == "mtp" else NgramDrafter()
    spec = Speculation(drafter, k=AdaptiveK(k, backoff_after=10**9), pipeline=True)
    out = [t async for t in speculative_tokens(LocalChain(stage), embed, head, PROMPT, tokens, Sampler(SamplingParams()),
                                               (), spec)]
    return out, spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=3, help="drafts per block (pinned: every block drafts)")
    args = parser.parse_args()
    lines = []
    with tempfile.TemporaryDirectory() as root:
        for family, (config, seed) in MODELS.items():
            folder = add_mtp(build(Path(root), family, config(), seed=seed), seed=seed + 1000)
            plain = LocalEngine(folder, device="cpu", dtype="float32").generate_ids(PROMPT, max_new_tokens=args.tokens)
            figures = {}
            for kind in ("mtp", "ngram"):
                got, spec = trio.run(drafted, folder, len(plain), args.k, kind)
                assert got == plain, f"{family} {kind}: the drafted answer differs from the plain one"
                figures[kind] = spec
                passes = spec.blocks - spec.cancelled  # the first token is the prompt's pass's, not a block's
                print(f"{family} {kind}: {len(got) - 1} tokens after the first in {passes} verification passes "
                      f"({(len(got) - 1) / max(passes, 1):.2f} a pass; plain decoding 1.00), "
                      f"accepted {spec.accepted} of {spec.proposed} drafted", flush=True)
            mtp = figures["mtp"]
            lines.append(f"mtp: {family}: accepted {mtp.accepted} of {mtp.proposed} drafted")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
