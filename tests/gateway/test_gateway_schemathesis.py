"""schemathesis against the live gateway and its own OpenAPI document: requests generated from the document
(valid ones, and invalid ones the document refuses) must never get a 5xx, every answer must match the
document for its status and media type, and every valid chat and completion request is served
(positive_data_acceptance: no 400 for a request the document allows). The embedded default configuration serves it (the two tiny trained
models behind auto, cascade, fast and best), with one API key. Bounded to a few minutes: a fixed seed and a
capped example count per operation. Requests are sent as generated (a body without max_tokens generates up to
the context: a long constrained answer on `best` is what found llguidance's rollback bug, engines/structured.py).
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.config import load_config
from gateway.server import ServerThread

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

KEY = "sk-schemathesis-0001"
MAX_TOKENS = 4  # what filter_case takes as a request's max_tokens where it names none (min_tokens above it is left out)
MODELS = ["auto", "cascade", "fast", "best", "tandem-small", "tandem-large", "no-such-model"]
# per mode; other operations get 10. Valid requests are now served (generated, often under a grammar), not
# refused: 150 keeps the test near its former time on 2 cores
EXAMPLES = {"/v1/chat/completions": 150, "/v1/completions": 150}
# the generating operations and the field that caps their tokens
GENERATING = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens", "/v1/responses": "max_output_tokens",
              "/v1/messages": "max_tokens"}
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
ACCEPTING = {"/v1/chat/completions", "/v1/completions"}  # where a valid request must not be refused
# What the server refuses that JSON Schema cannot state (docs/api.md lists them), left out of generation:
# - a regex or grammar in the language the compilers read (a string's syntax beyond a `pattern`);
# - a JSON Schema sent as a string (contentMediaType / contentSchema are annotations, not assertions);
# - a value compared with another field's (min_tokens <= max_tokens, tool_choice naming one of the tools);
# - a prompt longer in tokens than the context (tokenisation decides: the 400 says context_length_exceeded).
LANGUAGES = {"guided_regex": ["[a-z]{1,3}", "yes|no", "\\d+"],
             "guided_grammar": ['root ::= "a" | "b"', 'root ::= [0-9]+'],
             "regex": ["[a-z]{1,3}", "yes|no"], "grammar": ['root ::= "x" "y"?']}
# - a JSON Schema tandem can enforce exactly (and, when strict, one that follows OpenAI's strict rules): the
#   keywords it refuses are named in each 400, a meta-schema of them is not published
SCHEMAS = [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
            "additionalProperties": False}, {"type": "object", "properties": {}, "required": [],
                                             "additionalProperties": False}]
SCHEMA_FIELDS = {"ChatCompletionRequest": "guided_json", "CompletionRequest": "guided_json",
                 "StructuredOutputsParams": "json", "JSONSchemaFormat": "schema", "FunctionDefinition": "parameters"}
BEYOND_SCHEMA_CODES = {"context_length_exceeded"}


@pytest.fixture(scope="module")
def server():
    cfg = load_config(env={}, overrides={"kv_pool.memory_bytes": "64MiB", "auth.api_keys": [KEY]})
    with ServerThread(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/schema/openapi.json")


@schemathesis.hook
def before_load_schema(ctx, raw_schema: dict) -> None:
    """Mostly the names this server serves: a random string would only ever reach the 404."""
    for request in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest",
                    "CountTokensRequest", "EmbeddingRequest"):
        raw_schema["components"]["schemas"][request]["properties"]["model"] = {"enum": MODELS}
    for request in ("ChatCompletionRequest", "CompletionRequest", "StructuredOutputsParams"):
        props = raw_schema["components"]["schemas"][request]["properties"]
        for field, examples in LANGUAGES.items():
            if field in props:
                props[field] = {"anyOf": [{"enum": examples}, {"type": "null"}]}
    for component, field in SCHEMA_FIELDS.items():
        raw_schema["components"]["schemas"][component]["properties"][field] = {
            "anyOf": [{"enum": SCHEMAS}, {"type": "null"}]}


def _max_tokens(body: dict) -> int:
    """The most tokens a chat or completion request asks for once map_body has capped it."""
    asked = next((body[f] for f in ("max_completion_tokens", "max_tokens") if _is_number(body.get(f))), None)
    return MAX_TOKENS if asked is None else max(min(int(asked), MAX_TOKENS), 1)  # completions: 0 (echo) is 1


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@schemathesis.hook
def filter_case(ctx, case) -> bool:
    """Leave out the requests whose fields must agree with each other in ways JSON Schema cannot compare."""
    body = case.body
    if not isinstance(body, dict) or ctx.operation is None or ctx.operation.path not in ACCEPTING:
        return True
    if _is_number(body.get("min_tokens")) and body["min_tokens"] > _max_tokens(body):
        return False
    choice, tools = body.get("tool_choice"), body.get("tools")
    if isinstance(choice, dict) and isinstance(tools, list):  # (invalid bodies too: any shape may come)
        names = {_name(t.get("function")) for t in tools if isinstance(t, dict)}
        return _name(choice.get("function")) in names
    return True


def _name(function) -> str | None:
    return function.get("name") if isinstance(function, dict) else None


def served_when_valid(ctx, response, case):
    """positive_data_acceptance on chat and completions, but for a prompt that the tokenizer finds longer
    than the context (no schema can count tokens)."""
    if case.operation.path not in ACCEPTING:
        return None
    if response.status_code == 400 and response.json()["error"]["code"] in BEYOND_SCHEMA_CODES:
        return None
    return positive_data_acceptance(ctx, response, case)


def _operations(api_schema) -> list:
    return [result.ok() for result in api_schema.get_all_operations()]


def _has_inputs(operation) -> bool:
    return operation.body is not None and len(operation.body) > 0 or len(operation.query) > 0


def _answers_as_documented(operation, mode: GenerationMode, url: str, statuses: Counter) -> None:
    """Run one operation's generated cases; raises on the first failing check (shrunk by hypothesis)."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES.get(operation.path, 10), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
    def answers(case) -> None:
        response = case.call_and_validate(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, checks=[*CHECKS, served_when_valid],
                                          timeout=30)
        statuses[response.status_code] += 1

    answers()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_generated_request_gets_a_documented_answer_and_no_server_error(server, api_schema, mode):
    seen: dict[str, Counter] = {}
    for operation in _operations(api_schema):
        if mode is GenerationMode.NEGATIVE and not _has_inputs(operation):
            continue  # nothing to make invalid
        _answers_as_documented(operation, mode, server.url, seen.setdefault(operation.label, Counter()))
    if mode is GenerationMode.POSITIVE:  # valid requests mostly generate: the engines were exercised, not just the 400s
        for label in ("POST /v1/chat/completions", "POST /v1/completions"):
            assert seen[label][200] >= EXAMPLES[label.split()[1]] // 4, (label, dict(seen[label]))


# ------------------------------------------------------------------------ what schemathesis found, pinned


def test_a_token_id_beyond_any_vocabulary_on_a_router_route_is_a_400_not_a_500(server):
    """The router read a token-id prompt by decoding it, and an id past 2**32 overflowed the tokenizer."""
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "auto", "prompt": [[13576, 2**44, 851]], "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert "prompt token ids must be in [0, " in r.json()["error"]["message"]
