"""What a model is, as plain data: `ModelSpec` and the `LayerSpec` of each of its layers.

A family module (families/models/: `llama.py`, `qwen3.py`, `mixtral.py`) reads a Hugging Face
`config.json` into these frozen dataclasses, and nothing else in stages/ reads a config: the
layers (`stages/layers/`) are built from a `LayerSpec`, the weights (`stages/weights/`) are
named and shaped from it, a session's KV cache is laid out from each layer's
`CacheSpec`, and a peer prices a span from `ModelSpec.layer_bytes`. No torch here: the
planner and the weight fetcher read specs without loading the engine.

A model is a list of layers, each pre-norm:

    x = x + attention(rms_norm(x))      LayerSpec.attention: AttentionSpec (its `kind`)
    x = x + mlp(rms_norm(x))            LayerSpec.mlp: MlpSpec (its `kind`)

and layers may differ (Qwen3-MoE's dense layers among sparse ones, Qwen3's sliding-window
layers among full ones; a Nemotron-H layer has only one of the two halves, `None` the other):
`ModelSpec.layers` holds one `LayerSpec` per layer, equal ones shared. Every sub-spec names
its kind from a closed set (kinds.py; the MLP's in mlp.py, RoPE's in rope.py); whoever reads a
kind (layers/block.py builds modules, layers/cache.py allocates caches) refuses one it does not
know, so a kind added here without its module fails loudly, never silently.

One module a layer kind, with the session state it keeps, beside the model and the layer:

    model.py       ModelSpec: the whole model, and what a span of it costs and carries
    layer.py       LayerSpec (its two halves), HyperSpec, StatelessSpec (a layer without a mixer)
    attention.py   AttentionSpec (grouped-query), CacheSpec, SharedCacheSpec
    mla.py         MlaSpec, DsaSpec (MLA with an indexer), LatentCacheSpec, IndexedLatentCacheSpec
    compressed.py  CompressedAttentionSpec (DeepSeek-V4), CompressedCacheSpec
    recurrent.py   GatedDeltaNetSpec, KdaSpec, Mamba2Spec, RecurrentStateSpec (how far back it goes)
    mlp.py         MlpSpec, RouterSpec, GluSpec
    rope.py        RopeSpec
    kinds.py       the closed sets of mixer and state kinds, what a state kind costs (StateSize),
                   and the check every field goes through

Extending (the kinds are the extension points):

- an attention kind: add it to ATTENTION_KINDS with a dataclass of its own sizes in a module of
  its own (as mla.py's `MlaSpec` sits beside attention.py's `AttentionSpec`, with `rope`,
  `rope_dim`, `matrices`, `param_count` and `cache`), in layer.py's `MixerSpec`, its module in
  layers/ (registered in layers/block.py), and its cache kind.
  DeepSeek sparse attention (kind "dsa", GLM-5) is MLA plus an indexer that picks each
  query's top-k keys: `DsaSpec` holds an `MlaSpec` and the indexer's sizes, its module
  (layers/dsa.py) is built on layers/mla.py's over the picked rows;
- a session-state kind (what a layer keeps per session: its `cache`): add it to CACHE_KINDS and
  layer.py's `StateSpec` with a spec of its sizes, a kinds.py `StateSize` that says its
  `fixed_bytes` and `bytes_per_position` (as `LatentCacheSpec`: MLA's compressed kv + rope key
  per position), and its store in layers/cache.py (or, for a state that is not a row per position,
  layers/state.py). Peers budget sessions with `bytes(capacity)` = fixed + per position x
  capacity, so a smaller state is seen by admission
  and placement with no change in peer/. DSA's ("latent_indexed", `IndexedLatentCacheSpec`)
  holds the latent rows and the indexer's keys; a linear-attention or state-space layer's
  ("recurrent", `RecurrentStateSpec`) a fixed matrix per head and a convolution window, whatever
  the context; a layer without a token mixer's ("none", `StatelessSpec`) nothing;
  DeepSeek-V4's ("compressed", `CompressedCacheSpec`) a window of rows and, every `ratio`
  positions, one compressed entry (and the indexer's), going back only as far as its rings reach;
- an MLP or router kind: fields on `MlpSpec` / `RouterSpec` (as `shared_width` and the
  sigmoid router's groups and scale), the kind in MLP_KINDS / ROUTER_KINDS, its module in
  layers/routers.py;
- what crosses a stage boundary: `ModelSpec.hop_width(layer)`, the values a step carries per
  token into layer `layer` (the residual stream, `hyper.streams` of them under DeepSeek-V4's
  hyper-connections; the token id where a layer routes by it; Gemma 4's per-layer inputs of the
  layers still to run); stages/layers/hop.py packs it;
- RoPE variants: a `RopeSpec.kind` with its parameters, computed in layers/rope.py (YaRN;
  Gemma 4's "proportional", which turns the first pairs of each half of a head); partial
  rotary over the first dims of a head is `AttentionSpec.rotary_dim`;
- what a layer does around its two halves (Gemma's norms after each half, its per-layer input,
  its layer scalar): fields of `LayerSpec`, built in layers/block.py.
"""

from __future__ import annotations
