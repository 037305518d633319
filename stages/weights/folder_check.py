"""Check a whole model folder before it is registered: one clear error, and nothing half-made.

`check_folder` reads only headers and small files: the config (through its family's
reader, which refuses settings the engine does not implement), the tokenizer and its
chat template, and every weight file's tensor table — names, shapes and dtypes — against
what the spec says the model holds (in any layout the family accepts: MoE experts one
tensor each as published, or fused as transformers 5 can write them). No tensor data is
read, so checking a 70B folder costs what its headers cost.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors import SafetensorError, safe_open

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import FAMILIES, edge_names, layer_matrices, tensors_of_layer
from tessera.stages.families.shipped import FLOAT_DTYPES, ShippedFormat
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.tensors import INTEGER_DTYPES, INTEGER_TENSORS, Stacked, edge_tensors
from tessera.stages.text.tokenizer import Tokenizer
from tessera.stages.weights.folder import WeightFolder

# tensors older checkpoints carry that the engine recomputes from the config instead
RECOMPUTED_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)
# per ModelSpec.prefix, the checkpoint's tensors outside the text model we run: Qwen-style MTP
# layers ("mtp.": drafting with them is a later step), and a multimodal checkpoint's vision tower
NOT_RUN_PREFIXES = {"model.": ("mtp.",), "model.language_model.": ("mtp.", "model.visual.")}

# a stored tensor: its shape and the safetensors dtypes it may have
Stored = tuple[tuple[int, ...], tuple[str, ...]]


def expected_tensors(spec: ModelSpec, held: set[str]) -> dict[str, Stored]:
    """Every tensor a folder for `spec` holding tensors `held` must hold, with its shape and dtypes:
    of each engine tensor's layouts, the first `held` has completely (else the first, to be
    missing). A model that ships quantized (families/shipped.py) holds each matrix of its layers
    in its stored form; float tensors are F32, F16 or BF16."""
    shipped = spec.shipped
    out: dict[str, Stored] = {}
    for name, shape in edge_tensors(spec).items():  # under the first of its names the folder holds
        out.update(_dense(spec, next((n for n in edge_names(spec, name) if n in held), name), shape, held))
    for layer in range(spec.num_layers):
        matrices = {p + ".weight" for p in layer_matrices(spec, layer)} if shipped is not None else set()
        for ours, choices in tensors_of_layer(spec, layer).items():
            def stored(source: Stacked) -> dict[str, Stored]:
                if ours in INTEGER_TENSORS:
                    return {n: (shape, INTEGER_DTYPES) for n, shape in zip(source.names, source.shapes)}
                if shipped is None or ours not in matrices:
                    return {k: v for n, shape in zip(source.names, source.shapes) for k, v in _dense(spec, n, shape, held).items()}
                return {k: v for i, n in enumerate(source.names) for k, v in shipped.stored_tensors(n, source.shapes[i]).items()}
            out.update(next((found for found in map(stored, choices) if set(found) <= held), stored(choices[0])))
    return out


def _dense(spec: ModelSpec, name: str, shape: tuple[int, ...], held: set[str]) -> dict[str, Stored]:
    """A tensor a span holds dense (embedding, head, norm, router, MLA's wkv_b) as stored: float, unless
    the folder holds it quantized (stages/weights/formats/load.py `dense_tensor` reads whichever form it finds)."""
    shipped = spec.shipped
    if shipped is not None and len(shape) >= 2:
        if name + "_scale_inv" in held:
            return ShippedFormat("fp8", block=shipped.block).stored_tensors(name, shape)
        if name + "_blocks" in held:
            return ShippedFormat("mxfp4").stored_tensors(name, shape)
        if shipped.method == "gguf" or (shipped.method in ("nvfp4", "int4") and shipped.form_of(name) != "float"):
            return shipped.stored_tensors(name, shape)
    return {name: (shape, FLOAT_DTYPES)}


def tensor_table(weights: WeightFolder) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} of every tensor the folder's files hold (headers only)."""
    table: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in weights.files():
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    table[name] = (tuple(piece.get_shape()), piece.get_dtype())
        except (SafetensorError, OSError) as bad:
            raise ModelFormatError(f"cannot read {str(path)!r}: {bad}") from None
    return table


def check_tensors(spec: ModelSpec, weights: WeightFolder) -> None:
    """Raise ModelFormatError for a missing, unexpected or misshapen tensor (UnsupportedModel for a
    dtype the model's form does not store there: integer weights without a quantization_config)."""
    table = tensor_table(weights)
    expected = expected_tensors(spec, set(table))
    listed_elsewhere = sorted(weights.names() - set(table))
    if listed_elsewhere:
        raise ModelFormatError(
            f"the index lists tensor {listed_elsewhere[0]!r} but its file does not hold it"
        )
    missing = sorted(set(expected) - set(table))
    if missing:
        raise ModelFormatError(f"tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
    # a tied model may still carry lm_head.weight; transformers ignores it and so do we
    ignorable = {"lm_head.weight"} if spec.tie_embeddings else set()
    # multi-token-prediction modules after the decoder layers (DeepSeek-V3, GLM-4.5) or under "mtp."
    # (Qwen3-Next, Qwen3.5), a multimodal checkpoint's vision tower, and where the family keeps what it
    # does not run (MiMo-V2-Flash's "model.mtp.", Gemma 4's KV-shared layers' key projections): not run
    not_run = tuple(f"{spec.prefix}layers.{i}." for i in range(spec.num_layers, spec.num_layers + spec.mtp_layers))
    not_run += NOT_RUN_PREFIXES.get(spec.prefix, ()) + FAMILIES[spec.family].not_run(spec)
    unexpected = sorted(
        n for n in set(table) - set(expected) - ignorable
        if not n.endswith(RECOMPUTED_SUFFIXES) and not n.startswith(not_run) and not empty(table[n][0])
    )
    if unexpected:
        raise UnsupportedModel(
            f"tensor {unexpected[0]!r} is not part of a {spec.family} model as configured "
            f"({len(unexpected)} unexpected in all)"
        )
    for name, (shape, dtypes) in sorted(expected.items()):
        actual, dtype = table[name]
        if actual != shape:
            raise ModelFormatError(f"tensor {name!r} has shape {actual!r}, expected {shape!r}")
        if dtype not in dtypes:
            form = f"as {spec.shipped.method} ships it" if spec.shipped is not None else "float weights only"
            raise UnsupportedModel(f"tensor {name!r} has dtype {dtype!r} ({form}: {' or '.join(dtypes)})")


def empty(shape: tuple[int, ...]) -> bool:
    """A tensor with no elements computes nothing: transformers saves DeepSeek's and GLM's shared
    experts as [0, H] and [H, 0] when `n_shared_experts` is 0 (the spec then has none)."""
    return 0 in shape


def check_tokenizer(spec: ModelSpec, folder: Path) -> None:
    """Raise ModelFormatError when the tokenizer is absent or unreadable, holds ids past the
    embedding, or its chat template does not compile."""
    if not (folder / "tokenizer.json").exists():
        raise ModelFormatError(f"{str(folder)!r} has no tokenizer.json (tessera reads Hugging Face fast tokenizers)")
    tokenizer = Tokenizer.from_folder(folder)
    size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
    if size > spec.vocab_size:
        raise ModelFormatError(
            f"tokenizer.json has {size} tokens but config vocab_size is {spec.vocab_size}: "
            "ids past the embedding could not be run"
        )
    if tokenizer.chat_template is not None:
        try:
            ImmutableSandboxedEnvironment().parse(tokenizer.chat_template)
        except TemplateError as bad:
            raise ModelFormatError(f"the chat template of {str(folder)!r} does not parse: {bad}") from None


def check_folder(folder: Path) -> ModelSpec:
    """Everything `tessera model import` checks before it registers `folder`; returns its spec.

    Raises ModelFormatError or UnsupportedModel, each naming the file, key or tensor at fault.
    """
    folder = Path(folder)
    weights = WeightFolder(folder)  # parses config.json into a ModelSpec, with its refusals
    for path in weights.files():
        if not path.exists():
            raise ModelFormatError(f"the safetensors index names {path.name!r}, which is not in {str(folder)!r}")
    check_tensors(weights.spec, weights)
    check_tokenizer(weights.spec, folder)
    return weights.spec
