"""`tessera generate --join ...`: a requester on the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

import trio

from stages.generate import GenerationResult, prompt_ids
from stages.sampling import SamplingParams
from stages.tokenizer import TextStream

from .cli_generate import apply_threads
from .cli_peer import read_swarm_key
from .client import Swarm


async def generate_through_swarm(args: argparse.Namespace, sampling: SamplingParams) -> GenerationResult:
    async with Swarm.join(args.join, model=args.model, swarm_key=read_swarm_key(getattr(args, "swarm_key", None))) as swarm:
        ids = prompt_ids(swarm.tokenizer, args.prompt, raw=args.raw)
        stream = TextStream(swarm.tokenizer)
        info: dict = {}
        tokens = []
        started = time.perf_counter()
        async for token in swarm.generate_ids(ids, max_new_tokens=args.max_tokens, sampling=sampling, info=info):
            tokens.append(token)
            if not args.json:
                sys.stdout.write(stream.push(token))
                sys.stdout.flush()
        seconds = time.perf_counter() - started
        if not args.json:
            sys.stdout.write(stream.flush() + "\n")
            hops = " -> ".join(f"{h['peer'][-8:]}[{h['start']},{h['end']})" for h in info.get("route", []))
            print(f"route: requester -> {hops} -> requester", file=sys.stderr)
        return GenerationResult(swarm.tokenizer.decode(tokens), tokens, len(ids), seconds, extra=info)


def run_swarm_generate(args: argparse.Namespace, sampling: SamplingParams) -> int:
    apply_threads(args.threads)
    result = trio.run(generate_through_swarm, args, sampling)
    if args.json:
        print(json.dumps(result.as_json()))
    return 0
