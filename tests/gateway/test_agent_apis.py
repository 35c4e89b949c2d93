"""The APIs agents and SDKs call, against a live `tandem serve` on the embedded default (the tiny models, auth on):
OpenAI's Responses API through the official `openai` SDK (`client.responses.create` plain, streamed, with a
function tool, with `text.format` json_schema, `previous_response_id`, `store: false`) and Anthropic's Messages
API through the official `anthropic` SDK (`client.messages.create` and `.stream`, plain and with tools,
tool_result turns, stop_sequences, count_tokens, `x-api-key`), and `/v1/embeddings` (the engine's vectors,
float and base64). Bad input to each is a 4xx in that API's own error shape. The server-side store's bound and expiry are checked without a server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from live_server import start_serve, stop  # conftest puts tests/ on the path
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_config
from gateway.responses_store import ResponseStore
from gateway.server import ServerThread, free_port

KEY = "sk-agent-apis-test"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_LOG_LEVEL": "warning", "TANDEM_API_KEYS": KEY}
    env.pop("TANDEM_CONFIG", None)
    proc, url = start_serve(["--port", str(port)], env, port, timeout_s=180)
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def _post(server: str, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(server + path, json=body, headers={"authorization": f"Bearer {KEY}", **headers}, timeout=60)


# ------------------------------------------------------------------------------------------- Responses API

def test_responses_create_answers_text_with_usage_and_is_stored(oai):
    r = oai.responses.create(model="fast", input="Say hello", instructions="Be brief", max_output_tokens=12,
                             temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "fast"
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text and r.output_text
    assert 1 <= r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.usage.output_tokens == 12 and r.incomplete_details.reason == "max_output_tokens"
    again = oai.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text and again.instructions == "Be brief"


def test_responses_stream_sends_the_typed_events_in_order(oai):
    with oai.responses.create(model="fast", input="Count to five", max_output_tokens=10, temperature=0,
                              stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas and deltas == done.text == final.output_text
    assert final.usage.output_tokens == 10 or final.status == "completed"
    # the same request unstreamed, greedy: the same text
    whole = oai.responses.create(model="fast", input="Count to five", max_output_tokens=10, temperature=0)
    assert whole.output_text == deltas


def test_responses_function_tool_is_called_with_arguments_matching_its_schema(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
    r = oai.responses.create(model="fast", input="Weather in Paris?", tools=tools, max_output_tokens=40,
                             tool_choice={"type": "function", "name": "get_weather"})
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # streamed: argument deltas add up to the done event's arguments and the final item's
    with oai.responses.create(model="fast", input="Weather in Rome?", tools=tools, max_output_tokens=120,
                              tool_choice="required", parallel_tool_calls=False, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "get_weather"
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    final_call = events[-1].response.output[-1]
    assert final_call.type == "function_call" and final_call.arguments == done.arguments
    # the tool's result goes back as a function_call_output item
    follow = oai.responses.create(model="fast", tools=tools, max_output_tokens=8, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > r.usage.input_tokens


def test_responses_text_format_json_schema_is_followed(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["calm", "glad"]}},
              "required": ["ok", "mood"], "additionalProperties": False}
    r = oai.responses.create(model="fast", input="Answer in JSON", max_output_tokens=80, temperature=0,
                             text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                              "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_carries_the_conversation_and_store_false_keeps_nothing(oai, server):
    first = oai.responses.create(model="fast", input="My name is Ada.", max_output_tokens=6)
    second = oai.responses.create(model="fast", input="What is my name?", max_output_tokens=6,
                                  previous_response_id=first.id)
    alone = oai.responses.create(model="fast", input="What is my name?", max_output_tokens=6)
    # the first turn's input and output are in the second's prompt
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 2
    assert second.previous_response_id == first.id
    unstored = oai.responses.create(model="fast", input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    r = _post(server, "/v1/responses", {"model": "fast", "input": "x", "previous_response_id": unstored.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert httpx.delete(f"{server}/v1/responses/{first.id}", headers={"authorization": f"Bearer {KEY}"}
                        ).json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "fast"}, 400, "input"),
    ({"model": "fast", "input": "x", "seed": 3}, 400, "seed"),
    ({"model": "fast", "input": [{"type": "input_image", "image_url": "x"}]}, 400, "input[0].type"),
    ({"model": "fast", "input": [{"role": "user", "content": [{"type": "input_file"}]}]}, 400,
     "input[0].content[0].type"),
    ({"model": "fast", "input": [{"type": "function_call", "name": "f"}]}, 400, "input[0].call_id"),
    ({"model": "fast", "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": "fast", "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"model": "fast", "input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"model": "fast", "input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice.name"),
    ({"model": "fast", "input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, 400,
     "text.format.name"),
    ({"model": "fast", "input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"model": "fast", "input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"model": "no-such-model", "input": "x"}, 404, "model"),
])
def test_responses_bad_input_is_a_4xx_naming_the_field(server, body, status, param):
    r = _post(server, "/v1/responses", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_a_schema_the_grammar_cannot_compile_is_a_400_naming_text_format(server):
    r = _post(server, "/v1/responses", {"model": "fast", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": {"type": "string", "pattern": "(?<=a)b"}}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("text.format") and "response_format" not in error["message"]


def test_the_store_is_bounded_and_expires():
    clock = [0.0]
    store = ResponseStore(capacity=2, ttl_s=10, clock=lambda: clock[0])
    for i in range(3):
        store.put(f"r{i}", {"id": f"r{i}"}, [])
        clock[0] += 1
    assert store.get("r0") is None and store.get("r1").body == {"id": "r1"} and len(store) == 2
    clock[0] = 11.5  # r1 was stored at 1: expired; r2 at 2: still held
    assert store.get("r1") is None and store.get("r2") is not None
    clock[0] = 12.5
    assert store.get("r2") is None and len(store) == 0


# ------------------------------------------------------------------------------------------- Messages API

def test_messages_create_answers_text_with_usage(claude):
    m = claude.messages.create(model="fast", max_tokens=12, system="Be brief", temperature=0,
                               messages=[{"role": "user", "content": "Hi"}])
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "fast"
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and 1 <= m.usage.output_tokens <= 12
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 12
    counted = claude.messages.count_tokens(model="fast", system="Be brief",
                                           messages=[{"role": "user", "content": "Hi"}])
    assert counted.input_tokens == m.usage.input_tokens


def test_messages_stream_sends_the_event_sequence(claude):
    kwargs = {"model": "fast", "max_tokens": 10, "temperature": 0,
              "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]}]}
    with claude.messages.stream(**kwargs) as stream:
        kinds = [e.type for e in stream if e.type != "text"]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    whole = claude.messages.create(**kwargs)
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_messages_stop_sequences_end_the_text_and_are_reported(claude):
    kwargs = {"model": "fast", "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": "Go"}]}
    text = claude.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    m = claude.messages.create(**kwargs, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    got = m.content[0].text if m.content else ""
    assert got == text[:text.index(stop)]


def test_messages_tools_give_tool_use_blocks_and_take_tool_results(claude):
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = claude.messages.create(model="fast", max_tokens=40, tools=tools, messages=ask,
                               tool_choice={"type": "tool", "name": "get_weather"})
    use = m.content[-1]
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with claude.messages.stream(model="fast", max_tokens=120, tools=tools, messages=ask,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    jsonschema.validate(final.content[-1].input, WEATHER)
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    answer = claude.messages.create(model="fast", max_tokens=8, tools=tools, messages=[
        *ask, {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}])
    assert answer.usage.input_tokens > m.usage.input_tokens


def _served(server: str, route: str) -> float:
    """Requests the route has answered, as its e2e latency histogram counts them."""
    text = httpx.get(server + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tandem:e2e_request_latency_seconds_count" and s.labels.get("route") == route)


def test_both_apis_go_through_the_route_and_its_metrics(server):
    before = _served(server, "best")
    r = httpx.post(server + "/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
        "model": "best", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.headers["x-tandem-route"] == "best"
    assert r.headers["x-tandem-model"] == "tandem-large"
    r = _post(server, "/v1/responses", {"model": "best", "input": "Hi", "max_output_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["x-tandem-route"] == "best"
    assert _served(server, "best") == before + 2


def test_a_keys_request_limit_answers_429_in_each_apis_shape():
    cfg = load_config(env={}, overrides={"kv_pool.memory_bytes": "64MiB", "auth.api_keys": [
        {"key": KEY, "requests_per_minute": 1}]})
    with ServerThread(cfg) as srv:
        ok = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
            "model": "fast", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert ok.status_code == 200
        limited = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
            "model": "fast", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert limited.json()["type"] == "error" and limited.json()["error"]["type"] == "rate_limit_error"
        limited = _post(srv.url, "/v1/responses", {"model": "fast", "input": "Hi"})
        assert limited.status_code == 429 and limited.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize(("body", "status", "kind", "mentions"), [
    ({"model": "fast", "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "fast", "max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": "fast", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].type"),
    ({"model": "fast", "max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error", "temperature"),
    ({"model": "fast", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
     400, "invalid_request_error", "tool_choice.name"),
    ({"model": "fast", "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024},
      "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "thinking"),
    ({"model": "no-such-model", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, 404,
     "not_found_error", "no-such-model"),
])
def test_messages_bad_input_is_a_4xx_in_anthropics_shape(server, body, status, kind, mentions):
    r = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and mentions in error["error"]["message"]


def test_messages_need_a_key_and_the_sdk_raises_its_own_errors(server, claude):
    r = httpx.post(server + "/v1/messages", json={"model": "fast", "max_tokens": 4, "messages": []}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server + "/v1/messages/count_tokens", headers={"x-api-key": "wrong-key"}, timeout=60,
                   json={"model": "fast", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="fast", max_tokens=4, messages=[{"role": "system", "content": "x"}])


# ------------------------------------------------------------------------------------------- embeddings

def test_embeddings_are_the_engines_vectors_as_floats_and_base64(oai, server):
    import numpy as np
    import torch

    from engines.embedding import embed
    from engines.loader import load_checkpoint
    from engines.tokenizer import Tokenizer

    small = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-s"
    texts = ["The quick brown fox", "the sea"]
    r = oai.embeddings.create(model="fast", input=texts)  # the SDK asks for base64 and decodes it
    tokenizer = Tokenizer.from_pretrained(small)
    ids = [tokenizer.encode(t) for t in texts]
    expected = embed(load_checkpoint(small, dtype=torch.float32).model, ids, "mean")
    got = np.array([d.embedding for d in r.data])
    assert [d.index for d in r.data] == [0, 1] and got.shape == tuple(expected.shape)
    assert np.allclose(got, expected.numpy(), atol=1e-4)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    floats = _post(server, "/v1/embeddings", {"model": "fast", "input": ids[0], "encoding_format": "float"})
    assert floats.status_code == 200 and floats.headers["x-tandem-model"] == "tandem-small"
    assert np.allclose(floats.json()["data"][0]["embedding"], got[0], atol=1e-6)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "fast", "input": "x", "dimensions": 3}, "dimensions"),
    ({"model": "fast", "input": []}, "input"),
    ({"model": "fast", "input": ["ok", ""]}, "input[1]"),
    ({"model": "fast", "input": [[1, 2], [10**9]]}, "input[1]"),
    ({"model": "fast", "input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_embeddings_bad_input_is_a_400_naming_the_field(server, body, param):
    r = _post(server, "/v1/embeddings", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_embeddings_and_chat_at_once_each_get_what_they_get_alone(oai, server):
    """Embedding requests are engine requests: sent together with greedy chats they share the engine's steps,
    and neither changes the other's answer; the request counter counts them under their own operation."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [f"item {i}: the sea at dawn" for i in range(6)]
    chat = {"model": "fast", "messages": [{"role": "user", "content": "Name a colour"}], "max_tokens": 12,
            "temperature": 0}
    alone_chat = _post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    alone_vectors = [d.embedding for d in oai.embeddings.create(model="fast", input=texts).data]
    before = _served(server, "fast")
    with ThreadPoolExecutor(8) as pool:
        chats = [pool.submit(_post, server, "/v1/chat/completions", chat) for _ in range(4)]
        embeds = [pool.submit(oai.embeddings.create, model="fast", input=[t]) for t in texts]
        chats = [f.result() for f in chats]
        embeds = [f.result() for f in embeds]
    assert all(r.status_code == 200 for r in chats)
    assert [r.json()["choices"][0]["message"]["content"] for r in chats] == [alone_chat] * 4
    import numpy as np

    for got, want in zip(embeds, alone_vectors):
        assert np.allclose(got.data[0].embedding, want, atol=1e-5)
    assert _served(server, "fast") - before == len(chats) + len(embeds)  # both counted, on the same route


# ------------------------------------------------------------------------------------------- LiteLLM's client

@pytest.fixture(scope="module")
def litellm_client(monkeypatch_module):
    monkeypatch_module.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price table from the wheel, no network
    import litellm

    return litellm


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_litellm_completion_streaming_and_embedding_against_the_server(litellm_client, oai, server):
    """LiteLLM's first calls, through its own client and its `openai/` provider: a chat completion (plain and
    streamed) and an embedding, each equal to what the official SDK gets from the same server."""
    litellm = litellm_client
    base = {"api_base": server + "/v1", "api_key": KEY}
    messages = [{"role": "user", "content": "Name a colour"}]
    r = litellm.completion(model="openai/fast", messages=messages, max_tokens=10, temperature=0, **base)
    sdk = oai.chat.completions.create(model="fast", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == sdk.choices[0].message.content
    assert r.usage.completion_tokens == sdk.usage.completion_tokens and r.usage.prompt_tokens > 0
    chunks = litellm.completion(model="openai/fast", messages=messages, max_tokens=10, temperature=0, stream=True,
                                **base)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == sdk.choices[0].message.content
    texts = ["The quick brown fox", "the sea"]
    e = litellm.embedding(model="openai/fast", input=texts, **base)
    want = oai.embeddings.create(model="fast", input=texts)
    import numpy as np

    assert len(e.data) == 2 and e.usage.prompt_tokens == want.usage.prompt_tokens
    for got, ref in zip(e.data, want.data):
        assert np.allclose(got["embedding"], ref.embedding, atol=1e-6)
