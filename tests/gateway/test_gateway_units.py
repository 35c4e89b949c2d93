"""Gateway policy without HTTP: rate-limit buckets, API-key checks, request -> SamplingParams translation,
SLO attainment windows and route resolution."""

from __future__ import annotations

import msgspec
import pytest

from gateway.auth import KeyRing
from gateway.config import AuthConfig, ConfigError, config_from_dict
from gateway.errors import APIError
from gateway.limits import ANONYMOUS, RateLimiter
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidParameter,
    decode_request,
    prompt_input,
    sampling_params,
)
from gateway.routes import Routes
from gateway.routing import FixedStrategy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limiter(clock: Clock, **auth) -> RateLimiter:
    cfg = AuthConfig(**auth)
    return RateLimiter(cfg.keys(), default_rpm=cfg.requests_per_minute, default_tpm=cfg.tokens_per_minute,
                       clock=clock)


async def test_requests_per_minute_bucket_refuses_then_refills():
    clock = Clock()
    limiter = _limiter(clock, api_keys=["k"], requests_per_minute=2)
    await limiter.admit("k")
    await limiter.admit("k")
    with pytest.raises(APIError) as info:
        await limiter.admit("k")
    assert info.value.status == 429 and info.value.headers() == {"retry-after": "30"}
    clock.now += 29.0
    with pytest.raises(APIError):
        await limiter.admit("k")
    clock.now += 1.0
    await limiter.admit("k")  # one request refilled after 30 s at 2/min


async def test_tokens_per_minute_settles_real_usage_and_waits_out_the_debt():
    clock = Clock()
    limiter = _limiter(clock, api_keys=["k"], tokens_per_minute=60)
    await limiter.admit("k")
    await limiter.reservation("k").reserve(90)  # more than the bucket holds: taken from a full bucket
    with pytest.raises(APIError) as info:
        await limiter.reservation("k").reserve(1)
    assert info.value.retry_after == pytest.approx(31.0, abs=1e-6)  # 30 tokens of debt + 1 at 1 token/s
    assert "60 tokens per minute" in info.value.message
    clock.now += 31.5
    await limiter.reservation("k").reserve(1)


async def test_limits_apply_to_all_traffic_when_auth_is_off():
    clock = Clock()
    limiter = _limiter(clock, requests_per_minute=1)
    await limiter.admit(ANONYMOUS)
    with pytest.raises(APIError):
        await limiter.admit(ANONYMOUS)
    assert not _limiter(clock).active


def test_keyring_parses_bearer_and_redacts_wrong_keys():
    ring = KeyRing(AuthConfig(api_keys=["sk-abcdef123456"]))
    assert ring.identify("Bearer sk-abcdef123456") == "sk-abcdef123456"
    assert ring.identify("bearer   sk-abcdef123456 ") == "sk-abcdef123456"
    for header, code in ((None, "missing_api_key"), ("Basic xyz", "invalid_api_key"),
                         ("Bearer sk-wrongwrong99", "invalid_api_key")):
        with pytest.raises(APIError) as info:
            ring.identify(header)
        assert info.value.status == 401 and info.value.code == code
    with pytest.raises(APIError) as info:
        ring.identify("Bearer sk-wrongwrong99")
    assert "sk-wrongwrong99" not in info.value.message and "sk-...99" in info.value.message
    assert KeyRing(AuthConfig()).identify(None) == ANONYMOUS


def _chat(**fields) -> ChatCompletionRequest:
    """Decoded as the server decodes a body: a field out of its bounds is an InvalidParameter naming it here."""
    return decode_request(msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                               **fields}), ChatCompletionRequest)


def test_chat_request_translation_prefers_max_completion_tokens_and_maps_logprobs():
    params = sampling_params(_chat(max_tokens=50, max_completion_tokens=7, logprobs=True, top_logprobs=3,
                                   stop="END", seed=4, top_k=5, min_p=0.1, ignore_eos=True, min_tokens=2),
                             default_max_tokens=None)
    assert (params.max_tokens, params.logprobs, params.stop, params.seed, params.top_k, params.min_p,
            params.ignore_eos, params.min_tokens) == (7, 3, ["END"], 4, 5, 0.1, True, 2)
    assert sampling_params(_chat(), default_max_tokens=None).max_tokens is None  # up to the context
    assert sampling_params(_chat(max_tokens=100), default_max_tokens=None, max_tokens_cap=10).max_tokens == 10
    assert sampling_params(_chat(logprobs=True), default_max_tokens=None).logprobs == 0
    assert sampling_params(_chat(), default_max_tokens=None).logprobs is None


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_p": 0}, "top_p"),
])
def test_invalid_chat_parameters_are_named(fields, param):
    with pytest.raises(InvalidParameter) as info:
        sampling_params(_chat(**fields), default_max_tokens=None)
    assert info.value.param == param


def test_completion_prompt_forms():
    def req(prompt):
        return decode_request(msgspec.json.encode({"model": "m", "prompt": prompt}), CompletionRequest)
    assert prompt_input(req("text")) == "text"
    assert prompt_input(req([1, 2, 3])) == [1, 2, 3]
    assert prompt_input(req(["only"])) == "only"
    assert prompt_input(req([[4, 5]])) == [4, 5]
    for bad in (["a", "b"], [], "", [1, "x"]):
        with pytest.raises(InvalidParameter) as info:
            prompt_input(req(bad))
        assert info.value.param == "prompt"
    legacy = sampling_params(req("x"), default_max_tokens=16)
    assert legacy.max_tokens == 16 and legacy.logprobs is None


def test_routes_resolve_configured_routes_and_engines_by_name():
    cfg = config_from_dict({"engines": {"s": {"checkpoint": "/s"}, "l": {"checkpoint": "/l"}},
                            "routes": {"fast": {"engines": ["s"]}}})
    routes = Routes(cfg)
    assert routes.resolve("fast").config.engines == ["s"] and not routes.resolve("fast").direct
    assert routes.resolve("l").direct and routes.resolve("l").config.engines == ["l"]
    assert isinstance(routes.strategy(routes.resolve("fast")), FixedStrategy)
    with pytest.raises(APIError) as missing:
        routes.resolve("gpt-4")
    assert missing.value.status == 404 and missing.value.code == "model_not_found"
    assert "fast" in missing.value.message


def test_a_strategy_nobody_registered_is_refused_at_load_naming_the_field():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"engines": {"s": {"checkpoint": "/s"}, "l": {"checkpoint": "/l"}},
                          "routes": {"later": {"strategy": "absent", "engines": ["s", "l"]}}})
    assert "routes.later.strategy = 'absent' is invalid" in str(err.value) and "'cascade'" in str(err.value)


def test_every_engine_error_code_maps_to_an_openai_error_with_its_status():
    from engines.errors import ErrorCode
    from gateway.engine_errors import engine_api_error

    want = {"invalid_request": 400, "context_length_exceeded": 400, "kv_capacity_exceeded": 400,
            "ttft_deadline_exceeded": 503, "engine_error": 500, "engine_dead": 503, "compile_pool_busy": 503}
    assert {c.value for c in ErrorCode} == set(want)
    for code in ErrorCode:
        err = engine_api_error(code, "max_tokens=9 is too many")
        assert (err.status, err.code) == (want[code.value], code.value)
        assert (err.retry_after is not None) == (err.status == 503)  # every 503 says when to come back
    # the message is passed on, never parsed: the field at fault comes from the caller, who knows it
    assert engine_api_error(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "max_tokens=9 plus ...").param is None
    assert engine_api_error(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "...", param="max_tokens").param == "max_tokens"
