"""JSON-constrained decoding: the prefix checker against `json`, schema shapes, and the lazy mask
against a full-vocabulary mask on the real tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.stages.decoding.constrained import ConstrainedSampler, JsonConstraint
from tessera.stages.text.json_prefix import ANY, COMPLETE, INVALID, JSON_OBJECT, PREFIX, UnsupportedSchema, check, compile_schema
from tessera.stages.decoding.sampling import SamplingParams
from tessera.stages.text.tokenizer import Tokenizer

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES, st.sampled_from([None, 2]), st.booleans())
def test_every_prefix_of_a_document_is_a_prefix(value, indent, ascii_only):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert check(text, ANY) == COMPLETE
    for cut in range(len(text)):
        assert check(text[:cut], ANY) in (PREFIX, COMPLETE), text[:cut]
    assert check(text + "x", ANY) == INVALID and check(text + " ", ANY) == INVALID  # nothing after the end


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]",:0123456789.-+eEtrufalsn \\ab', max_size=14))
def test_complete_means_json_parses(text):
    verdict = check(text, ANY)
    try:
        json.loads(text)
        parses = True
    except ValueError:
        parses = False
    if verdict == COMPLETE:
        assert parses, text
    if parses and text == text.strip():  # no whitespace around a document (module docstring)
        assert verdict == COMPLETE, text


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "bc"]}},
                         "ok": {"type": "boolean"}, "score": {"type": ["number", "null"]}}}


@pytest.mark.parametrize("text, verdict", [
    ('{"name": "Bo", "age": 3', PREFIX), ('{"name": "Bo", "age": 3}', COMPLETE),
    ('{"name": "Bo", "age": 3.5', INVALID),  # an integer
    ('{"age": 3}', INVALID),  # name is required
    ('{"nam', PREFIX), ('{"nom', INVALID), ('{"name": 1', INVALID),
    ('{"name": "B", "age": 1, "name"', INVALID),  # twice
    ('{"name":"B","age":1,"tags":["b', PREFIX), ('{"name":"B","age":1,"tags":["x', INVALID),
    ('{"name":"B","age":1,"score":-1.5e3}', COMPLETE), ('{"name":"B","age":1,"score":nu', PREFIX),
    ('{"name":"B","age":1,"ok":"yes"}', INVALID), ('{"n\\u0061me', INVALID),  # known keys are written plainly
    (' {', INVALID), ("[", INVALID),
])
def test_schema_shapes(text, verdict):
    assert check(text, compile_schema(SCHEMA)) == verdict


def test_json_object_mode_wants_an_object():
    assert check('{"a": [1, {"b": null}]}', JSON_OBJECT) == COMPLETE
    assert check("[1]", JSON_OBJECT) == INVALID and check('"x"', JSON_OBJECT) == INVALID
    assert check("12", compile_schema({"type": "integer"})) == COMPLETE
    assert check("1.", compile_schema({"type": "number"})) == PREFIX


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "pattern": "^a"}, "pattern"), ({"anyOf": [{}]}, "anyOf"), ({"$ref": "#/x"}, "$ref"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 2}}}, "minLength"),
    ({"type": "date"}, "type"), ({"enum": []}, "enum"), ({"type": "object", "required": ["x"]}, "required"),
])
def test_unsupported_schema_names_the_keyword(schema, keyword):
    with pytest.raises(UnsupportedSchema) as raised:
        compile_schema(schema)
    assert raised.value.keyword == keyword and keyword in str(raised.value)


@pytest.fixture(scope="module")
def tokenizer(smol_dir) -> Tokenizer:
    return Tokenizer.from_folder(smol_dir)


def full_mask(constraint: JsonConstraint, vocab: int) -> torch.Tensor:
    return torch.tensor([constraint.allows(t) for t in range(vocab)])


def test_lazy_greedy_is_the_argmax_of_the_fully_masked_logits(tokenizer):
    """The sampler tries candidates from the top down; that must be the masked argmax, step after step."""
    vocab = 49152
    generator = torch.Generator().manual_seed(0)
    shape = compile_schema({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                            "additionalProperties": False})
    lazy = ConstrainedSampler(SamplingParams(), JsonConstraint(shape, tokenizer, [2]))
    full = JsonConstraint(shape, tokenizer, [2])
    for step in range(3):
        logits = torch.randn(vocab, generator=generator)
        mask = full_mask(full, vocab)
        want = int(logits.masked_fill(~mask, float("-inf")).argmax())
        assert lazy.sample(logits) == want
        full.advance(want)
        assert 0 < int(mask.sum()) < vocab
    assert full.text == lazy.constraint.text and full.text.startswith('{')


def test_sampled_tokens_are_allowed_and_reproducible(tokenizer):
    shape = JSON_OBJECT
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(1))
    for ch in '{}"ab: ,1x[':  # most of the mass on a few characters, some of them allowed at each step
        logits[tokenizer.encode(ch)] += 12.0
    runs = []
    for _ in range(2):
        sampler = ConstrainedSampler(SamplingParams(temperature=1.0, seed=7), JsonConstraint(shape, tokenizer, [2]))
        runs.append([sampler.sample(logits) for _ in range(4)])
        assert check(sampler.constraint.text, shape) in (PREFIX, COMPLETE)
    assert runs[0] == runs[1]


def test_end_of_sequence_only_when_complete(tokenizer):
    constraint = JsonConstraint(JSON_OBJECT, tokenizer, [2])
    assert not constraint.allows(2)
    for token in tokenizer.encode("{}"):
        constraint.advance(token)
    assert constraint.text == "{}" and constraint.allows(2)
    assert not any(constraint.allows(t) for t in tokenizer.encode(" ,x"))


def test_sampling_under_the_mask_draws_from_the_conditional_distribution(tokenizer):
    """Mass on two allowed first tokens and two refused ones: draws split like the allowed pair's odds."""
    brace, brace_quote, bracket, word = (tokenizer.encode(t)[0] for t in ("{", '{"', "[", "Sure"))
    assert len({brace, brace_quote, bracket, word}) == 4
    logits = torch.full((49152,), -30.0)
    logits[[brace, brace_quote, bracket, word]] = torch.tensor([1.0, 2.0, 3.0, 3.0])  # brace : brace_quote = 1 : e
    sampler = ConstrainedSampler(SamplingParams(temperature=1.0, seed=3), JsonConstraint(JSON_OBJECT, tokenizer, [2]))
    draws = [sampler.draw_allowed(logits) for _ in range(600)]
    assert set(draws) == {brace, brace_quote}
    share = draws.count(brace) / len(draws)
    assert abs(share - 1 / (1 + 2.718281828)) < 0.06, share  # 0.269; 4.4 standard deviations of 600 draws
