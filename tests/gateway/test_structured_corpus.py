"""120 real-world JSON schemas nobody here wrote (a seeded sample of the SchemaStore catalog,
tests/data/schemastore/) sent as `response_format` json_schema through the official `openai` client, sampled,
on the small engine and, streamed, on the speculative large one: no answer that finishes with `stop` fails
`jsonschema`, one cut by max_tokens is a prefix of some JSON document, every 400 names its keyword (in the
message and in `param`, as a JSON pointer) and nothing is a 5xx. Also once with `strict: true` (OpenAI's
rules: most catalog schemas break them, and the 400 says which rule, where)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import jsonschema
import openai
import pytest

from engines.schema_support import ANNOTATIONS, KEYWORDS
from gateway.config import config_from_dict
from gateway.server import ServerThread

ROOT = Path(__file__).resolve().parents[2]
CORPUS = json.loads((ROOT / "tests" / "data" / "schemastore" / "corpus.json").read_text(encoding="utf-8"))
MESSAGES = [{"role": "user", "content": "Write the configuration file as JSON."}]
FIELD = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def client():
    cfg = config_from_dict({
        "engines": {"tandem-small": {"checkpoint": str(ROOT / "models/tandem-tiny-s")},
                    "tandem-large": {"checkpoint": str(ROOT / "models/tandem-tiny-l"), "draft": "tandem-small",
                                     "num_speculative_tokens": 4}},
        "kv_pool": {"memory_bytes": 64 << 20},
        "routes": {"small": {"engines": ["tandem-small"]}, "best": {"engines": ["tandem-large"]}}})
    with ServerThread(cfg) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def json_prefix_ok(text: str) -> bool:
    """Whether `text` can be extended to a JSON document (a small pushdown automaton over the grammar)."""
    stack: list[str] = []  # "{" / "[" for open containers
    expect = "value"  # value | key | colon | comma | string | escape | number | literal
    literal, word = "", ""
    for ch in text:
        if expect == "string" or expect == "escape":
            if expect == "escape":
                expect = "string"
            elif ch == "\\":
                expect = "escape"
            elif ch == '"':
                expect = "colon" if word == "key" else "comma"
            elif ord(ch) < 0x20:
                return False
            continue
        if expect == "literal":
            if literal.startswith(word + ch):
                word += ch
                if word == literal:
                    expect = "comma"
                continue
            return False
        if expect == "number":
            if ch in "0123456789.eE+-":
                continue
            expect = "comma"
        if ch in " \t\r\n":
            continue
        if expect in ("value", "first"):
            if ch == "]" and expect == "first" and stack[-1] == "[":
                stack.pop()
                expect = "comma"
            elif ch in "{[":
                stack.append(ch)
                expect = "keyfirst" if ch == "{" else "first"
            elif ch == '"':
                expect, word = "string", "value"
            elif ch in "-0123456789":
                expect = "number"
            elif ch in "tfn":
                literal = {"t": "true", "f": "false", "n": "null"}[ch]
                expect, word = "literal", ch
            else:
                return False
        elif expect in ("key", "keyfirst"):
            if ch == '"':
                expect, word = "string", "key"
            elif ch == "}" and expect == "keyfirst":
                stack.pop()
                expect = "comma"
            else:
                return False
        elif expect == "colon":
            if ch != ":":
                return False
            expect = "value"
        elif expect == "comma":
            if not stack:
                return False
            if ch == ",":
                expect = "key" if stack[-1] == "{" else "value"
            elif ch == ("}" if stack[-1] == "{" else "]"):
                stack.pop()
            else:
                return False
    return True


def test_json_prefix_check_itself():
    for good in ['{"a": [1, 2', '{"a": "x\\"', '[tr', '{"a": {}, "b": nul', '{']:
        assert json_prefix_ok(good), good
    for bad in ['{"a" 1', '[1 2', '{1', '{"a": tx', '"a"]', '{"a": 1}}']:
        assert not json_prefix_ok(bad), bad


def _validator(schema: dict):
    """The validator of the schema's declared draft; undeclared: 2020-12, as tandem reads it (draft 7 when an
    `items` list shows an older schema)."""
    old = '"items": [' in json.dumps(schema)
    default = jsonschema.Draft7Validator if old else jsonschema.Draft202012Validator
    return jsonschema.validators.validator_for(schema, default=default)(schema)


def _refused_keyword(err: openai.BadRequestError) -> str:
    """The keyword a 400 names, checked against its param (`<field>#<JSON pointer ending in the keyword>`)."""
    body = err.body
    assert body["param"].startswith(FIELD + "#"), body
    keyword = body["param"].rsplit("/", 1)[-1].replace("~1", "/").replace("~0", "~")
    assert keyword in KEYWORDS or keyword in ANNOTATIONS, body
    assert f"`{keyword}`" in body["message"] and ".cc:" not in body["message"], body
    return keyword


@pytest.mark.parametrize("model, stream", [("small", False), ("best", True)], ids=["small", "speculative"])
def test_catalog_schemas_are_followed_or_refused_by_keyword(client, model, stream):
    outcomes: collections.Counter[str] = collections.Counter()
    refused: collections.Counter[str] = collections.Counter()
    for i, (name, schema) in enumerate(sorted(CORPUS.items())):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": False}}
        try:
            if stream:
                text, finish = "", None
                for chunk in client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                                            temperature=0.8, seed=i, max_tokens=32,
                                                            response_format=fmt):
                    for ch in chunk.choices:
                        text += ch.delta.content or ""
                        finish = ch.finish_reason or finish
            else:
                r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0.8, seed=i,
                                                   max_tokens=32, response_format=fmt)
                text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        except openai.BadRequestError as e:
            refused[_refused_keyword(e)] += 1
            outcomes["refused"] += 1
            continue
        if finish == "stop":
            errors = [e.message for e in _validator(schema).iter_errors(json.loads(text))]
            assert not errors, (name, text, errors[:3])
            outcomes["stop"] += 1
        else:
            assert finish == "length" and json_prefix_ok(text), (name, finish, text)
            outcomes["length"] += 1
    print(model, dict(outcomes), refused.most_common())
    assert sum(outcomes.values()) == len(CORPUS) >= 100
    assert outcomes["stop"] >= 10  # the corpus exercises decoding, not only refusals


def test_strict_mode_follows_openai_rules_on_catalog_schemas(client):
    accepted = 0
    for i, (_name, schema) in enumerate(sorted(CORPUS.items())):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        try:
            r = client.chat.completions.create(model="small", messages=MESSAGES, temperature=0.8, seed=i,
                                               max_tokens=32, response_format=fmt)
        except openai.BadRequestError as e:
            _refused_keyword(e)
            continue
        accepted += 1
        if r.choices[0].finish_reason == "stop":
            _validator(schema).validate(json.loads(r.choices[0].message.content))
    assert accepted < len(CORPUS)  # catalog schemas rarely meet strict mode's rules
