"""The `router` and `cascade` route strategies through HTTP with the official openai client, over tiny random
checkpoints: the router (a tiny one trained here on a keyword signal) sends easy and hard prompts to different
engines; a greedy cascade returns exactly the large model's answer when it escalates and the small model's
otherwise; headers, metrics, spans, buffered streaming and aborts.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
from engine_pacing import slowed  # noqa: E402  (conftest puts tests/ on the path)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tiny_checkpoints import with_chat_template  # noqa: E402

from engines.outputs import CompletionOutput, Logprob, RequestOutput
from gateway.cascade import CascadeStrategy, confidence
from gateway.config import ConfigError, config_from_dict, load_config
from gateway.router_strategy import RouterStrategy, load_route_router, route_threshold
from gateway.routes import Routes
from gateway.server import ServerThread
from router_model.data import read_examples
from router_model.features import FeatureConfig, HashBlock
from router_model.router import Router
from router_model.scoring import ANSWER_STATS, agreement
from router_model.train import TrainOptions, train_router

FILLER = ("alpha beta gamma delta river stone cloud paper light music garden window yellow quiet hello there thanks "
          "good morning").split()
EASY = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "hello there river stone cloud paper"}]
HARD = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "river stone cloud prove the theorem"}]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def _keyword_rows(n: int, seed: int = 0) -> list[dict]:
    """Labelled JSONL rows whose only signal is a keyword: "prove the theorem" in any turn means large.
    Easy rows get three filler words instead, so length carries no signal."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        hard = i % 2 == 0
        turns = [" ".join(rng.choices(FILLER, k=rng.randint(3, 8))) for _ in range(rng.choice([1, 1, 3]))]
        turns[rng.randrange(len(turns))] += " prove the theorem" if hard else " " + " ".join(rng.choices(FILLER, k=3))
        if len(turns) == 1 and rng.random() < 0.5:
            row: dict = {"prompt": turns[0]}
        else:
            system = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.5 else []
            row = {"messages": system + [{"role": ("user", "assistant")[k % 2], "content": t}
                                         for k, t in enumerate(turns)]}
        rows.append(row | {"label": int(hard)})
    return rows


@pytest.fixture(scope="module")
def router_dir(tmp_path_factory) -> Path:
    """A tiny router trained from synthetic JSONL (keyword label), the way an operator trains one."""
    root = tmp_path_factory.mktemp("router")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _keyword_rows(200)))
    options = TrainOptions(feature_config=FeatureConfig(blocks=(HashBlock("tail", 0, (2, 5), 1 << 10),)),
                           c_grid=(1.0,), folds=3, target_large_fraction=0.5)
    return train_router(read_examples(data), options, log=lambda *a: None).save(root / "artifact")


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory) -> Path:
    """A tiny escalation scorer (the learned cascade's): the same keyword signal in the prompt; the rows also
    carry a small answer and its logprob statistics, as `tandem router label` writes them."""
    root = tmp_path_factory.mktemp("scorer")
    rng = random.Random(1)
    rows = [r | {"small_answer": " ".join(rng.choices(FILLER, k=3)),
                 "small_answer_stats": {k: rng.uniform(-3, 0) for k in ANSWER_STATS}} for r in _keyword_rows(200)]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    blocks = (HashBlock("tail", 0, (2, 5), 1 << 10), HashBlock("answer", 0, (1, 3), 1 << 8))
    options = TrainOptions(feature_config=FeatureConfig(blocks=blocks, stats=(), extras=ANSWER_STATS),
                           c_grid=(1.0,), folds=3, target_large_fraction=0.5, kind="escalation")
    return train_router(read_examples(data), options, log=lambda *a: None).save(root / "artifact")


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory, router_dir, scorer_dir, spans):
    root = tmp_path_factory.mktemp("routing-ckpt")
    small = with_chat_template(tiny_checkpoint("llama"), root / "small")
    large = with_chat_template(tiny_checkpoint("qwen2", hidden_size=96, num_heads=6, num_kv_heads=2, seed=1),
                                root / "large")
    pair = ["tandem-small", "tandem-large"]
    cfg = config_from_dict({
        "engines": {"tandem-small": {"checkpoint": str(small)}, "tandem-large": {"checkpoint": str(large)}},
        "kv_pool": {"memory_bytes": 32 << 20},
        "routes": {"auto": {"strategy": "router", "engines": pair,
                            "router": {"artifact": str(router_dir), "threshold": 0.5}},
                   "cascade-always": {"strategy": "cascade", "engines": pair,
                                      "cascade": {"confidence_threshold": 0.0}},
                   "cascade-never": {"strategy": "cascade", "engines": pair,
                                     "cascade": {"confidence_threshold": -1e9, "mode": "min"}},
                   "cascade-learned": {"strategy": "cascade", "engines": pair,
                                       "cascade": {"mode": "learned", "scorer": str(scorer_dir),
                                                   "escalation_threshold": 0.5,
                                                   "verification_labels": str(root / "verifications.jsonl")}}}})
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    with ServerThread(cfg, tracer_provider=provider) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _metric(server: ServerThread, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _spans_once_served(spans: InMemorySpanExporter, server_span: str) -> list:
    """The finished spans once the server span has ended (it ends just after the response is sent)."""
    deadline = time.monotonic() + 5
    while not any(s.name == server_span for s in spans.get_finished_spans()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(spans.get_finished_spans())


def _chat(client: openai.OpenAI, model: str, messages=EASY, **kwargs):
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, **kwargs)
    return raw.headers, raw.parse()


# ------------------------------------------------------------------------------------------------ router


def test_router_sends_easy_and_hard_prompts_to_different_engines(server, client):
    before = {c: _metric(server, "tandem:router_decisions_total", route="auto", choice=c)
              for c in ("tandem-small", "tandem-large")}
    easy_headers, easy = _chat(client, "auto", EASY, max_tokens=3)
    hard_headers, hard = _chat(client, "auto", HARD, max_tokens=3)
    assert easy_headers["x-tandem-model"] == "tandem-small" and hard_headers["x-tandem-model"] == "tandem-large"
    assert float(easy_headers["x-tandem-router-score"]) < 0.5 <= float(hard_headers["x-tandem-router-score"])
    assert easy_headers["x-tandem-route"] == "auto" and "x-tandem-escalated" not in easy_headers
    assert easy.model == "auto" and easy.usage.completion_tokens == 3
    assert _metric(server, "tandem:router_decisions_total", route="auto", choice="tandem-small") == \
        before["tandem-small"] + 1
    assert _metric(server, "tandem:router_decisions_total", route="auto", choice="tandem-large") == \
        before["tandem-large"] + 1


def test_router_scores_the_whole_conversation_and_plain_prompts(server, client):
    # The hard request sits in an earlier turn: only a router that reads every message sends this to large.
    convo = [{"role": "user", "content": "alpha prove the theorem"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "hello there"}]
    headers, _ = _chat(client, "auto", convo, max_tokens=2)
    assert headers["x-tandem-model"] == "tandem-large"
    raw = client.completions.with_raw_response.create(model="auto", prompt="quiet garden music light window",
                                                      max_tokens=2)
    assert raw.headers["x-tandem-model"] == "tandem-small" and float(raw.headers["x-tandem-router-score"]) < 0.5


def test_router_decision_is_a_span_attribute(server, client, spans):
    spans.clear()
    headers, _ = _chat(client, "auto", HARD, max_tokens=2)
    route_span = next(s for s in _spans_once_served(spans, "chat auto") if s.name == "route")
    assert route_span.attributes["tandem.router.choice"] == "large"
    assert route_span.attributes["tandem.router.score"] == pytest.approx(float(headers["x-tandem-router-score"]),
                                                                          abs=1e-4)
    assert route_span.attributes["tandem.router.threshold"] == 0.5


def test_route_threshold_comes_from_the_route_or_the_artifact(router_dir):
    def route(**router):
        cfg = config_from_dict({"engines": {"s": {"checkpoint": "/s"}, "l": {"checkpoint": "/l"}},
                                "routes": {"auto": {"strategy": "router", "engines": ["s", "l"],
                                                    "router": {"artifact": str(router_dir), **router}}}})
        return cfg, cfg.routes["auto"]

    cfg, explicit = route(threshold=0.25)
    router = load_route_router("auto", explicit, cfg)
    assert route_threshold(router, explicit)[0] == 0.25
    _, by_fraction = route(target_large_fraction=0.1)
    assert route_threshold(router, by_fraction)[0] == pytest.approx(router.threshold_for_fraction(0.1))
    assert router.threshold_for_fraction(0.1) > router.threshold_for_fraction(0.4)
    _, default = route()
    assert route_threshold(router, default)[0] == router.threshold  # the artifact's (trained for 50% large)
    strategy = RouterStrategy("auto", explicit, router)
    assert strategy.decide("alpha beta prove the theorem gamma")[0] == "large"
    assert strategy.decide("quiet garden music light window")[0] == "small"


def test_default_config_routes_build_with_the_shipped_router():
    routes = Routes(load_config(env={}))
    auto = routes.strategies["auto"]
    assert isinstance(auto, RouterStrategy) and not auto.router.required_extras
    assert auto.threshold == pytest.approx(auto.router.threshold_for_fraction(0.3))
    assert (auto.small, auto.large) == ("tandem-small", "tandem-large")
    cascade = routes.strategies["cascade"]
    assert isinstance(cascade, CascadeStrategy) and cascade.mode == "learned"
    assert cascade.scorer.kind == "escalation" and cascade.threshold == cascade.scorer.threshold_for_fraction(0.3)


def test_broken_router_artifact_fails_at_start_up_naming_the_setting(router_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(router_dir, bad)
    doc = json.loads((bad / "router.json").read_text())
    doc["version"] = 99
    (bad / "router.json").write_text(json.dumps(doc))
    cfg = config_from_dict({"engines": {"s": {"checkpoint": "/s"}, "l": {"checkpoint": "/l"}},
                            "routes": {"auto": {"strategy": "router", "engines": ["s", "l"],
                                                "router": {"artifact": str(bad)}}}})
    with pytest.raises(ConfigError) as err:
        load_route_router("auto", cfg.routes["auto"], cfg)
    assert "routes.auto.router.artifact" in str(err.value) and "version 99" in str(err.value)


# ----------------------------------------------------------------------------------------------- cascade


def test_cascade_confidence_is_the_mean_or_min_chosen_token_logprob():
    out = CompletionOutput(index=0, token_ids=[5, 7], logprobs=[
        {5: Logprob(-0.5, 1), 9: Logprob(-1.0, 2)}, {7: Logprob(-2.5, 3), 1: Logprob(-0.1, 1)}])
    assert confidence(out, "mean") == pytest.approx(-1.5)
    assert confidence(out, "min") == pytest.approx(-2.5)
    assert confidence(CompletionOutput(index=0), "mean") == 0.0


def test_greedy_cascade_answers_exactly_as_large_when_escalating_and_as_small_otherwise(server, client):
    _, small = _chat(client, "tandem-small", **GREEDY)
    _, large = _chat(client, "tandem-large", **GREEDY)
    assert small.choices[0].message.content != large.choices[0].message.content  # the check can tell them apart
    before = _metric(server, "tandem:cascade_escalations_total", route="cascade-always")
    up_headers, up = _chat(client, "cascade-always", **GREEDY)
    assert up.choices[0].message.content == large.choices[0].message.content
    assert up_headers["x-tandem-escalated"] == "true" and up_headers["x-tandem-model"] == "tandem-large"
    assert up.usage.completion_tokens == 12 and up.usage.prompt_tokens == large.usage.prompt_tokens
    assert _metric(server, "tandem:cascade_escalations_total", route="cascade-always") == before + 1
    stay_headers, stay = _chat(client, "cascade-never", **GREEDY)
    assert stay.choices[0].message.content == small.choices[0].message.content
    assert stay_headers["x-tandem-escalated"] == "false" and stay_headers["x-tandem-model"] == "tandem-small"
    assert _metric(server, "tandem:cascade_escalations_total", route="cascade-never") == 0
    assert stay.choices[0].logprobs is None  # logprobs were computed for the decision, not asked for



def test_cascade_escalations_report_the_share_of_the_small_answer_the_large_accepted(server, client):
    monitor = server.app.state.gateway.routes.strategies["cascade-always"].monitor
    before = monitor.report()["window"]["verifications"]
    _chat(client, "cascade-always", **GREEDY)
    routing = {r["name"]: r for r in httpx.get(server.url + "/v1/routes").json()["data"]}["cascade-always"]["routing"]
    assert routing["window"]["verifications"] == before + 1 and routing["window"]["realised_escalated_fraction"] == 1
    share = monitor._acceptance[-1]  # 12 drafts verified: a whole number of them kept
    assert 0 <= share < 1 and share * 12 == round(share * 12)  # the answers differ (the greedy test above checks it)
    assert _metric(server, "tandem:cascade_escalation_acceptance", route="cascade-always") == \
        pytest.approx(routing["window"]["escalation_acceptance"])
    # the share is the leading drafts the large answer kept
    strategy = server.app.state.gateway.routes.strategies["cascade-always"]
    finished = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], finished=True,
                             outputs=[CompletionOutput(index=0, token_ids=[5, 6, 9, 9])])
    strategy._verified(finished, [5, 6, 7, 8])
    assert monitor._acceptance[-1] == 0.5
    strategy._verified(dataclasses.replace(finished, finished=False), [5, 6, 7, 8])  # not the end: nothing kept
    assert monitor._acceptance[-1] == 0.5 and monitor.report()["window"]["verifications"] == before + 2


def test_learned_cascade_escalates_by_the_scorer_and_answers_exactly_as_the_chosen_engine(server, client):
    """The escalation scorer reads the prompt and the small answer: the hard prompt escalates (and returns the
    large model's greedy answer), the easy one keeps the small model's, byte for byte."""
    before = _metric(server, "tandem:cascade_escalations_total", route="cascade-learned")
    for messages, engine, escalated in ((HARD, "tandem-large", "true"), (EASY, "tandem-small", "false")):
        _, direct = _chat(client, engine, messages, **GREEDY)
        headers, got = _chat(client, "cascade-learned", messages, **GREEDY)
        assert headers["x-tandem-escalated"] == escalated and headers["x-tandem-model"] == engine
        assert got.choices[0].message.content == direct.choices[0].message.content
        assert got.choices[0].logprobs is None  # top logprobs were computed for the scorer, not asked for
    _, small = _chat(client, "tandem-small", HARD, **GREEDY)
    _, large = _chat(client, "tandem-large", HARD, **GREEDY)
    assert small.choices[0].message.content != large.choices[0].message.content  # the check can tell them apart
    assert _metric(server, "tandem:cascade_escalations_total", route="cascade-learned") == before + 1


def test_learned_cascade_stores_each_verification_as_a_label_without_text(server, client, scorer_dir):
    """An escalation's finished verification is a label for `tandem router adapt`: the scorer's features of
    what it read, the agreement of the small answer with the large one, the accepted share; no prompt text."""
    path = Path(server.app.state.gateway.routes.strategies["cascade-learned"].labels.path)
    before = len(path.read_text().splitlines()) if path.is_file() else 0
    _chat(client, "cascade-learned", HARD, **GREEDY)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == before + 1
    rec = records[-1]
    _, small = _chat(client, "tandem-small", HARD, **GREEDY)
    _, large = _chat(client, "tandem-large", HARD, **GREEDY)
    s_text, l_text = small.choices[0].message.content, large.choices[0].message.content
    assert rec["agreement"] == pytest.approx(agreement(s_text, l_text))
    assert rec["small_chars"] == len(s_text) and rec["large_chars"] == len(l_text)
    scorer = Router.load(scorer_dir)
    assert len(rec["features"]["dense"]) == scorer.feature_config.num_dense
    assert rec["escalation_score"] >= 0.5 and rec["route"] == "cascade-learned"
    assert set(rec["small_answer_stats"]) == set(ANSWER_STATS)
    assert HARD[-1]["content"] not in path.read_text() and s_text not in json.dumps(rec["agreement"])


def test_learned_cascade_returns_only_the_logprobs_the_client_asked_for(client):
    _, stay = _chat(client, "cascade-learned", EASY, logprobs=True, top_logprobs=2, **GREEDY)
    content = stay.choices[0].logprobs.content
    assert len(content) == 12 and all(len(t.top_logprobs) == 2 for t in content)
    _, direct = _chat(client, "tandem-small", EASY, logprobs=True, top_logprobs=2, **GREEDY)
    assert [(t.token, [x.token for x in t.top_logprobs]) for t in content] == \
        [(t.token, [x.token for x in t.top_logprobs]) for t in direct.choices[0].logprobs.content]


def test_learned_cascade_threshold_comes_from_the_route_or_the_scorer(scorer_dir, router_dir):
    def route(**cascade):
        cfg = config_from_dict({"engines": {"s": {"checkpoint": "/s"}, "l": {"checkpoint": "/l"}},
                                "routes": {"c": {"strategy": "cascade", "engines": ["s", "l"],
                                                 "cascade": {"mode": "learned", **cascade}}}})
        return cfg.routes["c"]

    by_fraction = CascadeStrategy("c", route(scorer=str(scorer_dir), target_escalation_fraction=0.2))
    assert by_fraction.threshold == pytest.approx(by_fraction.scorer.threshold_for_fraction(0.2))
    assert CascadeStrategy("c", route(scorer=str(scorer_dir))).threshold == by_fraction.scorer.threshold
    with pytest.raises(ConfigError, match="routes.c.cascade.scorer .* not an escalation scorer"):
        CascadeStrategy("c", route(scorer=str(router_dir)))
    with pytest.raises(ConfigError, match="routes.c.cascade.scorer .* cannot be loaded"):
        CascadeStrategy("c", route(scorer=str(scorer_dir / "nowhere")))


def test_cascade_on_legacy_completions(client):
    def complete(model: str):
        raw = client.completions.with_raw_response.create(model=model, prompt="def read_config(path):",
                                                          **GREEDY)
        return raw.headers, raw.parse().choices[0].text

    assert complete("cascade-always")[1] == complete("tandem-large")[1]
    assert complete("cascade-never")[1] == complete("tandem-small")[1]
    assert complete("cascade-always")[0]["x-tandem-escalated"] == "true"


def test_cascade_keeps_logprobs_the_client_asked_for(client):
    _, stay = _chat(client, "cascade-never", logprobs=True, top_logprobs=2, **GREEDY)
    content = stay.choices[0].logprobs.content
    assert len(content) == 12 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    _, up = _chat(client, "cascade-always", logprobs=True, **GREEDY)
    _, large = _chat(client, "tandem-large", logprobs=True, **GREEDY)
    assert [t.token for t in up.choices[0].logprobs.content] == [t.token for t in large.choices[0].logprobs.content]


def test_streaming_cascade_buffers_until_the_decision(client):
    _, large = _chat(client, "tandem-large", **GREEDY)
    _, small = _chat(client, "tandem-small", **GREEDY)
    for route, expected, escalated in (("cascade-never", small, "false"), ("cascade-always", large, "true")):
        raw = client.chat.completions.with_raw_response.create(
            model=route, messages=EASY, stream=True, stream_options={"include_usage": True}, **GREEDY)
        assert raw.headers["x-tandem-escalated"] == escalated
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 12
        if escalated == "false":  # the whole small answer arrives as one content chunk after the decision
            assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 1


def test_escalation_is_a_child_span_with_the_decision(client, spans):
    spans.clear()
    _chat(client, "cascade-always", **GREEDY)
    finished = _spans_once_served(spans, "chat cascade-always")
    escalation = next(s for s in finished if s.name == "escalation")
    server_span = next(s for s in finished if s.name.startswith("chat cascade-always"))
    assert escalation.parent.span_id == server_span.context.span_id
    assert escalation.attributes["tandem.cascade.escalated"] is True
    assert escalation.attributes["tandem.cascade.confidence"] < 0.0
    assert escalation.attributes["tandem.cascade.draft_tokens"] == 12
    assert {"queue", "prefill", "decode"} <= {s.name for s in finished if s.parent
                                                and s.parent.span_id == escalation.context.span_id}
    assert server_span.attributes["gen_ai.response.model"] == "tandem-large"


def test_escalation_verifies_the_small_answer_as_drafts(tiny_checkpoint, tmp_path, spans):
    """Two engines on the same weights: the large one accepts every token of the small answer in its
    verification pass (the draft path is real, not a plain regeneration)."""
    ckpt = with_chat_template(tiny_checkpoint("llama"), tmp_path / "twin")
    cfg = config_from_dict({
        "engines": {"a": {"checkpoint": str(ckpt)}, "b": {"checkpoint": str(ckpt)}},
        "kv_pool": {"memory_bytes": 16 << 20},
        "routes": {"up": {"strategy": "cascade", "engines": ["a", "b"], "cascade": {"confidence_threshold": 0.0}}}})
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with ServerThread(cfg, tracer_provider=provider) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        _, direct = _chat(client, "b", **GREEDY)
        large = srv.app.state.gateway.engines["b"]
        before = large.stats()
        headers, up = _chat(client, "up", **GREEDY)
        after = large.stats()
        escalation = next(s for s in _spans_once_served(exporter, "chat up") if s.name == "escalation")
    assert headers["x-tandem-escalated"] == "true"
    assert up.choices[0].message.content == direct.choices[0].message.content
    assert escalation.attributes["tandem.cascade.draft_tokens"] == 12
    assert after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"] >= 11
    assert after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"] >= 11


def test_cascade_rejects_n_above_one(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="cascade-always", messages=EASY, n=2, max_tokens=2)
    assert err.value.param == "n"


def test_client_hanging_up_on_a_cascade_aborts_the_engine_and_frees_its_pages(server):
    body = {"model": "cascade-always", "messages": EASY, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    before = _metric(server, "tandem:request_success_total", route="cascade-always", finished_reason="abort")
    pool = server.app.state.gateway.host
    # paced at 5 ms a token, the small answer alone takes 2 s: the client surely leaves mid-cascade, and the
    # abort is noticed long before the generation could end by itself
    with slowed(server, "tandem-small", "tandem-large", per_step_s=0.005):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(5.0, read=0.2))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                pool.stats()["pool"]["used_pages"] > 0
                or _metric(server, "tandem:request_success_total", route="cascade-always",
                           finished_reason="abort") == before):
            time.sleep(0.05)
    assert pool.stats()["pool"]["used_pages"] == 0
    assert _metric(server, "tandem:request_success_total", route="cascade-always", finished_reason="abort") == \
        before + 1
