"""stages/: what is computed. Pure compute, no networking; CPU float32 is the reference.

Subpackages, lowest first; each imports only those above it in this list (never a sibling
of its own rank), as `tests/test_layers.py` checks over the source:

    errors      the one error tree (a module)
    families/   what a model is: ModelSpec and a LayerSpec per layer, read from config.json by
                one reader per family (llama, qwen3, mixtral), and the checkpoint's tensor names.
                Pure data: no torch (peer/plan prices spans from specs).                  } rank 1
    text/       text <-> token ids, the chat template, JSON prefixes. No torch.           } rank 1
    layers/     the math, each with float32 reference semantics: rope, norm, attention (GQA),
                cache (a store per layer's cache kind, one position pointer), mlp (SwiGLU),
                routers, moe, and block.py, which composes a layer from its LayerSpec.
    weights/    model folders and weight formats: the registry and manifests, reading only a
                span (folder.py), the folder check, GGUF conversion and Q4_1 blocks, int8/int4
                quantized linears, synthetic models.
    engine/     Stage (a span for many sessions, stacked per step), its sessions, the layer
                benchmark a peer advertises, device memory.
    shards/     tensor-sharded execution of a span, its collectives and audit layout.       } rank 6
    decoding/   sampling, constrained decoding, speculative drafts and acceptance, LocalEngine. } rank 6

Reading a family top-down: its module in families/ (config keys -> LayerSpecs), then
layers/block.py (a LayerSpec -> modules), then layers/attention.py and layers/moe.py.

Extension points (each module's docstring says how):
- a family on existing operators: a reader in families/ and a line in families/catalog.py;
- an attention, MLP, router or cache kind: its kind in families/spec.py, its module in
  layers/ (registered in layers/block.py, layers/routers.py or layers/cache.py), its tensor
  names in families/tensors.py;
- a weight format (FP8 blocks, MXFP4, GGUF k-quants): a linear module like kernels/quant.py's,
  built by the loader per matrix (`linear_paths`), with `dense_weight` as its reference;
- a compiled or device-specific decode step: inside engine/ over the same Blocks, checked
  against the eager float32 reference.
"""
