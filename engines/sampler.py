"""Turns one step's logits into next tokens: penalties, min_tokens, logit_bias, grammar masks, greedy /
temperature / top-k / top-p / min-p sampling with per-request seeds, and the logprobs of the raw model
distribution (as OpenAI and vLLM report them). Batched tensor ops; a Python loop only over rows that need a
per-row feature."""

from __future__ import annotations

from collections.abc import Mapping, Set
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engines.outputs import Logprob, PositionLogprobs
from engines.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engines.sequence import Sequence


@dataclass
class SamplerRow:
    """What the sampler needs to know about one row: its params, its tokens so far, its RNG."""

    params: SamplingParams
    prompt_token_ids: Seq[int]
    output_token_ids: Seq[int]
    uniform: float | None = None  # a seeded row's draw for this position (`seeded_uniform`); None: fresh
    mask: torch.Tensor | None = None  # packed allowed-token bits [W] from the sequence's grammar


class Sampled:
    """One sequence's new tokens from a step, for `Scheduler.update`: the `num_accepted` verified drafts, then
    the sampled (recovered or bonus) token; `logprobs` per token as (sampled logprob, top-k) when asked for."""

    __slots__ = ("seq", "token_ids", "num_accepted", "logprobs")

    def __init__(self, seq: Sequence, token_ids: list[int], num_accepted: int = 0,
                 logprobs: list[tuple[float, PositionLogprobs]] | None = None):
        self.seq = seq
        self.token_ids = token_ids
        self.num_accepted = num_accepted
        self.logprobs = logprobs


def sampler_row(seq: Sequence, extra: Seq[int] = (), mask: torch.Tensor | None = None) -> SamplerRow:
    """The sampler's view of `seq`, with `extra` (earlier drafts of a verify window) after its output; the token
    history is copied only for the rows whose options read it (penalties, min_tokens). A constrained sequence's
    row carries its grammar's mask after `extra` (or `mask`, computed by the caller for a whole window)."""
    p = seq.request.params
    grammar = seq.grammar
    if grammar is not None and mask is None:
        mask = grammar.draft_mask(extra) if extra else grammar.next_mask()
    history = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
    prompt = seq.token_ids[:seq.prompt_len] if history else ()
    output: Seq[int] = ()
    if history or p.min_tokens:
        output = seq.token_ids[seq.prompt_len:]
        if extra:
            output += extra
    uniform = None if seq.seed is None else seeded_uniform(seq.seed, seq.num_tokens + len(extra))
    return SamplerRow(p, prompt, output, uniform, mask)


_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform a seeded sequence draws its token at `position` with, in [0, 1): a counter-based generator
    (splitmix64 of seed and position), so the draw depends on nothing but the two: not on the batch, on
    whether the token was sampled in a plain step or verified after a draft, nor on how many draws came
    before. That makes seeded output identical with and without speculative decoding."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * (1.0 / (1 << 53))


def min_tokens_ban(params: SamplingParams, eos_token_ids: Set[int]) -> set[int]:
    """The ids a row may not sample before min_tokens (EOS and stop ids); empty when min_tokens is unset."""
    return eos_token_ids | set(params.stop_token_ids) if params.min_tokens else set()


def sample_sequences(logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: Set[int],
                     masks: Mapping[int, torch.Tensor] | None = None) -> list[Sampled]:
    """One token per sequence from its logits row. `masks`: seq_id -> grammar masks computed ahead
    (`structured.MaskPrefetch`; row 0 is the next token's), else a constrained row computes its own."""
    result = sample(logits, [sampler_row(s, mask=_first_mask(masks, s)) for s in seqs],
                    [min_tokens_ban(s.request.params, eos_token_ids) for s in seqs])
    lps = result.logprobs
    return [Sampled(s, [t], 0, None if lps[i] is None else [(result.sampled_logprobs[i], lps[i])])
            for i, (s, t) in enumerate(zip(seqs, result.token_ids))]


def _first_mask(masks: Mapping[int, torch.Tensor] | None, seq: Sequence) -> torch.Tensor | None:
    if masks is None or seq.grammar is None:
        return None
    m = masks.get(seq.seq_id)
    return None if m is None else m[0]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    sampled_logprobs: list[float | None]  # the sampled token's raw logprob where logprobs were requested
    logprobs: list[PositionLogprobs | None]  # sampled token + top-k, per row (None: not requested)


def apply_penalties(logits: torch.Tensor, rows: Seq[SamplerRow]) -> torch.Tensor:
    """Repetition (vLLM/HF: prompt and output tokens, divide positive logits, multiply negative ones),
    frequency and presence (OpenAI: output tokens only, subtract count * f and [count > 0] * p)."""
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(list(r.prompt_token_ids) + list(r.output_token_ids), dtype=torch.long,
                                device=logits.device).unique()
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(r.output_token_ids):
            out = torch.tensor(list(r.output_token_ids), dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_bias_and_masks(logits: torch.Tensor, rows: Seq[SamplerRow], indices: Seq[int]) -> None:
    """In place: each row's logit_bias (OpenAI: added to the logits; ids past the vocabulary ignored), then its
    grammar mask (forbidden tokens to -inf, whatever their bias)."""
    vocab = logits.shape[1]
    masked = []
    for i in indices:
        r = rows[i]
        bias = r.params.logit_bias
        if bias:
            ids = [t for t in bias if t < vocab]
            logits[i, ids] += torch.tensor([bias[t] for t in ids], dtype=logits.dtype, device=logits.device)
        if r.mask is not None:
            masked.append(i)
    if masked:
        from engines.structured import apply_masks

        apply_masks(logits, masked, [rows[i].mask for i in masked])


def apply_top_k_top_p_min_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                            min_p: torch.Tensor | None) -> torch.Tensor:
    """x: temperature-scaled logits [R, V]; per-row k (V = off), p (1 = off), min_p (0 = off). Masks with -inf."""
    neg_inf = torch.finfo(x.dtype).min if x.dtype != torch.float32 else float("-inf")
    if top_k is not None:
        kmax = int(top_k.max())
        kth = x.topk(kmax, dim=-1).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
        x = x.masked_fill(x < kth, neg_inf)
    if top_p is not None:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass strictly before it already reaches p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, neg_inf)
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    if min_p is not None:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, neg_inf)
    return x


def processed_logits(logits: torch.Tensor, rows: Seq[SamplerRow], stop_ids: Seq[set[int]] | None = None
                     ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """What a row samples from, in one place for the sampler and the speculative verifier: penalties and
    min_tokens bans on every row (the argmax of the result is the greedy choice), then temperature and
    top-k / top-p / min-p on the rows that sample. Returns (penalised logits [R, V], indices of the sampling
    rows, their filtered logits [len(indices), V] or None when every row is greedy)."""
    num_rows, vocab = logits.shape
    device = logits.device
    needs_penalty = any(r.params.repetition_penalty != 1.0 or r.params.frequency_penalty
                        or r.params.presence_penalty for r in rows)
    needs_ban = stop_ids is not None and any(
        r.params.min_tokens and len(r.output_token_ids) < r.params.min_tokens for r in rows)
    constrained = [i for i, r in enumerate(rows) if r.mask is not None or r.params.logit_bias]
    raw = logits
    if needs_penalty or needs_ban or constrained:
        logits = logits.clone()
    if needs_penalty:
        logits = apply_penalties(logits, rows)
    if needs_ban:
        for i, r in enumerate(rows):
            if len(r.output_token_ids) < r.params.min_tokens and stop_ids[i]:
                logits[i, [t for t in stop_ids[i] if t < vocab]] = float("-inf")
    if constrained:
        apply_bias_and_masks(logits, rows, constrained)
    if needs_penalty or needs_ban or constrained:
        logits = _constraint_wins(raw, logits, rows)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random_rows:
        return logits, random_rows, None
    x = logits if len(random_rows) == num_rows else logits[torch.tensor(random_rows, device=device)]
    params = [rows[i].params for i in random_rows]
    x = x / torch.tensor([p.temperature for p in params], dtype=x.dtype, device=device)[:, None]
    top_k = top_p = min_p = None
    if any(0 < p.top_k < vocab for p in params):
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=device)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=device)
    x = apply_top_k_top_p_min_p(x, top_k, top_p, min_p)
    bad = (~torch.isfinite(x.amax(-1))).nonzero()[:, 0].tolist()
    for j in bad:  # temperature overflowed what the penalties left (e.g. 1e30 / 1e-10): the row as it is
        x[j] = logits[random_rows[j]]
    return logits, random_rows, x


def _constraint_wins(raw: torch.Tensor, logits: torch.Tensor, rows: Seq[SamplerRow]) -> torch.Tensor:
    """Rows whose penalties, bans and bias left nothing drawable (every allowed token at -inf, a +inf from a
    tiny repetition_penalty, a NaN) take the raw logits under the grammar mask alone: the constraint wins over
    the sampling options, so the token drawn is always one the grammar allows (drafts and the verifier see the
    same rows, so speculation stays exact)."""
    bad = (~torch.isfinite(logits.amax(-1))).nonzero()[:, 0].tolist()
    if not bad:
        return logits
    from engines.structured import apply_masks

    masked = [j for j, i in enumerate(bad) if rows[i].mask is not None]
    fallback = raw[bad].nan_to_num(nan=float("-inf"), posinf=torch.finfo(raw.dtype).max)
    for attempt in range(2):
        if masked:
            apply_masks(fallback, masked, [rows[bad[j]].mask for j in masked])
        empty = ~torch.isfinite(fallback.amax(-1))
        if attempt or not bool(empty.any()):
            break
        fallback[empty] = 0.0  # nothing finite even raw (a broken forward): uniform over what is allowed
    logits[bad] = fallback
    return logits


def draw(probs: torch.Tensor, uniforms: Seq[float | None]) -> torch.Tensor:
    """One token per row of probs [R, V] (rows sum to about 1): the inverse CDF at the row's uniform (a
    seeded row's `seeded_uniform`, else a fresh one), so a seeded row's token depends only on its seed, its
    position and its distribution. On the GPU the unseeded rows take the exponential race argmax(p / E),
    E ~ Exp(1) (one fused pass, no sort, no sync); on the CPU the inverse CDF (V exponentials cost ~100 us
    at V = 4096, a cumsum and a binary search a few us)."""
    seeded = [j for j, u in enumerate(uniforms) if u is not None]
    if probs.is_cuda:
        picked = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
        if seeded:
            idx = torch.tensor(seeded, device=probs.device)
            u = torch.tensor([uniforms[j] for j in seeded], dtype=probs.dtype, device=probs.device)[:, None]
            picked[idx] = _inverse_cdf(probs[idx], u)
        return picked
    u = torch.rand(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    for j in seeded:
        u[j] = uniforms[j]
    return _inverse_cdf(probs, u)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token of each row whose cumulative mass exceeds u * total (zero-probability tokens never
    are); u [R, 1] in [0, 1)."""
    cdf = probs.cumsum(-1)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    over = picked >= probs.shape[1]
    if bool(over.any()):  # u * total rounded up to the total (u within 1e-7 of 1): the last token with mass
        for j in over.nonzero()[:, 0].tolist():
            picked[j] = int(torch.nonzero(probs[j])[-1])
    return picked


def sample(logits: torch.Tensor, rows: Seq[SamplerRow], stop_ids: Seq[set[int]] | None = None) -> SamplerOutput:
    """logits: fp32 [R, V], one row per entry of `rows`. `stop_ids[i]` are the ids that min_tokens bans."""
    num_rows = logits.shape[0]
    device = logits.device
    want = [r.params.logprobs for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want) else None

    logits, random_rows, x = processed_logits(logits, rows, stop_ids)
    tokens = logits.argmax(dim=-1)
    if random_rows:
        idx = torch.tensor(random_rows, device=device) if len(random_rows) < num_rows else None
        probs = x.softmax(dim=-1)
        picked = draw(probs, [rows[i].uniform for i in random_rows])
        if idx is None:
            tokens = picked
        else:
            tokens[idx] = picked

    token_list = tokens.tolist()
    sampled_lp: list[float | None] = [None] * num_rows
    pos_lps: list[PositionLogprobs | None] = [None] * num_rows
    if raw_logprobs is not None:
        lp_rows = [i for i, k in enumerate(want) if k is not None]
        sub = raw_logprobs[lp_rows]
        tok = tokens[lp_rows][:, None]
        chosen = sub.gather(1, tok)
        ranks = (sub > chosen).sum(-1) + 1
        kmax = max(want[i] for i in lp_rows)
        top = sub.topk(kmax, dim=-1) if kmax > 0 else None
        chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
        top_v = top.values.tolist() if top is not None else None
        top_i = top.indices.tolist() if top is not None else None
        for j, i in enumerate(lp_rows):
            d: PositionLogprobs = {token_list[i]: Logprob(chosen_l[j], ranks_l[j])}
            for r in range(want[i]):
                t = top_i[j][r]
                if t not in d:
                    d[t] = Logprob(top_v[j][r], r + 1)
            sampled_lp[i] = chosen_l[j]
            pos_lps[i] = d
    return SamplerOutput(token_list, sampled_lp, pos_lps)


def greedy_bans(seqs: Seq[Sequence], ban_ids: Seq[Set[int]]) -> list[tuple[Set[int], int]] | None:
    """For the C greedy loop (`draft_greedy`): per sequence, the ids min_tokens bans (`ban_ids`, as
    `min_tokens_ban` gives them) and for how many of its next tokens (its output so far counts); None when
    no sequence has a ban left."""
    bans = [(ids, s.request.params.min_tokens - s.num_output_tokens) for s, ids in zip(seqs, ban_ids)]
    return bans if any(ids and n > 0 for ids, n in bans) else None
