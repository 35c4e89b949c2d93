"""The sampler: chi-square checks that temperature / top-k / top-p / min-p draw from the intended distribution,
seeded rows reproduce whatever shares the batch, penalties follow OpenAI/vLLM semantics, and logprobs are the
raw model distribution's."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engines.sampler import SamplerRow, sample
from engines.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def rows(params: SamplingParams, n: int) -> list[SamplerRow]:
    return [SamplerRow(params, [0], []) for _ in range(n)]


def expected_probs(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Straight from the definitions, one token at a time (the sampler does it batched)."""
    p = torch.softmax(LOGITS.double() / temperature, -1)
    keep = torch.ones_like(p, dtype=torch.bool)
    order = torch.argsort(p, descending=True)
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        mass = 0.0
        for i in order.tolist():  # smallest prefix of the sorted tokens whose mass reaches top_p
            if mass >= top_p:
                keep[i] = False
            mass += p[i].item()
    q = torch.where(keep, p, 0)
    q = q / q.sum()
    if min_p:
        q = torch.where(q >= min_p * q.max(), q, 0)
        q = q / q.sum()
    return q


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.3, top_k=3),
                                dict(temperature=1.0, top_p=0.8), dict(temperature=0.8, top_k=5, top_p=0.9),
                                dict(temperature=1.0, min_p=0.2)])
def test_sampling_matches_the_expected_distribution_chi_square(kw):
    torch.manual_seed(1234)
    n = 20000
    out = sample(LOGITS.repeat(n, 1), rows(SamplingParams(**kw), n))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).double()
    expected = expected_probs(kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    assert (counts[expected == 0] == 0).all(), "a filtered-out token was sampled"
    support = expected > 0
    _, pvalue = chisquare(counts[support].numpy(), (expected[support] * n).numpy())
    assert pvalue > 1e-3, (counts, expected * n)


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(5, 50)
    out = sample(logits, [SamplerRow(SamplingParams(temperature=0), [0], []) for _ in range(3)]
                 + [SamplerRow(SamplingParams(top_k=1), [0], []) for _ in range(2)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch():
    from engines.sampler import seeded_uniform

    params = SamplingParams(temperature=1.0, seed=3)
    logits = torch.randn(1, 64)
    alone = [sample(logits, [SamplerRow(params, [0], [], seeded_uniform(3, pos))]).token_ids[0] for pos in range(20)]
    crowd = [SamplerRow(SamplingParams(temperature=1.0), [0], []) for _ in range(5)]
    mixed = []
    for pos in range(20):
        batch = crowd[: pos % 5] + [SamplerRow(params, [0], [], seeded_uniform(3, pos))] + crowd[pos % 5:]
        out = sample(torch.cat([torch.randn(pos % 5, 64), logits, torch.randn(5 - pos % 5, 64)]), batch)
        mixed.append(out.token_ids[pos % 5])
    assert mixed == alone
    assert len(set(alone)) > 1  # it really sampled


def test_seeded_uniforms_are_a_function_of_seed_and_position_and_look_uniform():
    from scipy.stats import kstest

    from engines.sampler import seeded_uniform

    us = [seeded_uniform(seed, pos) for seed in (0, 1, 2 ** 64 - 1, -(2 ** 63)) for pos in range(2500)]
    assert all(0.0 <= u < 1.0 for u in us) and len(set(us)) == len(us)
    assert kstest(us, "uniform").pvalue > 1e-3
    # neighbouring seeds and positions are not correlated (choice i of n uses seed + i)
    a = [seeded_uniform(7, pos) for pos in range(4000)]
    b = [seeded_uniform(8, pos) for pos in range(4000)]
    c = [seeded_uniform(7, pos + 1) for pos in range(4000)]
    assert abs(float(torch.corrcoef(torch.tensor([a, b, c]))[0, 1:].abs().max())) < 0.05


def test_repetition_presence_and_frequency_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.5, 1.0]])
    # repetition (prompt + output): positive logits divided, negative multiplied
    row = SamplerRow(SamplingParams(temperature=0, repetition_penalty=2.0), [0], [1])
    from engines.sampler import apply_penalties
    got = apply_penalties(logits.clone(), [row])
    assert got.tolist() == [[1.0, -2.0, 0.5, 0.5, 1.0]]
    # frequency and presence: output tokens only, count * f + [count > 0] * p
    row = SamplerRow(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25), [3], [2, 2, 4])
    got = apply_penalties(logits.clone(), [row])
    assert got.tolist() == [[2.0, -1.0, 0.5 - 1.0 - 0.25, 0.5, 1.0 - 0.5 - 0.25]]
    # the greedy choice moves when the penalty pushes the top token down
    out = sample(torch.tensor([[1.0, 0.9]]), [SamplerRow(SamplingParams(temperature=0, presence_penalty=0.5),
                                                          [], [0])])
    assert out.token_ids == [1]


def test_min_tokens_bans_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    p = SamplingParams(temperature=0, min_tokens=2)
    banned = sample(logits, [SamplerRow(p, [0], [2])], stop_ids=[{1}])
    allowed = sample(logits, [SamplerRow(p, [0], [2, 2])], stop_ids=[{1}])
    assert banned.token_ids == [2] and allowed.token_ids == [1]


def test_logprobs_are_the_raw_distribution_with_ranks_and_top_k():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 0.5]])
    p = SamplingParams(temperature=2.0, top_k=2, logprobs=3, seed=0)
    out = sample(logits, [SamplerRow(p, [0], [], 0.25)])
    raw = torch.log_softmax(logits[0], -1)
    tok = out.token_ids[0]
    lp = out.logprobs[0]
    assert out.sampled_logprobs[0] == pytest.approx(raw[tok].item())
    assert lp[tok].rank == int((raw > raw[tok]).sum()) + 1
    top3 = raw.topk(3)
    for rank, (v, i) in enumerate(zip(top3.values.tolist(), top3.indices.tolist()), start=1):
        assert lp[i].logprob == pytest.approx(v) and lp[i].rank == rank
    assert set(lp) == set(top3.indices.tolist()) | {tok}
    none = sample(logits, [SamplerRow(SamplingParams(temperature=0), [0], [])])
    assert none.logprobs == [None] and none.sampled_logprobs == [None]


def test_the_cpu_draw_never_picks_a_token_without_mass_even_at_the_top_of_the_cdf(monkeypatch):
    from engines.sampler import draw

    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0], [0.5, 0.0, 0.5, 0.0]])
    picks = {tuple(draw(probs, [None, None]).tolist()) for _ in range(300)}
    assert {a for a, _ in picks} == {1, 2} and {b for _, b in picks} == {0, 2}
    # u * total can round up to the total when u is within 1e-7 of 1: u = 1 is that case, past the cdf's end
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones_like(real_rand(*a, **k)))
    assert draw(probs, [None, 1.0]).tolist() == [2, 2]  # the last live tokens


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": float("nan")}, "temperature"), ({"top_p": float("nan")}, "top_p"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"), ({"min_p": float("nan")}, "min_p"),
    ({"seed": 2 ** 70}, "seed"), ({"seed": 2 ** 64 - 1, "n": 2}, "seed"), ({"seed": -(2 ** 63) - 1}, "seed")])
def test_sampling_params_refuse_nan_and_seeds_the_generator_cannot_take(kwargs, param):
    from engines.sampling_params import InvalidSamplingParameter

    with pytest.raises(InvalidSamplingParameter) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and f"{param}=" in str(err.value)


def test_the_largest_seed_of_each_choice_seeds_a_generator():
    """Every choice's seed (seed + i) that validation lets through seeds torch's generator as that 64-bit
    value (negative seeds wrap), the last choice's included."""
    for seed, n in ((2 ** 64 - 1, 1), (2 ** 64 - 3, 3), (-(2 ** 63), 2)):
        params = SamplingParams(seed=seed, n=n)
        got = [torch.Generator().manual_seed(params.seed + i).initial_seed() for i in range(params.n)]
        assert got == [(seed + i) % 2 ** 64 for i in range(n)]
