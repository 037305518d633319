"""A checkpoint's multi-token-prediction (MTP) modules as plain data: what `--speculate mtp` drafts with.

DeepSeek-V3, GLM-4.5, GLM-5 and Qwen3.5 ship, after the decoder, `ModelSpec.mtp_layers` MTP
modules trained to predict a token further ahead. Module k of the published architecture
(DeepSeek-V3 report §2.2; transformers 5 `MtpLayer`, vLLM's `deepseek_mtp` / `qwen3_next_mtp`)
reads the model's last hidden state h_i *after* the final norm (what transformers hands it:
`hidden_states[-1]`, the normed `last_hidden_state`) and the embedding of the token after it:

    x   = W_proj [enorm(emb(t_{i+1})) ; hnorm(h_i)]      (the halves swapped where `hidden_first`)
    o_i = out_norm(block(x))                             one decoder layer, with a cache of its own
    p(t_{i+2}) = softmax(W_head o_i)                     the model's own head (shared, never copied)

so at the last position it drafts the token after next. A longer draft chains the first module
on its own output: o_i stands for h_{i+1} beside the drafted token (vLLM's way with one module;
transformers drafts one token per module). The checkpoint's further modules are read by
nothing here: one module is what every published checkpoint of these families holds.

Two published layouts (`MtpSpec.layout`):

- "nextn" (DeepSeek-V3, GLM-4.5, GLM-5): module k is decoder layer L + k of the checkpoint,
  `model.layers.{L+k}.`: its block's tensors under the layer's usual names beside `enorm`,
  `hnorm`, `eh_proj` and `shared_head.norm`, and copies of the model's embedding and head
  (`embed_tokens`, `shared_head.head`), which are not read (transformers skips them too);
- "mtp" (Qwen3.5): one set of `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc`,
  `mtp.norm`, and the blocks under `mtp.layers.{k}.`.

The block is a layer of the model's own kinds (its norms offset as the model's are): a sparse
layer of the model's attention (transformers builds MTP layers with `first_k_dense_replace` 0;
GLM-5's with its own indexer) or Qwen3.5's gated full attention with the model's MLP. It is named
and shaped as a decoder layer of `MtpSpec.blocks`, a spec that lists it as layer `layer`, so
that the tensor tables (families/tensors.py), the weight reader and the Stage take it as any layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.model import ModelSpec

MTP_LAYOUTS = ("nextn", "mtp")
QWEN_PREFIX = "mtp."  # Qwen3.5's MTP tensors, at the checkpoint's top level (a multimodal one's too)


@dataclass(frozen=True)
class MtpSpec:
    """The first MTP module of a model (module docstring).

    blocks, layer:  a spec whose layer `layer` is the module's decoder block, its tensors named as the
                    checkpoint names them (nextn: the model's layers and then its MTP blocks; mtp: the
                    blocks alone, under "mtp.").
    embed_norm, hidden_norm, proj, out_norm: checkpoint names of enorm [H], hnorm [H], the projection
                    [H, 2H] and the output norm [H].
    prefixes:       every checkpoint tensor of the modules lies under one of these.
    copies:         tensors there that copy the model's own (DeepSeek's embedding and head): not read.
    hidden_first:   the projection reads [hnorm(h); enorm(e)] (the default: the embedding first).
    """

    blocks: ModelSpec
    layer: int
    layout: str
    embed_norm: str
    hidden_norm: str
    proj: str
    out_norm: str
    prefixes: tuple[str, ...]
    copies: tuple[str, ...] = ()
    hidden_first: bool = False

    @property
    def block(self) -> LayerSpec:
        return self.blocks.layers[self.layer]

    @property
    def hidden_size(self) -> int:
        return self.blocks.hidden_size

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """The module's own tensors outside its block, with their shapes."""
        h = self.hidden_size
        return {self.embed_norm: (h,), self.hidden_norm: (h,), self.proj: (h, 2 * h), self.out_norm: (h,)}


def nextn_mtp(spec: ModelSpec, block: LayerSpec) -> MtpSpec:
    """DeepSeek-V3's layout: module k is layer L + k (module docstring)."""
    n, first = spec.mtp_layers, spec.num_layers
    blocks = replace(spec, layers=spec.layers + (block,) * n, mtp_layers=0)
    p = f"{spec.prefix}layers.{first}."
    prefixes = tuple(f"{spec.prefix}layers.{first + k}." for k in range(n))
    return MtpSpec(blocks, first, "nextn", p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight",
                   p + "shared_head.norm.weight", prefixes,
                   copies=tuple(x + name for x in prefixes for name in ("embed_tokens.weight", "shared_head.head.weight")))


def qwen_mtp(spec: ModelSpec, block: LayerSpec) -> MtpSpec:
    """Qwen3.5's layout: one projection and its norms under "mtp.", the blocks under "mtp.layers.{k}."."""
    blocks = replace(spec, layers=(block,) * spec.mtp_layers, mtp_layers=0, prefix=QWEN_PREFIX)
    q = QWEN_PREFIX
    return MtpSpec(blocks, 0, "mtp", q + "pre_fc_norm_embedding.weight", q + "pre_fc_norm_hidden.weight",
                   q + "fc.weight", q + "norm.weight", (q,))


def sparse_block(spec: ModelSpec) -> LayerSpec:
    """DeepSeek's and GLM's MTP block: the attention of the model's last layer that computes its own
    (a DSA layer that makes its selection, not one that reuses another's), the MLP of its last sparse layer."""
    attention = next(layer.attention for layer in reversed(spec.layers) if not getattr(layer.attention, "shared", False))
    sparse = [layer.mlp for layer in spec.layers if layer.mlp.kind == "moe"]
    if not sparse:
        raise UnsupportedModel(f"this {spec.family} model has no sparse layer, so the shape of its MTP block "
                               "(a sparse layer) is not known")
    return LayerSpec(attention, sparse[-1])


def full_attention_block(spec: ModelSpec) -> LayerSpec:
    """Qwen3.5's MTP block: the model's gated full attention and its MLP."""
    full = [layer for layer in spec.layers if isinstance(layer.attention, AttentionSpec)]
    if not full:
        raise UnsupportedModel(f"this {spec.family} model has no full-attention layer, so the shape of its MTP "
                               "block (a full-attention layer) is not known")
    return LayerSpec(full[-1].attention, spec.layers[-1].mlp)


def deepseek_mtp(spec: ModelSpec) -> MtpSpec:
    return nextn_mtp(spec, sparse_block(spec))


def qwen3_5_mtp(spec: ModelSpec) -> MtpSpec:
    return qwen_mtp(spec, full_attention_block(spec))
