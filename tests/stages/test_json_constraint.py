"""JSON-constrained decoding: the prefix checker against `json`, schema shapes, the lazy mask
against a full-vocabulary mask on the real tokenizer, and answers that always close within their
token budget (the shortest closing, forced as the budget runs out)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.stages.decoding.constrained import CannotClose, ConstrainedSampler, Form, JsonConstraint
from tessera.stages.decoding.generate import prompt_ids
from tessera.stages.text.json_prefix import (
    ANY, COMPLETE, INVALID, JSON_OBJECT, PREFIX, UnsupportedSchema, check, closing, compile_schema, parse,
)
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


# -- the shortest closing, and answers that always close -----------------------------------------

def assert_closes(prefix: str, shape) -> str:
    tail = closing(prefix, shape)
    assert tail is not None and check(prefix + tail, shape) == COMPLETE, (prefix, tail)
    json.loads(prefix + tail)
    for k in range(len(tail)):  # a shortest closing is one along the way, too (what the plan relies on)
        assert len(closing(prefix + tail[:k], shape)) == len(tail) - k, (prefix, tail, k)
    return tail


@settings(max_examples=100, deadline=None)
@given(JSON_VALUES, st.sampled_from([None, 2]))
def test_every_prefix_closes(value, indent):
    text = json.dumps(value, indent=indent, ensure_ascii=False)
    for cut in range(len(text) + 1):
        assert_closes(text[:cut], ANY)
    assert closing(text + "x", ANY) is None


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({"name": st.text(max_size=6), "age": st.integers(-99, 10**9)},
                             optional={"tags": st.lists(st.sampled_from(["a", "bc"]), max_size=3),
                                       "ok": st.booleans(), "score": st.none() | st.floats(-1e3, 1e3)}),
       st.sampled_from([None, 1]))
def test_every_prefix_of_a_schema_document_closes(value, indent):
    text = json.dumps(value, indent=indent)
    shape = compile_schema(SCHEMA)
    for cut in range(len(text) + 1):
        assert_closes(text[:cut], shape)


def shortest_by_search(prefix: str, shape, alphabet: str, longest: int) -> int:
    """The length of the shortest closing found by trying every string over `alphabet`."""
    frontier = [""]
    for length in range(longest + 1):
        if any(check(prefix + t, shape) == COMPLETE for t in frontier):
            return length
        frontier = [t + ch for t in frontier for ch in alphabet if check(prefix + t + ch, shape) != INVALID]
    return longest + 1


@pytest.mark.parametrize("prefix, schema", [
    ('{"a": [1, {"b": "x', {}), ('{"a": -', {}), ('{"a": 1.5e', {}), ('[tr', {}), ('{"x\\u00', {}),
    ('{', {"type": "object", "required": ["n"], "properties": {"n": {"type": ["null", "integer"]}}}),
    ('{"k": ', {"type": "object", "properties": {"k": {"enum": ["long", "ab", 7]}}}),
    ('[{"b', {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                          "properties": {"bc": {"type": "boolean"}, "b": {"type": "array"}}}}),
])
def test_the_closing_is_the_shortest(prefix, schema):
    """No string over the closing's own characters and a few others closes the text sooner."""
    tail = assert_closes(prefix, compile_schema(schema))
    assert len(tail) <= 6
    alphabet = "".join(sorted(set(tail + '"0}]a')))
    assert shortest_by_search(prefix, compile_schema(schema), alphabet, len(tail)) == len(tail)


def test_a_framed_document_closes_with_its_markers():
    shape = compile_schema({"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}})
    assert parse("<call>", shape, prefix="<call>\n", suffix="\n</call>") == (PREFIX, '\n{"q":""}\n</call>')
    assert parse('<call>\n{"q":"a"}\n</', shape, prefix="<call>\n", suffix="\n</call>") == (PREFIX, "call>")
    assert parse('<call>\n{"q":"a"}\n</call>', shape, prefix="<call>\n", suffix="\n</call>")[0] == COMPLETE
    assert parse('<call>\n{"q":"a"} ', shape, prefix="<call>\n", suffix="\n</call>")[0] == INVALID


class StubbornModel:
    """Logits that never want to close anything: a fixed ranking of the tokens that keep a number
    growing, a string going, an array or an object opening another level."""

    def __init__(self, tokenizer: Tokenizer, favourites: str) -> None:
        self.logits = torch.full((49152,), -10.0)
        for rank, piece in enumerate(favourites.split("|")):
            for token in tokenizer.encode(piece)[:1]:
                self.logits[token] = max(float(self.logits[token]), 100.0 - rank)

    def row(self) -> torch.Tensor:
        return self.logits


STUBBORN = [
    ({"type": "integer"}, "1|2|9"),
    ({"type": "object", "required": ["city", "population"], "additionalProperties": False,
      "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}}, '{"|city|": "|aaaa|a|,|1|9|"'),
    ({"type": "array", "items": {"type": "array", "items": {"type": "string"}}}, '[[|[|"|ab|,|"'),
    ({"type": "object", "required": ["a"], "properties": {"a": {"type": "object", "required": ["b", "c"],
      "properties": {"b": {"type": "array", "items": {"type": "integer"}}, "c": {"type": "string"}}}}},
     '{"|a|":|{"|b|[|1|,|"|x'),
    ({}, '{"|[|{|"a|":|[1|,'),  # any value: objects and arrays nest without end
]


@pytest.mark.parametrize("schema, favourites", STUBBORN)
def test_a_stubborn_greedy_answer_closes_in_every_budget(smol_tokenizer, schema, favourites):
    """Whatever the budget (from the least that fits up), the greedy answer is a whole document
    ending with end-of-sequence within it; a budget one short is refused up front."""
    shape, eos = compile_schema(schema), [2]
    model = StubbornModel(smol_tokenizer, favourites)
    least = len(smol_tokenizer.encode(closing("", shape))) + 1
    with pytest.raises(CannotClose) as refused:
        JsonConstraint(shape, smol_tokenizer, eos).limit(least - 1)
    assert refused.value.needed == least and "max_tokens" in str(refused.value)
    longest = ""
    for budget in [least, least + 2, least + 12]:
        sampler = ConstrainedSampler(SamplingParams(), JsonConstraint(shape, smol_tokenizer, eos))
        sampler.constraint.limit(budget)
        out = []
        while not out or out[-1] not in eos:
            assert len(out) < budget, (budget, smol_tokenizer.decode(out))
            out.append(sampler.sample(model.row()))
        text = smol_tokenizer.decode(out)
        assert check(text, shape) == COMPLETE, (budget, text)
        json.loads(text)
        longest = max(longest, text, key=len)
    unbounded = ConstrainedSampler(SamplingParams(), JsonConstraint(shape, smol_tokenizer, eos))
    run = [unbounded.sample(model.row()) for _ in range(least + 20)]
    if schema != {"type": "integer"}:  # (a bare number is whole after its first digit)
        assert 2 not in run and len(smol_tokenizer.decode(run)) > len(longest)  # without a budget it never ends


def test_sampled_answers_close_too(smol_tokenizer):
    shape = compile_schema(STUBBORN[1][0])
    model = StubbornModel(smol_tokenizer, STUBBORN[1][1])
    for seed in range(3):
        sampler = ConstrainedSampler(SamplingParams(temperature=1.0, seed=seed), JsonConstraint(shape, smol_tokenizer, [2]))
        sampler.constraint.limit(20)
        out = [sampler.sample(model.row()) for _ in range(20)]
        assert 2 in out and check(smol_tokenizer.decode(out[: out.index(2)]), shape) == COMPLETE


CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}}}


@pytest.mark.parametrize("budget", [16, 40])
def test_the_city_schema_closes_on_the_real_model(local_engine, budget):
    """Issue 34: greedy SmolLM2 ran the population to max_tokens (`"population": 1111111111111111`)."""
    tokenizer = local_engine.tokenizer
    constraint = JsonConstraint(compile_schema(CITY), tokenizer, local_engine.spec.eos_token_ids)
    ids = local_engine.generate_ids(prompt_ids(tokenizer, "Give the city, country and population of Paris as JSON.",
                                              raw=False), max_new_tokens=budget, constraint=constraint)
    value = json.loads(tokenizer.decode(ids))
    assert ids[-1] in local_engine.spec.eos_token_ids and len(ids) <= budget
    assert value["city"].startswith("Paris"[: len(value["city"])]) and isinstance(value["population"], int)
    with pytest.raises(CannotClose):
        local_engine.generate_ids([1, 2, 3], max_new_tokens=5, constraint=JsonConstraint(
            compile_schema(CITY), tokenizer, local_engine.spec.eos_token_ids))


def test_a_tool_call_form_is_forced_or_free(smol_tokenizer):
    """With an opener, an answer that starts otherwise is free text; one that starts the opener is held
    to the forms (one per tool) and closes. Without one, the form is forced from the first token."""
    args = compile_schema({"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}},
                           "additionalProperties": False})
    forms = [Form(args, '<tool_call>\n{"name": "search", "arguments": ', "}\n</tool_call>")]
    free = JsonConstraint(forms, smol_tokenizer, [2], opener="<tool_call>")
    free.limit(30)
    for token in smol_tokenizer.encode("Sure"):
        assert free.allows(token)
        free.advance(token)
    assert free.free and free.allows(2) and free.allows(smol_tokenizer.encode(" }")[0])

    stubborn = StubbornModel(smol_tokenizer, "x|<")
    for opener in ("<tool_call>", None):
        sampler = ConstrainedSampler(SamplingParams(), JsonConstraint(forms, smol_tokenizer, [2], opener=opener))
        sampler.constraint.limit(80)  # room for the stubborn "x"s (the rest is written a character at a time)
        out: list[int] = []
        while not out or out[-1] != 2:
            text = sampler.constraint.text
            started = opener is not None and len(text) < len(opener)  # the model begins a call by itself
            row = stubborn.row().clone()
            if started:
                row[smol_tokenizer.encode(opener[len(text):])[0]] = 1000.0
            out.append(sampler.sample(row))
        text = smol_tokenizer.decode(out)
        prefix, suffix = forms[0].prefix, forms[0].suffix
        assert text.startswith(prefix) and text.endswith(suffix) and len(out) <= 80 and not sampler.constraint.free
        assert json.loads(text[len(prefix):-len(suffix)])["q"].startswith("xx")


def test_an_opened_call_that_cannot_fit_is_not_begun(smol_tokenizer):
    """With an opener and too small a budget for any call, the answer stays free text (never a
    call cut short), even when the model wants the opener most."""
    args = compile_schema({"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}})
    forms = [Form(args, '<tool_call>\n{"name": "search", "arguments": ', "}\n</tool_call>")]
    sampler = ConstrainedSampler(SamplingParams(), JsonConstraint(forms, smol_tokenizer, [2], opener="<tool_call>"))
    sampler.constraint.limit(10)
    model = StubbornModel(smol_tokenizer, "<|tool|_call|>|\n|Sure")
    out = [sampler.sample(model.row()) for _ in range(10)]
    assert sampler.constraint.free and not smol_tokenizer.decode(out).startswith("<tool_call>")


def test_a_tokenizer_that_does_not_concatenate_closes_a_character_at_a_time(smol_tokenizer):
    """Where encoding pieces apart is not the text together (SentencePiece prepends a space), the
    plan writes the closing one character-token at a time."""

    class Spaced:  # encodes as a SentencePiece tokenizer would: a space before every encoding
        def __init__(self, inner):
            self.inner = inner

        def encode(self, text):
            return self.inner.encode(" " + text)

        def decode(self, ids, **kw):
            return self.inner.decode(ids, **kw)

        def token_id(self, token):
            return self.inner.token_id(token)

    shape = compile_schema(CITY)
    constraint = JsonConstraint(shape, Spaced(smol_tokenizer), [2])
    assert not constraint.concatenates
    constraint.limit(60)
    assert smol_tokenizer.decode(constraint.plan) == closing("", shape) and len(constraint.plan) == len(closing("", shape))


def test_the_screen_judges_few_candidates_and_changes_no_token(tmp_path, monkeypatch):
    """Issue 46, item 6: a tool call on a tiny random-weight model with a 150k vocabulary took
    minutes: every step judged (decoded and parsed) tens of thousands of candidates before the
    first allowed one (cProfile: parse 60 %, decode 20 %). The screen rejects by the start of a
    token's text first; the tokens drawn are the same as without it, greedy and sampled."""
    from tokenizers import Tokenizer as HFTokenizer

    from tessera.stages.decoding import constrained
    from tessera.stages.weights.synth import byte_tokenizer_json

    vocab = 30000  # bytes, the ChatML specials, and fillers ("<unused123>") as a synthesised model has
    tokenizer = Tokenizer(HFTokenizer.from_str(byte_tokenizer_json(vocab)))
    args = compile_schema({"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}},
                           "additionalProperties": False})
    forms = [Form(args, '<tool_call>\n{"name": "get_weather", "arguments": ', "}\n</tool_call>")]
    eos = [tokenizer.token_id("<|im_end|>")]

    def run(params: SamplingParams, steps: int) -> tuple[list[int], int]:
        sampler = ConstrainedSampler(params, JsonConstraint(forms, tokenizer, eos))
        sampler.constraint.limit(120)
        generator = torch.Generator().manual_seed(3)
        out = [sampler.sample(torch.randn(vocab, generator=generator)) for _ in range(steps)]
        return out, sampler.constraint.checked

    for params, steps in ((SamplingParams(), 12), (SamplingParams(temperature=1.0, seed=5), 6)):
        screened, judged = run(params, steps)
        assert judged < steps * vocab // 100, judged  # under 1 % of the vocabulary a step
        with monkeypatch.context() as unscreened:
            unscreened.setattr(constrained.JsonConstraint, "screen", lambda self, size: None)
            plain, judged_plain = run(params, steps)
        assert screened == plain and judged_plain > 10 * judged
        assert tokenizer.decode(screened).startswith("<tool_call>"[:steps])
