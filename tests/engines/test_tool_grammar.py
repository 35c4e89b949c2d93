"""tool_choice auto's grammar (engines/tool_grammar.py) on the tiny tokenizer: free text, a call after text and
two calls are accepted; a wrong name, arguments that break the schema, free whitespace or raw control bytes
are not; the llguidance Lark form accepts and refuses exactly what the xgrammar structural tag does and serves
parameters only llguidance enforces; a random walk over the grammar's own masks, with real-world tool
definitions (BFCL, SchemaStore), only ever closes calls whose arguments `jsonschema` validates; with an answer
schema beside the tools, only calls or a valid JSON answer; what neither backend enforces is refused by name."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
from grammar_masks import allowed_ids

from engines import tool_grammar
from engines.llguidance_backend import LLGTemplate, LLGuidanceBackend
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


@pytest.fixture(scope="module")
def llg(compiler):
    tok, _ = compiler
    return LLGuidanceBackend(tok.backend.to_str(), tok.backend.get_vocab_size(), sorted(tok.eos_token_ids))


def _compiled(comp, parallel=True, tools=REAL_TOOLS, answer=None):
    return comp.compile(StructuredOutput("tool_calls", tool_grammar.spec(tools, parallel, answer), "tool_choice"))


def _lark(llg, parallel=True, tools=REAL_TOOLS, answer=None):
    """The Lark form on llguidance, whatever xgrammar covers."""
    return llg.compile_lark(tool_grammar.lark_grammar(tool_grammar.spec(tools, parallel, answer)))


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
def test_calls_that_break_the_schema_or_the_format_are_refused(compiler, llg, bad):
    tok, comp = compiler
    assert not _accepts(tok, comp, _compiled(comp), bad)
    assert not _accepts(tok, comp, _lark(llg), bad)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "single"])
@pytest.mark.parametrize("text", [
    "Just text, no call.", "", "Let me check.\n" + CALL, CALL, CALL + "\n" + CALL, "Two.\n" + CALL + " and " + CALL,
    CALL + "\nDone.", "a <tool_call", "<tool_cal> is no tag", "hi <tool_call> junk", CALL + " then <tool_call>x",
    CALL.replace('"Paris"', '"Par\\"is é"'), CALL.replace("Paris", "Par\nis"),
])
def test_the_lark_form_accepts_exactly_what_the_structural_tag_accepts(compiler, llg, text, parallel):
    tok, comp = compiler
    xgr, lark = _compiled(comp, parallel), _lark(llg, parallel)
    assert not isinstance(xgr, LLGTemplate) and isinstance(lark, LLGTemplate)
    # (llguidance writes no \\u escape for a printable character: a narrower layout, never an invalid one)
    assert _accepts(tok, comp, lark, text) == _accepts(tok, comp, xgr, text)


def _walk_call(tok, grammar, rng: random.Random, ids: list[int], steps: int = 400) -> bool:
    """Sample tokens from the grammar's own masks until the call closes (leaning towards closing tokens so
    that strings end); True when it closed within `steps` (the closing tag may end inside a token)."""
    start = len(ids)
    for _ in range(steps):
        allowed = allowed_ids(grammar.next_mask(), grammar.vocab_size)
        closing = [i for i in allowed if tok.backend.id_to_token(i) in ('"', '}', ']', '"}', '}}', '",', 'Ċ', '</')]
        t = rng.choice(closing if closing and rng.random() < 0.7 else allowed)
        grammar.accept(t)
        ids.append(t)
        if tool_grammar.CLOSE in tok.backend.decode(ids[start:], skip_special_tokens=False):
            return True
    return False


def _assert_calls_validate(text: str, schemas: dict[str, dict]) -> int:
    """Every closed `<tool_call>` block in `text` names a listed tool and its arguments validate (jsonschema,
    the formats it checks included); how many there were."""
    blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
    for block in blocks:
        call = json.loads(block)
        assert set(call) == {"name", "arguments"} and call["name"] in schemas
        jsonschema.validate(call["arguments"], schemas[call["name"]], format_checker=jsonschema.FormatChecker())
    return len(blocks)


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


BOOK = ("book", {"type": "object", "properties": {"when": {"type": "string", "format": "date"}},
                 "required": ["when"], "additionalProperties": False})


def test_parameters_only_llguidance_enforces_get_the_lark_form_and_are_enforced(compiler):
    tok, comp = compiler
    c = _compiled(comp, tools=[REAL_TOOLS[0], BOOK])
    assert isinstance(c, LLGTemplate)
    call = '<tool_call>\n{"name": "book", "arguments": {"when": "2026-12-03"}}\n</tool_call>'
    assert _accepts(tok, comp, c, "Booking.\n" + call + "\n" + CALL)
    assert not _accepts(tok, comp, c, call.replace("2026-12-03", "tomorrow"))  # format date, exactly
    assert not _accepts(tok, comp, c, call.replace("2026-12-03", "2026-13-03"))


@pytest.mark.parametrize("tool, where", [
    (("f", {"type": "object", "properties": {"x": {"not": {"type": "null"}}}}),
     "tools[1].function.parameters#/properties/x/not"),  # no backend enforces `not`
    (("g", {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                      {"type": "object", "properties": {"b": {"type": "integer"}}}]}),
     "tools[1].function.parameters#/oneOf"),  # llguidance refuses overlapping oneOf branches
])
def test_what_neither_backend_enforces_is_refused_naming_the_tool_and_keyword(compiler, tool, where):
    _, comp = compiler
    with pytest.raises(InvalidConstraint) as exc:
        _compiled(comp, tools=[REAL_TOOLS[0], tool])
    assert exc.value.where == where, str(exc.value)
    assert f"`{where.rsplit('/', 1)[1]}`" in str(exc.value)


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


# real SchemaStore object schemas (tests/data/schemastore, Apache-2.0) whose keywords only llguidance enforces
STORE_TOOLS = ["sake.json", "enonic-xp-service-8.0.0-B4.json", "buf.work.json", "chart-lock.json",
               "dotnetcli.host.json", "mail-servers-config.json", "imgbotconfig.json", "aliases.json",
               "winutil-applications.json"]


def _store_tools() -> list[tuple[str, dict]]:
    corpus = json.loads((ROOT / "tests" / "data" / "schemastore" / "corpus.json").read_text())
    return [(name.removesuffix(".json").replace(".", "_"), corpus[name]) for name in STORE_TOOLS]


def _walks(tok, comp, compiled, schemas, seeds, prefix="Calling.\n") -> int:
    """Random walks that open a call after `prefix` and follow the masks; the calls that closed (each one
    validated)."""
    closed = 0
    for seed in seeds:
        rng = random.Random(seed)
        grammar = comp.matcher(compiled)
        ids: list[int] = []
        for t in tok.backend.encode(prefix + tool_grammar.OPEN, add_special_tokens=False).ids:
            grammar.accept(t)
            ids.append(t)
        _walk_call(tok, grammar, rng, ids, steps=600)
        closed += _assert_calls_validate(tok.backend.decode(ids, skip_special_tokens=False), schemas)
    return closed


def test_random_walks_with_real_tools_only_llguidance_enforces_close_only_valid_calls(compiler):
    tok, comp = compiler
    tools = _store_tools()
    from engines import schema_support
    assert all(schema_support.plan(p).backend == schema_support.LLGUIDANCE for _, p in tools)
    c = _compiled(comp, tools=tools)
    assert isinstance(c, LLGTemplate)
    closed = _walks(tok, comp, c, dict(tools), range(200, 214))
    assert closed >= 7, closed  # the validation ran on most walks


def test_random_walks_over_the_lark_form_of_the_bfcl_definitions_close_only_valid_calls(compiler, llg):
    tok, comp = compiler
    tools = _bfcl_tools()
    closed = _walks(tok, comp, _lark(llg, tools=tools), dict(tools), range(300, 310))
    assert closed >= 5, closed


ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "multipleOf": 7}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.mark.parametrize("text, ok", [
    ('{"city": "Paris", "days": 14}', True),
    (CALL, True),
    (CALL + "\n" + CALL.replace("Paris", "Rome"), True),
    ('{"city": "Paris", "days": 10}', False),  # multipleOf 7
    ('{"city": "Paris"}', False),
    ("Sure: " + '{"city": "Paris", "days": 14}', False),  # no text: the content is the JSON answer
    ("Let me check.\n" + CALL, False),
    (CALL + '\n{"city": "Paris", "days": 14}', False),  # calls or an answer, not both
    (CALL + "\nDone.", False),
    ("", False),
])
def test_beside_an_answer_schema_only_calls_or_a_valid_json_answer(compiler, text, ok):
    tok, comp = compiler
    c = _compiled(comp, answer=ANSWER)
    assert isinstance(c, LLGTemplate)
    assert _accepts(tok, comp, c, text) == ok
    single = _compiled(comp, parallel=False, answer=ANSWER)
    assert _accepts(tok, comp, single, text) == (ok and text.count("<tool_call>") < 2)


def test_walks_beside_an_answer_schema_give_calls_that_validate(compiler):
    tok, comp = compiler
    c = _compiled(comp, answer=ANSWER)
    assert _walks(tok, comp, c, SCHEMAS, range(400, 406), prefix="") >= 3


def test_an_answer_schema_llguidance_refuses_is_named_by_its_field(compiler):
    _, comp = compiler
    bad = {"oneOf": [{"type": "object"}, {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    so = StructuredOutput("tool_calls", tool_grammar.spec(REAL_TOOLS, True, bad,
                                                          "response_format.json_schema.schema"), "tool_choice")
    with pytest.raises(InvalidConstraint) as exc:
        comp.compile(so)
    assert exc.value.where == "response_format.json_schema.schema#/oneOf", str(exc.value)
