"""Where each of the engine's tensors lies in a Hugging Face checkpoint: names and shapes only.

The engine names a layer's tensors after its own modules (stages/layers/block.py):

    attn_norm.weight          attn.wqkv.weight (.bias)   attn.wo.weight (.bias)
    attn.q_norm.weight        attn.k_norm.weight         mlp_norm.weight
    dense MLP:  mlp.w_gate_up.weight   mlp.w_down.weight
    MoE:        mlp.router.weight      mlp.experts.{e}.w_gate_up.weight   mlp.experts.{e}.w_down.weight
                mlp.router.correction_bias (sigmoid router)    mlp.shared.w_gate_up.weight  mlp.shared.w_down.weight
    MLA:        attn.wq.weight, or attn.wq_a.weight  attn.q_norm.weight  attn.wq_b.weight
                attn.wkv_a.weight   attn.kv_norm.weight   attn.wkv_b   attn.wo.weight  (biases: wq_a, wkv_a, wo)
    DSA:        MLA's, and (unless the layer reuses a selection) attn.indexer.wq  attn.indexer.wk
                attn.indexer.k_norm.weight  attn.indexer.k_norm.bias  attn.indexer.w_heads
    Gated DeltaNet: attn.w_in.weight (q, k, v, z, b, a: GatedDeltaNetSpec.layout)  attn.conv
                attn.A_log  attn.dt_bias  attn.out_norm.weight  attn.w_out.weight
    KDA:        attn.w_in.weight (q, k, v, b, f_a, g_a)  attn.w_fb.weight  attn.w_gb.weight  attn.conv
                attn.A_log  attn.dt_bias  attn.out_norm.weight  attn.w_out.weight   (families/models/kimi_linear.py)
    Mamba2:     attn.w_in.weight (z, xBC, dt)  attn.conv  attn.conv_bias  attn.dt_bias  attn.A_log  attn.D
                attn.out_norm.weight  attn.w_out.weight       relu^2 MLP: mlp.w_up.weight  mlp.w_down.weight
                (a layer without a mixer or an MLP has neither it nor its norm: families/models/nemotron_h.py)
    a gated shared expert: mlp.shared_gate [1, H] (Qwen3-Next)

A checkpoint's decoder tensors lie under `ModelSpec.prefix` ("model.", or
"model.language_model." in a multimodal checkpoint whose text model is all we run, or "backbone."
in Nemotron-H's, which names its embedding and final norm otherwise: EDGE_NAMES).

and stacks what a checkpoint keeps apart (q, k and v into wqkv; gate and up into w_gate_up),
so that each is one matmul. `layer_tensors` maps every engine tensor to the checkpoint
tensors it is made of (a `Stacked`), in the order they are stacked. Where checkpoints come in
more than one layout, an engine tensor lists each as an alternative, and a folder is read
with the first alternative it holds completely: MoE experts are published one tensor per
expert (`model.layers.3.mlp.experts.7.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.7.w1.weight`), and transformers 5 keeps them fused in memory and
writes them so with `save_pretrained(save_original_format=False)`
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first; `mlp.experts.down_proj` [E, H, I];
the router as `mlp.gate.weight`): expert e is row e of those (`Stacked.index`).

A family names only what differs (`ExpertNames`); a family with other layer tensors (MLA's
low-rank projections) adds its own entries here, keyed by the engine names its modules use.

Which engine tensors are a layer's weight matrices — its linear modules, what quantization
stores as integers and a shipped format keeps as stored — is read from these names too
(`matrix_paths`): every `<path>.weight` of two dimensions, but a router's, which picks the
experts and stays float in every form. The weights (stages/weights/) learn it here, never from
the modules; the conformance tests hold it equal to the Block's own linear modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mla import DsaSpec, MlaSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.recurrent import GatedDeltaNetSpec

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Stacked:
    """An engine tensor: checkpoint tensors `names` (shapes `shapes`, as stored) stacked along
    dim 0 — of each, only row `index` when set (one expert of a fused [E, ...] tensor).

    Two rearrangements, for checkpoints that store a matrix otherwise than the engine does
    (gpt-oss's experts as transformers holds them: `gate_up_proj` [E, H, 2I], gate and up
    interleaved): `transposed`, a part (its row `index`) is stored [in, out] and the engine
    takes its transpose; `interleaved`, the part's rows (once transposed) alternate two
    halves, gate and up, and the engine takes the even rows, then the odd ones.
    """

    names: tuple[str, ...]
    shapes: tuple[Shape, ...]
    index: int | None = None
    transposed: bool = False
    interleaved: bool = False

    def part_shape(self, i: int) -> Shape:
        """The shape part i contributes (its row `index` when set, transposed when `transposed`)."""
        shape = self.shapes[i][1:] if self.index is not None else self.shapes[i]
        return (*shape[:-2], shape[-1], shape[-2]) if self.transposed else shape

    def matrix_shape(self, i: int) -> Shape:
        """Part i's tensor with each matrix [out, in] (a fused tensor's expert dimension kept): the
        logical shape of the part as a form that stores every matrix so holds it (MXFP4's blocks,
        fp8's codes: gpt-oss ships `gate_up_proj_blocks` [E, 2I, H/32, 16], the float tensor
        [E, H, 2I] transposed). Such a form applies `interleaved` to its rows, never `transposed`."""
        shape = self.shapes[i]
        return (*shape[:-2], shape[-1], shape[-2]) if self.transposed else shape

    @property
    def shape(self) -> Shape:
        parts = [self.part_shape(i) for i in range(len(self.names))]
        return (sum(p[0] for p in parts), *parts[0][1:])


# An engine tensor's layouts, in order of preference: a folder is read with the first it holds.
Choices = tuple[Stacked, ...]


def one(name: str, shape: Shape) -> Choices:
    return (Stacked((name,), (shape,)),)


def stacked(names: list[str], shapes: list[Shape]) -> Choices:
    return (Stacked(tuple(names), tuple(shapes)),)


@dataclass(frozen=True)
class ExpertNames:
    """How a family's published checkpoints name a sparse MLP under `model.layers.{i}.`:
    `{block}.gate.weight` (the router), `{block}.experts.{e}.{gate|up|down}.weight`, and a sigmoid
    router's correction bias `{block}.{correction_bias}` (`mlp.{correction_bias}` where transformers
    writes the experts fused)."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    correction_bias: str = "gate.e_score_correction_bias"
    shared: str = "shared_experts"  # `{block}.{shared}.{gate|up|down}.weight`: the shared experts as one SwiGLU


QWEN_EXPERTS = ExpertNames()  # the default: Qwen3-MoE's, DeepSeek's and GLM's names (a family with others has its own)


def layer_tensors(spec: ModelSpec, layer: int, experts: ExpertNames = QWEN_EXPERTS) -> dict[str, Choices]:
    """Engine name -> its checkpoint layouts, for every tensor of decoder layer `layer`."""
    ls: LayerSpec = spec.layers[layer]
    h, at = spec.hidden_size, ls.attention
    p = f"{spec.prefix}layers.{layer}."
    if isinstance(at, MlaSpec):
        return {**mla_tensors(p, at, h), **mlp_tensors(p, ls, h, experts)}
    if isinstance(at, DsaSpec):
        return {**mla_tensors(p, at.mla, h), **indexer_tensors(p, at, h), **mlp_tensors(p, ls, h, experts)}
    if isinstance(at, GatedDeltaNetSpec):
        return {**deltanet_tensors(p, at, h), **mlp_tensors(p, ls, h, experts)}
    qkv = [p + f"self_attn.{x}_proj" for x in "qkv"]
    out: dict[str, Choices] = {
        "attn_norm.weight": one(p + "input_layernorm.weight", (h,)),
        "attn.wqkv.weight": stacked([n + ".weight" for n in qkv], [(at.q_rows, h), (at.kv_size, h), (at.v_size, h)]),
        "attn.wo.weight": one(p + "self_attn.o_proj.weight", (h, at.num_heads * at.value_width)),
        **mlp_tensors(p, ls, h, experts),
    }
    # the optional ones last (the order synth draws random weights in, kept from the Llama block's)
    if at.qkv_bias:
        out["attn.wqkv.bias"] = stacked([n + ".bias" for n in qkv], [(at.q_rows,), (at.kv_size,), (at.v_size,)])
    if at.o_bias:
        out["attn.wo.bias"] = one(p + "self_attn.o_proj.bias", (h,))
    if at.qk_norm:  # per head (D each), or over all heads of q and of k at once (`qk_norm_whole`)
        out["attn.q_norm.weight"] = one(p + "self_attn.q_norm.weight", (at.q_size if at.qk_norm_whole else at.head_dim,))
        out["attn.k_norm.weight"] = one(p + "self_attn.k_norm.weight", (at.kv_size if at.qk_norm_whole else at.head_dim,))
    return out


def mlp_tensors(p: str, ls: LayerSpec, h: int, experts: ExpertNames) -> dict[str, Choices]:
    """The MLP's norm and tensors under prefix `p`: dense, or a router and experts (and the sigmoid
    router's correction bias, and shared experts, where the layer has them)."""
    mlp, i = ls.mlp, ls.mlp.width
    out = {"mlp_norm.weight": one(p + "post_attention_layernorm.weight", (h,))}
    if mlp.kind == "dense":
        out["mlp.w_gate_up.weight"] = stacked([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [(i, h), (i, h)])
        out["mlp.w_down.weight"] = one(p + "mlp.down_proj.weight", (h, i))
        return out
    out.update(expert_tensors(p, mlp.num_experts, i, h, experts))
    if mlp.router is not None and mlp.router.kind == "sigmoid_group_topk":
        names = dict.fromkeys((f"{p}{experts.block}.{experts.correction_bias}", f"{p}mlp.{experts.correction_bias}"))
        out["mlp.router.correction_bias"] = tuple(c for name in names for c in one(name, (mlp.num_experts,)))
    if mlp.shared_width:
        x, w = f"{p}{experts.block}.{experts.shared}.", mlp.shared_width
        out["mlp.shared.w_gate_up.weight"] = stacked([x + "gate_proj.weight", x + "up_proj.weight"], [(w, h), (w, h)])
        out["mlp.shared.w_down.weight"] = one(x + "down_proj.weight", (h, w))
    if mlp.shared_gate:
        out["mlp.shared_gate"] = one(f"{p}{experts.block}.{experts.shared}_gate.weight", (1, h))
    return out


def deltanet_tensors(p: str, at: GatedDeltaNetSpec, h: int) -> dict[str, Choices]:
    """A Gated DeltaNet layer's attention norm and tensors under prefix `p` (transformers' names):
    the in-projection stacked from Qwen3.5's four matrices (`layout` "split") or Qwen3-Next's two
    ("grouped": qkvz and ba, each grouped per key head, which layers/recurrent/gated_deltanet.py reads so)."""
    a = p + "linear_attn."
    if at.layout == "split":
        w_in = stacked([a + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")],
                       [(at.conv_channels, h), (at.value_size, h), (at.num_value_heads, h), (at.num_value_heads, h)])
    else:
        w_in = stacked([a + "in_proj_qkvz.weight", a + "in_proj_ba.weight"],
                       [(at.conv_channels + at.value_size, h), (2 * at.num_value_heads, h)])
    return {
        "attn_norm.weight": one(p + "input_layernorm.weight", (h,)),
        "attn.w_in.weight": w_in,
        "attn.conv": one(a + "conv1d.weight", (at.conv_channels, 1, at.conv_kernel)),
        "attn.A_log": one(a + "A_log", (at.num_value_heads,)),
        "attn.dt_bias": one(a + "dt_bias", (at.num_value_heads,)),
        "attn.out_norm.weight": one(a + "norm.weight", (at.value_dim,)),
        "attn.w_out.weight": one(a + "out_proj.weight", (h, at.value_size)),
    }


def mla_tensors(p: str, at: MlaSpec, h: int) -> dict[str, Choices]:
    """An MLA layer's attention norm and attention tensors under prefix `p` (DeepSeek's names)."""
    a = p + "self_attn."
    q_size, latent = at.num_heads * at.qk_head_dim, at.kv_lora_rank + at.qk_rope_head_dim
    out: dict[str, Choices] = {"attn_norm.weight": one(p + "input_layernorm.weight", (h,))}
    if at.q_lora_rank is None:
        out["attn.wq.weight"] = one(a + "q_proj.weight", (q_size, h))
    else:
        out["attn.wq_a.weight"] = one(a + "q_a_proj.weight", (at.q_lora_rank, h))
        out["attn.q_norm.weight"] = one(a + "q_a_layernorm.weight", (at.q_lora_rank,))
        out["attn.wq_b.weight"] = one(a + "q_b_proj.weight", (q_size, at.q_lora_rank))
    out["attn.wkv_a.weight"] = one(a + "kv_a_proj_with_mqa.weight", (latent, h))
    out["attn.kv_norm.weight"] = one(a + "kv_a_layernorm.weight", (at.kv_lora_rank,))
    out["attn.wkv_b"] = one(a + "kv_b_proj.weight", at.kv_b_shape)
    out["attn.wo.weight"] = one(a + "o_proj.weight", (h, at.num_heads * at.v_head_dim))
    if at.bias:
        if at.q_lora_rank is not None:
            out["attn.wq_a.bias"] = one(a + "q_a_proj.bias", (at.q_lora_rank,))
        out["attn.wkv_a.bias"] = one(a + "kv_a_proj_with_mqa.bias", (latent,))
        out["attn.wo.bias"] = one(a + "o_proj.bias", (h,))
    return out


def indexer_tensors(p: str, at: DsaSpec, h: int) -> dict[str, Choices]:
    """A DSA layer's indexer under prefix `p` (transformers' `GlmMoeDsaIndexer` names); none when shared."""
    if at.shared:
        return {}
    x, hi, di = p + "self_attn.indexer.", at.index_heads, at.index_head_dim
    assert at.mla.q_lora_rank is not None, "DsaSpec checks it"
    return {
        "attn.indexer.wq": one(x + "wq_b.weight", (hi * di, at.mla.q_lora_rank)),
        "attn.indexer.wk": one(x + "wk.weight", (di, h)),
        "attn.indexer.k_norm.weight": one(x + "k_norm.weight", (di,)),
        "attn.indexer.k_norm.bias": one(x + "k_norm.bias", (di,)),
        "attn.indexer.w_heads": one(x + "weights_proj.weight", (hi, h)),
    }


def expert_tensors(p: str, e_count: int, i: int, h: int, experts: ExpertNames) -> dict[str, Choices]:
    """A sparse MLP's router and experts under prefix `p` (module docstring: both layouts)."""
    out: dict[str, Choices] = {}
    b = p + experts.block
    out["mlp.router.weight"] = (*one(b + ".gate.weight", (e_count, h)), *one(p + "mlp.gate.weight", (e_count, h)))
    fused_gate_up = Stacked((p + "mlp.experts.gate_up_proj",), ((e_count, 2 * i, h),))
    fused_down = Stacked((p + "mlp.experts.down_proj",), ((e_count, h, i),))
    for e in range(e_count):
        x = f"{b}.experts.{e}."
        out[f"mlp.experts.{e}.w_gate_up.weight"] = (
            *stacked([x + experts.gate + ".weight", x + experts.up + ".weight"], [(i, h), (i, h)]),
            Stacked(fused_gate_up.names, fused_gate_up.shapes, e),
        )
        out[f"mlp.experts.{e}.w_down.weight"] = (
            *one(x + experts.down + ".weight", (h, i)), Stacked(fused_down.names, fused_down.shapes, e))
    return out


# two-dimensional engine tensors that are not multiplied through a linear module of their own
FLOAT_MATRICES = frozenset({"mlp.router.weight"})
# engine tensors of integers, stored and read as such (a hash layer's expert table: DeepSeek-V4)
INTEGER_TENSORS = frozenset({"mlp.router.table"})
INTEGER_DTYPES = ("I64", "I32")


def matrix_paths(tensors: dict[str, Choices]) -> tuple[str, ...]:
    """The paths of a layer's weight matrices among its engine tensors (module docstring), e.g.
    "attn.wqkv", "mlp.experts.3.w_down", in the order the tensors are listed."""
    return tuple(name[: -len(".weight")] for name, choices in tensors.items()
                 if name.endswith(".weight") and name not in FLOAT_MATRICES and len(choices[0].shape) == 2)


HEAD_MIX = {"fn": "model.hc_head.hc_fn", "base": "model.hc_head.hc_base", "scale": "model.hc_head.hc_scale"}


def edge_tensors(spec: ModelSpec) -> dict[str, Shape]:
    """The tensors outside the layers: embedding, final norm, the head unless tied, under
    hyper-connections the head's connection (`HEAD_MIX`: engine name -> checkpoint name), and the
    per-layer input table, projection and norm where the layers take per-layer inputs (Gemma 4)."""
    shapes = {embedding_name(spec): (spec.vocab_size, spec.hidden_size), final_norm_name(spec): (spec.hidden_size,)}
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    if spec.hyper is not None:
        n, h = spec.hyper.streams, spec.hidden_size
        shapes.update({HEAD_MIX["fn"]: (n, n * h), HEAD_MIX["base"]: (n,), HEAD_MIX["scale"]: (1,)})
    return {**shapes, **per_layer_tensors(spec)}


# The embedding's and the final norm's names under a prefix that names them otherwise than "embed_tokens"
# and "norm": Mamba's checkpoints (Nemotron-H's decoder lies under "backbone.")
EDGE_NAMES = {"backbone.": ("embeddings.weight", "norm_f.weight")}


def embedding_name(spec: ModelSpec) -> str:
    """The checkpoint name of the embedding matrix."""
    return spec.prefix + EDGE_NAMES.get(spec.prefix, ("embed_tokens.weight",))[0]


def final_norm_name(spec: ModelSpec) -> str:
    """The checkpoint name of the final norm's weight."""
    return spec.prefix + EDGE_NAMES.get(spec.prefix, ("", "norm.weight"))[1]


# Gemma 4's per-layer inputs, beside the embedding: engine name (layers/per_layer.py PerLayerInputs) -> checkpoint
# name after the decoder's prefix ("model.", or "model.language_model." in a multimodal checkpoint)
PER_LAYER_TENSORS = {"table": "embed_tokens_per_layer.weight", "projection": "per_layer_model_projection.weight",
                     "norm.weight": "per_layer_projection_norm.weight"}


def per_layer_tensors(spec: ModelSpec) -> dict[str, Shape]:
    """The per-layer input table [V, L P], projection [L P, H] and norm [P] by checkpoint name (none
    where the layers take no per-layer inputs)."""
    p = spec.per_layer_width
    if not p:
        return {}
    width = spec.num_layers * p
    shapes = {"table": (spec.per_layer_vocab, width), "projection": (width, spec.hidden_size), "norm.weight": (p,)}
    return {spec.prefix + PER_LAYER_TENSORS[ours]: shape for ours, shape in shapes.items()}
