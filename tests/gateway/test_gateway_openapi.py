"""The OpenAPI document says what the server does: OpenAI's error body for every error status it answers,
Retry-After on 429 and 503, `text/event-stream` beside JSON on the generation endpoints, the request bounds the
decoder enforces (and the engine's SamplingParams.validate agrees with), and a 405 carries Allow.
No engine is loaded: the document and the decoder need none."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from litestar.testing import TestClient

from engines.sampling_params import InvalidSamplingParameter, SamplingParams
from gateway.app import create_app
from gateway.config import config_from_dict
from gateway.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    InvalidParameter,
    decode_request,
)

ANTHROPIC_ERROR_BODY = {"$ref": "#/components/schemas/AnthropicErrorBody"}
ERROR_BODY = {"$ref": "#/components/schemas/ErrorBody"}


@pytest.fixture(scope="module")
def client():
    cfg = config_from_dict({"engines": {"m": {"checkpoint": "/nowhere"}}})
    app = create_app(cfg, host_factory=lambda: None)  # no lifespan below: the engines never load
    return TestClient(app)


@pytest.fixture(scope="module")
def document(client) -> dict:
    return client.get("/schema/openapi.json").json()


def _json_schema(response: dict) -> dict:
    return response["content"]["application/json"]["schema"]


def test_generation_endpoints_document_json_and_sse_answers_and_each_error_status(document):
    for path, ok, chunk in (("/v1/chat/completions", "ChatCompletion", "ChatCompletionChunk"),
                            ("/v1/completions", "Completion", "Completion")):
        responses = document["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "408", "413", "415", "429", "431", "503"}
        assert _json_schema(responses["200"]) == {"$ref": f"#/components/schemas/{ok}"}
        event = responses["200"]["content"]["text/event-stream"]["schema"]
        json_data, done = event["properties"]["data"]["oneOf"]
        assert json_data["contentMediaType"] == "application/json" and done["const"] == "[DONE]"
        assert json_data["contentSchema"]["oneOf"] == [{"$ref": f"#/components/schemas/{chunk}"}, ERROR_BODY]
        for status in set(responses) - {"200"}:
            assert _json_schema(responses[status]) == ERROR_BODY, (path, status)
        assert set(responses["429"]["headers"]) == set(responses["503"]["headers"]) == {"Retry-After"}


def test_every_error_status_everywhere_is_the_openai_error_body(document):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if int(status) >= 400 and not (path in ("/ready", "/health") and status == "503"):
                    # Anthropic's Messages API answers in its own error shape (gateway/anthropic_api.py)
                    expected = ANTHROPIC_ERROR_BODY if path.startswith("/v1/messages") else ERROR_BODY
                    assert _json_schema(response) == expected, (method, path, status)
    ready_503 = document["paths"]["/ready"]["get"]["responses"]["503"]
    assert _json_schema(ready_503)["oneOf"] == [{"$ref": "#/components/schemas/Readiness"}, ERROR_BODY]
    health_503 = document["paths"]["/health"]["get"]["responses"]["503"]  # degraded, or draining
    assert _json_schema(health_503)["oneOf"] == [{"$ref": "#/components/schemas/Health"}, ERROR_BODY]
    error = document["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_request_schemas_publish_the_bounds_the_decoder_enforces(document):
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]

    def bounds(prop: dict) -> dict:
        branch = prop["anyOf"][0] if "anyOf" in prop else prop
        return {k: v for k, v in branch.items() if k in ("minimum", "maximum", "exclusiveMinimum", "maxItems",
                                                          "minItems")}

    assert bounds(chat["n"]) == {"minimum": 1, "maximum": 16}
    assert bounds(chat["temperature"]) == {"minimum": 0, "maximum": 2}
    assert bounds(chat["top_p"]) == {"exclusiveMinimum": 0, "maximum": 1}
    assert bounds(chat["top_logprobs"]) == {"minimum": 0, "maximum": 20}
    assert bounds(chat["max_completion_tokens"]) == {"minimum": 1}
    assert bounds(chat["messages"]) == {"minItems": 1}
    assert chat["stop"]["anyOf"][1]["maxItems"] == 4
    legacy = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert bounds(legacy["logprobs"]) == {"minimum": 0, "maximum": 5}


# request field -> the SamplingParams field its value becomes (where the engine checks a range of its own)
SHARED_BOUNDS = {"n": "n", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                 "repetition_penalty": "repetition_penalty", "max_tokens": "max_tokens",
                 "min_tokens": "min_tokens", "top_logprobs": "logprobs"}


def _constraints(field: str) -> msgspec.inspect.Type:
    info = next(f for f in msgspec.inspect.type_info(ChatCompletionRequest).fields if f.name == field)
    kind = info.type.types[0] if isinstance(info.type, msgspec.inspect.UnionType) else info.type
    return kind.type if isinstance(kind, msgspec.inspect.Metadata) else kind


def _engine_accepts(field: str, value: float) -> bool:
    try:
        SamplingParams(**{field: value, **({"max_tokens": None} if field == "min_tokens" else {})})
        return True
    except InvalidSamplingParameter:
        return False


@pytest.mark.parametrize("field", sorted(SHARED_BOUNDS))
def test_protocol_bounds_agree_with_the_engines_sampling_params(field):
    """Each bound the decoder enforces is the engine's own range: the edge passes both, a step past it neither."""
    kind, engine_field = _constraints(field), SHARED_BOUNDS[field]
    step = 1 if isinstance(kind, msgspec.inspect.IntType) else 1e-6
    for edge, inside, outside in ((kind.ge, 0, -step), (kind.gt, step, 0), (kind.le, 0, step)):
        if edge is not None:
            assert _engine_accepts(engine_field, edge + inside), (field, edge + inside)
            assert not _engine_accepts(engine_field, edge + outside), (field, edge + outside)
    if kind.le is None and engine_field not in ("max_tokens", "min_tokens", "top_k"):
        assert not _engine_accepts(engine_field, math.inf)  # unbounded above for the decoder: finite for both


@pytest.mark.parametrize("body, param, allowed", [
    ({"temperature": 2.5}, "temperature", "between 0 and 2"),
    ({"n": 17}, "n", "between 1 and 16"),
    ({"top_p": 0}, "top_p", "in (0, 1]"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ({"messages": []}, "messages", "at least one message"),
    ({"stop": ["x", ""]}, "stop[1]", "stop must be at most 4 sequences, each a non-empty string"),
    ({"messages": [{"role": "wizard"}]}, "messages[0].role", "one of system, developer, user"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type",
     "this server serves text models"),
])
def test_an_out_of_bounds_field_is_a_400_naming_it_and_its_bounds(body, param, allowed):
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(InvalidParameter) as info:
        decode_request(json.dumps(request).encode(), ChatCompletionRequest)
    assert info.value.param == param and allowed in str(info.value)


def test_a_field_inside_a_bounded_list_is_not_worded_by_the_lists_bounds():
    with pytest.raises(InvalidParameter) as info:
        decode_request(b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', ChatCompletionRequest)
    assert info.value.param == "messages[0].content" and "at least one message" not in str(info.value)


def test_a_legacy_completion_prompt_is_documented_as_the_forms_it_takes(document):
    prompt = document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[0] == {"type": "string", "minLength": 1}
    token_ids, prompts = prompt[1]["anyOf"]
    assert token_ids["items"] == {"type": "integer", "minimum": 0} and prompts["maxItems"] == MAX_PROMPTS
    with pytest.raises(InvalidParameter):
        decode_request(b'{"model": "m", "prompt": ""}', CompletionRequest)


def test_a_405_carries_allow_and_the_openai_error_body(client):
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST, OPTIONS"
    assert r.json()["error"]["code"] == "method_not_allowed" and "POST" in r.json()["error"]["message"]


def _validator(document: dict, name: str):
    import jsonschema

    return jsonschema.Draft202012Validator({**document["components"]["schemas"][name],
                                            "components": document["components"]})


@pytest.mark.parametrize("body, valid", [
    ({}, True),
    ({"top_logprobs": 3}, False), ({"top_logprobs": 3, "logprobs": True}, True), ({"top_logprobs": None}, True),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, False), ({"guided_regex": "a+", "guided_choice": None}, True),
    ({"guided_regex": "a+", "min_tokens": 2}, False), ({"guided_regex": "a+", "ignore_eos": True}, False),
    ({"response_format": {"type": "text"}, "guided_json": {"type": "object"}}, True),
    ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, False),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, False),
    ({"tool_choice": "required"}, False), ({"tool_choice": "auto"}, True),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}},
     True),  # auto's calls or the answer: one constraint
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"},
      "tool_choice": "required"}, False),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"},
      "guided_regex": "a"}, False),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "guided_regex": "a"}, False),
    ({"modalities": ["text"]}, True), ({"modalities": ["text", "audio"]}, False),
    ({"guided_choice": [""]}, False), ({"guided_choice": []}, False), ({"guided_choice": ["a\u0000"]}, False),
    ({"logit_bias": {"12": 1}}, True), ({"logit_bias": {"-1": 1}}, False), ({"logit_bias": {"01": 1}}, False),
    ({"messages": [{"role": "system"}]}, False), ({"messages": [{"role": "assistant"}]}, True),
])
def test_the_chat_schema_states_the_rules_across_fields_the_server_enforces(document, body, valid):
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    assert _validator(document, "ChatCompletionRequest").is_valid(request) is valid


@pytest.mark.parametrize("body, valid", [
    ({"max_tokens": 0}, False), ({"max_tokens": 0, "echo": True}, True), ({"suffix": "x"}, False),
    ({"suffix": ""}, True), ({"best_of": 2}, False), ({"model": "cascade-route", "n": 2}, False),
    ({"model": "cascade-route"}, True), ({"n": 2}, True),
])
def test_the_completion_schema_states_the_rules_across_fields(body, valid):
    cfg = config_from_dict({"engines": {"a": {"checkpoint": "/nowhere"}, "b": {"checkpoint": "/nowhere"}},
                            "routes": {"cascade-route": {"strategy": "cascade", "engines": ["a", "b"]}}})
    document = TestClient(create_app(cfg, host_factory=lambda: None)).get("/schema/openapi.json").json()
    request = {"model": "a", "prompt": "hi", **body}
    assert _validator(document, "CompletionRequest").is_valid(request) is valid


def test_token_id_bounds_are_published_from_the_loaded_engines():
    from types import SimpleNamespace

    from gateway.request_contract import bound_tokens, engine_bounds

    engines = [SimpleNamespace(config=SimpleNamespace(vocab_size=4096), tokenizer=SimpleNamespace(vocab_size=4100),
                               max_model_len=512), SimpleNamespace(config=SimpleNamespace(vocab_size=5000),
                                                                   tokenizer=None, max_model_len=256)]
    assert engine_bounds(engines) == (4096, 256)
    cfg = config_from_dict({"engines": {"m": {"checkpoint": "/nowhere"}}})
    app = create_app(cfg, host_factory=lambda: None)
    client = TestClient(app)
    client.get("/schema/openapi.json")  # served once before the engines load: the served copy is amended too
    from gateway.openapi import amend

    amend(app, lambda schemas: bound_tokens(schemas, 4096, 256))
    document = client.get("/schema/openapi.json").json()
    chat, legacy = _validator(document, "ChatCompletionRequest"), _validator(document, "CompletionRequest")
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert chat.is_valid({**base, "stop_token_ids": [4095], "logit_bias": {"4095": 1}})
    assert not chat.is_valid({**base, "stop_token_ids": [4096]})
    assert not chat.is_valid({**base, "logit_bias": {"4096": 1}})
    assert legacy.is_valid({"model": "m", "prompt": [4095] * 255})
    assert not legacy.is_valid({"model": "m", "prompt": [4096]})
    assert not legacy.is_valid({"model": "m", "prompt": [[1], [4096]]})
    assert not legacy.is_valid({"model": "m", "prompt": [1] * 256})


def test_logit_bias_key_pattern_is_exactly_the_ids_below_the_vocabulary():
    import re

    from gateway.request_contract import _key_pattern

    for below in (1, 7, 10, 11, 100, 101, 4096, 32000, 151936):
        pattern = re.compile(_key_pattern(below))
        assert all(bool(pattern.fullmatch(str(i))) == (i < below) for i in range(3 * below))
        assert not any(pattern.fullmatch(k) for k in ("00", "01", "-1", "+1", " 1", "1.0", ""))
