"""What the wire costs per hop, next to what one decoder layer costs to compute.

For hidden sizes 576 (SmolLM2-135M), 2048 (~1B) and 8192 (~70B), and steps of 1
token (decode) and 128 tokens (a prefill chunk or a block of drafts), it times the
full per-hop path of a float32 hidden-state tensor [T, H]:

    send:    encode_tensor -> XChaCha20-Poly1305 seal -> Forward message -> frame
    receive: frame decoder -> decode Forward -> open (authenticate, decrypt) -> decode_tensor

and reports both directions in MB/s of tensor data. In the same run it times one
Llama decoder layer (`tessera.stages.layers.block.Block`: GQA attention with n_kv = n_heads / 2,
SwiGLU MLP of width 2.75 H, float32, random weights) on the same T tokens after a
128-position KV history, with 1 and with 2 threads, and prints the ratio

    (send + receive time) / (one layer's compute time)

last. A hop carries a whole span of layers, so the ratio to ONE layer is the
pessimistic figure; the goal is <= 3% at hidden 2048.

    .venv/bin/python bench/wire.py [--min-time 1.0] [--hidden 576 2048 8192]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from tessera.protocol.activations import open_activations, seal_activations
from tessera.protocol.codec import decode, encode
from tessera.protocol.framing import FrameDecoder, encode_frame
from tessera.protocol.links import Direction, LinkCipher
from tessera.protocol.messages import Forward
from tessera.stages.families.models.llama import llama_spec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.layers.attention import StepContext
from tessera.stages.layers.block import Block
from tessera.stages.layers.cache import SessionCache
from tessera.stages.layers.rope import Rotary

HISTORY = 128  # KV positions already cached before the timed step
SHAPES = {576: (9, 3, 1536), 2048: (16, 8, 5632), 8192: (64, 32, 22528)}  # heads, kv heads, MLP width


def spec_for(hidden: int) -> ModelSpec:
    heads, kv_heads, width = SHAPES.get(hidden, (hidden // 128, hidden // 256, round(2.75 * hidden / 64) * 64))
    return llama_spec(
        vocab_size=32000, hidden_size=hidden, intermediate_size=width, num_layers=1,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
    )


def median_time(fn: Callable[[], object], *, min_time: float, min_reps: int = 3) -> float:
    fn()  # warm-up
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - started < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wire_times(hidden: torch.Tensor, *, min_time: float) -> tuple[float, float]:
    """Median seconds for one send and one receive of `hidden`, over fresh ciphers."""
    key, session = os.urandom(32), os.urandom(16)
    sender = LinkCipher(key, session_id=session, link_id=1, direction=Direction.FORWARD)
    receiver = LinkCipher(key, session_id=session, link_id=1, direction=Direction.FORWARD)
    decoder = FrameDecoder()
    t = hidden.shape[0]
    step = 0
    frames: list[bytes] = []

    def send() -> None:
        nonlocal step
        step += 1
        template = Forward(session_id=session, step=step, link_id=1, counter=0, start_pos=HISTORY,
                           n_tokens=t, stop_layer=30, payload=b"")
        frames.append(encode_frame(encode(seal_activations(sender, template, hidden))))

    def receive() -> torch.Tensor:
        (payload,) = decoder.feed(frames.pop(0))
        return open_activations(receiver, decode(payload, expect=Forward))

    send()
    assert torch.equal(receive(), hidden), "the wire changed the tensor"
    send_s = median_time(send, min_time=min_time / 2)
    # receive exactly the frames that were sent, in order
    pending = len(frames)
    recv_times = []
    for _ in range(pending):
        t0 = time.perf_counter()
        receive()
        recv_times.append(time.perf_counter() - t0)
    return send_s, statistics.median(recv_times)


def layer_time(spec: ModelSpec, tokens: int, *, threads: int, min_time: float) -> float:
    torch.set_num_threads(threads)
    layer = spec.layers[0]
    with torch.device("meta"):
        block = Block(spec, layer)
    block = block.to_empty(device="cpu").train(False)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                bound = 1.0 / math.sqrt(p.shape[-1])
                p.uniform_(-bound, bound)
    cache = SessionCache([layer.cache], HISTORY + tokens)
    cache.reserve(0, HISTORY + tokens)
    cache.layers[0].keys.normal_()
    cache.layers[0].values.normal_()
    positions = torch.arange(HISTORY, HISTORY + tokens)
    rope = (layer.attention.rope, layer.attention.rope_dim)
    ctx = StepContext(HISTORY, {rope: Rotary(*rope).cos_sin(positions)}, torch.device("cpu"))
    x = torch.randn(tokens, spec.hidden_size)

    def run() -> None:
        with torch.inference_mode():
            block(x, ctx, cache.layers[0])

    seconds = median_time(run, min_time=min_time)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[576, 2048, 8192])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds spent on each measurement")
    args = parser.parse_args()

    ratios: list[tuple[int, int, int, float]] = []
    print(f"{'hidden':>6} {'tokens':>6} {'MB':>7} {'send MB/s':>10} {'recv MB/s':>10} {'hop us':>9}  layer ms by threads")
    for hidden in args.hidden:
        spec = spec_for(hidden)
        for tokens in args.tokens:
            torch.set_num_threads(1)
            x = torch.randn(tokens, hidden)
            send_s, recv_s = wire_times(x, min_time=args.min_time)
            megabytes = x.numel() * 4 / 1e6
            layers = {n: layer_time(spec, tokens, threads=n, min_time=args.min_time) for n in args.threads}
            shown = "  ".join(f"{n}t {s * 1e3:8.2f}" for n, s in layers.items())
            print(f"{hidden:>6} {tokens:>6} {megabytes:>7.3f} {megabytes / send_s:>10.0f} "
                  f"{megabytes / recv_s:>10.0f} {(send_s + recv_s) * 1e6:>9.1f}  {shown}", flush=True)
            ratios += [(hidden, tokens, n, (send_s + recv_s) / s) for n, s in layers.items()]

    print()
    for hidden, tokens, threads, ratio in ratios:
        print(f"wire/layer ratio hidden={hidden} tokens={tokens} threads={threads}: {ratio:.4f}")
    at_2048 = [r for h, _, _, r in ratios if h == 2048]
    if at_2048:
        print(f"wire/layer ratio at hidden 2048, worst case: {max(at_2048):.4f} (goal <= 0.03)")


if __name__ == "__main__":
    main()
