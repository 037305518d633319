"""What a model is: `ModelSpec`, its vocabulary, its width, one `LayerSpec` per layer and what lies
outside them (the embedding's scale, the head's softcap, MTP modules, the shipped format), and
what every reader above asks of the whole: a layer's and the model's parameters, the width of a
hop into a layer, where a span may start, and the session state a span costs."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from tessera.stages.errors import SpanError
from tessera.stages.families.shipped import ShippedFormat
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.kinds import check_field
from tessera.stages.families.spec.layer import HyperSpec, LayerSpec

# state kinds that go back only to their checkpoints or as far as their rings reach (or to 0)
CHECKPOINTED_KINDS = ("recurrent", "compressed")
# Digits (base 256) a token id takes on the hop tensor where a layer routes by it (`ModelSpec.hop_width`):
# each is exact in float32, float16 and bfloat16 (integers to 256 have at most 8 significant bits), so
# the id survives a peer computing in any of them; 3 digits hold ids up to 2^24.
HOP_ID_DIGIT_BASE = 256


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a model's shape.

    family:         the config's `model_type` ("llama", "mistral", "qwen2", "qwen3",
                    "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe", "glm_moe_dsa",
                    "qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "nemotron_h");
                    stages/families/catalog.py reads each.
    vocab_size:     rows of the embedding matrix; hidden_size (H): width of the residual stream.
    layers:         one LayerSpec per decoder layer (L = len(layers)).
    rms_norm_eps:   epsilon of every RMSNorm.
    max_position:   the longest context the model was trained for.
    tie_embeddings: the head reuses the embedding matrix.
    bos_token_id, eos_token_ids: special ids from the config.
    mtp_layers:     multi-token-prediction modules a checkpoint holds after the decoder layers
                    (DeepSeek-V3's and GLM-4.5's `num_nextn_predict_layers`, as layers L, L+1...;
                    Qwen3.5's under "mtp."; MiMo-V2-Flash's under "model.mtp.layers.", not drafted
                    with yet): run by no span, their tensors accepted in a folder; `--speculate mtp`
                    drafts with the first where the head runs (families/mtp.py).
    shipped:        how the checkpoint stores its matrices when not as floats (fp8 blocks, mxfp4,
                    GGUF blocks: families/shipped.py), else None. The arithmetic is the same; the
                    bytes a span holds are the shipped ones.
    norm_offset:    what every RMSNorm's stored weight is short of the scale it applies (every
                    layer's two norms, q/k norms and the final norm; 0.0 but for Qwen3-Next's and
                    Qwen3.5's zero-centred norms, which scale by 1 + w): added once, at load.
    prefix:         where the decoder's tensors lie in the checkpoint: "model." (a causal LM),
                    "model.language_model." (the text model of a multimodal checkpoint, whose
                    other towers are not run), or "backbone." (Nemotron-H's).
    embed_scale:    the embedding's rows are multiplied by it (Gemma: sqrt(H), as a float32 scalar
                    cast to the model's dtype, as transformers does), else None.
    logit_softcap:  the logits are softcapped, c tanh(logits / c) (Gemma's
                    `final_logit_softcapping`), else None.
    per_layer_vocab: rows of the per-layer input table (Gemma 4's `vocab_size_per_layer_input`)
                    when the layers take per-layer inputs (`LayerSpec.per_layer_input`), else 0.

    Under hyper-connections (every layer's `hyper`, DeepSeek-V4) the residual is several streams
    and the head mixes them back into one before the final norm; what a step carries between
    stages is `hop_width` values a token.
    """

    family: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float = 1e-5
    max_position: int = 4096
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    mtp_layers: int = 0
    shipped: ShippedFormat | None = None
    norm_offset: float = 0.0
    prefix: str = "model."
    embed_scale: float | None = None
    logit_softcap: float | None = None
    per_layer_vocab: int = 0

    def __post_init__(self) -> None:
        check_field(len(self.layers) > 0, "num_hidden_layers", len(self.layers))
        check_field(self.hidden_size > 0, "hidden_size", self.hidden_size)
        check_field(self.vocab_size > 0, "vocab_size", self.vocab_size)
        check_field(self.max_position > 0, "max_position_embeddings", self.max_position)
        check_field(self.mtp_layers >= 0, "num_nextn_predict_layers", self.mtp_layers)
        check_field(self.embed_scale is None or self.embed_scale > 0, "embedding scale", self.embed_scale)
        check_field(self.logit_softcap is None or self.logit_softcap > 0, "final_logit_softcapping", self.logit_softcap)
        widths = {layer.per_layer_input for layer in self.layers}
        check_field(len(widths) == 1 and (self.per_layer_vocab > 0) == (0 not in widths), "hidden_size_per_layer_input",
               sorted(widths))
        check_field(0 in self.span_starts, "indexer_types", "shared at layer 0")
        for i, layer in enumerate(self.layers):  # a layer reads the keys and values of an earlier one of its shape
            at = layer.attention
            source = getattr(at, "kv_source", None)
            if source is not None:
                giver = self.layers[source].attention if source < i else None
                check_field(isinstance(giver, AttentionSpec) and giver.kv_source is None
                       and (giver.num_kv_heads, giver.head_dim, giver.value_dim, giver.window)
                       == (at.num_kv_heads, at.head_dim, at.value_dim, at.window), "num_kv_shared_layers", source)
        check_field(len({layer.hyper for layer in self.layers}) == 1, "hc_mult", [layer.hyper for layer in self.layers])

    @property
    def hyper(self) -> HyperSpec | None:
        """The hyper-connections every layer has (DeepSeek-V4), or None: one residual stream."""
        return self.layers[0].hyper

    @property
    def streams(self) -> int:
        """Rows of H the residual is per token: `hyper.streams`, else 1."""
        return self.hyper.streams if self.hyper is not None else 1

    @cached_property
    def hop_id_digits(self) -> int:
        """Base-256 digits of a token id the hop carries (HOP_ID_DIGIT_BASE): enough for every id of the
        vocabulary where some layer routes by token id (a hash router), else 0."""
        if not any(layer.mlp is not None and layer.mlp.router is not None and layer.mlp.router.hash_vocab
                   for layer in self.layers):
            return 0
        return max(1, -(-(self.vocab_size - 1).bit_length() // 8))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property  # a frozen spec: hashing every layer's shape once, not per byte count asked
    def uniform(self) -> bool:
        """Whether every layer has the same shape (the Llama block; not Qwen3-MoE's dense-first)."""
        return len(set(self.layers)) == 1

    def layer_param_count(self, layer: int | None = None) -> int:
        """Parameters in decoder layer `layer` (None: any layer of a uniform model)."""
        if layer is None:
            if not self.uniform:
                raise ValueError(f"the layers of this {self.family} model differ: name the layer")
            layer = 0
        return self.layers[layer].param_count(self.hidden_size)

    def layer_bytes(self, itemsize: int = 4, *, layer: int | None = None) -> int:
        """Bytes of layer `layer`'s weights in a float of `itemsize` bytes (None: any layer of a
        uniform model; ValueError where layers differ)."""
        return self.layer_param_count(layer) * itemsize

    @cached_property  # a frozen spec: each distinct layer shape counted once
    def param_count(self) -> int:
        """Parameters of the whole model: embedding, every decoder layer, the final norm, and the
        head unless tied, and the per-layer input table, projection and norm (Gemma 4's PLE) (MTP
        modules, which are not run, left out)."""
        edges = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2) + self.hidden_size
        edges += self.hyper.head_params(self.hidden_size) if self.hyper is not None else 0
        p = self.per_layer_width * self.num_layers
        edges += self.per_layer_vocab * p + p * self.hidden_size + self.per_layer_width
        return edges + sum(n * layer.param_count(self.hidden_size) for layer, n in Counter(self.layers).items())

    @property
    def per_layer_width(self) -> int:
        """P: each layer's per-layer input width (Gemma 4's `hidden_size_per_layer_input`), or 0."""
        return self.layers[0].per_layer_input

    def hop_width(self, layer: int) -> int:
        """Values a step carries per token into layer `layer` (0 <= layer <= L): what a stage whose span
        starts there takes (from the requester at 0), and what one ending there hands on. What a layer
        hands the next one, and what only the embedding knows that a layer still to run reads:

            the residual stream      `streams` rows of H (DeepSeek-V4's hyper-connections: several)
            the token id             `hop_id_digits` digits, where a layer routes by it (DeepSeek-V4)
            the per-layer inputs     P each of layers layer..L-1 (Gemma 4's E-models: computed by the
                                     requester with the embedding, layers/per_layer.py)

        So the width shrinks by P a layer run where layers take per-layer inputs and is the same at
        every layer otherwise (docs/pages/models.md says why it is not kept constant). A hop of T
        tokens is [T, hop_width(layer)] (stages/layers/hop.py packs and unpacks it): what the wire, the
        requester's history at that cut, the spot checks and a peer's frame limit carry; its bytes per
        token are `hop_bytes`. At L it is what the head reads."""
        if not 0 <= layer <= self.num_layers:
            raise SpanError(f"layer {layer} is outside [0, {self.num_layers}]")
        return (self.streams * self.hidden_size + self.hop_id_digits
                + self.per_layer_width * (self.num_layers - layer))

    def hop_bytes(self, layer: int, itemsize: int = 4) -> int:
        """Bytes one token's hop into layer `layer` (`hop_width`) takes at `itemsize` bytes a value."""
        return self.hop_width(layer) * itemsize

    def max_layer_bytes(self, itemsize: int = 4) -> int:
        """Bytes of the largest layer."""
        return max(self.layer_bytes(itemsize, layer=i) for i in range(self.num_layers))

    @cached_property  # a frozen spec: asked at every session a peer opens
    def span_starts(self) -> tuple[int, ...]:
        """The layers a span may start at (and L): every layer but those that reuse a selection made
        before them (`DsaSpec.shared`), and but those between a layer whose keys and values later
        layers attend over and the last of those (`AttentionSpec.kv_source`: Gemma 4's KV-shared
        layers). A step carries a DSA selection from layer to layer in one stage, never between
        peers, and a layer that reuses it cannot recompute it: that needs the selecting layer's
        weights, its input and its cache of index keys. Likewise a shared layer attends over the
        whole cache of the layer it reads, which lives in that layer's stage: the two are served
        together (sending the cache's new rows along every hop instead would cost 2 K D values
        per token per source layer; not done). So a stage's span and a session's sub-span start
        only here (`load_stage`, `SessionTable.open` refuse others)."""
        blocked = {i for i, layer in enumerate(self.layers) if getattr(layer.attention, "shared", False)}
        for i, layer in enumerate(self.layers):
            source = getattr(layer.attention, "kv_source", None)
            if source is not None:
                blocked.update(range(source + 1, i + 1))
        return tuple(i for i in range(self.num_layers + 1) if i not in blocked)

    def aligned_span(self, start: int, end: int) -> tuple[int, int]:
        """The span nearest [start, end) whose ends are `span_starts` (L among them): the largest such
        span inside it; where none is, the smallest one from the start moved down (a layer and those
        reusing its selection are served together, even past the length asked). What a peer claims
        where placement chose [start, end); any span of a model without reusing layers is itself."""
        starts = self.span_starts
        if len(starts) == self.num_layers + 1:
            return start, end
        inner = [i for i in starts if start <= i <= end]
        if len(inner) >= 2:
            return inner[0], inner[-1]
        first = max(i for i in starts if i <= start)
        return first, min(i for i in starts if i > first)

    def check_span_start(self, start: int, end: int) -> None:
        """SpanError unless a span [start, end) may start at layer `start` (`span_starts`; an empty
        span may start anywhere)."""
        if start < end and start not in self.span_starts:
            sources = [(i, getattr(self.layers[i].attention, "kv_source", None)) for i in range(start, self.num_layers)]
            reading = next(((i, source) for i, source in sources if source is not None and source < start), None)
            if reading is not None:
                what = f"layer {reading[0]} attends over the keys and values of layer {reading[1]}"
            else:
                what = f"it reuses the sparse-attention selection of layer {max(i for i in self.span_starts if i < start)}"
            raise SpanError(f"a span cannot start at layer {start} of this {self.family} model: {what}, which is not "
                            f"sent between peers (spans start at layers {list(self.span_starts[:-1])})")

    def rolls_back_anywhere(self, start: int, end: int) -> bool:
        """Whether a session over layers [start, end) can go back to any earlier position (every layer's
        state a row per position, cut by a pointer), or only to its recent checkpoints and to 0 (a
        recurrent layer's: `RecurrentStateSpec`): a requester that goes further back replays from 0."""
        return all(self.layers[i].cache.kind not in CHECKPOINTED_KINDS for i in range(start, end))

    def kv_bytes_per_position(self, start: int, end: int, itemsize: int = 4) -> int:
        """KV bytes one position costs a session over layers [start, end), each per its state kind
        (0 for a layer whose state does not grow with the context)."""
        return sum(self._kv_items_per_position[start:end]) * itemsize

    @cached_property  # asked at every session a peer opens or grows: each layer's cache spec built once
    def _kv_items_per_position(self) -> tuple[int, ...]:
        """Per layer: the cache entries one position holds (its bytes at an itemsize of 1)."""
        return tuple(layer.cache.bytes_per_position(1) for layer in self.layers)

    def state_fixed_bytes(self, start: int, end: int, itemsize: int = 4) -> int:
        """Bytes a session over layers [start, end) holds whatever its length (recurrent states)."""
        return sum(self.layers[i].cache.fixed_bytes(itemsize) for i in range(start, end))

    def state_bytes(self, start: int, end: int, positions: int, itemsize: int = 4) -> int:
        """Bytes a session of `positions` over layers [start, end) holds: fixed + per position x positions."""
        return self.state_fixed_bytes(start, end, itemsize) + self.kv_bytes_per_position(start, end, itemsize) * positions

    def context_tokens(self, start: int, end: int, budget: int, itemsize: int = 4) -> int:
        """The longest context one session over layers [start, end) can hold in `budget` bytes of
        session state (at most the model's context; 0 when not even its fixed state fits). A span
        of linear-attention layers holds the whole context in a fixed state: its bound is
        `max_position` as soon as that state fits."""
        fixed = self.state_fixed_bytes(start, end, itemsize)
        if budget < fixed or end <= start:
            return 0 if end > start else self.max_position
        per_token = self.kv_bytes_per_position(start, end, itemsize)
        return self.max_position if per_token == 0 else min(self.max_position, (budget - fixed) // per_token)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
