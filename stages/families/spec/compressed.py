"""DeepSeek-V4's attention (kind "compressed": `CompressedAttentionSpec`), one key-value head read over
a window of rows and over compressed entries, and what it keeps per session (`CompressedCacheSpec`):
the window and the entries in rings that reach back as far as a recurrent state's checkpoints do.
Computed in layers/compressed.py."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.stages.families.spec.kinds import StateSize, check_field
from tessera.stages.families.spec.recurrent import RECURRENT_CHECKPOINTS, REPLAY_TOKENS
from tessera.stages.families.spec.rope import RopeSpec

# How far back from its end a compressed layer's session state goes by moving a pointer
# (CompressedCacheSpec): it keeps the rows of its last positions in rings, not every position, and
# this many past what its window and its open compression windows need — what a recurrent state
# reaches inside its runs of steps (the same two speculative blocks in flight, the same local draft
# model's one-token drafts); the start of a longer step is kept apart (its snapshot), as a recurrent
# state keeps its checkpoint. A rollback further back is refused (StateRewindError): the requester
# replays from position 0.
COMPRESSED_REACH = RECURRENT_CHECKPOINTS * REPLAY_TOKENS
COMPRESSED_SNAPSHOTS = RECURRENT_CHECKPOINTS  # the starts of the last steps longer than the reach


@dataclass(frozen=True)
class CompressedCacheSpec(StateSize):
    """What a DeepSeek-V4 layer keeps per session (kind "compressed"): its window of key-value rows
    and, every `ratio` positions, one compressed entry (and, with an indexer, one index entry).

    head_dim (D): a window row and a compressed entry (one key-value head: keys are values).
    window (W):   the positions a query reads as rows (its own and the W - 1 before).
    ratio (m):    positions per compressed entry; 0 for a layer with the window only.
    overlap:      an entry mixes two windows of positions (CSA: window w's second half of each
                  row with window w - 1's first half), so each position keeps 2 D of projections
                  (and of gate logits) until it is compressed; else D (HCA).
    index_dim (Di): the indexer's entries (its own compression of the same windows, with overlap);
                  0 without an indexer.

    What grows with the context is the entries: (D + Di) values every m positions
    (`bytes_per_position`, rounded up). What does not is the window and the projections of the
    positions whose compression window is still open — kept in rings of their last positions
    plus COMPRESSED_REACH (layers/cache.py `CompressedRows`), so that a rollback that far back
    is a pointer move — and a snapshot of them at the starts of the last COMPRESSED_SNAPSHOTS
    long steps (`fixed_bytes`). V4-Flash (D 512, W 128, CSA m 4 with Di 128; HCA m 128): a CSA
    layer 160 values a position, an HCA layer 4, against MLA's 576.
    """

    head_dim: int
    window: int
    ratio: int = 0
    overlap: bool = False
    index_dim: int = 0
    kind: str = "compressed"

    def __post_init__(self) -> None:
        check_field(self.kind == "compressed", "cache kind", self.kind)
        check_field(self.head_dim > 0, "head_dim", self.head_dim)
        check_field(self.window > 0, "sliding_window", self.window)
        check_field(self.ratio >= 0, "compress_rates", self.ratio)
        check_field(self.ratio > 0 or not (self.overlap or self.index_dim), "compress_rates", self.ratio)
        check_field(self.index_dim >= 0, "index_head_dim", self.index_dim)

    @property
    def raw_width(self) -> int:
        """Values a position keeps until its compression window closes: the compressor's projection and
        gate logits (2 D each with overlap, else D), and the indexer's (2 Di each)."""
        if not self.ratio:
            return 0
        return 2 * (2 if self.overlap else 1) * self.head_dim + 4 * self.index_dim

    @property
    def raw_span(self) -> int:
        """The most positions before the next one whose projections its compression may still read:
        the open window's (m - 1), and with overlap the whole window before it (m)."""
        return 0 if not self.ratio else self.ratio - 1 + (self.ratio if self.overlap else 0)

    @property
    def entry_width(self) -> int:
        return self.head_dim + self.index_dim

    def ring_rows(self) -> tuple[int, int]:
        """Rows of the window's ring and of the projections' ring (layers/cache.py `CompressedRows`)."""
        return self.window - 1 + COMPRESSED_REACH, (self.raw_span + COMPRESSED_REACH if self.ratio else 0)

    def entries(self, positions: int) -> int:
        """Compressed entries a session of `positions` positions holds room for."""
        return -(-positions // self.ratio) if self.ratio else 0

    def fixed_bytes(self, itemsize: int) -> int:
        """What a session holds whatever its length: the rings, the snapshots of the window and open
        projections, and one entry of rounding (`bytes_per_position` rounds the rest up)."""
        window, raw = self.ring_rows()
        rings = window * self.head_dim + raw * self.raw_width
        snapshots = COMPRESSED_SNAPSHOTS * ((self.window - 1) * self.head_dim + self.raw_span * self.raw_width)
        return (rings + snapshots + (self.entry_width if self.ratio else 0)) * itemsize

    def bytes_per_position(self, itemsize: int) -> int:
        """An entry's bytes over the `ratio` positions it stands for, rounded up (0: window only)."""
        return -(-self.entry_width * itemsize // self.ratio) if self.ratio else 0


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """One layer's DeepSeek-V4 attention (kind "compressed"): one key-value head whose rows are keys
    and values at once, read over a sliding window and over compressed entries.

    num_heads (A) query heads of head_dim (D), from a low-rank query (`q_lora_rank`, normed, then
    each head's D normed without a weight); one key-value row of D per position (normed);
    RoPE in interleaved pairs on the LAST `rope_dim` (Dr) dims of each, by `rope` (DeepSeek-V4's
    "main" RoPE for a window-only layer, its "compress" RoPE for the others); the attention's
    output turned back by the same angle at its query's position (keys are values, so each
    read value carries its own position: the reverse turn leaves its distance to the query).
    Each head has a sink logit (as gpt-oss). The output projection is grouped: the A heads in
    `o_groups` groups, each group's A D / g values to `o_lora_rank`, then all g of those to H.

    window (W):  a query reads the rows of its position and the W - 1 before.
    ratio (m):   every m positions are compressed into one entry a query reads once its m
                 positions are all at or before it (0: no compression, the window only: a
                 "sliding_attention" layer). An entry: the softmax over the window's positions of
                 gate logits (plus a learned bias per position in the window) weighting their
                 projections, summed, normed, and turned by RoPE at the window's first position.
    index_heads (Hi), index_head_dim (Di), index_topk (k): the indexer of a "compressed sparse
                 attention" layer (0 heads: none, a "heavily compressed" layer, which reads every
                 entry). Its entries are its own compression of the same windows at Di; a query
                 q_i = Wq_i(query latent) [Hi, Di], rotated at its position, scores entry j as
                 sum_h w_h relu(q_i[h] . e_j) / sqrt(Di), w = x Ww / sqrt(Hi), and reads only its k
                 best entries (all while there are at most k). With an indexer an entry overlaps
                 two windows (`CompressedCacheSpec.overlap`).
    norm_eps:    epsilon of every RMSNorm of the layer (the model's rms_norm_eps).
    """

    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    rope: RopeSpec = RopeSpec()
    ratio: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    norm_eps: float = 1e-6
    kind: str = "compressed"

    def __post_init__(self) -> None:
        check_field(self.kind == "compressed", "attention kind", self.kind)
        for name, value in (("num_attention_heads", self.num_heads), ("head_dim", self.head_dim),
                            ("q_lora_rank", self.q_lora_rank), ("o_lora_rank", self.o_lora_rank),
                            ("sliding_window", self.window)):
            check_field(value > 0, name, value)
        check_field(0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0, "partial_rotary_factor", self.rope_dim)
        check_field(self.o_groups > 0 and self.num_heads % self.o_groups == 0, "o_groups", self.o_groups)
        check_field(self.ratio >= 0, "compress_rates", self.ratio)
        if self.index_heads:
            check_field(self.ratio > 0, "compress_rates", self.ratio)
            check_field(self.index_head_dim >= self.rope_dim, "index_head_dim", self.index_head_dim)
            check_field(self.index_topk > 0, "index_topk", self.index_topk)

    @property
    def indexed(self) -> bool:
        return self.index_heads > 0

    @property
    def cache(self) -> CompressedCacheSpec:
        return CompressedCacheSpec(self.head_dim, self.window, self.ratio, self.indexed,
                                   self.index_head_dim if self.indexed else 0)

    @property
    def group_width(self) -> int:
        """Each output group's input: A D / g."""
        return self.num_heads * self.head_dim // self.o_groups

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of the matrices quantization stores: Wq_a, Wq_b, Wkv, Wo_b. The grouped Wo_a
        (a matrix per group, read as one block-diagonal product), the compressor's and the indexer's
        projections stay in float, as DeepSeek ships them."""
        return [(self.q_lora_rank, hidden), (self.num_heads * self.head_dim, self.q_lora_rank),
                (self.head_dim, hidden), (hidden, self.o_groups * self.o_lora_rank)]

    def param_count(self, hidden: int) -> int:
        d, m = self.head_dim, self.ratio
        own = self.q_lora_rank + d + self.num_heads + self.o_groups * self.o_lora_rank * self.group_width
        compressor = 0
        if m:  # kv and gate projections, the bias per window position, the norm
            width = (2 if self.indexed else 1) * d
            compressor = 2 * width * hidden + m * width + d
        indexer = 0
        if self.indexed:
            hi, di = self.index_heads, self.index_head_dim
            indexer = 2 * 2 * di * hidden + m * 2 * di + di + hi * di * self.q_lora_rank + hi * hidden
        return sum(r * c for r, c in self.matrices(hidden)) + own + compressor + indexer
