"""Verification of draft tokens, as one function of (logits, batch layout, drafts, draft probabilities) to the
tokens each sequence appends: greedy rows keep drafts while they equal the target's argmax (exact), sampling
rows go through rejection sampling against the processed target distribution (exact in distribution); rows
without drafts are sampled as in a plain step. logit_bias and grammar masks are part of the processed
distribution at every window position, so a forbidden draft is always rejected."""

from __future__ import annotations

from collections.abc import Mapping, Set
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from engines.outputs import Logprob, PositionLogprobs
from engines.sampler import (
    Sampled,
    SamplerRow,
    draw,
    min_tokens_ban,
    processed_logits,
    sample_sequences,
    sampler_row,
)
from engines.spec.rejection import rejection_sample, rejection_sample_one

if TYPE_CHECKING:
    from engines.attention import StepBatch
    from engines.sequence import Sequence


def verify(logits: torch.Tensor, batch: StepBatch, drafts: Mapping[int, list[int]],
           draft_probs: Mapping[int, torch.Tensor], eos_token_ids: Set[int],
           masks: Mapping[int, torch.Tensor] | None = None) -> list[Sampled]:
    """logits: the 1 + k rows of every sampling sequence verifying k drafts (`batch.rows_per_seq`), one row for
    the others; drafts: seq_id -> the k scheduled drafts; draft_probs: seq_id -> q [k, V] for drafts sampled
    from a distribution (absent: one-hot q, greedy or supplied drafts); masks: seq_id -> grammar masks after
    each draft prefix, computed ahead (`structured.MaskPrefetch`), else computed here."""
    plain_rows, plain_seqs, spec = [], [], []
    row = 0
    for seq, n in zip(batch.sample_seqs, batch.rows_per_seq):
        if n == 1:
            plain_rows.append(row)
            plain_seqs.append(seq)
        else:
            spec.append((seq, row, n - 1))
        row += n
    out = []
    if plain_seqs:
        out = sample_sequences(logits[plain_rows] if len(plain_rows) < logits.shape[0] else logits, plain_seqs,
                               eos_token_ids, masks)
    if spec:
        out += _accept(logits, spec, drafts, draft_probs, eos_token_ids, masks)
    return out


def processed_distributions(logits: torch.Tensor, rows: Seq[SamplerRow], stop_ids: Seq[set[int]]
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What `sampler.sample` would draw from: (the greedy choice [R], probabilities [R, V] after penalties,
    min_tokens bans, temperature, top-k/top-p/min-p — rows of greedy params hold zeros; None when every row
    is greedy)."""
    logits, random_rows, x = processed_logits(logits, rows, stop_ids)
    greedy = logits.argmax(dim=-1)
    if x is None:
        return greedy, None
    if len(random_rows) == logits.shape[0]:
        return greedy, x.softmax(-1)
    probs = torch.zeros_like(logits)
    probs[torch.tensor(random_rows, device=logits.device)] = x.softmax(-1)
    return greedy, probs


def plain_greedy_targets(logits: torch.Tensor, spec: list[tuple[Sequence, int, int]], eos_token_ids: Set[int]
                         ) -> list[int] | None:
    """The target's token at every window position when every window is greedy on the raw logits, min_tokens'
    ban at most (the load tester's requests): the argmax of its rows with the banned ids masked at the
    positions the ban covers, which is what `processed_distributions` gives such rows without building a
    sampler row per position. None when some window needs the general path."""
    vocab = logits.shape[1]
    for seq, _, _ in spec:
        p = seq.request.params
        if not p.greedy or seq.grammar is not None or not p.plain(vocab, min_tokens_ok=True):
            return None
    x = logits[torch.tensor([start + j for _, start, k in spec for j in range(k + 1)], device=logits.device)]
    row = 0
    for seq, _, k in spec:
        p = seq.request.params
        left = min(p.min_tokens - seq.num_output_tokens, k + 1)  # positions j with output + j < min_tokens
        if left > 0:
            ids = [t for t in min_tokens_ban(p, eos_token_ids) if t < vocab]
            if ids:
                x[row:row + left, ids] = float("-inf")
        row += k + 1
    return x.argmax(dim=-1).tolist()


def _accept(logits: torch.Tensor, spec: list[tuple[Sequence, int, int]], drafts: Mapping[int, list[int]],
            draft_probs: Mapping[int, torch.Tensor], eos_token_ids: Set[int],
            masks_ahead: Mapping[int, torch.Tensor] | None) -> list[Sampled]:
    targets = plain_greedy_targets(logits, spec, eos_token_ids)
    if targets is not None:
        results, offset = [], 0
        for seq, _, k in spec:
            results.append(_keep_while_equal(drafts[seq.seq_id][:k], targets[offset:offset + k + 1]))
            offset += k + 1
        return _with_logprobs(logits, spec, results)
    rows, stop_ids, windows = [], [], []
    for seq, _, k in spec:
        d = drafts[seq.seq_id][:k]
        q = draft_probs.get(seq.seq_id)
        windows.append((d, None if q is None else q[:k]))
        stop = min_tokens_ban(seq.request.params, eos_token_ids)
        # a constrained row's masks after each draft prefix: a draft its grammar forbids is never accepted
        masks = None
        if seq.grammar is not None:
            ahead = masks_ahead.get(seq.seq_id) if masks_ahead is not None else None
            masks = ahead if ahead is not None and len(ahead) > k else seq.grammar.window_masks(d)
        for j in range(k + 1):  # each position's history includes the drafts before it
            rows.append(sampler_row(seq, d[:j], None if masks is None else masks[j]))
            stop_ids.append(stop)
    index = torch.tensor([start + j for _, start, k in spec for j in range(k + 1)], device=logits.device)
    greedy, probs = processed_distributions(logits[index], rows, stop_ids)
    greedy_l = greedy.tolist()
    results: list[tuple[list[int], int] | None] = [None] * len(spec)
    random_idx, seeded_idx = [], []
    offset = 0
    for i, (seq, _, k) in enumerate(spec):
        if seq.request.params.greedy:
            results[i] = _keep_while_equal(windows[i][0], greedy_l[offset:offset + k + 1])
        elif seq.seed is not None:
            seeded_idx.append((i, offset))
        else:
            random_idx.append((i, offset))
        offset += k + 1
    if seeded_idx:
        # a seeded row's token at each position is its own seeded draw from the target distribution, as in a
        # plain step (exact, and identical with or without drafts): keep drafts while they equal those draws
        at = [off + j for i, off in seeded_idx for j in range(spec[i][2] + 1)]
        target_l = draw(probs[torch.tensor(at, device=probs.device)], [rows[r].uniform for r in at]).tolist()
        pos = 0
        for i, _ in seeded_idx:
            k = spec[i][2]
            results[i] = _keep_while_equal(windows[i][0], target_l[pos:pos + k + 1])
            pos += k + 1
    if random_idx:
        for (i, _), r in zip(random_idx, _rejection(probs, spec, windows, random_idx)):
            results[i] = r
    return _with_logprobs(logits, spec, results)


def _with_logprobs(logits: torch.Tensor, spec: list[tuple[Sequence, int, int]],
                   results: list[tuple[list[int], int]]) -> list[Sampled]:
    out = []
    for (seq, start, _), (tokens, acc) in zip(spec, results):
        k_lp = seq.request.params.logprobs
        lps = None
        if k_lp is not None:
            lp_rows = torch.log_softmax(logits[start:start + len(tokens)], -1)
            lps = [_logprobs(lp_rows[j], tok, k_lp) for j, tok in enumerate(tokens)]
        out.append(Sampled(seq, tokens, acc, lps))
    return out


def _keep_while_equal(drafts: list[int], target: list[int]) -> tuple[list[int], int]:
    """Drafts up to the first that differs from the target's token at its position, then the target's token."""
    acc = 0
    while acc < len(drafts) and drafts[acc] == target[acc]:
        acc += 1
    return drafts[:acc] + [target[acc]], acc


def _rejection(probs: torch.Tensor, spec, windows, random_idx) -> list[tuple[list[int], int]]:
    """Rejection sampling of the sampling rows, batched per draft count k (no padding)."""
    dev = probs.device
    by_k: dict[int, list[tuple[int, int]]] = {}
    for i, off in random_idx:
        by_k.setdefault(spec[i][2], []).append((i, off))
    results: dict[int, tuple[list[int], int]] = {}
    for k, group in by_k.items():
        b = len(group)
        p = torch.stack([probs[off:off + k + 1] for _, off in group])
        draft_ids = torch.tensor([windows[i][0] for i, _ in group], dtype=torch.long, device=dev)
        q = None
        if any(windows[i][1] is not None for i, _ in group):
            q = torch.stack([windows[i][1] if windows[i][1] is not None
                             else torch.nn.functional.one_hot(draft_ids[j], p.shape[-1]).to(p.dtype)
                             for j, (i, _) in enumerate(group)])
        u = torch.rand(b, k + 1, device=dev)
        if b == 1 and not p.is_cuda:
            results[group[0][0]] = rejection_sample_one(draft_ids[0], q, p[0], u[0])
            continue
        tokens, num_acc = rejection_sample(draft_ids, q, p, u[:, :k].contiguous(), u[:, k].contiguous())
        for (i, _), toks, acc in zip(group, tokens.tolist(), num_acc.tolist()):
            results[i] = (toks[:acc + 1], acc)
    return [results[i] for i, _ in random_idx]


def _logprobs(row: torch.Tensor, token: int, k: int) -> tuple[float, PositionLogprobs]:
    """The target's raw logprob of `token` at one window position, plus its top k (as the sampler reports)."""
    chosen = float(row[token])
    d: PositionLogprobs = {token: Logprob(chosen, int((row > chosen).sum()) + 1)}
    if k:
        top = row.topk(k)
        for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            if t not in d:
                d[t] = Logprob(v, r + 1)
    return chosen, d
