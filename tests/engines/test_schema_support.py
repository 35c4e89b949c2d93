"""The schema walk's decisions on hand-picked tricky schemas (which backend, or which keyword at which JSON
pointer is refused), and that each backend enforces what it is given: strings that
jsonschema accepts and rejects, fed token by token to the compiled grammar of the default tokenizer. OpenAI's
strict rules: tests/gateway/test_strict_schema.py."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engines import schema_support as ss
from engines.structured import GrammarCompiler, InvalidConstraint, StructuredOutput
from engines.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
X, L = ss.XGRAMMAR, ss.LLGUIDANCE

# (schema, backend the walk picks, JSON documents to try: each must be accepted iff jsonschema accepts it)
DECIDED = [
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": -3, "maximum": 12}},
      "required": ["a"], "additionalProperties": False}, X, ['{"a": -3}', '{"a": 13}', '{}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, L,
     ['{"a": 1}', '{"a": 1, "b": 2}']),  # xgrammar drops a required key missing from properties
    ({"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}]}, L,
     ['{"a": 1}', '5', '{}']),  # xgrammar loses the sibling type
    ({"type": "object", "properties": {"a": {"type": "string"}}, "anyOf": [{"required": ["a"]}]}, L,
     ['{}', '{"a": "x"}']),  # xgrammar drops required beside anyOf
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, L, ['"a"', '1', 'true']),
    ({"type": "string", "pattern": "a"}, L, ['"a"', '"xa"', '"b"']),  # unanchored: JSON Schema searches
    ({"type": "string", "pattern": "^[0-9]{3}$"}, X, ['"123"', '"12"']),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, L, ['"abc"', '"abcd"']),
    ({"type": "number", "minimum": 0.5, "exclusiveMaximum": 1.5}, L, ['0.5', '1.5', '0.4', '1.25']),
    ({"type": "integer", "multipleOf": 3}, L, ['3', '4', '-6']),
    ({"properties": {"a": {"type": "integer"}}}, L, ['{"a": 1}', '1', '"s"', '{"a": "x"}']),
    ({"type": ["string", "integer"], "minLength": 2}, L, ['"a"', '"ab"', '1']),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "integer"}],
      "additionalItems": False}, L, ['[1]', '[1, 2]', '["a"]']),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False}, L,
     ['{"xa": 1}', '{"y": 1}']),
    ({"type": "string", "format": "date"}, L, ['"2024-02-29"', '"tomorrow"', '"2023-02-29"', '"1900-02-29"',
                                               '"2000-02-29"', '"2023-04-31"', '"0000-01-01"', '"2023-12-31"']),
    ({"type": "string", "format": "date", "pattern": "^2"}, L, ['"2024-02-29"', '"1999-01-01"', '"2023-02-29"']),
    ({"enum": ["a", {"x": [1]}]}, L, ['"a"', '{"x": [1]}', '"b"']),
    ({"$ref": "#/definitions/n", "definitions": {"n": {"type": "object", "properties": {
        "next": {"$ref": "#/definitions/n"}}, "additionalProperties": False}}}, X,
     ['{}', '{"next": {"next": {}}}', '{"next": 1}']),
    ({"x-library": {"t": {"type": "object", "properties": {"c": {"$ref": "#/x-library/t"}},
                          "additionalProperties": False}}, "$ref": "#/x-library/t"}, X,
     ['{}', '{"c": {"c": {}}}', '{"c": 1}']),  # a $ref into an unknown keyword: copied under $defs
    ({"$schema": "http://json-schema.org/draft-07/schema#", "x-library": {"n": {"type": "integer"}},
      "type": "object", "properties": {"a": {"$ref": "#/x-library/n"}}, "required": ["a"], "minProperties": 1}, L,
     ['{"a": 1}', '{"a": "x"}', '{}']),
    ({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False,
      "markdownDescription": "an editor's annotation", "x-intellij-html-description": "<b>"}, X, ['{"a": true}']),
]
# (schema, refused keyword, its JSON pointer)
REFUSED = [
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if", "/if"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "not", "/properties/a/not"),
    ({"type": "object", "$ref": "https://example.com/other.json"}, "$ref", "/$ref"),
    ({"$ref": "#/definitions/missing"}, "$ref", "/$ref"),
    ({"type": "string", "pattern": "^(?=x)x$"}, "pattern", "/pattern"),
    ({"type": "string", "pattern": "(?<!a)b"}, "pattern", "/pattern"),
    ({"type": "string", "pattern": "\\bword\\b"}, "pattern", "/pattern"),
    ({"type": "string", "pattern": "^(a)\\1$"}, "pattern", "/pattern"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems", "/uniqueItems"),
    ({"type": "array", "contains": {"const": 1}}, "contains", "/contains"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames", "/propertyNames"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "/dependentRequired"),
    ({"definitions": {"a/b": {"type": "integer", "exclusiveMinimum": True, "minimum": 1}}},
     "exclusiveMinimum", "/definitions/a~1b/exclusiveMinimum"),
    ({"type": "string", "format": "regex"}, "format", "/format"),
    ({"type": "object", "properties": {"x": {"$id": "https://example.com/x", "type": "integer"},
                                       "y": {"$ref": "#/properties/x"}}}, "$id", "/properties/x/$id"),
]


def test_the_walk_refuses_what_no_backend_enforces_naming_keyword_and_pointer():
    for schema, keyword, pointer in REFUSED:
        with pytest.raises(ss.SchemaRefused) as exc:
            ss.plan(schema)
        assert (exc.value.keyword, exc.value.pointer) == (keyword, pointer), schema
        assert f"`{keyword}`" in str(exc.value) and (pointer in str(exc.value)), str(exc.value)


def test_the_walk_strips_annotations_and_keeps_assertions():
    schema = DECIDED[-1][0]
    chosen = ss.plan(schema)
    assert chosen.backend == X
    assert chosen.schema == {k: v for k, v in schema.items() if k in ("type", "properties", "required",
                                                                    "additionalProperties")}


@pytest.fixture(scope="module")
def compiler():
    tok = Tokenizer.from_pretrained(ROOT / "models" / "tandem-tiny-s")
    return tok, GrammarCompiler(tok, tok.backend.get_vocab_size(), sorted(tok.eos_token_ids))


def _accepts(tok, compiler, compiled, text: str) -> bool:
    grammar = compiler.matcher(compiled)
    for t in tok.backend.encode(text, add_special_tokens=False).ids:
        if not grammar.matcher.accept_token(t):
            return False
    return grammar.matcher.accept_token(min(tok.eos_token_ids))


@pytest.mark.parametrize("schema, backend, docs", DECIDED, ids=[str(i) for i in range(len(DECIDED))])
def test_each_backend_accepts_exactly_what_jsonschema_accepts(compiler, schema, backend, docs):
    tok, comp = compiler
    assert ss.plan(schema).backend == backend
    compiled = comp.compile(StructuredOutput.json_schema(schema))
    checker = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    for doc in docs:
        assert _accepts(tok, comp, compiled, doc) == checker.is_valid(json.loads(doc)), (schema, doc)


def test_date_formats_are_enforced_as_calendar_dates(compiler):
    # llguidance's own date regex takes February 29 in every year; the walk hands it an exact pattern
    # instead, checked here against Python's calendar for every February of years 1-9999
    import datetime
    import re

    date = re.compile(ss.FORMAT_PATTERNS["date"])
    for year in range(1, 10000):
        for day in (28, 29, 30):
            try:
                valid = bool(datetime.date(year, 2, day))
            except ValueError:
                valid = False
            assert bool(date.match(f"{year:04d}-02-{day}")) == valid, (year, day)
    tok, comp = compiler
    compiled = comp.compile(StructuredOutput.json_schema({"type": "string", "format": "date-time"}))
    for text, ok in [("2024-02-29T10:00:00Z", True), ("2023-02-29T10:00:00Z", False),
                     ("2023-01-01T23:59:59.123+02:00", True), ("2023-01-01T24:00:00Z", False),
                     ("2023-01-01T23:59:60Z", False), ("2023-06-31T00:00:00Z", False)]:
        assert _accepts(tok, comp, compiled, json.dumps(text)) == ok, text
        if ok:
            datetime.datetime.fromisoformat(text)  # what it lets through, Python's parser takes too


def test_llguidance_refusals_name_the_keyword(compiler):
    _, comp = compiler
    schema = {"type": "object", "properties": {"v": {"oneOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        {"type": "object", "properties": {"b": {"type": "integer"}}}]}}}
    with pytest.raises(InvalidConstraint) as exc:  # not provably disjoint: llguidance will not take it
        comp.compile(StructuredOutput.json_schema(schema, "guided_json"))
    assert exc.value.where == "guided_json#/properties/v/oneOf"
    assert "`oneOf`" in str(exc.value) and "/project/" not in str(exc.value)


def test_regex_features_without_an_exact_backend_are_refused(compiler):
    _, comp = compiler
    for rx, what in [("(?=a)a", "lookaround"), ("\\bab", "word boundaries"), ("(a)\\1", "backreferences")]:
        with pytest.raises(InvalidConstraint) as exc:
            comp.compile(StructuredOutput("regex", rx, "guided_regex"))
        assert exc.value.where == "guided_regex" and what in str(exc.value)
    with pytest.raises(InvalidConstraint) as exc:  # a syntax error: xgrammar's reason, without its source path
        comp.compile(StructuredOutput("regex", "(", "guided_regex"))
    assert ".cc" not in str(exc.value) and "[" not in str(exc.value).split(":", 1)[1][:4]


def test_no_free_whitespace_on_either_backend(compiler):
    """vLLM's disable-any-whitespace: one layout, separators ", " and ": ", nothing before, after or inside."""
    tok, comp = compiler
    for schema in ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}},
                    "required": ["a", "b"], "additionalProperties": False},
                   {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}},
                    "required": ["a", "b"], "additionalProperties": False, "minProperties": 2}):
        assert ss.plan(schema).backend == (L if "minProperties" in schema else X)
        compiled = comp.compile(StructuredOutput.json_schema(schema))
        assert _accepts(tok, comp, compiled, '{"a": 1, "b": [1, 2]}'), schema
        for loose in ['{"a":1, "b": []}', '{ "a": 1, "b": []}', '{"a": 1,  "b": []}', '{"a": 1, "b": [1,2]}',
                      '{"a": 1, "b": []}\n', ' {"a": 1, "b": []}', '{"a": 1, "b": [\n]}']:
            assert not _accepts(tok, comp, compiled, loose), (schema, loose)


FUZZED = [  # schemas whose every output must validate: random walks under the masks, on both backends
    {"type": "string", "minLength": 1, "maxLength": 3},  # xgrammar alone lets raw control bytes in here
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}, "n": {"type": "integer",
     "minimum": -5, "maximum": 5}}, "required": ["s", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "boolean"}},
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}, "maxItems": 3},
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "prefixItems": [{"type": "integer"}],
     "items": {"type": "boolean"}, "maxItems": 3},  # draft 7: prefixItems is an annotation
    {"type": "integer", "minimum": -1.5, "exclusiveMaximum": 2.5},
    {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.25, "maximum": 2},
    {"enum": ["a\"b", "\u00e9", "\n", 1.5, True, None, {"k": [1]}]},
    {"anyOf": [{"type": "integer", "minimum": 5}, {"type": "string", "maxLength": 1}], "type": "integer"},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}}, "required": ["a", "b"],
     "additionalProperties": {"type": "boolean"}},
    {"oneOf": [{"type": "string", "maxLength": 2}, {"type": "boolean"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"properties": {"a": {"maximum": 3}}}]},
    {"type": "string", "pattern": "[0-9]{2}", "maxLength": 4},
    {"type": "string", "pattern": "^[\\w-]{2,4}$"},
    {"type": "string", "pattern": "^[\"a]{1,3}$"},  # xgrammar would emit the quote unescaped
    {"type": "string", "pattern": "^\\\\[ab]$"},  # likewise a backslash
    {"type": "string", "pattern": "^[^a]{1,3}$"},
    {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
    {"$ref": "#/$defs/t", "$defs": {"t": {"anyOf": [{"type": "null"}, {"type": "array", "items": {
        "$ref": "#/$defs/t"}, "maxItems": 2}]}}},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                      "id": {"type": "string", "format": "uuid"}}, "required": ["when"]},
]


@pytest.mark.parametrize("schema", FUZZED, ids=[str(i) for i in range(len(FUZZED))])
def test_random_walks_under_the_masks_only_produce_valid_documents(compiler, schema):
    import random

    import torch

    tok, comp = compiler
    compiled = comp.compile(StructuredOutput.json_schema(schema))
    checker = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(
        schema, format_checker=jsonschema.FormatChecker())
    stops, vocab, rng, finished = sorted(tok.eos_token_ids), tok.backend.get_vocab_size(), random.Random(0), 0
    for _ in range(16):
        grammar, ids = comp.matcher(compiled), []
        for _ in range(48):
            mask = grammar.next_mask()
            allowed = (((mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
                       .nonzero().flatten().tolist())
            ends = [t for t in allowed if t in stops]
            t = ends[0] if ends and rng.random() < 0.3 else rng.choice(allowed)
            grammar.accept(t)
            if t in stops:
                text = tok.backend.decode(ids, skip_special_tokens=False)
                assert checker.is_valid(json.loads(text)), (schema, text)
                finished += 1
                break
            ids.append(t)
    assert finished >= 4, schema


def test_patterns_matching_a_quote_or_backslash_leave_xgrammar(compiler):
    """xgrammar would emit a quote or a backslash the pattern matches unescaped (three quotes are not JSON)."""
    tok, comp = compiler
    for pattern, raw, escaped in [('^["a]{1,3}$', '"""', '"\\""'), ("^\\\\[ab]$", '"\\a"', '"\\\\a"')]:
        schema = {"type": "string", "pattern": pattern}
        assert ss.plan(schema).backend == L
        compiled = comp.compile(StructuredOutput.json_schema(schema))
        assert not _accepts(tok, comp, compiled, raw) and _accepts(tok, comp, compiled, escaped), pattern


def test_the_walk_raises_nothing_but_refusals_on_random_keyword_trees():
    import random

    rng = random.Random(5)
    keys = [*ss.KEYWORDS, *ss.ANNOTATIONS, "x-editor", "a", "0"]
    leaves = [None, True, False, 0, -1, 1.5, 2 ** 60, "", "a", "#", "#/", "#/definitions/a", "^a$", "(?=x)",
              "string", "object", "integer", "date", [], {}]

    def tree(depth: int):
        r = rng.random()
        if depth > 3 or r < 0.3:
            return rng.choice(leaves)
        if r < 0.5:
            return [tree(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(keys): tree(depth + 1) for _ in range(rng.randint(0, 4))}

    outcomes = {"planned": 0, "refused": 0}
    for _ in range(2000):
        schema = tree(0)
        try:
            ss.plan(schema)
            outcomes["planned"] += 1
        except ss.SchemaRefused as e:
            assert e.keyword and str(e), schema
            outcomes["refused"] += 1
    assert outcomes["planned"] > 100 and outcomes["refused"] > 100, outcomes
