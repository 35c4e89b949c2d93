"""Drafting windows looped in one step (a `StepPlan` with windows): every running sequence drafts k greedy tokens
in one C call and is verified through the runner, window after window. What the loop saves is the per-window
work of an engine step: scheduling, the sampler's bookkeeping, updates and emits. The scheduler booked every
window's tokens as lookahead; `Scheduler.update` then takes the tokens the windows kept as accepted drafts and
a bonus token (stops and max length apply there)."""

from __future__ import annotations

from collections.abc import Set
from typing import TYPE_CHECKING

from engines.sampler import Sampled

if TYPE_CHECKING:
    from engines.sequence import Sequence
    from engines.spec.decoder import SpeculativeDecoder


def run_windows(runner, sp: SpeculativeDecoder, seqs: list[Sequence], k: int, room: dict[int, int],
                eos_token_ids: Set[int]) -> tuple[list[Sampled], int]:
    """(the tokens each sequence kept, the windows run: 0 where none could, nothing changed); `runner`: the
    engine's `ModelRunner`, whose `execute` verifies each window; `room`: seq_id ->
    the tokens booked for it. The sequences come back as they were (`Scheduler.update` appends the tokens), on
    an error too."""
    saved = [(seq, len(seq.token_ids), seq.num_computed) for seq in seqs]
    out: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
    try:
        windows = _loop(runner, sp, seqs, k, room, out, eos_token_ids)
    finally:
        for seq, length, computed in saved:
            del seq.token_ids[length:]
            seq.num_computed = computed
    return [Sampled(seq, toks, num_accepted=len(toks) - 1) for seq in seqs if (toks := out[seq.seq_id])], windows


def _loop(runner, sp: SpeculativeDecoder, seqs: list[Sequence], k: int, room: dict[int, int],
          out: dict[int, list[int]], eos_token_ids: Set[int]) -> int:
    """Each sequence's kept tokens into `out`, the sequence itself advanced past them for the drafter and the
    runner; each window is for all of `seqs`: where one of them stops, the loop ends (the next step weighs the
    smaller batch, whose windows measure that batch size). Between windows adaptive k weighs the choice again,
    and the loop ends where it no longer drafts k for every sequence or a window would not fit the booking."""
    dr = sp.drafter
    spare = len(seqs) + 1
    active = list(seqs)
    windows = 0
    while active:  # every sequence in it has room for a whole window of k (`StepPolicy._windows`, `still`)
        if windows and sp.plan(active).uniform_k(active) != k:  # weighed as a step's would be
            break
        states = [dr.reserve(seq, k, spare) for seq in active]
        if any(st is None for st in states):
            break
        drafts, _ = dr.draft(active, states, [k] * len(active), [set()] * len(active), sp.adaptive.draft)
        logits, _ = runner.execute(active, [k + 1] * len(active), {seq.seq_id: d for seq, d in zip(active, drafts)})
        targets = logits.argmax(dim=-1).tolist()
        still = []
        for i, (seq, d) in enumerate(zip(active, drafts)):
            t = targets[i * (k + 1):(i + 1) * (k + 1)]
            a = 0
            while a < k and d[a] == t[a]:
                a += 1
            kept = d[:a] + [t[a]]
            seq.token_ids.extend(kept)
            seq.num_computed += a + 1
            out[seq.seq_id].extend(kept)
            dr.rollback(seq, seq.num_tokens - 1)
            sp.count_window(seq, k, a)
            p = seq.request.params
            stops = p.stop_token_ids if p.ignore_eos else (*eos_token_ids, *p.stop_token_ids)
            if not any(tok in stops for tok in kept) and room[seq.seq_id] - len(out[seq.seq_id]) > k:
                still.append(seq)
        windows += 1
        if len(still) < len(seqs):
            break
        active = still
    return windows
