"""Structured outputs, tools and logit_bias through HTTP with the official `openai` client on the default models
(tandem-tiny-l drafted by tandem-tiny-s on route `best`, the same checkpoint without a drafter on `plain`):
every sampled json_schema answer parses and validates, streaming and not, with and without speculation; greedy
constrained output is the same on both; forced tool calls are valid calls; under auto every Hermes `<tool_call>`
block decodes to arguments that validate; tool results round-trip; what cannot be honoured (an
unimplemented OpenAI field included) is a 400 naming its field. `TANDEM_STRUCTURED_REQUESTS=N` sends N requests per schema and mode (default 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import openai
import pytest

from gateway.config import config_from_dict
from gateway.server import ServerThread

ROOT = Path(__file__).resolve().parents[2]
PER_SCHEMA = int(os.environ.get("TANDEM_STRUCTURED_REQUESTS", "2"))
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "admin": {"type": "boolean"}},
                 "required": ["id", "admin"], "additionalProperties": False}},
               "required": ["user"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3,
                                                        "items": {"type": "string", "maxLength": 5}}},
              "required": ["tags"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]},
                                              "color": {"type": "string", "enum": ["red", "blue"]}},
             "required": ["level", "color"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                 "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
                "required": ["zip", "code"], "additionalProperties": False},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
# parameters only llguidance enforces exactly (format, multipleOf, oneOf, minProperties): auto uses the Lark
# form of the call grammar (real SchemaStore schemas as tools are walked in tests/engines/test_tool_grammar.py:
# with their descriptions they overflow the tiny models' 512-token context here)
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a table",
    "parameters": {"type": "object", "properties": {
        "booking": {"type": "string", "format": "uuid"},
        "guests": {"type": "integer", "minimum": 2, "maximum": 12, "multipleOf": 2},
        "contact": {"oneOf": [{"type": "string", "format": "email", "maxLength": 16},
                              {"type": "integer", "minimum": 0, "maximum": 999}]}},
        "required": ["booking", "guests", "contact"], "additionalProperties": False}}}
TAGS = {"type": "function", "function": {
    "name": "tag_items", "parameters": {"type": "object", "minProperties": 1, "maxProperties": 2,
                                        "additionalProperties": {"type": "string", "maxLength": 6}}}}
LLG_TOOLS = [BOOK, TAGS]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS + LLG_TOOLS}


@pytest.fixture(scope="module")
def server():
    cfg = config_from_dict({
        "engines": {"tandem-small": {"checkpoint": str(ROOT / "models/tandem-tiny-s")},
                    "tandem-large": {"checkpoint": str(ROOT / "models/tandem-tiny-l"), "draft": "tandem-small",
                                     "num_speculative_tokens": 4},
                    "tandem-large-plain": {"checkpoint": str(ROOT / "models/tandem-tiny-l")}},
        "kv_pool": {"memory_bytes": 64 << 20},
        "routes": {"best": {"engines": ["tandem-large"]}, "plain": {"engines": ["tandem-large-plain"]}}})
    with ServerThread(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _draft_tokens(server) -> int:
    return server.app.state.gateway.host.stats()["engines"]["tandem-large"]["spec_num_draft_tokens"]


def _chat(client, model: str, stream: bool, **kw):
    """(text, finish_reason, tool_calls as dicts) of one chat answer, reassembled when streamed."""
    if not stream:
        r = client.chat.completions.create(model=model, messages=kw.pop("messages", MESSAGES), **kw)
        m = r.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in m.tool_calls or []]
        return m.content, r.choices[0].finish_reason, calls
    text, finish, calls = "", None, {}
    for chunk in client.chat.completions.create(model=model, messages=kw.pop("messages", MESSAGES),
                                                stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            text += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = tc.id or c["id"]
                if tc.function is not None:
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return text or None, finish, [calls[i] for i in sorted(calls)]


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("model", ["best", "plain"], ids=["speculative", "plain"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_sampled_json_schema_answers_parse_and_validate(server, client, model, stream):
    before = _draft_tokens(server)
    # every step of `best` drafts (k = 4), whatever this machine's timings make adaptive k choose: after a run of
    # plain wins its explorations come only every few hundred choices, and these ten answers may not reach one
    adaptive = server.app.state.gateway.host.engines["tandem-large"].speculator.adaptive
    adaptive.fixed = 4
    try:
        for name, schema in SCHEMAS.items():
            for i in range(PER_SCHEMA):
                text, finish, _ = _chat(client, model, stream, temperature=0.8, max_tokens=60, seed=i,
                                        response_format=_schema_format(name))
                assert finish == "stop", (name, text)
                jsonschema.validate(json.loads(text), schema)
    finally:
        adaptive.fixed = None
    if model == "best":
        assert _draft_tokens(server) > before  # the drafts were verified under the grammar


def test_greedy_constrained_output_is_the_same_with_and_without_speculation(client):
    for name in SCHEMAS:
        answers = {model: _chat(client, model, False, temperature=0, max_tokens=60,
                                response_format=_schema_format(name))[0] for model in ("best", "plain")}
        assert answers["best"] == answers["plain"]
        jsonschema.validate(json.loads(answers["best"]), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_vllm_guided_fields_and_json_object_on_chat_and_completions(client, stream):
    extra = [({"guided_regex": "(yes|no)-[0-9]{3}"}, lambda t: len(t) == 6 and t[:2] in ("ye", "no")),
             ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
             ({"guided_grammar": 'root ::= "v" [0-9] "." [0-9]'}, lambda t: len(t) == 4 and t[0] == "v"),
             ({"guided_json": SCHEMAS["enum"]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["enum"])
              or True),
             ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down"))]
    for body, check in extra:
        text, finish, _ = _chat(client, "best", stream, temperature=0.8, max_tokens=40, seed=1, extra_body=body)
        assert finish == "stop" and check(text), (body, text)
        if not stream:
            r = client.completions.create(model="best", prompt="answer: ", temperature=0.8, max_tokens=40,
                                          seed=2, extra_body=body)
            assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), (body, r.choices[0].text)
    # any JSON object: the tiny model often nests past max_tokens; every one that closes is an object
    closed = 0
    for seed in range(4):
        text, finish, _ = _chat(client, "best", stream, temperature=0.8, max_tokens=60, seed=seed,
                                messages=[{"role": "user", "content": 'data = {"a": 1}\n'}],
                                response_format={"type": "json_object"})
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
            closed += 1
    assert closed


def test_logit_bias_minus_100_changes_the_answer_and_plus_100_forces_a_token(client):
    greedy = client.completions.create(model="best", prompt="def read_config(path):", temperature=0,
                                       max_tokens=6, logprobs=0)
    first = greedy.choices[0].text
    tok = client.completions.create(model="best", prompt="def read_config(path):", temperature=0, max_tokens=1,
                                    extra_body={"return_tokens_as_token_ids": False})
    assert tok.choices[0].text == first[:len(tok.choices[0].text)]
    ids = server_tokenizer().encode(tok.choices[0].text)
    banned = client.completions.create(model="best", prompt="def read_config(path):", temperature=0,
                                       max_tokens=6, logit_bias={str(ids[0]): -100})
    assert banned.choices[0].text != first
    forced = client.completions.create(model="best", prompt="def read_config(path):", temperature=0.9,
                                       max_tokens=4, logit_bias={"42": 100})
    assert forced.choices[0].text == server_tokenizer().decode([42] * 4)
    plain = client.completions.create(model="plain", prompt="def read_config(path):", temperature=0,
                                      max_tokens=6, logit_bias={str(ids[0]): -100})
    assert plain.choices[0].text == banned.choices[0].text  # the same with and without speculation


def server_tokenizer():
    from engines.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(ROOT / "models/tandem-tiny-l")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("model", ["best", "plain"], ids=["speculative", "plain"])
def test_named_and_required_tool_choice_always_give_valid_calls(client, stream, model):
    for i in range(PER_SCHEMA + 1):
        _, finish, calls = _chat(client, model, stream, temperature=0.8, max_tokens=60, seed=i, tools=TOOLS,
                                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert finish == "stop" and len(calls) == 1 and calls[0]["name"] == "get_weather"
        assert calls[0]["id"].startswith("call_")
        jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS["get_weather"])
        _, finish, calls = _chat(client, model, stream, temperature=0.8, max_tokens=80, seed=i, tools=TOOLS,
                                 tool_choice="required", parallel_tool_calls=False)
        assert finish == "tool_calls" and len(calls) == 1, calls
        jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS[calls[0]["name"]])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_strict_tools_under_auto_only_ever_get_arguments_that_validate(client, stream):
    # tool_choice auto decodes under the calls' grammar: free text, and inside <tool_call> only a listed
    # name with arguments matching that tool's parameters (tests/engines/test_tool_grammar.py walks it)
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    for seed in range(3):
        text, finish, calls = _chat(client, "best", stream, temperature=0.9, max_tokens=40, seed=seed,
                                    tools=strict, tool_choice="auto")
        assert finish in ("stop", "length", "tool_calls"), finish
        assert (finish == "tool_calls") == bool(calls)
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
        if finish != "length":  # every block the model opened was closed and parsed as a call
            assert "<tool_call>" not in (text or "")


def _validate_call(call: dict) -> None:
    jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]],
                        format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tools_only_llguidance_enforces_are_served_under_auto_and_forced(client, stream):
    # auto: the Lark form on llguidance (tests/engines/test_tool_grammar.py walks it); the tiny model seldom
    # opens a call by itself, so forced choices (llguidance JSON schemas) give the calls to validate here
    for seed in range(2):
        text, finish, calls = _chat(client, "best", stream, temperature=0.9, max_tokens=40, seed=seed,
                                    tools=LLG_TOOLS, tool_choice="auto")
        assert finish in ("stop", "length", "tool_calls"), finish
        for c in calls:
            _validate_call(c)
        if finish != "length":
            assert "<tool_call>" not in (text or "")
    for seed in range(2):
        _, finish, calls = _chat(client, "best", stream, temperature=0.8, max_tokens=80, seed=seed,
                                 tools=LLG_TOOLS, tool_choice={"type": "function",
                                                               "function": {"name": "book_table"}})
        assert finish == "stop" and [c["name"] for c in calls] == ["book_table"], calls
        _validate_call(calls[0])
        _, finish, calls = _chat(client, "plain", stream, temperature=0.8, max_tokens=80, seed=seed,
                                 tools=LLG_TOOLS, tool_choice="required", parallel_tool_calls=False)
        if finish != "length":
            assert finish == "tool_calls" and len(calls) == 1, calls
            _validate_call(calls[0])


ANSWER = {"type": "object", "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 20,
                                                      "multipleOf": 3},
                                           "note": {"type": "string", "maxLength": 12}},
          "required": ["guests", "note"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("model", ["best", "plain"], ids=["speculative", "plain"])
def test_tools_beside_a_response_schema_give_calls_or_an_answer_that_validate(client, model, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}}
    lt, brace = server_tokenizer().encode("<"), server_tokenizer().encode("{")
    assert len(lt) == len(brace) == 1
    seen = {"answer": 0, "call": 0}
    for seed in range(PER_SCHEMA):
        # a first `<` can only open a call, a first `{` only the answer: both kinds are checked
        for bias in (None, {str(lt[0]): 100}, {str(brace[0]): 100}):
            text, finish, calls = _chat(client, model, stream, temperature=0.8, max_tokens=120, seed=seed,
                                        tools=[BOOK], response_format=rf, logit_bias=bias,
                                        parallel_tool_calls=False)
            if finish == "stop":  # the answer: the content is the schema's
                assert not calls and str(lt[0]) not in (bias or {}), (text, calls)
                jsonschema.validate(json.loads(text), ANSWER)
                seen["answer"] += 1
            elif finish == "tool_calls":  # calls and nothing else
                assert len(calls) == 1 and not text, (text, calls)
                _validate_call(calls[0])
                seen["call"] += 1
            else:
                assert finish == "length" and (text or "").startswith(("{", "<tool_call>")), (finish, text)
    assert seen["answer"] and seen["call"], seen  # both kinds were checked


def test_tool_results_round_trip_in_the_history(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    r = client.chat.completions.create(model="best", messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    tok = server_tokenizer()
    rendered = tok.apply_chat_template(history, tools=TOOLS)  # the tools, the call and its result, as sent
    assert "<tool_response>\nsunny, 21\n</tool_response>" in rendered and '"name": "get_time"' in rendered
    assert r.usage.prompt_tokens == len(tok.encode(rendered))
    none = client.chat.completions.create(model="best", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=5, temperature=0)
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(MESSAGES)))  # no tools shown


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_regex": "(?=a)a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "null"}}}}}}},
     "response_format.json_schema.schema#/properties/a/not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
     "response_format.json_schema.schema#/additionalProperties"),
    ({"guided_json": {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                                {"type": "object", "properties": {"b": {"type": "integer"}}}]}},
     "guided_json#/oneOf"),  # refused by llguidance at compile time, in the engine
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "additionalProperties": False}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters#/required"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "guided_regex": "a+"}, "guided_regex"),  # auto's call grammar combines with response_format only
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"when": {"type": "string", "not": {"format": "date-time"}}}}}}]},
     "tools[1].function.parameters#/properties/when/not"),  # under auto too: no backend enforces `not`
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"oneOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        {"type": "object", "properties": {"b": {"type": "integer"}}}]}}}]},
     "tools[1].function.parameters#/oneOf"),  # llguidance refuses it inside auto's call grammar, by name
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"logit_bias": {"1": 500}}, "logit_bias[...]"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="best", messages=MESSAGES, max_tokens=4, extra_body=body)
    err = exc.value.body
    assert err["param"] == param, err
    assert "/project/" not in err["message"] and ".cc:" not in err["message"], err
