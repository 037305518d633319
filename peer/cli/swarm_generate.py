"""`tessera generate --join ...`: a requester on the command line."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import trio

from tessera.stages.decoding.generate import GenerationResult, prompt_ids
from tessera.stages.decoding.sampling import SamplingParams
from tessera.stages.text.tokenizer import TextStream
from tessera.store.trace import TraceWriter

from tessera.peer.cli.json_lines import JsonLines
from tessera.peer.cli.options import apply_threads, quant_from, read_swarm_key, span_weights_from
from tessera.stages.decoding.sampling import Sampler
from tessera.stages.decoding.mtp import MtpDrafter
from tessera.stages.decoding.speculative import AdaptiveK, ModelDrafter, NgramDrafter
from tessera.stages.assembly.mtp import load_mtp
from tessera.stages.assembly.stage import load_stage
from tessera.stages.families.catalog import mtp_of, spec_from_file, tensors_of_layer
from tessera.stages.weights.tensor_table import group_of

from tessera.peer.request.answer import Rewind
from tessera.peer.request.client import Swarm
from tessera.peer.net.emulated import LinkEmulation
from tessera.peer.base.errors import ConfigError
from tessera.peer.request.decode import Speculation
from tessera.peer.weights.bootstrap import REQUESTER_GROUPS, ensure_model


def speculation_from(spec: str, k: int, pipeline: bool, swarm: Swarm, sampling: SamplingParams, capacity: int) -> Speculation | None:
    """--speculate none | ngram | mtp | self:N -> a Speculation (or None). `mtp` reads the model's own
    multi-token-prediction module here, beside the head (UnsupportedModel in one line for a model that has
    none; ModelFormatError for a folder without its tensors)."""
    if spec == "none":
        return None
    draws = None if sampling.greedy else Sampler(sampling)  # a drafter's own stream: q, as the verifier knows it
    if spec == "ngram":
        drafter = NgramDrafter()
    elif spec == "mtp":
        drafter = MtpDrafter(load_mtp(swarm.folder, swarm.head), capacity=capacity, sampler=draws)
    elif spec.startswith("self:") and spec[5:].isdigit() and 0 < int(spec[5:]) < swarm.spec.num_layers:
        stage = load_stage(swarm.folder, start=0, end=int(spec[5:]), embed=True, head=True)
        drafter = ModelDrafter(stage, capacity=capacity, sampler=draws)
    else:
        raise ConfigError(f"--speculate wants none, ngram, mtp or self:N (0 < N < {swarm.spec.num_layers}), got {spec!r}")
    return Speculation(drafter, k=AdaptiveK(k), pipeline=pipeline)


def mtp_groups(folder) -> frozenset[str]:
    """The weight groups (stages/weights/tensor_table.py) of the model's first MTP module: what a requester
    without the model's files fetches from the swarm beside its embedding and head for `--speculate mtp`."""
    mtp = mtp_of(spec_from_file(folder / "config.json"))
    names = [*mtp.tensors(), *(name for choices in tensors_of_layer(mtp.blocks, mtp.layer).values()
                               for name in choices[0].names)]
    return frozenset(group_of(name) for name in names)


async def generate_through_swarm(args: argparse.Namespace, sampling: SamplingParams) -> GenerationResult:
    emulation = LinkEmulation.parse(args.emulate_link) if args.emulate_link else None
    swarm_key = read_swarm_key(args.swarm_key)
    # without the model here: its embedding, head and tokenizer from the --join peers (peer/weights/)
    folder = await ensure_model(args.model, args.join, swarm_key=swarm_key, groups=REQUESTER_GROUPS,
                                out=lambda line: print(line, file=sys.stderr, flush=True))
    if args.speculate == "mtp":  # and the model's MTP module, which drafts beside the head
        folder = await ensure_model(args.model, args.join, swarm_key=swarm_key, groups=mtp_groups(folder),
                                    out=lambda line: print(line, file=sys.stderr, flush=True))
    with contextlib.ExitStack() as stack:
        # the requester's own trace (--record-trace): the id it records is bound as it joins
        tracer = stack.enter_context(TraceWriter(args.record_trace)) if args.record_trace else None
        return await _generate(args, sampling, folder, swarm_key, emulation, tracer)


async def _generate(args: argparse.Namespace, sampling: SamplingParams, folder, swarm_key, emulation,
                    tracer: TraceWriter | None) -> GenerationResult:
    span_weights, dispute_memory = span_weights_from(args, folder)
    async with Swarm.join(args.join, model=folder, swarm_key=swarm_key, tracer=tracer,
                          emulate_link=emulation, policy=args.policy, quant=quant_from(args),
                          accept_mixed=args.accept_mixed, dedicated=not args.no_dedicated,
                          compile=args.compile, spot_check=args.checks,
                          wire=args.wire, span_weights=span_weights, dispute_memory=dispute_memory) as swarm:
        swarm.on_route_wait = lambda line: print(line, file=sys.stderr, flush=True)
        ids = prompt_ids(swarm.tokenizer, args.prompt, raw=args.raw)
        speculation = speculation_from(args.speculate, args.draft_k, not args.no_pipeline, swarm, sampling,
                                       len(ids) + args.max_tokens + 64)
        stream = TextStream(swarm.tokenizer)
        lines = JsonLines(swarm.tokenizer) if args.json else None  # --json: JSON lines as it streams
        info: dict = {}
        tokens: list[int] = []
        started = time.perf_counter()
        answer = swarm.answer_ids(ids, max_new_tokens=args.max_tokens, sampling=sampling, speculation=speculation,
                                  info=info, route_wait=args.route_wait)
        try:
            async for item in answer:
                if isinstance(item, Rewind):
                    # a spot check caught a peer after tokens computed from its activations were
                    # printed: the answer goes on from the last right one, printed afresh below
                    del tokens[item.kept :]
                    print(f"\n[a peer was caught returning wrong activations: the answer after token {len(tokens)} "
                          "is computed again]", file=sys.stderr, flush=True)
                    if lines is not None:
                        lines.rewind(tokens)
                    else:
                        stream = TextStream(swarm.tokenizer)
                        sys.stdout.write("\n" + "".join(stream.push(t) for t in tokens))
                        sys.stdout.flush()
                    continue
                tokens.append(item)
                if lines is not None:
                    lines.token(item)
                else:
                    sys.stdout.write(stream.push(item))
                    sys.stdout.flush()
        finally:
            await answer.aclose()
        seconds = time.perf_counter() - started
        if not args.json:
            sys.stdout.write(stream.flush() + "\n")
            hops = " -> ".join(f"{h['peer'][-8:]}[{h['start']},{h['end']})" for h in info.get("route", []))
            print(f"route: requester -> {hops} -> requester", file=sys.stderr)
        result = GenerationResult(swarm.tokenizer.decode(tokens), tokens, len(ids), seconds, extra=info)
        if lines is not None:
            lines.done(result)
        return result


def run_swarm_generate(args: argparse.Namespace, sampling: SamplingParams) -> int:
    apply_threads(args.threads)
    trio.run(generate_through_swarm, args, sampling)
    return 0
