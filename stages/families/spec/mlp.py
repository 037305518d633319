"""A layer's MLP as plain data: `MlpSpec` (dense, a sparse mixture of experts, or Gemma 4's both side
by side), the router that picks a token's experts (`RouterSpec`) and the gated activation between
the projections (`GluSpec`), each kind from a closed set here. Computed in layers/mlp.py,
layers/moe.py and layers/routers.py."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.stages.families.spec.kinds import check_field

# SwiGLU (or GluSpec's other activations); a sparse mixture of such experts; a dense MLP and a sparse mixture
# side by side, each normed (Gemma 4)
MLP_KINDS = ("dense", "moe", "dense_and_moe")
ROUTER_KINDS = (
    "softmax_topk",  # softmax over experts, top-k, optionally renormalised
    "topk_softmax",  # top-k of the logits, softmax over those k (gpt-oss)
    "sigmoid_group_topk",  # DeepSeek's sigmoid, group-limited top-k
    "sqrtsoftplus_topk",  # DeepSeek-V4's sqrt(softplus), top-k with a correction bias
    "normed_softmax_topk",  # Gemma 4's: its input normed and scaled, softmax, top-k renormalised, a scale per expert
)
# silu(gate) * up; gpt-oss's clamped form; relu(up)^2 with no gate (Nemotron-H); DeepSeek-V4's silu with
# gate and up clamped; gelu(gate) * up (Gemma's GeGLU): GluSpec
GLU_KINDS = ("silu", "clamped_swiglu", "relu2", "clamped_silu", "gelu_tanh")


@dataclass(frozen=True)
class RouterSpec:
    """How a token picks its experts.

    kind "softmax_topk": softmax over the router's logits (float32), the `top_k` largest, divided
    by their sum when `renormalize` (Mixtral always; Qwen3-MoE when `norm_topk_prob`).
    kind "topk_softmax": the `top_k` largest logits, their softmax the weights (gpt-oss;
    `renormalize` is moot: they sum to one).
    kind "sigmoid_group_topk" (DeepSeek-V3, GLM-4.5): sigmoid scores (float32); a learned
    correction bias added to them only to choose; the experts split into `num_groups` groups
    (`n_group`), each ranked by its two best corrected scores, and the top `top_k` chosen
    within the best `topk_groups` groups; weighted by their uncorrected scores, divided by
    their sum when `renormalize`, times `scale` (`routed_scaling_factor`).
    kind "sqrtsoftplus_topk" (DeepSeek-V4): the same with scores sqrt(softplus(x Wᵀ)) and one group.
    kind "normed_softmax_topk" (Gemma 4): the router's input RMSNormed (no weight), times a learned
    vector [H] and H^-1/2, then softmax over x Wᵀ (float32), the `top_k` largest divided by their
    sum, each times its expert's learned scale [E].
    bias: the router's logits carry a learned bias (gpt-oss).
    hash_vocab: when > 0, the experts are not chosen by score: a token's `top_k` experts are row
              `token id` of a fixed table [hash_vocab, top_k] (DeepSeek-V4's hash layers,
              `tid2eid`), and the scores only weight them (there is no correction bias). The
              layer then reads each row's token id (carried on the hop: `ModelSpec.hop_width`).
    """

    kind: str = "softmax_topk"
    top_k: int = 2
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    bias: bool = False
    hash_vocab: int = 0

    def __post_init__(self) -> None:
        check_field(self.kind in ROUTER_KINDS, "router kind", self.kind)
        check_field(self.top_k > 0, "num_experts_per_tok", self.top_k)
        check_field(0 < self.topk_groups <= self.num_groups, "topk_group", self.topk_groups)
        check_field(self.scale > 0, "routed_scaling_factor", self.scale)
        if self.kind not in ("sigmoid_group_topk", "sqrtsoftplus_topk"):
            check_field(self.num_groups == 1 and self.scale == 1.0, "n_group", self.num_groups)
        check_field(self.kind != "sqrtsoftplus_topk" or self.num_groups == 1, "n_group", self.num_groups)
        check_field(not self.bias or self.kind == "topk_softmax", "router bias", self.bias)
        check_field(self.hash_vocab >= 0, "vocab_size", self.hash_vocab)
        check_field(not self.hash_vocab or (self.scored and self.num_groups == 1), "hash routing", self.kind)

        check_field(self.kind != "normed_softmax_topk" or self.renormalize, "router renormalize", self.renormalize)

    @property
    def scored(self) -> bool:
        """A correction-biased top-k of per-expert scores (DeepSeek's routers), hashed or not."""
        return self.kind in ("sigmoid_group_topk", "sqrtsoftplus_topk")

    def param_count(self, hidden: int, num_experts: int) -> int:
        """The [E, H] logit projection, and the correction bias or the logits' bias [E], or a hash
        layer's table [hash_vocab, k] of expert ids (Gemma 4's: its input scale [H] and expert scales [E])."""
        if self.kind == "normed_softmax_topk":
            return num_experts * hidden + hidden + num_experts
        extra = num_experts if (self.scored and not self.hash_vocab) or self.bias else 0
        return num_experts * hidden + extra + self.hash_vocab * self.top_k


@dataclass(frozen=True)
class GluSpec:
    """The activation of an MLP (each expert's), between its gate/up and its down projection.

    kind "silu":           silu(gate) * up.
    kind "clamped_swiglu": gpt-oss's: gate clamped above at `limit`, up to [-limit, limit],
                           then gate * sigmoid(alpha * gate) * (up + 1).
    kind "relu2":          relu(up)^2, with no gate projection at all (Nemotron-H's MLP).
    kind "clamped_silu":   DeepSeek-V4's: gate clamped above at `limit`, up to [-limit, limit],
                           then silu(gate) * up (no alpha).
    kind "gelu_tanh":      gelu(gate) * up, gelu's tanh approximation (Gemma's GeGLU,
                           `gelu_pytorch_tanh`).
    """

    kind: str = "silu"
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self) -> None:
        check_field(self.kind in GLU_KINDS, "activation", self.kind)
        swiglu, clamped = self.kind == "clamped_swiglu", self.kind in ("clamped_swiglu", "clamped_silu")
        check_field(not swiglu or (self.alpha is not None and self.alpha > 0), "swiglu_alpha", self.alpha)
        check_field(not clamped or (self.limit is not None and self.limit > 0), "swiglu_limit", self.limit)
        check_field(swiglu or self.alpha is None, "swiglu_alpha", self.alpha)
        check_field(clamped or self.limit is None, "swiglu_limit", self.limit)

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate projection beside its up projection."""
        return self.kind != "relu2"


@dataclass(frozen=True)
class MlpSpec:
    """One layer's MLP.

    kind "dense": SwiGLU of `width` (the intermediate size).
    kind "moe":   `num_experts` SwiGLU experts of `width` each (the expert intermediate
                  size), `router` choosing `router.top_k` of them per token, their outputs
                  summed with the router's weights; plus, when `shared_width`, one SwiGLU of
                  that width every token goes through (DeepSeek's `n_shared_experts` shared
                  experts, n x `moe_intermediate_size`), added unweighted — or, with
                  `shared_gate`, times sigmoid(x · w) of a learned [H] vector w (Qwen3-Next's
                  and Qwen3.5's shared expert).
    kind "dense_and_moe": Gemma 4's: a dense MLP of `shared_width` and `num_experts` experts of
                  `width` side by side, each with a norm before and after (the experts' router
                  reads the layer's residual stream, not the normed input), their outputs summed.
                  The MLP holds its input norms itself (layers/moe.py `DenseAndMoE`).
    glu:  the gated activation of the SwiGLU (each expert's).
    bias: the gate/up and down projections (each expert's) carry biases (gpt-oss).
    """

    width: int
    kind: str = "dense"
    num_experts: int = 0
    router: RouterSpec | None = None
    shared_width: int = 0
    glu: GluSpec = GluSpec()
    bias: bool = False
    shared_gate: bool = False

    def __post_init__(self) -> None:
        check_field(self.kind in MLP_KINDS, "MLP kind", self.kind)
        check_field(self.width > 0, "intermediate_size", self.width)
        check_field(self.kind != "dense_and_moe" or self.shared_width > 0, "intermediate_size", self.shared_width)
        check_field((self.kind == "dense_and_moe") == (self.router is not None and self.router.kind == "normed_softmax_topk"),
               "router kind", self.router and self.router.kind)
        if self.kind in ("moe", "dense_and_moe"):
            check_field(self.num_experts > 0, "num_experts", self.num_experts)
            check_field(self.router is not None and self.router.top_k <= self.num_experts, "num_experts_per_tok",
                   self.router and self.router.top_k)
            assert self.router is not None
            groups, per_group = self.router.num_groups, self.num_experts // self.router.num_groups
            check_field(self.num_experts % groups == 0, "n_group", groups)
            # a group is ranked by its two best scores; the chosen groups must hold top_k experts
            check_field(groups == 1 or per_group >= 2, "n_group", groups)
            check_field(self.router.top_k <= self.router.topk_groups * per_group, "num_experts_per_tok", self.router.top_k)
            check_field(self.shared_width >= 0, "n_shared_experts", self.shared_width)
            check_field(not self.shared_gate or self.shared_width > 0, "shared_expert_intermediate_size", self.shared_width)
        else:
            check_field(self.num_experts == 0 and self.router is None and self.shared_width == 0, "num_experts",
                   self.num_experts)

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of its weight matrices as the engine stacks them: (gate+up, down) per expert,
        then the shared experts' (gate+up, down)."""
        ups = 2 if self.glu.gated else 1
        one = [(ups * self.width, hidden), (hidden, self.width)]
        shared = [(ups * self.shared_width, hidden), (hidden, self.shared_width)] if self.shared_width else []
        return one if self.kind == "dense" else one * self.num_experts + shared

    def param_count(self, hidden: int) -> int:
        # the router's [E, H] (and correction bias or logits' bias), kept in float: it picks the experts
        router = self.router.param_count(hidden, self.num_experts) if self.router is not None else 0
        ups = 2 if self.glu.gated else 1
        biases = (ups * self.width + hidden) * max(self.num_experts, 1) if self.bias else 0
        # `matrices`' sum, counted without listing every expert's: 3 W H a SwiGLU (2 W H ungated)
        matrices = (ups + 1) * (self.width * hidden * max(self.num_experts, 1) + self.shared_width * hidden)
        gate = hidden if self.shared_gate else 0  # the shared expert's gate vector, in float as a router
        norms = 4 * hidden if self.kind == "dense_and_moe" else 0  # its own: before and after each branch
        return matrices + router + biases + gate + norms
