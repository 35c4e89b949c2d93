"""The gateway end to end: a real server on 127.0.0.1 over tiny random checkpoints, driven by the official
`openai` client (sync and async) and raw httpx: wire format, routing, errors, auth and limits, disconnects,
tracing and metrics.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tiny_checkpoints import with_chat_template  # noqa: E402  (conftest puts tests/ on the path)

from gateway.config import config_from_dict
from gateway.routes import register_strategy
from gateway.routing import Plan, RoutedRun, start_planned
from gateway.server import ServerThread

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gateway-ckpt")
    return {"small": with_chat_template(tiny_checkpoint("llama"), root / "small"),
            "large": with_chat_template(tiny_checkpoint("qwen2", hidden_size=96, num_heads=6, num_kv_heads=2,
                                                         seed=1, max_position_embeddings=4096), root / "large")}


def _config(checkpoints: dict[str, Path], **sections):
    raw = {"engines": {"tandem-small": {"checkpoint": str(checkpoints["small"])},
                       "tandem-large": {"checkpoint": str(checkpoints["large"])}},
           "kv_pool": {"memory_bytes": 32 << 20},
           "routes": {"fast": {"engines": ["tandem-small"], "slo": {"ttft_ms": 60000, "tpot_ms": 60000}},
                      "best": {"engines": ["tandem-large"]},
                      "capped": {"engines": ["tandem-small"], "max_tokens": 3},
                      "flaky": {"strategy": "test-flaky", "engines": ["tandem-small", "tandem-large"]},
                      "broken": {"strategy": "test-broken", "engines": ["tandem-small", "tandem-large"]}},
           "server": {"max_body_bytes": 64 << 10}}
    raw.update(sections)
    return config_from_dict(raw)


class _FailAfterFirstOutput:
    """A strategy whose generation fails after streaming began (the engine path an SSE error must cover)."""

    def plan(self, ctx, engines) -> Plan:
        return Plan(ctx.route.config.engines[0])

    async def start(self, plan, ctx, engines) -> RoutedRun:
        run = await start_planned(plan, ctx, engines)
        inner = run.outputs

        async def outputs():
            yield await anext(inner)
            await inner.aclose()
            raise RuntimeError("engine went away")

        run.outputs = outputs()
        return run


class _Broken:
    def plan(self, ctx, engines) -> Plan:
        raise RuntimeError("secret internal detail")


register_strategy("test-flaky", lambda name, route, cfg: _FailAfterFirstOutput())
register_strategy("test-broken", lambda name, route, cfg: _Broken())


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def metric_reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture(scope="module")
def server(checkpoints, spans, metric_reader):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    with ServerThread(_config(checkpoints), tracer_provider=provider,
                      meter_provider=MeterProvider(metric_readers=[metric_reader])) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _used_pages(server: ServerThread) -> int:
    return server.app.state.gateway.host.stats()["pool"]["used_pages"]


def _metric(server: ServerThread, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()) or not want:
                total += float(line.rsplit(" ", 1)[1])
    return total


# ----------------------------------------------------------------------------------------- discovery


def test_models_list_has_routes_and_engines(client):
    models = {m.id: m for m in client.models.list().data}
    assert {"fast", "best", "capped", "tandem-small", "tandem-large"} <= set(models)
    assert models["tandem-small"].owned_by == "tandem" and models["tandem-small"].object == "model"
    assert models["tandem-small"].model_extra["max_model_len"] == 512


def test_health_ready_routes_and_openapi(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json() == {"status": "ready", "engines": ["tandem-large", "tandem-small"]}
    routes = {r["name"]: r for r in httpx.get(server.url + "/v1/routes").json()["data"]}
    assert routes["fast"]["strategy"] == "fixed" and routes["fast"]["engines"] == ["tandem-small"]
    assert routes["fast"]["slo"] == {"ttft_ms": 60000.0, "tpot_ms": 60000.0, "percentile": 99.0}
    schema = httpx.get(server.url + "/schema/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"] and "/v1/completions" in schema["paths"]


# ------------------------------------------------------------------------------------------- chat


def test_chat_completion_wire_format_usage_and_headers(client):
    raw = client.chat.completions.with_raw_response.create(model="fast", messages=MESSAGES, max_tokens=6,
                                                           temperature=0)
    assert raw.headers["x-tandem-route"] == "fast" and raw.headers["x-tandem-model"] == "tandem-small"
    assert len(raw.headers["x-request-id"]) == 32
    body = json.loads(raw.text)
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-" + raw.headers["x-request-id"]
    choice = body["choices"][0]
    # explicit nulls, as OpenAI sends them
    assert choice["logprobs"] is None and choice["message"]["refusal"] is None
    assert body["system_fingerprint"] is None and choice["message"]["role"] == "assistant"
    resp = raw.parse()
    assert resp.model == "fast"
    assert resp.choices[0].finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage.completion_tokens >= 1 and usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # prompt tokens really counted: the rendered ChatML prompt is much longer than a handful of tokens
    assert usage.prompt_tokens > 10


def test_chat_stream_shares_id_role_first_finish_last_usage_chunk(client):
    chunks = list(client.chat.completions.create(model="fast", messages=MESSAGES, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    content = [c for c in chunks if c.choices]
    assert content[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in content)
    full = client.chat.completions.create(model="fast", messages=MESSAGES, max_tokens=5, temperature=0)
    assert text == full.choices[0].message.content  # greedy: streaming and not agree
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n2_interleaves_choice_indices_and_counts_both(client):
    chunks = list(client.chat.completions.create(model="fast", messages=MESSAGES, max_tokens=8, n=2, seed=3,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    indices = [c.choices[0].index for c in chunks if c.choices]
    assert set(indices) == {0, 1}
    first_one = indices.index(1)
    assert 0 in indices[first_one:]  # interleaved, not one choice after the other
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 16


def test_stop_string_is_stripped_and_finishes_with_stop(client):
    base = client.completions.create(model="fast", prompt="def read_config", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) >= 4
    stop = base[2:4]
    first = base.find(stop)
    resp = client.completions.create(model="fast", prompt="def read_config", max_tokens=12, temperature=0,
                                     stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == base[:first]
    assert resp.choices[0].finish_reason == "stop"


def test_seed_reproduces_sampling_and_different_seeds_differ(client):
    def sample(seed: int) -> str:
        return client.completions.create(model="fast", prompt="The quick", max_tokens=12, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    assert a != c


def test_chat_logprobs_top_logprobs_are_ranked_and_greedy_picks_the_top(client):
    resp = client.chat.completions.create(model="fast", messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 5
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy takes the most likely token
        assert entry.token == entry.top_logprobs[0].token and entry.bytes == list(entry.token.encode())


def test_legacy_completion_logprobs_format(client):
    resp = client.completions.create(model="best", prompt="Hello world", max_tokens=4, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    choice = resp.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and token in top and max(top.values()) == pytest.approx(token_lp, abs=1e-5)


def test_echo_prepends_the_prompt_and_its_tokens_logprobs(client):
    """OpenAI's echo with logprobs: the prompt's tokens come first in logprobs (the first with a null logprob and
    no top logprobs), offsets count from the prompt's start, the generated tokens follow."""
    prompt = "Hello world"
    for stream in (False, True):
        resp = client.completions.create(model="fast", prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                         echo=True, stream=stream, extra_body={"ignore_eos": True})
        choices = [c.choices[0] for c in resp if c.choices] if stream else resp.choices
        text = "".join(c.text for c in choices)
        offsets = [o for c in choices if c.logprobs for o in c.logprobs.text_offset]
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        token_lps = [lp for c in choices if c.logprobs for lp in c.logprobs.token_logprobs]
        tops = [t for c in choices if c.logprobs for t in c.logprobs.top_logprobs]
        assert text.startswith(prompt) and text == "".join(tokens)
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        assert token_lps[0] is None and tops[0] is None and all(lp <= 0 for lp in token_lps[1:])
        assert len(tokens) > 3 and all(len(top) >= 1 for top in tops[1:])


def test_legacy_completion_stream_and_token_id_prompt(client, server):
    chunks = list(client.completions.create(model="tandem-large", prompt=[5, 6, 7, 8], max_tokens=4,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].usage.prompt_tokens == 4 and chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_max_completion_tokens_wins_over_max_tokens_and_route_cap_applies(client):
    resp = client.chat.completions.create(model="fast", messages=MESSAGES, max_tokens=9,
                                          max_completion_tokens=2, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2 and resp.choices[0].finish_reason == "length"
    capped = client.completions.create(model="capped", prompt="x y", max_tokens=50, extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 3


def test_vllm_extras_and_unknown_fields_are_accepted(client):
    resp = client.chat.completions.create(
        model="fast", messages=MESSAGES, max_tokens=4, temperature=0.7,
        extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True,
                    "stop_token_ids": [], "some_future_field": {"x": 1}})
    assert resp.usage.completion_tokens == 4


async def test_async_client_chat_and_completion_streaming(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat, comp = await asyncio.gather(
        client.chat.completions.create(model="best", messages=MESSAGES, max_tokens=3, temperature=0),
        client.completions.create(model="fast", prompt="abc", max_tokens=3, stream=True))
    assert chat.choices[0].message.content is not None and chat.model == "best"
    texts = [c.choices[0].text async for c in comp if c.choices]
    assert len(texts) >= 1
    await client.close()


# ------------------------------------------------------------------------------------------ raw SSE


def test_raw_sse_framing(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={"model": "fast", "messages": MESSAGES, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: {") and "\n" not in event
        assert json.loads(event[6:])["object"] == "chat.completion.chunk"
    first = json.loads(events[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["logprobs"] is None and first["usage"] is None


# ---------------------------------------------------------------------------------------------- errors


def test_error_statuses_map_to_openai_exception_classes(client, server):
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    assert nf.value.code == "model_not_found" and "gpt-nope" in nf.value.message and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="fast", messages=MESSAGES, temperature=5)
    assert bad.value.param == "temperature" and "between 0 and 2" in bad.value.message
    with pytest.raises(openai.BadRequestError) as stop:
        client.completions.create(model="fast", prompt="x", stop=["a", "b", "c", "d", "e"])
    assert stop.value.param == "stop" and "at most 4" in stop.value.message
    with pytest.raises(openai.BadRequestError) as typed:
        client.completions.create(model="fast", prompt="x", extra_body={"n": "two"})
    assert typed.value.param == "n"
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.completions.create(model="fast", prompt=list(range(5, 305)) * 2, max_tokens=4)
    assert long_prompt.value.code == "context_length_exceeded"
    assert "600 tokens" in long_prompt.value.message and "512" in long_prompt.value.message
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model="fast", prompt="hi", max_tokens=100000)
    assert too_many.value.param == "max_tokens" and "100000" in too_many.value.message
    with pytest.raises(openai.InternalServerError) as crash:
        client.chat.completions.create(model="broken", messages=MESSAGES)
    assert crash.value.status_code == 500
    request_id = crash.value.response.headers["x-request-id"]
    assert request_id in crash.value.message and "secret internal detail" not in crash.value.response.text
    assert "Traceback" not in crash.value.response.text


def test_http_level_errors_are_openai_shaped(server):
    def error(r: httpx.Response) -> dict:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        return r.json()["error"]

    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and error(r)["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "fast"})
    assert r.status_code == 400 and error(r)["param"] == "messages"
    r = httpx.get(server.url + "/v2/nothing")
    assert r.status_code == 404 and error(r)["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and error(r)["code"] == "method_not_allowed"
    r = httpx.post(server.url + "/v1/completions", json={"model": "fast", "prompt": "x" * (70 << 10)})
    assert r.status_code == 413 and error(r)["code"] == "request_too_large"


def test_error_after_streaming_started_is_an_sse_error_event_then_done(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={"model": "flaky", "messages": MESSAGES, "max_tokens": 20, "stream": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])
    assert error["error"]["type"] == "server_error" and error["error"]["code"] == "internal_error"
    assert "engine went away" not in events[-2]
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


# --------------------------------------------------------------------------------------- disconnects


async def test_dropping_50_streams_midway_frees_every_kv_page(server):
    aborted_before = _metric(server, "tandem:request_success_total", route="fast", finished_reason="abort")

    async def drop_one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/completions", json={
                "model": "fast", "prompt": "Speculative decoding", "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # leave after the first token, long before the 400th

    limits = httpx.Limits(max_connections=60, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
        await asyncio.gather(*(drop_one(client) for _ in range(50)))
    deadline = time.monotonic() + 20
    while _used_pages(server) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _used_pages(server) == 0
    stats = server.app.state.gateway.host.stats()["engines"]["tandem-small"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    while server.app.state.gateway.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert server.app.state.gateway.inflight == 0
    aborted = _metric(server, "tandem:request_success_total", route="fast", finished_reason="abort")
    assert aborted - aborted_before == 50


def test_client_hanging_up_on_a_long_non_streamed_request_aborts_it(server):
    aborted_before = _metric(server, "tandem:request_success_total", route="best", finished_reason="abort")
    # 4,000 decode steps, one after another: far past the client's 0.3 s on any machine (500 were not on a fast one)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(5, read=0.3), json={
            "model": "best", "prompt": "x", "max_tokens": 4000, "n": 8, "ignore_eos": True})
    deadline = time.monotonic() + 10
    while _metric(server, "tandem:request_success_total", route="best", finished_reason="abort") == aborted_before \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "tandem:request_success_total", route="best", finished_reason="abort") == aborted_before + 1
    assert _used_pages(server) == 0


# ------------------------------------------------------------------------------------------ telemetry


def test_request_span_has_genai_attributes_and_engine_children(client, spans):
    spans.clear()
    client.chat.completions.create(model="best", messages=MESSAGES, max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 5
    while not any(s.name == "chat best" for s in spans.get_finished_spans()) and time.monotonic() < deadline:
        time.sleep(0.01)
    finished = spans.get_finished_spans()
    request = next(s for s in finished if s.name == "chat best")
    attrs = dict(request.attributes)
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.provider.name"] == "tandem"
    assert attrs["gen_ai.request.model"] == "best" and attrs["gen_ai.response.model"] == "tandem-large"
    assert attrs["gen_ai.usage.output_tokens"] == 3 and attrs["gen_ai.usage.input_tokens"] > 10
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    assert not any("content" in k or "messages" in k for k in attrs)  # record_content is off
    children = {s.name: s for s in finished if s.parent is not None
                and s.parent.span_id == request.context.span_id}
    assert {"route", "queue", "prefill", "decode"} <= set(children)
    assert children["route"].attributes["tandem.route.engine"] == "tandem-large"
    assert children["queue"].end_time <= children["prefill"].end_time <= children["decode"].end_time
    assert not any(s.name.endswith(("http send", "http receive")) for s in finished)


def test_request_span_is_a_server_span_joining_the_callers_trace(client, server, spans):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    spans.clear()
    client.chat.completions.create(model="fast", messages=MESSAGES, max_tokens=2,
                                   extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-route", messages=MESSAGES, max_tokens=2)
    deadline = time.monotonic() + 5
    while len([s for s in spans.get_finished_spans() if s.kind.name == "SERVER"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    served, missing = sorted((s for s in spans.get_finished_spans() if s.kind.name == "SERVER"),
                             key=lambda s: s.start_time)
    assert served.name == "chat fast"
    assert f"{served.context.trace_id:032x}" == trace_id and f"{served.parent.span_id:016x}" == parent_id
    # the stable HTTP semantic conventions (the pre-stable names only with OTEL_SEMCONV_STABILITY_OPT_IN=http/dup)
    assert served.attributes["http.request.method"] == "POST"
    assert served.attributes["http.response.status_code"] == 200
    assert served.attributes["http.route"] == "/v1/chat/completions"
    assert served.attributes["url.path"] == "/v1/chat/completions" and served.attributes["url.scheme"] == "http"
    assert served.attributes["client.address"] == "127.0.0.1"
    assert served.attributes["server.address"] == "127.0.0.1" and served.attributes["server.port"] == server.port
    assert served.attributes["user_agent.original"].startswith("OpenAI/Python")
    assert "http.method" not in served.attributes and "http.status_code" not in served.attributes
    assert missing.parent is None and missing.attributes["http.response.status_code"] == 404
    assert missing.status.status_code.name == "UNSET"  # a 4xx is the client's error, not the server's


def test_prompt_and_completion_enter_spans_only_with_record_content(client, server, spans):
    telemetry = server.app.state.gateway.cfg.telemetry
    telemetry.record_content = True
    try:
        spans.clear()
        resp = client.chat.completions.create(model="best", messages=MESSAGES, max_tokens=2, temperature=0)
        deadline = time.monotonic() + 5
        while not any(s.name == "chat best" for s in spans.get_finished_spans()) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        telemetry.record_content = False
    attrs = next(s for s in spans.get_finished_spans() if s.name == "chat best").attributes
    assert json.loads(attrs["gen_ai.input.messages"]) == MESSAGES
    assert json.loads(attrs["gen_ai.output.messages"]) == [resp.choices[0].message.content]


def test_genai_server_metrics_use_the_semantic_convention_buckets(client, metric_reader):
    client.chat.completions.create(model="fast", messages=MESSAGES, max_tokens=3, extra_body={"ignore_eos": True})
    found = {}
    for resource in metric_reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found[metric.name] = metric
    assert {"gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token",
            "gen_ai.server.request.duration"} <= set(found)
    ttft = found["gen_ai.server.time_to_first_token"]
    point = next(p for p in ttft.data.data_points if p.attributes["gen_ai.request.model"] == "fast")
    assert point.count >= 1 and tuple(point.explicit_bounds)[:3] == (0.001, 0.005, 0.01)
    assert point.attributes["gen_ai.response.model"] == "tandem-small"
    assert point.attributes["gen_ai.operation.name"] == "chat" and point.attributes["gen_ai.provider.name"] == "tandem"


def test_errors_are_counted_by_route_and_status(client, server):
    before = _metric(server, "tandem:request_errors_total", route="fast", status="400")
    with pytest.raises(openai.BadRequestError):  # refused once routed (a bound is refused while decoding, unrouted)
        client.completions.create(model="fast", prompt="x", max_tokens=2, extra_body={"min_tokens": 5})
    assert _metric(server, "tandem:request_errors_total", route="fast", status="400") == before + 1


def test_metrics_histograms_and_slo_attainment_move(client, server):
    before = _metric(server, "tandem:time_to_first_token_seconds_count", route="fast")
    e2e_before = _metric(server, "tandem:e2e_request_latency_seconds_count", route="fast")
    for _ in range(2):
        client.completions.create(model="fast", prompt="abc", max_tokens=3, extra_body={"ignore_eos": True})
    assert _metric(server, "tandem:time_to_first_token_seconds_count", route="fast") == before + 2
    assert _metric(server, "tandem:e2e_request_latency_seconds_count", route="fast") == e2e_before + 2
    assert _metric(server, "tandem:inter_token_latency_seconds_count", route="fast") > 0
    assert _metric(server, "tandem:request_queue_time_seconds_count", route="fast") > 0
    text = httpx.get(server.url + "/metrics").text
    for name in ("tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc",
                 "tandem:prefix_cache_queries_total", "tandem:num_preemptions_total"):
        assert f'{name}{{model_name="tandem-small"}}' in text
    assert 'tandem:slo_attainment{kind="ttft",route="fast"} 1.0' in text
    routes = {r["name"]: r for r in httpx.get(server.url + "/v1/routes").json()["data"]}
    assert routes["fast"]["attainment"]["requests"] >= 2 and routes["fast"]["attainment"]["ttft"]["attainment"] == 1.0


# ------------------------------------------------------------------------------------ auth and limits


@pytest.fixture(scope="module")
def secured(checkpoints):
    cfg = _config(checkpoints, auth={"api_keys": ["sk-good-key-1", {"key": "sk-limited", "requests_per_minute": 2},
                                                  {"key": "sk-tokens", "tokens_per_minute": 10}]})
    with ServerThread(cfg) as srv:
        yield srv


def test_auth_rejects_missing_and_wrong_keys_and_accepts_a_good_one(secured):
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=secured.url + "/v1", api_key=key, max_retries=0)

    with pytest.raises(openai.AuthenticationError) as wrong:
        client("sk-wrong-key-9").chat.completions.create(model="fast", messages=MESSAGES, max_tokens=1)
    assert wrong.value.code == "invalid_api_key" and "sk-wrong-key-9" not in wrong.value.message
    r = httpx.post(secured.url + "/v1/completions", json={"model": "fast", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    assert httpx.get(secured.url + "/health").status_code == 200  # probes need no key
    resp = client("sk-good-key-1").chat.completions.create(model="fast", messages=MESSAGES, max_tokens=2)
    assert resp.usage.completion_tokens >= 1


def test_request_limit_answers_429_with_retry_after(secured):
    client = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-limited", max_retries=0)
    for _ in range(2):
        client.completions.create(model="fast", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model="fast", prompt="x", max_tokens=1)
    retry_after = int(limited.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 30  # one request refills in 30 s at 2/min
    assert "2 requests per minute" in limited.value.message
    # another key is not affected
    ok = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-good-key-1", max_retries=0)
    assert ok.completions.create(model="fast", prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_token_limit_charges_real_usage_then_429(secured):
    client = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-tokens", max_retries=0)
    first = client.completions.create(model="fast", prompt="a b c d", max_tokens=8, extra_body={"ignore_eos": True})
    assert first.usage.total_tokens > 10  # more than the 10 tokens/minute budget: the bucket is in debt now
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model="fast", prompt="x", max_tokens=1)
    assert "tokens per minute" in limited.value.message
    assert int(limited.value.response.headers["retry-after"]) >= 1


# ------------------------------------------------------------------------------------ readiness, load


def test_not_ready_until_engines_load_then_serves(checkpoints):
    from engines import EngineCore
    from gateway.engine_setup import engine_core_args

    cfg = _config(checkpoints, routes={"fast": {"engines": ["tandem-small"]}})
    release = threading.Event()

    def slow_host():
        release.wait(30)
        return EngineCore(*engine_core_args(cfg)[:2], device="cpu")

    srv = ServerThread(cfg, host_factory=slow_host).start(wait_ready=False)
    try:
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as not_ready:
            client.completions.create(model="fast", prompt="x", max_tokens=1)
        assert not_ready.value.status_code == 503 and not_ready.value.code == "not_ready"
        assert not_ready.value.response.headers["retry-after"] == "5"
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.completions.create(model="fast", prompt="x", max_tokens=1).usage.completion_tokens == 1
    finally:
        release.set()
        srv.stop()


async def test_overload_answers_503_with_retry_after(checkpoints):
    cfg = _config(checkpoints, server={"max_inflight_requests": 2})
    with ServerThread(cfg) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            replies = await asyncio.gather(*(client.post("/v1/completions", json={
                "model": "best", "prompt": "x", "max_tokens": 200, "ignore_eos": True}) for _ in range(20)))
    shed = [r for r in replies if r.status_code == 503]
    assert len(shed) >= 1 and sum(r.status_code == 200 for r in replies) >= 2
    assert len(shed) + sum(r.status_code == 200 for r in replies) == 20  # nothing else: shed or served
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded" for r in shed)


# ------------------------------------------------------------------------------------ request chat templates


def test_a_request_chat_template_is_refused_unless_the_operator_allows_it(server, checkpoints):
    body = {"model": "fast", "messages": MESSAGES, "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": "{{ 'x' * 10 }}{% for m in messages %}{{ m.content }}"
                                                      "{% endfor %}"}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "chat_template_kwargs.chat_template" and "allow_request_chat_template" in err["message"]
    with ServerThread(_config(checkpoints, server={"allow_request_chat_template": True})) as srv:
        ok = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] >= 3  # the request's template rendered the prompt


@pytest.mark.parametrize("kwargs", [{"add_generation_prompt": False}, {"messages": []}, {"tools": 5}])
def test_template_kwargs_that_shadow_request_fields_are_a_400_naming_them(server, kwargs):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "fast", "messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"chat_template_kwargs.{next(iter(kwargs))}"
