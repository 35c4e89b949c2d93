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
