"""Tokens per minute are reserved at admission (prompt + n x max_tokens) and settled to the real usage at the
end: parallel requests cannot spend more than the bucket holds, the unused part of a reservation goes back,
and a key never waits longer than its real usage takes to refill. The policy alone with a fake clock, then a
real server over tiny checkpoints.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path

import httpx
import pytest

from gateway.config import AuthConfig, config_from_dict
from gateway.errors import APIError
from gateway.limits import RateLimiter
from gateway.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limiter(clock: Clock, tpm: int) -> RateLimiter:
    auth = AuthConfig(api_keys=["k"], tokens_per_minute=tpm)
    return RateLimiter(auth.keys(), clock=clock)


async def test_parallel_reservations_cannot_spend_more_than_the_bucket_holds():
    clock = Clock()
    limiter = _limiter(clock, 600)  # 10 tokens/s
    held, refused = [], []
    for _ in range(10):  # ten requests in flight at once, 110 tokens each at most
        try:
            tokens = limiter.reservation("k")
            await tokens.reserve(110)
            held.append(tokens)
        except APIError as exc:
            refused.append(exc)
    assert len(held) == 5 and len(refused) == 5  # 5 x 110 = 550 of 600
    assert all(e.status == 429 and e.retry_after == pytest.approx(6.0) for e in refused)  # 60 missing at 10/s
    for tokens in held:
        tokens.settle(60)  # each used 60: 50 each go back
    await limiter.reservation("k").reserve(300)  # 600 - 5 x 60 = 300 left


async def test_lockout_never_exceeds_the_refill_time_of_real_usage():
    """The issue's case: ten parallel requests of 420 tokens each on a 600/min key (7x the budget)."""
    clock = Clock()
    limiter = _limiter(clock, 600)
    used = 0
    for _ in range(10):
        try:
            tokens = limiter.reservation("k")
            await tokens.reserve(420)
        except APIError:
            continue
        tokens.settle(420)
        used += 420
    assert used <= 600 + 420  # at most the bucket, plus one request larger than what was left
    with pytest.raises(APIError) as info:
        await limiter.reservation("k").reserve(420)
    assert info.value.retry_after <= used / 10.0  # never longer than the real usage takes to refill
    clock.now += info.value.retry_after
    await limiter.reservation("k").reserve(420)


async def test_the_unused_part_of_a_reservation_goes_back_and_settling_twice_changes_nothing():
    clock = Clock()
    limiter = _limiter(clock, 600)
    tokens = limiter.reservation("k")
    await tokens.reserve(500)
    with pytest.raises(APIError):
        await limiter.reservation("k").reserve(200)
    tokens.settle(20)
    tokens.settle(20)
    await limiter.reservation("k").reserve(580)  # 600 - 20
    with pytest.raises(APIError):
        await limiter.reservation("k").reserve(10)


async def test_a_request_larger_than_the_bucket_waits_for_a_full_bucket_and_is_never_refused_for_good():
    clock = Clock()
    limiter = _limiter(clock, 60)  # 1 token/s
    first = limiter.reservation("k")
    await first.reserve(90)
    first.settle(90)  # 30 tokens of debt
    with pytest.raises(APIError) as info:
        await limiter.reservation("k").reserve(90)
    assert info.value.retry_after == pytest.approx(90.0)  # back to a full bucket: the debt and 60
    clock.now += 90.0
    await limiter.reservation("k").reserve(90)


def test_a_key_without_a_token_limit_reserves_nothing():
    limiter = RateLimiter(AuthConfig(api_keys=["k"], requests_per_minute=5).keys())
    assert limiter.reservation("k") is None and limiter.reservation(None) is None


# ------------------------------------------------------------------------------------------- over HTTP


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("limits-ckpt") / "small"
    shutil.copytree(Path(tiny_checkpoint("llama")), checkpoint)
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"chat_template": CHATML}))
    cfg = config_from_dict({
        "engines": {"tandem-small": {"checkpoint": str(checkpoint)}},
        "kv_pool": {"memory_bytes": 32 << 20},
        "routes": {"fast": {"engines": ["tandem-small"]}},
        "auth": {"api_keys": [{"key": "sk-burst", "tokens_per_minute": 200},
                              {"key": "sk-refund", "tokens_per_minute": 600},
                              {"key": "sk-chat", "tokens_per_minute": 300}],
                 "reserved_completion_tokens": 256}})
    with ServerThread(cfg) as srv:
        yield srv


async def test_ten_parallel_requests_spend_at_most_the_budget_then_wait_only_for_their_usage(server):
    headers = {"authorization": "Bearer sk-burst"}
    body = {"model": "fast", "prompt": "x", "max_tokens": 39, "ignore_eos": True}  # 1 + 39: five fill 200
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as client:
        answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(10)))
        served = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code == 429]
        assert len(served) + len(refused) == 10 and served and refused
        spent = sum(r.json()["usage"]["total_tokens"] for r in served)
        assert spent <= 200  # each reserved 1 + 39 at admission: never more than the bucket in flight
        assert all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
        late = await client.post("/v1/completions", json=body)
    assert late.status_code == 429
    wait = int(late.headers["retry-after"])
    assert 1 <= wait <= math.ceil(spent / (200 / 60)) + 1  # at most the refill time of what was really used


def test_a_refused_request_gives_its_reservation_back(server):
    headers = {"authorization": "Bearer sk-refund"}
    too_long = httpx.post(server.url + "/v1/completions", headers=headers, json={
        "model": "fast", "prompt": "x", "max_tokens": 600})  # 601 reserved; the 512-token context refuses it
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    for _ in range(2):  # nothing was used: the whole 600 is there again (1 + 250 twice)
        ok = httpx.post(server.url + "/v1/completions", headers=headers, json={
            "model": "fast", "prompt": "x", "max_tokens": 250, "ignore_eos": True}, timeout=60)
        assert ok.status_code == 200, ok.text


async def test_a_chat_without_max_tokens_reserves_the_bounded_estimate(server):
    """Up to the context (about 500 tokens) may come back: 256 are held until the real usage is known."""
    body = {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, headers={"authorization": "Bearer sk-chat"},
                                 timeout=60) as client:
        first, second = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(2)))
    statuses = sorted([first.status_code, second.status_code])
    assert statuses == [200, 429]  # prompt + 256 each: the second does not fit in 300 while the first runs
    served = first if first.status_code == 200 else second
    assert served.json()["usage"]["completion_tokens"] > 256  # settled to the real usage, past the estimate
