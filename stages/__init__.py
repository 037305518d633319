"""stages/: what is computed. Pure compute, no networking; CPU float32 is the reference.

Subpackages, lowest first; each imports only those above it in this list (never a sibling
of its own rank), as `tests/test_layers.py` checks over the source:

    errors      the one error tree (a module)                                           rank 0
    families/   what a model is: ModelSpec and a LayerSpec per layer, read from config.json by
                one reader per family, and the checkpoint's tensor names (which of them are
                matrices included). Pure data: no torch (peer/plan prices spans from specs).   } rank 1
    text/       text <-> token ids, the chat template, JSON prefixes. No torch.            } rank 1
    kernels/    the matmul of each way a matrix is stored: int8/int4 (quant.py: Quant,
                QuantLinear, quantize_linear, dense_weight, and the bytes a span holds), the
                shipped formats (linear.py's ShippedLinear; fp8, mxfp4, ggml/),
                stored.py (a stored matrix's module by its form), encode.py (floats written in
                a shipped form), chunked.py (the float32 CPU form: dequantize rows, multiply).  rank 2
    layers/     the math, each with float32 reference semantics: rope, norm, attention (GQA),
                mla, dsa, recurrent/ (gated_deltanet and kda: linear attention; mamba2: state
                space; short_conv: their causal convolution), cache (a store per layer's state kind,
                one position pointer), state (a fixed recurrent state and its checkpoints), mlp,
                routers, moe, mtp (a multi-token-prediction module's ends), per_layer (Gemma 4's
                per-layer inputs), and block.py, which composes a layer from its LayerSpec.     } rank 3
    weights/    model folders and what they hold: the registry and manifests, reading only a
                span (folder.py), the folder check, GGUF conversion and blocks, reading matrices
                quantized (quantize.py) or as shipped (formats/load.py) into kernels' modules,
                synthetic models. Never imports layers/: it knows tensor names, not modules.  } rank 3
    engine/     Stage (a span for many sessions, stacked per step, given its Blocks), its
                sessions, an MTP module beside the head (mtp.py), compiled decode steps, the layer benchmark a peer advertises, device
                memory. Never imports weights/: the runtime does not read files.              rank 4
    assembly/   a Stage from a model folder: blocks.py fills a layer's Block from the weights
                (float, quantized as read, or as shipped), stage.py `load_stage`, mtp.py `load_mtp`. The one place
                where modules and files meet.                                                 rank 5
    shards/     tensor-sharded execution of a span, its collectives and audit layout.       } rank 6
    decoding/   sampling, constrained decoding, speculative drafts (n-gram, a draft model, the
                model's MTP module) and acceptance, LocalEngine. } rank 6

Reading a family top-down: its module in families/ (config keys -> LayerSpecs), then
layers/block.py (a LayerSpec -> modules), then layers/attention.py and layers/moe.py.

Extension points (each module's docstring says how):
- a family on existing operators: its module in families/ (reader, writer, `FAMILY`) and its row
  in families/catalog.py (whose docstring says how), plus its conformance row in the tests;
- an attention, MLP, router or cache kind: its kind in families/spec/, its module in
  layers/ (registered in layers/block.py, layers/routers.py or layers/cache.py), its tensor
  names in families/tensors.py;
- a weight format (FP8 blocks, MXFP4, GGUF k-quants): a linear module in kernels/ like
  kernels/linear.py's ShippedLinear, its line in kernels/stored.py, its stored tensors in
  families/shipped.py; `dequantized` is its reference;
- a compiled or device-specific decode step: inside engine/ over the same Blocks, checked
  against the eager float32 reference.
"""
