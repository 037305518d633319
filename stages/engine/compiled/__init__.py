"""Compiled decode steps: a span's one-token steps through torch.compile (CPU) or CUDA graphs.

A decode step is every row one session's next token; it runs through the very `Block`s the
eager path runs (layers/block.py), with a step object of its own (layers/attention.py's
`StepRows`) that decides how the rows meet their caches. Prefill, draft blocks and any shape
without a compiled form run eagerly, through `StepContext`, as before.

    modes.py        --compile auto|off|inductor|cuda-graphs: what each means on which device (pure)
    forms.py        a block's decode form: the same parameters, one-row matrix-vector products
                    written as the reductions inductor streams well, a sparse MLP's dispatch left eager
    rows.py         the step of a torch.compile'd layer: each row's cache write and attention as one
                    opaque op over the session's own store
    inductor.py     `InductorDecode`: one compiled function per layer kind and row bucket, built at
                    span load (warm-up), eager per kind where compiling fails, with the reason
    slots.py        static KV slots and the step that attends through them (what a CUDA graph
                    replays; runs on any device, so the CPU tests check it against the eager path)
    cuda_graphs.py  `GraphDecode`: per (row bucket, length bucket) the span's step captured as CUDA
                    graphs around eager islands (a sparse MLP's dispatch), replayed per step

Exactness: a compiled step computes what the eager step computes, in another order of
summation (float32: within a few 1e-6 of the eager logits; tests hold 1e-4 and greedy tokens
for every family).
"""
