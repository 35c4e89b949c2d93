"""schemathesis against the live gateway and its own OpenAPI document: requests generated from the document
(valid ones, and invalid ones the document refuses) must never get a 5xx, and every answer must match the
document for its status and media type. The embedded default configuration serves it (the two tiny trained
models behind auto, cascade, fast and best), with one API key. Bounded to a couple of minutes: a fixed seed,
a capped example count per operation, and generation capped at a few tokens per request.
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
    response_schema_conformance,
    status_code_conformance,
)

from gateway.config import load_config
from gateway.server import ServerThread

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

KEY = "sk-schemathesis-0001"
MAX_TOKENS = 4  # generation is not what is under test here: keep every request to a few tokens
MODELS = ["auto", "cascade", "fast", "best", "tandem-small", "tandem-large", "no-such-model"]
EXAMPLES = {"/v1/chat/completions": 400, "/v1/completions": 400}  # per mode; other operations get 10
# the generating operations and the field that caps their tokens
GENERATING = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens", "/v1/responses": "max_output_tokens",
              "/v1/messages": "max_tokens"}
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]


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


@schemathesis.hook
def map_body(ctx, body):
    """At most MAX_TOKENS generated tokens per choice (no max_tokens means up to the context): a bound on the
    test's time, not a workaround (integers written as 2.0 are served as JSON Schema says)."""
    if not isinstance(body, dict) or ctx.operation is None or ctx.operation.path not in GENERATING:
        return body
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(field), int | float) and not isinstance(body[field], bool) and body[field] > MAX_TOKENS:
            body[field] = MAX_TOKENS
    if not any(body.get(field) is not None for field in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
        body[GENERATING[ctx.operation.path]] = MAX_TOKENS
    return body


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
        response = case.call_and_validate(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, checks=CHECKS,
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
