"""tool_choice auto's grammar (engines/tool_grammar.py) on the tiny tokenizer: free text, a call after text and
two calls are accepted; a wrong name, arguments that break the schema, free whitespace or raw control bytes
are not; a random walk over the grammar's own masks, with several real-world tool definitions, only ever
closes calls whose arguments `jsonschema` validates; keywords that need llguidance are refused by name."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from engines import tool_grammar
from engines.structured import GrammarCompiler, InvalidConstraint, StructuredOutput
from engines.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]

# function definitions in the shape of OpenAI's and popular agent frameworks' examples (strict-mode style)
REAL_TOOLS = [
    ("get_current_weather", {
        "type": "object", "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"], "additionalProperties": False}),
    ("search_flights", {
        "type": "object", "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "IATA code"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            "cabin": {"type": ["string", "null"], "enum": ["economy", "business", "first", None]}},
        "required": ["origin", "destination", "passengers", "cabin"], "additionalProperties": False}),
    ("create_calendar_event", {
        "type": "object", "properties": {
            "title": {"type": "string", "maxLength": 40},
            "attendees": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 20}},
            "reminder": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 120}, {"type": "null"}]}},
        "required": ["title", "attendees", "reminder"], "additionalProperties": False}),
    ("send_email", {
        "type": "object", "properties": {
            "to": {"type": "string", "maxLength": 30}, "subject": {"type": "string", "maxLength": 30},
            "body": {"type": "string", "maxLength": 60}, "urgent": {"type": "boolean"}},
        "required": ["to", "subject", "body", "urgent"], "additionalProperties": False}),
]
SCHEMAS = dict(REAL_TOOLS)
CALL = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris", "unit": "celsius"}}' \
       '\n</tool_call>'


@pytest.fixture(scope="module")
def compiler():
    tok = Tokenizer.from_pretrained(ROOT / "models" / "tandem-tiny-s")
    return tok, GrammarCompiler(tok, tok.backend.get_vocab_size(), sorted(tok.eos_token_ids))


def _compiled(comp, parallel=True, tools=REAL_TOOLS):
    return comp.compile(StructuredOutput("tool_calls", tool_grammar.spec(tools, parallel), "tool_choice"))


def _accepts(tok, comp, compiled, text: str) -> bool:
    grammar = comp.matcher(compiled)
    for t in tok.backend.encode(text, add_special_tokens=False).ids:
        if not grammar.matcher.accept_token(t):
            return False
    return grammar.matcher.accept_token(min(tok.eos_token_ids))


def test_text_a_call_after_text_and_two_calls_are_accepted(compiler):
    tok, comp = compiler
    c = _compiled(comp)
    assert _accepts(tok, comp, c, "Just text, no call.")
    assert _accepts(tok, comp, c, "Let me check.\n" + CALL)
    assert _accepts(tok, comp, c, "Checking both.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\nDone.")
    single = _compiled(comp, parallel=False)
    assert _accepts(tok, comp, single, "Let me check.\n" + CALL)
    assert not _accepts(tok, comp, single, CALL + "\n" + CALL)  # parallel_tool_calls false: one call at most


@pytest.mark.parametrize("bad", [
    CALL.replace("get_current_weather", "get_weather"),  # not among the tools
    CALL.replace('"celsius"', '"kelvin"'),  # outside the enum
    '<tool_call>\n{"name": "search_flights", "arguments": {"origin": "JFK", "destination": "LHR", "passengers": 1, '
    '"cabin": 7}}\n</tool_call>',  # a typed enum keeps its type
    CALL.replace(', "unit": "celsius"', ""),  # a required argument missing
    CALL.replace('"unit": "celsius"', '"unit": "celsius", "extra": 1'),  # additionalProperties false
    CALL.replace('{"location": "Paris"', '{"location":"Paris"'),  # free whitespace: the layout is compact
    '<tool_call>\n{"name": "send_email", "arguments": {"to": "a\x01b", "subject": "s", "body": "b", '
    '"urgent": true}}\n</tool_call>',  # a raw control byte in a length-bounded string is not JSON
    CALL.replace("\n</tool_call>", ""),  # never closed
])
def test_calls_that_break_the_schema_or_the_format_are_refused(compiler, bad):
    tok, comp = compiler
    assert not _accepts(tok, comp, _compiled(comp), bad)


def _allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask.to(torch.int64)[:, None] >> torch.arange(32)) & 1
    return [i for i in bits.flatten().nonzero().flatten().tolist() if i < vocab]


def _walk_call(tok, grammar, rng: random.Random, ids: list[int], steps: int = 400) -> bool:
    """Sample tokens from the grammar's own masks until the call closes (leaning towards closing tokens so
    that strings end); True when it closed within `steps` (the closing tag may end inside a token)."""
    start = len(ids)
    for _ in range(steps):
        allowed = _allowed(grammar.next_mask(), grammar.vocab_size)
        closing = [i for i in allowed if tok.backend.id_to_token(i) in ('"', '}', ']', '"}', '}}', '",', 'Ċ', '</')]
        t = rng.choice(closing if closing and rng.random() < 0.7 else allowed)
        grammar.accept(t)
        ids.append(t)
        if tool_grammar.CLOSE in tok.backend.decode(ids[start:], skip_special_tokens=False):
            return True
    return False


def _assert_calls_validate(text: str, schemas: dict[str, dict]) -> None:
    """Every closed `<tool_call>` block in `text` names a listed tool and its arguments validate (jsonschema)."""
    for block in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S):
        call = json.loads(block)
        assert set(call) == {"name", "arguments"} and call["name"] in schemas
        jsonschema.validate(call["arguments"], schemas[call["name"]])


def test_every_call_a_random_walk_over_the_masks_closes_validates(compiler):
    tok, comp = compiler
    c = _compiled(comp)
    closed = 0
    for seed in range(12):
        rng = random.Random(seed)
        grammar = comp.matcher(c)
        ids: list[int] = []
        for i in range(2):  # text before the first call, then a second call after it
            prefix = ("Let me look that up.\n" if i == 0 else "\n") + tool_grammar.OPEN
            for t in tok.backend.encode(prefix, add_special_tokens=False).ids:
                grammar.accept(t)
                ids.append(t)
            if not _walk_call(tok, grammar, rng, ids):
                break
            closed += 1
        _assert_calls_validate(tok.backend.decode(ids, skip_special_tokens=False), SCHEMAS)
    assert closed >= 12  # most walks close both calls: the check above is not vacuous


def test_parameters_only_llguidance_enforces_are_refused_naming_the_keyword(compiler):
    _, comp = compiler
    tools = [REAL_TOOLS[0], ("book", {"type": "object", "properties": {"when": {"type": "string",
                                                                                "format": "date-time"}},
                                      "required": ["when"], "additionalProperties": False})]
    with pytest.raises(InvalidConstraint) as exc:
        _compiled(comp, tools=tools)
    assert exc.value.where == "tools[1].function.parameters#/properties/when/format"
    assert "`format`" in str(exc.value)


def test_a_typed_enum_is_rewritten_to_the_same_set_of_values():
    assert tool_grammar._typed_enums_alone({"type": "string", "enum": ["a", 1, None], "description": "d"}) == \
        {"description": "d", "enum": ["a"]}
    assert tool_grammar._typed_enums_alone({"type": ["integer", "null"], "enum": [1, True, 2.5, None]}) == \
        {"enum": [1, None]}
    assert tool_grammar._typed_enums_alone({"type": "boolean", "const": True}) == {"enum": [True]}
    beside = {"type": "string", "enum": ["ab"], "maxLength": 1}  # another assertion beside: left as written
    assert tool_grammar._typed_enums_alone(beside) == beside


def _bfcl_tools() -> list[tuple[str, dict]]:
    """The real BFCL definitions in tests/data (gorilla's own type table maps them to JSON Schema)."""
    data = json.loads((ROOT / "tests" / "data" / "bfcl_tools.json").read_text())
    table = data["gorilla_to_openapi"]

    def conv(node):
        if isinstance(node, dict):
            return {k: (table.get(v, v) if k == "type" and isinstance(v, str) else conv(v)) for k, v in node.items()}
        return [conv(x) for x in node] if isinstance(node, list) else node

    return [(fn["name"], conv(fn["parameters"])) for e in data["entries"] for fn in e["function"]]


def test_random_walks_with_real_bfcl_definitions_close_only_valid_calls(compiler):
    tok, comp = compiler
    tools = _bfcl_tools()
    schemas = dict(tools)
    assert len(schemas) >= 7
    c = _compiled(comp, tools=tools)
    closed = 0
    for seed in range(10):
        rng = random.Random(100 + seed)
        grammar = comp.matcher(c)
        ids: list[int] = []
        for t in tok.backend.encode("Calling.\n" + tool_grammar.OPEN, add_special_tokens=False).ids:
            grammar.accept(t)
            ids.append(t)
        if not _walk_call(tok, grammar, rng, ids, steps=600):
            continue
        closed += 1
        _assert_calls_validate(tok.backend.decode(ids, skip_special_tokens=False), schemas)
    assert closed >= 5, closed  # the validation above ran on most walks
