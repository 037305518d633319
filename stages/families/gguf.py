"""How llama.cpp's GGUF files describe a family: its metadata keys and its tensor names, as data.

A GGUF file names its family in `general.architecture` (llama.cpp's names: "llama", "qwen2",
"qwen3", "qwen3moe" ...) and its sizes under that prefix (`qwen3.embedding_length`). A family
module that reads GGUF files says so with a `GgufForm`: the architecture name, the Hugging Face
config.json its metadata describes (`config`; most families start from `llama_block_config`,
the keys every llama.cpp decoder writes), whether it `claims` a file (two families share
"llama": Mixtral is a llama-architecture file with experts), and whether llama.cpp permuted
its q/k rows for its RoPE (`permuted_rope`: the converter and stages/weights/gguf_blocks.py undo
it). stages/weights/convert.py reads the file and writes the folder; nothing there names a family.

Tensor names: `TENSOR_NAMES` maps llama.cpp's names of a decoder's tensors to the Hugging
Face names (`{i}` the layer), and a sparse layer's stacked experts (`blk.N.ffn_gate_exps`
[E, I, H] ...) become one tensor per expert under the family's `ExpertNames` (`hf_tensors`).
No torch and no numpy here: the metadata is read through `GgufMetadata`, a lookup the caller
gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tessera.stages.families.tensors import ExpertNames

# llama.cpp tensor names -> Hugging Face names ({i} = layer)
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    # Qwen3's per-head q/k norms
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
# a sparse MLP's tensors in llama.cpp: the router, and the experts stacked on dim 0 ([E, rows, cols])
ROUTER_TENSOR = "ffn_gate_inp"
EXPERT_TENSORS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}

_REQUIRED = object()


class GgufMetadata:
    """A GGUF file's metadata as a family reads it: `value(key)` by full key, `arch(suffix)` under the
    file's `general.architecture`, and the names of the tensors it holds."""

    def __init__(self, lookup: Callable[[str], Any], tensor_names: frozenset[str]) -> None:
        self._lookup = lookup  # key -> its value, or None when the file has no such key
        self.tensor_names = tensor_names
        self.architecture = lookup("general.architecture")

    def value(self, key: str, default: Any = None) -> Any:
        found = self._lookup(key)
        return default if found is None else found

    def arch(self, suffix: str, default: Any = _REQUIRED) -> Any:
        """`{architecture}.{suffix}`; a required key the file lacks is a KeyError (the converter's
        caller turns it into a ModelFormatError naming it)."""
        found = self._lookup(f"{self.architecture}.{suffix}")
        if found is None:
            if default is _REQUIRED:
                raise KeyError(f"{self.architecture}.{suffix}")
            return default
        return found

    @property
    def experts(self) -> int:
        """Experts per sparse layer (0: a dense model)."""
        return int(self.arch("expert_count", 0) or 0)


@dataclass(frozen=True)
class GgufForm:
    """How GGUF files describe one family (module docstring)."""

    architecture: str
    config: Callable[[GgufMetadata], dict[str, Any]]
    claims: Callable[[GgufMetadata], bool] = lambda meta: True
    permuted_rope: bool = False


def llama_block_config(meta: GgufMetadata, architecture: str) -> dict[str, Any]:
    """The config.json keys every llama.cpp decoder's metadata gives (`architecture`: the
    transformers class the family's configs name)."""
    hidden = int(meta.arch("embedding_length"))
    heads = int(meta.arch("attention.head_count"))
    tokens = meta.value("tokenizer.ggml.tokens") or []
    return {
        "architectures": [architecture],
        "vocab_size": int(meta.arch("vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch("feed_forward_length")),
        "num_hidden_layers": int(meta.arch("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.arch("attention.head_count_kv", heads)),
        "head_dim": int(meta.arch("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.arch("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.arch("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
        "bos_token_id": meta.value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.value("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }


def biased_attention(meta: GgufMetadata) -> bool:
    """Whether the file's q/k/v projections carry biases (Qwen2's always do)."""
    return "blk.0.attn_q.bias" in meta.tensor_names


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of one of `TENSOR_NAMES` (None for any other)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        pattern = "blk.{i}." + ".".join(parts[2:])
        target = TENSOR_NAMES.get(pattern)
        return target.replace("{i}", parts[1]) if target else None
    return TENSOR_NAMES.get(gguf_name)


def hf_tensors(gguf_name: str, experts: ExpertNames, num_experts: int) -> list[tuple[str, int | None]]:
    """The checkpoint tensors a GGUF tensor becomes: [(name, None)] for one of TENSOR_NAMES or a
    router; [(expert e's name, e)] for a stacked expert tensor; [] if it has no counterpart."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[1].isdigit() and parts[3] == "weight":
        prefix = f"model.layers.{parts[1]}.{experts.block}."
        if parts[2] == ROUTER_TENSOR:
            return [(prefix + "gate.weight", None)]
        if parts[2] in EXPERT_TENSORS:
            which = getattr(experts, EXPERT_TENSORS[parts[2]])
            return [(f"{prefix}experts.{e}.{which}.weight", e) for e in range(num_experts)]
    name = hf_name(gguf_name)
    return [(name, None)] if name else []
