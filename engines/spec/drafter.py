"""The drafter: the small engine's model (the same weights object and runner) proposing k tokens per sequence
over draft KV kept in the shared pool under the small model's id, so the small engine's cached prompt blocks
serve as draft KV; `rollback` keeps what verification accepted."""

from __future__ import annotations

import torch

from engines.kv_pool import KVPool
from engines.sampler import draw, greedy_bans, processed_logits, sampler_row, seeded_uniform
from engines.scheduler import extra_keys
from engines.sequence import Sequence
from engines.spec.adaptive import CostModel
from engines.spec.lean_runner import LeanDraftRunner
from engines.spec.state import DraftState


class Drafter:
    """Drafts with `model` through `runner` (the small engine's), or through the lean CPU runner when it
    supports the model, the runner has no C forward, and a pass has few tokens per sequence."""

    def __init__(self, model: torch.nn.Module, runner, pool: KVPool, model_id: int):
        self.model = model
        self.runner = runner
        self.pool = pool
        self.model_id = model_id
        self.block_size = pool.block_size
        # the runner's one-call C forward (kernels/cpu_forward.py) beats the lean runner's torch ops wherever
        # it covers the model
        self.lean = (LeanDraftRunner(model, runner.kv_view, self.block_size)
                     if getattr(runner, "cpu_forward", None) is None and LeanDraftRunner.supported(model, runner)
                     else None)
        self.num_prefix_hit_tokens = 0  # draft KV found in the prefix cache (e.g. the small engine's prompts)
        self.caught_up = False  # the latest `draft` first computed a sequence's missed tokens (not a steady step)

    def release(self, seq: Sequence) -> None:
        ds = seq.draft_state
        if ds is not None:
            self.pool.release_holder(ds)
            seq.draft_state = None

    def _state(self, seq: Sequence) -> DraftState:
        ds = seq.draft_state
        if ds is None:
            hit = self.pool.match(self.model_id, seq.token_ids, extra_keys(seq))
            self.pool.acquire(hit.held())
            self.num_prefix_hit_tokens += hit.num_blocks * self.block_size
            ds = DraftState(list(seq.token_ids), hit.pages, hit.num_blocks * self.block_size, hit.hashes,
                            hit.group_pages)
            seq.draft_state = ds
        else:  # catch up with the tokens appended since (its list is always a prefix of the sequence's)
            ds.token_ids.extend(seq.token_ids[len(ds.token_ids):])
        return ds

    def lag(self, seq: Sequence) -> int:
        """Tokens the drafter computes before its first draft for `seq` (without a state: the whole sequence,
        a prefix-cache hit not counted)."""
        ds = seq.draft_state
        return seq.num_tokens - (ds.num_computed if ds is not None else 0)

    def reserve(self, seq: Sequence, k: int, spare_pages: int) -> DraftState | None:
        """The state with pages for k drafts (positions up to num_tokens + k - 2), or None if the pool
        cannot spare them without starving the engines (`spare_pages` stay free)."""
        ds = self._state(seq)
        need = -(-(ds.num_tokens + k - 1) // self.block_size) - len(ds.pages)
        if need > 0:
            if need * self.pool.geometries[self.model_id].num_groups + spare_pages > self.pool.num_free:
                return None
            self.pool.grow(self.model_id, ds, need)
        return ds

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Keep the first `num_valid` tokens of the sequence's draft state (verified: the sequence has them too)
        and hash their full blocks, as the scheduler hashes the sequence's."""
        ds = seq.draft_state
        if ds is None:
            return
        del ds.token_ids[num_valid:]
        ds.num_computed = min(ds.num_computed, num_valid)
        ds.shadow_len = min(ds.shadow_len, ds.num_computed)
        self.pool.commit_blocks(self.model_id, ds, ds.num_computed // self.block_size, extra_keys(seq))
        # only here, never while drafting: verified tokens are never computed again, drafts may be
        self.pool.free_outside_window(self.model_id, ds)

    def _greedy_in_one_call(self, seqs: list[Sequence], states: list[DraftState], ks: list[int]) -> list[int]:
        """The sequences (indices) whose whole draft runs in one C call: greedy on the raw logits (no
        penalties or constraints; min_tokens' ban the C loop applies), the batch's largest k, the runner's C
        forward able to take them; no Python runs between their draft tokens. The others take the loop."""
        can = getattr(self.runner, "can_draft_greedy", None)
        if self.lean is not None or can is None:
            return []
        vocab, k = self.model.config.vocab_size, max(ks)
        picked = [i for i, s in enumerate(seqs) if ks[i] == k and s.request.params.greedy
                  and s.request.params.plain(vocab, min_tokens_ok=True)]
        if not picked or not can([1]):
            return []
        behind = [states[i] for i in picked if not can([states[i].num_tokens - states[i].num_computed])]
        if behind:  # a catch-up longer than the C call takes (a prompt): the runner's varlen prefill computes
            # all but the last missed token first, so the draft itself still runs in one call
            self.runner.execute(behind, [s.num_tokens - s.num_computed - 1 for s in behind])
            for s in behind:
                s.num_computed = s.num_tokens - 1
        return picked

    def _draft_greedy(self, seqs: list[Sequence], states: list[DraftState], k: int, cost: CostModel,
                      stop_ids: list[set[int]]) -> list[list[int]]:
        t0 = cost.clock()
        num_new = [s.num_tokens - s.num_computed for s in states]
        drafts = self.runner.draft_greedy(states, num_new, k, greedy_bans(seqs, stop_ids))
        for s, n, d in zip(states, num_new, drafts):
            s.num_computed += n + k - 1
            s.token_ids.extend(d)
        if sum(num_new) <= 2 * len(num_new):  # decode-like: k draft passes' cost, as the loop below counts it
            per_pass = (cost.clock() - t0) / k
            for _ in range(k):
                cost.observe(len(states), per_pass)
        return drafts

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence], states: list[DraftState], ks: list[int], stop_ids: list[set[int]],
              cost: CostModel) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """k_i tokens for sequence i, sampled from the draft's processed distribution q (greedy rows take
        its argmax), appended to its state; returns (the drafts, q rows [k_i, V] per sequence: None for
        deterministic drafts, whose q is one-hot)."""
        # more than the last draft and the bonus token to compute first: a prompt or tokens missed
        self.caught_up = max(s.num_tokens - s.num_computed for s in states) > 2
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        one_call = self._greedy_in_one_call(seqs, states, ks)
        if one_call:
            for i, d in zip(one_call, self._draft_greedy([seqs[i] for i in one_call], [states[i] for i in one_call],
                                                         ks[one_call[0]], cost, [stop_ids[i] for i in one_call])):
                drafts[i] = d
            chosen = set(one_call)
            active = [i for i in active if i not in chosen]
        while active:
            t0 = cost.clock()
            act_states = [states[i] for i in active]
            num_new = [s.num_tokens - s.num_computed for s in act_states]
            decode_like = sum(num_new) <= 2 * len(num_new)
            if self.lean is not None and sum(num_new) <= 4 * len(num_new):  # few tokens each: the lean runner
                logits, _ = self.lean.execute(act_states, num_new)
            else:  # catch-up (a prompt, or many tokens since the last draft): the runner's varlen prefill
                for s in act_states:  # it writes only the pages: the dense path's copy is stale there
                    s.shadow_len = min(s.shadow_len, s.num_computed)
                logits, _ = self.runner.execute(act_states, num_new)
            for s, n in zip(act_states, num_new):
                s.num_computed += n
            if len(active) == 1 and seqs[active[0]].request.params.plain(logits.shape[1]):
                # one sequence, temperature only (no penalties, bans or top-k/p/min-p): the same q, few ops
                seq = seqs[active[0]]
                prm = seq.request.params
                probs = None if prm.greedy else torch.softmax(logits / prm.temperature, -1)
                pos = seq.num_tokens + len(drafts[active[0]])
                u = None if seq.seed is None else seeded_uniform(seq.seed, pos)
                tokens = logits.argmax(-1) if probs is None else draw(probs, [u])
                is_greedy = [prm.greedy]
            else:
                rows = [sampler_row(seqs[i], drafts[i]) for i in active]
                is_greedy = [r.params.greedy for r in rows]
                penalised, random_rows, x = processed_logits(logits, rows, [stop_ids[i] for i in active])
                tokens = penalised.argmax(-1)
                probs = None
                if random_rows:  # draw only the sampling rows: a greedy row has no distribution to draw from
                    probs = x.softmax(-1)
                    sampled = draw(probs, [rows[j].uniform for j in random_rows])
                    if len(random_rows) == len(active):
                        tokens = sampled
                    else:
                        tokens[torch.tensor(random_rows, device=tokens.device)] = sampled
                    probs = dict(zip(random_rows, probs))  # q rows by position in `active`
            token_list = tokens.tolist()
            still = []
            for j, i in enumerate(active):
                drafts[i].append(token_list[j])
                states[i].token_ids.append(token_list[j])
                if not is_greedy[j]:
                    qs[i].append(probs[j])
                if len(drafts[i]) < ks[i]:
                    still.append(i)
            if decode_like:  # a catch-up pass (a prompt, tokens since the last draft) is not a draft step's cost
                cost.observe(len(active), cost.clock() - t0)
            active = still
        return drafts, [torch.stack(q) if q else None for q in qs]
