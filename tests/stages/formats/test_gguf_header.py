"""A crafted GGUF header is refused in one line, before anything trusts it (stages/weights/gguf_directory.py).

A tiny Llama GGUF (one layer, Q4_1 matrices, a Q8_0 embedding, written with the gguf package's
writer) is imported as it is; then its header is mutated the ways an attacker (or a broken
download) would: a tensor count, a key/value count or a string length of 2^60 (the gguf package's
reader ended in an IndexError), a tensor's type relabelled (Q4_1 read as Q8_0 imported, and the
model answered token 0), a dimension or an offset changed, and any byte of the header replaced
(hypothesis). Each is refused with one ModelFormatError (or UnsupportedModel) line by the header
walk and by the import; none raises anything else.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.weights.convert import convert_gguf
from tessera.stages.weights.gguf_directory import read_gguf_directory

HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 64, 128, 288, 4, 2
HUGE = 1 << 60


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def write_tiny_gguf(path: Path) -> Path:
    """A one-layer Llama GGUF: Q4_1 layer matrices, a Q8_0 embedding, F32 norms, a vocabulary of names."""
    import gguf
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    writer.add_eos_token_id(1)

    def put(name: str, shape: tuple[int, ...], kind: str) -> None:
        w = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, quantize(w, GGMLQuantizationType[kind]), raw_dtype=GGMLQuantizationType[kind])

    head_dim = HIDDEN // HEADS
    put("token_embd.weight", (VOCAB, HIDDEN), "Q8_0")
    put("blk.0.attn_norm.weight", (HIDDEN,), "F32")
    put("blk.0.attn_q.weight", (HIDDEN, HIDDEN), "Q4_1")
    put("blk.0.attn_k.weight", (KV_HEADS * head_dim, HIDDEN), "Q4_1")
    put("blk.0.attn_v.weight", (KV_HEADS * head_dim, HIDDEN), "Q4_1")
    put("blk.0.attn_output.weight", (HIDDEN, HIDDEN), "Q4_1")
    put("blk.0.ffn_norm.weight", (HIDDEN,), "F32")
    put("blk.0.ffn_gate.weight", (FFN, HIDDEN), "Q4_1")
    put("blk.0.ffn_up.weight", (FFN, HIDDEN), "Q4_1")
    put("blk.0.ffn_down.weight", (HIDDEN, FFN), "Q4_1")
    put("output_norm.weight", (HIDDEN,), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def places(path: Path) -> dict[str, int]:
    """Byte offsets of the header fields a mutation aims at, found by the gguf package's reader on
    the intact file: the two counts, each key's length, each tensor's type and offset, and the end of
    the header."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    base = reader.data.ctypes.data
    at = {"n_tensors": 8, "n_fields": 16}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            at[f"key {key}"] = field.offset  # its length: the field's first 8 bytes
    for tensor in reader.tensors:
        *_, kind, offset = tensor.field.parts
        at[f"type {tensor.name}"] = kind.ctypes.data - base
        at[f"offset {tensor.name}"] = offset.ctypes.data - base
    at["header end"] = max(v for k, v in at.items() if k.startswith("offset")) + 8
    return at


def mutated(path: Path, out: Path, at: int, value: bytes) -> Path:
    data = bytearray(path.read_bytes())
    data[at : at + len(value)] = value
    out.write_bytes(bytes(data))
    return out


def refused(path: Path, tmp: Path, words: str = "") -> None:
    """The header walk and the import both refuse `path` in one ModelFormatError line (matching `words`)."""
    for attempt in (lambda: read_gguf_directory(path), lambda: convert_gguf(path, tmp / "out", keep_blocks=True)):
        with pytest.raises(ModelFormatError, match=words) as error:
            attempt()
        assert "\n" not in str(error.value)


def test_the_intact_file_reads_and_imports(tiny_gguf, tmp_path):
    tensors, architecture = read_gguf_directory(tiny_gguf)
    assert architecture == "llama" and len(tensors) == 11
    assert tensors["blk.0.attn_q.weight"].nbytes == HIDDEN * HIDDEN // 32 * 20
    convert_gguf(tiny_gguf, tmp_path / "kept", keep_blocks=True)


@pytest.mark.parametrize("field", ["n_tensors", "n_fields", "key general.architecture", "key tokenizer.ggml.tokens"])
def test_a_count_or_a_length_of_2_to_the_60_is_refused(tiny_gguf, tmp_path, field):
    at = places(tiny_gguf)[field]
    bad = mutated(tiny_gguf, tmp_path / "huge.gguf", at, HUGE.to_bytes(8, "little"))
    refused(bad, tmp_path, "more than the .* bytes left can hold")


@pytest.mark.parametrize("tensor, kind", [("blk.0.attn_k.weight", "Q8_0"), ("blk.0.ffn_down.weight", "Q8_0"),
                                          ("blk.0.attn_v.weight", "Q4_0"), ("token_embd.weight", "Q4_1")])
def test_a_relabelled_tensor_type_is_refused(tiny_gguf, tmp_path, tensor, kind):
    """Q4_1 (20 bytes a block) read as Q8_0 (34) overlaps the next tensor; read as Q4_0 (18) leaves bytes
    no tensor accounts for; the last tensor relabelled runs past the file's end or leaves bytes after it."""
    from gguf.constants import GGMLQuantizationType

    at = places(tiny_gguf)[f"type {tensor}"]
    bad = mutated(tiny_gguf, tmp_path / "relabelled.gguf", at, int(GGMLQuantizationType[kind]).to_bytes(4, "little"))
    refused(bad, tmp_path, "offset|past the end|after the last tensor")


def test_an_offset_that_overlaps_the_tensor_before_is_refused(tiny_gguf, tmp_path):
    at = places(tiny_gguf)["offset blk.0.attn_v.weight"]
    bad = mutated(tiny_gguf, tmp_path / "overlap.gguf", at, (32).to_bytes(8, "little"))
    refused(bad, tmp_path, "has offset 32, expected")


def test_the_import_refuses_before_writing_anything(tiny_gguf, tmp_path, monkeypatch):
    from tessera.peer.cli.model_files import import_model

    monkeypatch.setenv("TESSERA_MODELS", str(tmp_path / "models"))
    at = places(tiny_gguf)["type blk.0.attn_k.weight"]
    bad = mutated(tiny_gguf, tmp_path / "relabelled.gguf", at, (8).to_bytes(4, "little"))  # Q8_0
    with pytest.raises(ModelFormatError):
        import_model(bad, name="relabelled")
    from tessera.stages.weights import registry

    assert not (registry.models_root() / "relabelled").exists()


FIELDS = st.sampled_from(["n_tensors", "n_fields", "key general.architecture", "key tokenizer.ggml.tokens",
                          "type blk.0.attn_q.weight", "offset blk.0.ffn_up.weight", "type output_norm.weight"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.tuples(FIELDS, st.sampled_from([0, 1, 7, 40, 41, 255, 2**31, 2**32 - 1, 2**60, 2**64 - 1]), st.just(8)),
    st.tuples(st.just("header"), st.integers(0, 2**8 - 1), st.integers(0, 1 << 20)),
))
def test_any_mutated_header_reads_or_is_refused_in_one_line(tiny_gguf, tmp_path, mutation):
    """A field set to a boundary value, or any one header byte replaced: the walk and the import give a
    model or one typed error line, never another exception."""
    where, value, width = mutation
    at_of = places(tiny_gguf)
    if where == "header":
        at, raw = width % at_of["header end"], bytes([value])
    else:
        size = 4 if where.startswith("type") else 8
        at, raw = at_of[where], (value % (1 << (8 * size))).to_bytes(size, "little")
    bad = mutated(tiny_gguf, tmp_path / "mutated.gguf", at, raw)
    for attempt in (lambda: read_gguf_directory(bad), lambda: convert_gguf(bad, tmp_path / "out", keep_blocks=True)):
        try:
            attempt()
        except (ModelFormatError, UnsupportedModel) as error:
            assert "\n" not in str(error)
