"""Speculative decoding: a small model drafts k tokens per sequence, the engine's model verifies them in one
pass over k+1 positions, and rejection sampling keeps the target's output distribution exactly. Owns the
drafter (the small engine's model and runner, its KV in the shared pool), verification, adaptive k and metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engines.outputs import Logprob, PositionLogprobs
from engines.sampler import SamplerRow, draw, processed_logits
from engines.sequence import Sequence

if TYPE_CHECKING:
    from engines.core import ModelEngine
    from engines.runner import StepBatch
    from engines.sampling_params import SamplingParams

log = logging.getLogger("tandem.speculative")

SUPPLIED_CHUNK = 16  # supplied drafts are verified this many per target pass
EXPLORE_SEQS = 4  # sequences that draft in a step that only measures acceptance and cost


# ---------------------------------------------------------------------------------------------------------
# distributions and the rejection sampler


def sampler_row(seq: Sequence, extra: Seq[int] = ()) -> SamplerRow:
    """The sampler's view of `seq` with `extra` (earlier drafts of this window) appended to its output."""
    p = seq.request.params
    history = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
    prompt = seq.token_ids[:seq.prompt_len] if history else ()
    output = seq.token_ids[seq.prompt_len:] + list(extra) if history or p.min_tokens else ()
    return SamplerRow(p, prompt, output, seq.generator)


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


def rejection_sample_batched(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                             target_probs: torch.Tensor, uniform_accept: torch.Tensor,
                             uniform_recover: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.fused.rejection_sample_ref` vectorised over rows (same arguments, same results): the CPU path.
    A row with fewer real drafts pads with uniform_accept = inf and a zero draft-probability row, so its
    first padded position recovers from p itself, which is the bonus token."""
    b, k = draft_token_ids.shape
    dev = target_probs.device
    p_d = target_probs[:, :k].gather(2, draft_token_ids[..., None])[..., 0]
    if draft_probs is not None:
        q_d = draft_probs.gather(2, draft_token_ids[..., None])[..., 0]
    else:
        q_d = torch.ones_like(p_d)
    rejected = ~(uniform_accept * q_d < p_d)
    pos = torch.where(rejected.any(1), rejected.to(torch.int8).argmax(1), torch.full((b,), k, device=dev))
    rows = torch.arange(b, device=dev)
    p = target_probs[rows, pos]
    safe = pos.clamp(max=k - 1)
    if draft_probs is not None:
        q = draft_probs[rows, safe]
    else:
        q = torch.nn.functional.one_hot(draft_token_ids[rows, safe], p.shape[-1]).to(p.dtype)
    r = torch.where((pos == k)[:, None], p, (p - q).clamp_min(0.0))
    live = r > 0
    hits = (r.cumsum(1) > (uniform_recover * r.sum(1))[:, None]) & live
    vocab_idx = torch.arange(r.shape[1], device=dev)
    last_live = torch.where(live, vocab_idx, -1).max(1).values.clamp_min(0)
    token = torch.where(hits.any(1), hits.to(torch.int8).argmax(1), last_live)
    out = torch.where(torch.arange(k, device=dev)[None, :] < pos[:, None], draft_token_ids, -1)
    out = torch.cat([out, torch.full((b, 1), -1, dtype=out.dtype, device=dev)], 1)
    out[rows, pos] = token
    return out, pos


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     uniform_accept: torch.Tensor, uniform_recover: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA, the vectorised reference elsewhere."""
    if target_probs.is_cuda:
        from kernels.fused import rejection_sample as kernel

        return kernel(draft_token_ids, draft_probs, target_probs, uniform_accept, uniform_recover)
    return rejection_sample_batched(draft_token_ids, draft_probs, target_probs, uniform_accept, uniform_recover)


# ---------------------------------------------------------------------------------------------------------
# adaptive k


class CostModel:
    """Seconds of one pass as a function of its size, learned online: an EMA per power-of-two size bucket,
    read by linear interpolation between measured sizes; outside them it assumes no saving below and linear
    growth above (pessimistic, so an unmeasured large batch does not look cheap)."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        # single-threaded CPU: the thread's CPU time, steady when other jobs share the cores (the ratio of
        # costs is what matters); elsewhere wall time (a GPU runs asynchronously to this thread)
        self.clock = time.perf_counter
        self.points: dict[int, list[float]] = {}  # bucket -> [mean size, mean seconds]

    def observe(self, size: int, seconds: float) -> None:
        b = max(1, size).bit_length()
        pt = self.points.get(b)
        if pt is None:
            self.points[b] = [float(size), seconds]
        else:
            pt[0] = self.decay * pt[0] + (1 - self.decay) * size
            pt[1] = self.decay * pt[1] + (1 - self.decay) * seconds

    def estimate(self, size: int) -> float | None:
        if not self.points:
            return None
        pts = sorted(self.points.values())
        if size <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if size <= x1:
                return y0 + (y1 - y0) * (size - x0) / max(x1 - x0, 1e-9)
        x, y = pts[-1]
        return y * size / x


class AdaptiveK:
    """Per engine: picks k in 0..k_max maximising expected tokens per second,
    B * E(k) / S(B, k), E(k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al.), from the measured acceptance a
    and the step cost S: the measured whole step at this batch size and k once there is one, else the target
    pass (T, by tokens per step) plus k draft passes (D): T(B * (k + 1)) + k * D(B). k = 0
    is plain decoding;
    every `explore_every` choices it takes the other side so both cost estimates stay measured and a stale
    acceptance estimate can recover: plain decoding instead of k for 3 steps; drafting instead of plain
    decoding as the best k > 0 for 3 steps at batches of up to `explore_seqs` (every sequence drafts, so the
    whole step is measured), else k = 1 once for a few sequences (acceptance only), and not at all where
    drafting would lose even with every draft accepted. While the same side keeps winning, the interval
    doubles up to `explore_max` (each exploration costs a catch-up or a switch: at batch 8 exploring every 32
    steps cost 5-7% of throughput, at batch 1 the plain runs 3%); a change of side resets it. Outside
    explorations a batch size leaves plain decoding only for a predicted `hysteresis` gain (the drafters
    catch up)."""

    def __init__(self, k_max: int, explore_every: int = 32, decay: float = 0.95,
                 device: torch.device | str = "cpu", explore_max: int = 512, explore_seqs: int = EXPLORE_SEQS):
        self.k_max = k_max
        self.explore_seqs = explore_seqs  # an exploring step drafts for this many sequences at most
        self.explore_every = explore_every
        self.explore_max = max(explore_max, explore_every)
        self._interval = explore_every
        self._last_best = 0  # the winner at the previous exploration (0: plain decoding)
        # leaving plain decoding for a k not yet measured at this batch size needs this predicted gain: the
        # switch makes every sequence's drafter catch up on the tokens it missed (batch 32 greedy took a few
        # such steps, about 36 ms longer each by the run times, and ran at 0.92x in bench/speculative.py)
        self.switch_margin = 1.2
        self.hysteresis = 1.1  # leaving plain decoding for a measured k needs this predicted gain
        self._side: dict[int, bool] = {}  # per batch-size bucket: whether its latest choice drafted
        self._next_explore = explore_every
        # the target step's cost by k, keyed by the number of decoding sequences: a verify step over k + 1
        # tokens per sequence costs more than plain decodes of as many tokens (rejection sampling,
        # per-window work), which a model keyed by tokens per step cannot tell apart
        self.step_cost: dict[int, CostModel] = {}
        self.decay = decay
        self.target = CostModel()
        self.draft = CostModel()
        if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
            self.target.clock = self.draft.clock = time.thread_time
        self._accepted = 0.0  # EMA counts of the geometric model: accepted drafts and first rejections
        self._rejected = 0.0
        self._zeros = 0
        self._steps = 0
        self.k = k_max
        self.exploring = False  # the latest choice only measures: draft for a few sequences, not the batch
        self._hold_plain = 0  # steps left of an exploration of plain decoding (a short run, see observe_step)
        self._hold_draft = (0, 0)  # steps left of an exploration of drafting, and its k (small batches)
        self._prev_k: int | None = None  # k of the previous observed step
        self.fixed: int | None = None  # pin k (tests, benchmarks); None: adaptive

    @property
    def acceptance(self) -> float | None:
        n = self._accepted + self._rejected
        return self._accepted / n if n > 0 else None

    def observe_window(self, num_drafts: int, num_accepted: int) -> None:
        self._accepted = self.decay * self._accepted + num_accepted
        self._rejected = self.decay * self._rejected + (1 if num_accepted < num_drafts else 0)

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """A whole decode-only engine step where every sequence drafted k: drafting, its bookkeeping, the
        target forward, verification and sampling. That is what a step really costs; the target and draft
        models see only their passes, and judged by those alone batch 8 greedy drafted on 97% of steps and
        ran at 0.84x of plain decoding (bench/speculative.py). Only steady steps count: the first step after
        k changes pays for the switch (the other model's weights and K/V have just left the caches, the
        drafter catches up); at batch 8 the isolated plain steps averaged 6.96 ms where a run of them takes
        5.2 ms, which kept speculation on when it lost."""
        prev, self._prev_k = self._prev_k, k
        if prev == k:
            self.step_cost.setdefault(k, CostModel()).observe(batch, seconds)

    def unsteady(self) -> None:
        """The coming step pays for more than its k (the drafter caught up on a prompt or on tokens it missed):
        it is not counted, and the step after it is (if its k is the same)."""
        self._prev_k = None

    def step_seconds(self, batch: int, k: int, draft_seconds: float = 0.0) -> float:
        """Seconds of a whole step with k drafts for each of `batch` sequences: measured at this batch size
        and k when it has been, else the tokens-per-step model of the target pass plus k draft passes, scaled
        by the measured / modelled ratio of another k > 0 at this batch size when there is one (so one
        measured k corrects the others at once instead of each being tried in turn)."""
        bucket = max(1, batch).bit_length()
        m = self.step_cost.get(k)
        if m is not None and bucket in m.points:
            return m.estimate(batch)
        model = self.target.estimate(batch * (k + 1)) + k * draft_seconds
        if k > 0:  # another k measured at this batch size: scale the model by how far off it was there
            for j, mj in sorted(self.step_cost.items(), reverse=True):
                if j > 0 and bucket in mj.points:
                    return model * mj.estimate(batch) / (self.target.estimate(batch * (j + 1)) + j * draft_seconds)
        return model

    @staticmethod
    def expected_tokens(a: float, k: int) -> float:
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def choose(self, batch: int) -> int:
        self.exploring = False
        if self._hold_plain > 0:  # the rest of a plain-decoding exploration
            self._hold_plain -= 1
            self.k = 0
            return 0
        if self._hold_draft[0] > 0:  # the rest of a drafting exploration
            self._hold_draft = (self._hold_draft[0] - 1, self._hold_draft[1])
            self.k = self._hold_draft[1]
            self.exploring = True
            return self.k
        if self.fixed is not None:
            self.k = min(self.fixed, self.k_max)
            return self.k
        if self.k_max == 0 or batch == 0:
            return 0
        self._steps += 1
        a = self.acceptance
        bucket = max(1, batch).bit_length()
        if bucket not in self.target.points:
            self.k = 0  # measure a plain step at this batch size first
            return 0
        d = self.draft.estimate(batch)
        if a is None or d is None:
            self.k = min(2, self.k_max)  # nothing drafted yet: draft a little to learn
            self.exploring = True
            return self.k
        plain_rate = batch / self.step_seconds(batch, 0)
        best, best_rate = 0, plain_rate
        best_draft, best_draft_rate = 1, 0.0  # the best k > 0, what an exploration of drafting tries
        perfect_rate = 0.0  # the best k > 0 if every draft were accepted
        for k in range(1, self.k_max + 1):
            seconds = self.step_seconds(batch, k, d)
            rate = batch * self.expected_tokens(a, k) / seconds
            perfect_rate = max(perfect_rate, batch * (k + 1) / seconds)
            if rate > best_rate:
                best, best_rate = k, rate
            if rate > best_draft_rate:
                best_draft, best_draft_rate = k, rate
        side = self._side.get(bucket)
        if (best > 0 and not side and best_rate < self.switch_margin * plain_rate
                and bucket not in getattr(self.step_cost.get(best), "points", {})):
            best = 0  # from plain decoding (or nothing yet) to a k never measured at this batch size: only for a
            # clear gain (batch 4 greedy, starting from batch 2's drafting, drafted on 148 of 151 steps at 0.91x)
        if side is False and best > 0 and best_rate < self.hysteresis * plain_rate:
            # from plain decoding to drafting costs a catch-up of every sequence's drafter: near break-even stay
            # (batch 4 greedy, where fixed k = 2-3 runs at 0.95-1.0x, went back and forth on 203 steps at
            # 0.88x). The way back costs no catch-up and has no margin: a margin there kept batch 4 at
            # temperature 0.8 drafting on 188 of 203 steps at 0.84x.
            best = 0
        if side is not None and side != (best > 0):
            # a change of side outside explorations came from the estimates of one side only (the other's are
            # as old as its last use): look at the old side again soon, not after the interval it had earned
            # (batch 1 at temperature 0.8 held plain decoding for 426 of 1056 steps at 1.19x, against 1.30x)
            self._next_explore = min(self._next_explore, self._steps + self.explore_every)
        self._side[bucket] = best > 0
        if self._steps >= self._next_explore:  # keep both sides measured: the other choice, once
            # while the same side keeps winning, explore ever more rarely; a change of side starts over
            same = (best > 0) == (self._last_best > 0)
            self._interval = min(2 * self._interval, self.explore_max) if same else self.explore_every
            self._last_best = best
            self._next_explore = self._steps + self._interval
            self.exploring = best == 0
            if best > 0:  # plain decoding for 3 steps: the first after drafting pays the switch, the next two
                self._hold_plain = 2  # measure plain decoding (observe_step)
                best = 0
            elif batch <= self.explore_seqs:
                # every sequence drafts: the best k > 0 for 3 steps, so two steady ones measure the whole step
                # at this batch size (a single step pays the switch and is never counted; without a measured
                # k > 0 here, the tokens-per-step model alone decided: at batch 2 it held plain decoding at
                # 0.99x where drafting ran at 1.18x, bench/speculative.py)
                best = best_draft
                self._hold_draft = (2, best)
            elif perfect_rate >= self.switch_margin * plain_rate:
                best = 1  # a few sequences draft k = 1: it measures acceptance, not the cost of a whole step
            else:  # drafting would lose even if every draft were accepted: measuring acceptance cannot change
                self.exploring = False  # the choice, and the few sequences' catch-ups cost (batch 32 greedy ran
                # at 0.93x in a run with 6 exploring steps)
        self.k = best
        return best


# ---------------------------------------------------------------------------------------------------------
# the drafter


class LeanDraftForward:
    """A lean forward for draft passes of a few tokens per sequence on the CPU, where a tiny model's time is
    per-op overhead: functional calls on the draft model's own parameters (no module dispatch, no copies),
    RoPE as one matmul with a per-position rotation table, and every query token attending over its
    sequence's pages as its own batch row. Same math as `Transformer.forward` over the paged pool (logits
    agree to float rounding); plain Llama/Mistral float models only, others take the runner."""

    MAX_TABLE_BYTES = 64 << 20
    MAX_WEIGHT_BYTES = 256 << 20

    def __init__(self, model: torch.nn.Module, kv_view: torch.Tensor, block_size: int):
        """kv_view: the model's pool view ([pages, 2, layers, block, kv_heads, head_dim], `ModelRunner.kv_view`);
        the dense path (`_dense`) writes a new position's K/V of every layer in one copy through it."""
        cfg = model.config
        self.cfg, self.block_size = cfg, block_size
        self.kv_view = kv_view
        self.max_dense_seqs = 4  # draft passes of up to this many sequences take `_dense`
        self.k_caches = [kv_view[:, 0, i] for i in range(kv_view.shape[2])]
        self.v_caches = [kv_view[:, 1, i] for i in range(kv_view.shape[2])]
        # fused weights (one copy made at start-up; the draft model is tiny): q/k/v as one matmul, gate/up as
        # one, so a layer is 4 matmuls instead of 7 (each op costs ~5-20 us of dispatch on the CPU)
        def like(w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:  # the model's weight layout (model.py)
            return w if ref.is_contiguous() else w.t().contiguous().t()

        with torch.no_grad():
            self.layers = [(lay.input_layernorm.weight,
                            like(torch.cat([lay.self_attn.q_proj.weight, lay.self_attn.k_proj.weight,
                                            lay.self_attn.v_proj.weight]), lay.self_attn.q_proj.weight),
                            lay.self_attn.o_proj.weight, lay.post_attention_layernorm.weight,
                            like(torch.cat([lay.mlp.gate_proj.weight, lay.mlp.up_proj.weight]),
                                 lay.mlp.gate_proj.weight),
                            lay.mlp.down_proj.weight)
                           for lay in model.model.layers]
        # the dense path's copies, shaped for the fewest and cheapest ops (each op costs ~1-10 us of dispatch
        # here, more than its arithmetic): weights transposed for `torch.mm` (about twice as fast as
        # `F.linear` at one row), each RMSNorm weight and sqrt(hidden) folded into the matmul after it (the
        # norm is then x / sqrt(sum(x^2) + hidden * eps), under half of `F.rms_norm`'s cost at one row),
        # and 1/sqrt(head_dim) folded into the q rows (RoPE is linear: scaling q before it scales the scores)
        hq_rows, root = cfg.num_heads * cfg.head_dim, cfg.hidden_size ** 0.5
        with torch.no_grad():
            def fold(w: torch.Tensor, norm_w: torch.Tensor | None = None) -> torch.Tensor:
                w = w.float() if norm_w is None else w.float() * (norm_w.float() * root)[None, :]
                return w.t().contiguous().to(self.embed_dtype)

            self.embed_dtype = model.model.embed_tokens.weight.dtype
            self.single_layers = []
            for ln1, wqkv, wo_, ln2, wgu, wd in self.layers:
                w = wqkv.float().clone()
                w[:hq_rows] *= cfg.head_dim ** -0.5
                self.single_layers.append((fold(w, ln1), fold(wo_), fold(wgu, ln2), fold(wd)))
            self.single_head = fold(model.lm_head.weight, model.model.norm.weight)
            self.norm_eps = torch.full((1, 1), cfg.hidden_size * cfg.rms_norm_eps, dtype=self.embed_dtype,
                                       device=model.model.embed_tokens.weight.device)
        self.embed = model.model.embed_tokens.weight
        self.norm = model.model.norm.weight
        self.lm_head = model.lm_head.weight
        # x @ rot[t] == x * cos[t] + rotate_half(x) * sin[t] (HF's half-split RoPE) for x [.., head_dim]
        with torch.no_grad():
            cos, sin = model.rope(torch.arange(cfg.max_position_embeddings, device=self.embed.device),
                                  self.embed.dtype)
            h = cfg.head_dim // 2
            rot = torch.diag_embed(cos)
            idx = torch.arange(h, device=cos.device)
            rot[:, idx + h, idx] = -sin[:, :h]
            rot[:, idx, idx + h] = sin[:, h:]
        self.rot = rot

    @staticmethod
    def supported(model: torch.nn.Module, runner: object) -> bool:
        cfg = model.config
        caches = getattr(runner, "k_caches", None)
        if (caches is None or getattr(runner, "use_kernel", True) or cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias
                or cfg.qk_norm or getattr(cfg, "hidden_act", "silu") != "silu"):
            return False
        dtype = next(model.parameters()).dtype
        linears = [m for m in model.modules() if m.__class__.__name__.endswith("Linear")]
        if any(type(m) is not torch.nn.Linear for m in linears) or dtype not in (torch.float32, torch.bfloat16):
            return False  # quantised layers or an unusual dtype: the model's own forward knows them
        table = cfg.max_position_embeddings * cfg.head_dim * cfg.head_dim * torch.finfo(dtype).bits // 8
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        # for tiny drafts, where per-op dispatch dominates; it keeps fused copies of the layer weights
        return (caches[0].dtype == dtype and table <= LeanDraftForward.MAX_TABLE_BYTES
                and weights <= LeanDraftForward.MAX_WEIGHT_BYTES)

    @torch.inference_mode()
    def __call__(self, states: Seq[DraftState], num_new: Seq[int]) -> torch.Tensor:
        """Forward each state's next `num_new` tokens (K/V written into its pages); logits [S, V] of each
        state's last token."""
        if len(states) <= self.max_dense_seqs and max(num_new) <= 4:
            return self._dense(states, num_new)
        cfg, bs = self.cfg, self.block_size
        ids: list[int] = []
        pos: list[int] = []
        tables: list[list[int]] = []
        last: list[int] = []
        for s, n in zip(states, num_new):
            c = s.num_computed
            s.shadow_len = min(s.shadow_len, c)  # this path writes only the pages
            ids.extend(s.token_ids[c:c + n])
            pos.extend(range(c, c + n))
            tables.extend([s.pages] * n)
            last.append(len(ids) - 1)
        nb = max(pos) // bs + 1
        tables = [t[:nb] + [t[0]] * (nb - len(t)) for t in tables]  # pad with an own page (never foreign)
        dev = self.embed.device
        t = len(ids)
        pos_t = torch.tensor(pos, device=dev)
        table_t = torch.tensor(tables, device=dev)
        flat = table_t.view(-1)
        wp = table_t.gather(1, (pos_t // bs)[:, None])[:, 0]
        wo = pos_t % bs
        mask = (torch.arange(nb * bs, device=dev)[None, :] <= pos_t[:, None])[:, None, None, :]
        rot = self.rot[pos_t]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        x = self.embed[torch.tensor(ids, device=dev)]
        nq = hq + hkv
        for i, (ln1, wqkv, wo_, ln2, wgu, wd) in enumerate(self.layers):
            hs = F.rms_norm(x, (x.shape[-1],), ln1, eps)
            qkv = F.linear(hs, wqkv).view(t, nq + hkv, d)
            qk = torch.matmul(qkv[:, :nq], rot)  # RoPE on q and k heads at once
            q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, nq:]
            kc, vc = self.k_caches[i], self.v_caches[i]
            kc[wp, wo] = k
            vc[wp, wo] = v
            keys = kc.flatten(1).index_select(0, flat).view(t, nb * bs, hkv, d).transpose(1, 2)
            vals = vc.flatten(1).index_select(0, flat).view(t, nb * bs, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.reshape(t, hkv, hq // hkv, d), keys, vals, attn_mask=mask)
            x = x + F.linear(o.reshape(t, hq * d), wo_)
            x = self._mlp(x, ln2, wgu, wd)
        return self._logits(x[torch.tensor(last, device=dev)])

    def _mlp(self, x: torch.Tensor, ln2: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
        """The residual SwiGLU block of one layer (gate and up fused in `wgu`)."""
        ni = self.cfg.intermediate_size
        gu = F.linear(F.rms_norm(x, (x.shape[-1],), ln2, self.cfg.rms_norm_eps), wgu)
        return x + F.linear(F.silu(gu[:, :ni]) * gu[:, ni:], wd)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg.rms_norm_eps), self.lm_head).float()

    def _shadow(self, s: DraftState, length: int) -> list[torch.Tensor]:
        """The state's dense K/V copy ([2, layers, kv_heads, capacity, head_dim], per-layer K and V views),
        grown to hold `length` positions and filled from its pages where it is stale."""
        cfg, bs = self.cfg, self.block_size
        sh = s.shadow
        if sh is None or sh[0].shape[3] < length:
            cap = max(256, 1 << (length - 1).bit_length())
            new = torch.empty(2, cfg.num_layers, cfg.num_kv_heads, cap, cfg.head_dim,
                              dtype=self.embed.dtype, device=self.embed.device)
            if sh is not None and s.shadow_len:
                new[:, :, :, :s.shadow_len] = sh[0][:, :, :, :s.shadow_len]
            else:
                s.shadow_len = 0
            sh = s.shadow = [new] + [new[j, i] for i in range(cfg.num_layers) for j in (0, 1)]
        a, p0 = s.shadow_len, s.num_computed
        if a < p0:  # positions computed by the batched path (or the prefix cache): copy them in once
            b0, b1 = a // bs, (p0 - 1) // bs + 1
            pages = torch.tensor(s.pages[b0:b1], device=self.embed.device)
            got = self.kv_view.index_select(0, pages)  # [nb, 2, layers, bs, hkv, d]
            got = got.permute(1, 2, 4, 0, 3, 5).flatten(3, 4)  # [2, layers, hkv, nb * bs, d]
            sh[0][:, :, :, a:p0] = got[:, :, :, a - b0 * bs:p0 - b0 * bs]
            s.shadow_len = p0
        return sh

    def _unit(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight, over sqrt(hidden) (both folded into the next matmul)."""
        if x.shape[0] == 1:  # the sum of squares as one addmm: the fewest ops at one row
            return x * torch.addmm(self.norm_eps, x, x.t()).rsqrt_()
        return x * x.square().sum(-1, keepdim=True).add_(self.norm_eps).rsqrt_()

    def _dense(self, states: Seq[DraftState], num_new: Seq[int]) -> torch.Tensor:
        """The next n_i (1-4) tokens of each of a few sequences (a draft step at a small batch, the case
        speculation is for; n_i > 1 when the step's catch-up feeds the last draft and the bonus token). K/V
        live in a dense per-sequence copy (`DraftState.shadow`): each layer appends a sequence's new K/V there
        and attends over exactly its keys as two bmm's (a causal mask only among its new tokens), with no
        gather from the pages; the matmuls run over all sequences' rows at once. New positions go to the
        pages once per call (one copy per position for all layers). Logits [S, V] of each last token."""
        cfg, bs = self.cfg, self.block_size
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        g, nq = hq // hkv, hq + hkv
        dev = self.embed.device
        # per sequence: its dense copy's per-layer views, first new position, end, rows and causal mask
        seqs = []
        if len(states) == 1 and num_new[0] == 1:  # one token of one sequence: the fewest ops
            st = states[0]
            p0 = st.num_computed
            tok = st.token_ids[p0]
            x, rot = self.embed[tok:tok + 1], self.rot[p0]
            seqs.append((self._shadow(st, p0 + 1), p0, p0 + 1, 0, 1, None))
        else:
            ids: list[int] = []
            pos: list[int] = []
            for st, n in zip(states, num_new):
                p0, length = st.num_computed, st.num_computed + n
                mask = None
                if n > 1:  # query row r = token i (r // g) of head j: it sees keys up to position p0 + i
                    qpos = torch.arange(p0, length, device=dev).repeat_interleave(g)
                    mask = torch.arange(length, device=dev)[None, :] > qpos[:, None]
                seqs.append((self._shadow(st, length), p0, length, len(ids), n, mask))
                ids.extend(st.token_ids[p0:length])
                pos.extend(range(p0, length))
            x = self.embed[torch.tensor(ids, device=dev)]
            rot = self.rot[torch.tensor(pos, device=dev)] if len(states) > 1 else self.rot[pos[0]:pos[-1] + 1]
        t = x.shape[0]
        ni = cfg.intermediate_size
        for i, (wqkv, wo_, wgu, wd) in enumerate(self.single_layers):
            qkv = torch.mm(self._unit(x), wqkv).view(t, nq + hkv, d)
            qk = torch.matmul(qkv[:, :nq], rot)  # [t, nq, d] @ [d, d] or [t, d, d]; q is pre-scaled
            outs = []
            for sh, p0, length, r0, n, mask in seqs:
                kc, vc = sh[1 + 2 * i], sh[2 + 2 * i]  # [hkv, capacity, d]
                if n == 1:
                    kc[:, p0] = qk[r0, hq:]
                    vc[:, p0] = qkv[r0, nq:]
                else:
                    kc[:, p0:length] = qk[r0:r0 + n, hq:].transpose(0, 1)
                    vc[:, p0:length] = qkv[r0:r0 + n, nq:].transpose(0, 1)
                # per KV head: its n * g query rows (GQA without copying K/V); SDPA's dispatch costs more here
                q = qk[r0:r0 + n, :hq].reshape(n, hkv, g, d).transpose(0, 1).reshape(hkv, n * g, d)
                scores = torch.bmm(q, kc[:, :length].transpose(1, 2))
                if mask is not None:
                    scores.masked_fill_(mask, float("-inf"))
                o = torch.bmm(torch.softmax(scores, -1), vc[:, :length])  # [hkv, n * g, d]
                outs.append(o.view(hkv, n, g, d).transpose(0, 1).reshape(n, hq * d))
            x = x + torch.mm(outs[0] if len(outs) == 1 else torch.cat(outs), wo_)
            gu = torch.mm(self._unit(x), wgu)
            x = x + torch.mm(F.silu(gu[:, :ni]).mul_(gu[:, ni:]), wd)
        for st, (sh, p0, length, _, _, _) in zip(states, seqs):
            for p in range(p0, length):  # the pool keeps the draft KV too (prefix cache, the batched path)
                self.kv_view[st.pages[p // bs], :, :, p % bs] = sh[0][:, :, :, p]
            st.shadow_len = length
        last = [r0 + n - 1 for _, _, _, r0, n, _ in seqs]
        x = x[-1:] if len(last) == 1 else x[torch.tensor(last, device=dev)]
        return torch.mm(self._unit(x), self.single_head).float()


class DraftState:
    """The drafter's view of one sequence, shaped like a `Sequence` for the runner: its own token list
    (a prefix of the sequence's, then this step's drafts) and its own pages in the small model's geometry."""

    __slots__ = ("token_ids", "pages", "num_computed", "block_hashes", "spec_token_ids", "shadow", "shadow_len")

    def __init__(self, token_ids: list[int], pages: list[int], num_computed: int, block_hashes: list[int]):
        self.token_ids = token_ids
        self.pages = pages
        self.num_computed = num_computed
        self.block_hashes = block_hashes
        self.spec_token_ids: list[int] = []  # the runner's field: a draft state never verifies anything
        # the dense draft path's K/V copy (LeanDraftForward._shadow) and how many positions of it
        # hold this state's current tokens; the batched paths write only the pages, so they lower it
        self.shadow: list[torch.Tensor] | None = None
        self.shadow_len = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _plain_params(p: SamplingParams, vocab: int) -> bool:
    """Sampling by temperature alone: the draft distribution is softmax(logits / T) (or the argmax)."""
    return (p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty
            and not p.min_tokens and not 0 < p.top_k < vocab and p.top_p >= 1.0 and p.min_p <= 0.0)


class Drafter:
    """Runs the small engine's model (the same weights object and runner) over draft KV kept in the shared
    pool under the small model's id, so the small engine's cached prompt blocks serve as draft KV."""

    def __init__(self, engine: ModelEngine):
        self.engine = engine
        self.runner = engine.runner
        self.pool = engine.pool
        self.model_id = engine.model_id
        self.block_size = engine.pool.block_size
        self.lean = (LeanDraftForward(engine.model, engine.runner.kv_view, self.block_size)
                     if LeanDraftForward.supported(engine.model, engine.runner) else None)
        self.num_prefix_hit_tokens = 0  # draft KV found in the prefix cache (e.g. the small engine's prompts)
        self.caught_up = False  # the latest `draft` first computed a sequence's missed tokens (not a steady step)

    def release(self, seq: Sequence) -> None:
        ds = seq.draft_state
        if ds is not None:
            self.pool.release(ds.pages)
            seq.draft_state = None

    def _state(self, seq: Sequence) -> DraftState:
        ds = seq.draft_state
        if ds is None:
            pages, hashes = self.pool.match_prefix(self.model_id, seq.token_ids)
            self.pool.acquire(pages)
            self.num_prefix_hit_tokens += len(pages) * self.block_size
            ds = DraftState(list(seq.token_ids), pages, len(pages) * self.block_size, hashes)
            seq.draft_state = ds
        else:  # catch up with the tokens appended since (its list is always a prefix of the sequence's)
            ds.token_ids.extend(seq.token_ids[len(ds.token_ids):])
        return ds

    def reserve(self, seq: Sequence, k: int, spare_pages: int) -> DraftState | None:
        """The state with pages for k drafts (positions up to num_tokens + k - 2), or None if the pool
        cannot spare them without starving the engines (`spare_pages` stay free)."""
        ds = self._state(seq)
        need = -(-(ds.num_tokens + k - 1) // self.block_size) - len(ds.pages)
        if need > 0:
            if need + spare_pages > self.pool.num_free:
                return None
            ds.pages.extend(self.pool.allocate(self.model_id, need))
        return ds

    def rollback(self, ds: DraftState, num_valid: int) -> None:
        """Keep the first `num_valid` tokens (verified: the sequence has them too); hash their full blocks."""
        del ds.token_ids[num_valid:]
        ds.num_computed = min(ds.num_computed, num_valid)
        ds.shadow_len = min(ds.shadow_len, ds.num_computed)
        bs = self.block_size
        parent = ds.block_hashes[-1] if ds.block_hashes else None
        for i in range(len(ds.block_hashes), ds.num_computed // bs):
            parent = self.pool.commit_block(self.model_id, ds.pages[i], parent,
                                            tuple(ds.token_ids[i * bs:(i + 1) * bs]))
            ds.block_hashes.append(parent)

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence], states: list[DraftState], ks: list[int],
              stop_ids: list[set[int]], cost: CostModel) -> list[torch.Tensor | None]:
        """k_i tokens for sequence i, sampled from the draft's processed distribution q (greedy rows take
        its argmax). Appends them to `seq.spec_token_ids` and the state; returns q rows [k_i, V] per
        sequence (None: deterministic drafts, q is one-hot)."""
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        # more than the last draft and the bonus token to compute first: a prompt or tokens missed
        self.caught_up = max(s.num_tokens - s.num_computed for s in states) > 2
        while active:
            t0 = cost.clock()
            act_states = [states[i] for i in active]
            num_new = [s.num_tokens - s.num_computed for s in act_states]
            decode_like = sum(num_new) <= 2 * len(num_new)
            if self.lean is not None and sum(num_new) <= 4 * len(num_new):  # few tokens each: the lean forward
                logits = self.lean(act_states, num_new)
            else:  # catch-up (a prompt, or many tokens since the last draft): the runner's varlen prefill
                for s in act_states:  # it writes only the pages: the dense path's copy is stale there
                    s.shadow_len = min(s.shadow_len, s.num_computed)
                logits, _ = self.runner.execute_batch(act_states, num_new)
            for s, n in zip(act_states, num_new):
                s.num_computed += n
            if len(active) == 1 and _plain_params(seqs[active[0]].request.params, logits.shape[1]):
                # one sequence, temperature only (no penalties, bans or top-k/p/min-p): the same q, few ops
                seq = seqs[active[0]]
                prm = seq.request.params
                probs = None if prm.greedy else torch.softmax(logits / prm.temperature, -1)
                tokens = logits.argmax(-1) if probs is None else draw(probs, [seq.generator])
                is_greedy = [prm.greedy]
            else:
                rows = [sampler_row(seqs[i], seqs[i].spec_token_ids) for i in active]
                is_greedy = [r.params.greedy for r in rows]
                penalised, random_rows, x = processed_logits(logits, rows, [stop_ids[i] for i in active])
                tokens = penalised.argmax(-1)
                probs = None
                if random_rows:  # draw only the sampling rows: a greedy row has no distribution to draw from
                    probs = x.softmax(-1)
                    sampled = draw(probs, [seqs[active[j]].generator for j in random_rows])
                    if len(random_rows) == len(active):
                        tokens = sampled
                    else:
                        tokens[torch.tensor(random_rows, device=tokens.device)] = sampled
                    probs = dict(zip(random_rows, probs))  # q rows by position in `active`
            token_list = tokens.tolist()
            still = []
            for j, i in enumerate(active):
                seqs[i].spec_token_ids.append(token_list[j])
                states[i].token_ids.append(token_list[j])
                if not is_greedy[j]:
                    qs[i].append(probs[j])
                if len(seqs[i].spec_token_ids) < ks[i]:
                    still.append(i)
            if decode_like:  # a catch-up pass (a prompt, tokens since the last draft) is not a draft step's cost
                cost.observe(len(active), cost.clock() - t0)
            active = still
        return [torch.stack(q) if q else None for q in qs]


# ---------------------------------------------------------------------------------------------------------
# the engine's speculative decoder


@dataclass
class _Window:
    seq: Sequence
    drafts: list[int]
    q: torch.Tensor | None  # [k, V] or None (one-hot: supplied or greedy drafts)
    drafted: bool  # by the drafter (counts toward its measured acceptance), not supplied
    base: int  # the sequence's length when drafted: the draft state's tokens past it are unverified


def _stop_ids(engine: ModelEngine, seq: Sequence) -> set[int]:
    """The ids min_tokens bans, as the engine hands them to the sampler."""
    p = seq.request.params
    return engine.eos_token_ids | set(p.stop_token_ids) if p.min_tokens else set()


class SpeculativeDecoder:
    """Per target engine: `propose()` before scheduling sets `Sequence.spec_token_ids` (supplied drafts
    first, then the drafter's k), `verify()` after the forward turns the k + 1 logits rows of each such
    sequence into accepted tokens, commits their K/V and rolls the rest back."""

    def __init__(self, engine: ModelEngine, drafter: Drafter | None, k_max: int):
        self.engine = engine
        self.drafter = drafter
        self.k_max = k_max if drafter is not None else 0
        self.adaptive = AdaptiveK(self.k_max, device=engine.device)
        self.supplied: set[Sequence] = set()  # sequences with supplied drafts left (engine thread only)
        self._windows: dict[int, _Window] = {}
        self.num_drafts = 0  # verification windows
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.num_emitted_tokens = 0  # tokens the windows produced (accepted + the recovered/bonus one)
        if drafter is not None:
            engine.scheduler.on_free = self._on_free

    def _on_free(self, seq: Sequence) -> None:
        self.drafter.release(seq)

    # ---- before scheduling ----------------------------------------------------------------------------------
    def propose(self) -> None:
        self._drop_unverified()
        if self.supplied:
            self._propose_supplied()
        if self.drafter is None:
            return
        seqs = [s for s in self.engine.scheduler.running
                if not s.spec_token_ids and s.num_tokens - s.num_computed == 1 and s.num_tokens < s.max_len
                and s.request.params.speculative is not False]
        if not seqs:
            return
        k = self.adaptive.choose(len(seqs))
        # exploring is a measurement, not a bet: a few sequences draft (their draft KV may lag far behind)
        num_k = EXPLORE_SEQS if self.adaptive.exploring else len(seqs)
        chosen, states, ks = [], [], []
        spare = len(self.engine.scheduler.running) + 1
        for i, s in enumerate(seqs):
            p = s.request.params
            # a seeded sampling row always drafts k_max so its random draws do not depend on timing or batch
            k_s = self.k_max if s.generator is not None and not p.greedy else (k if i < num_k else 0)
            k_s = min(k_s, s.max_len - s.num_tokens)
            if k_s <= 0:
                continue
            ds = self.drafter.reserve(s, k_s, spare)
            if ds is None:
                continue
            chosen.append(s)
            states.append(ds)
            ks.append(k_s)
        if not chosen:
            return
        stop_ids = [_stop_ids(self.engine, s) for s in chosen]
        try:
            qs = self.drafter.draft(chosen, states, ks, stop_ids, self.adaptive.draft)
        except Exception as e:  # a drafter failure fails the sequences it was drafting for, nothing else
            log.exception("engine %s: drafting failed", self.engine.name)
            for req in {id(s.request): s.request for s in chosen}.values():
                self.engine._fail(req, f"engine error while drafting: {type(e).__name__}: {e}")
            return
        if self.drafter.caught_up:  # this step's cost includes a catch-up: no measure of a drafting step
            self.adaptive.unsteady()
        for s, q in zip(chosen, qs):
            self._windows[s.seq_id] = _Window(s, list(s.spec_token_ids), q, True, s.num_tokens)

    def _drop_unverified(self) -> None:
        """Drafts of the previous step that were not verified (trimmed by the budget, preempted, finished) go
        away; the sequence may have advanced by a plain token, so the draft state keeps only what it had."""
        for w in self._windows.values():
            seq = w.seq
            seq.spec_token_ids.clear()
            ds = seq.draft_state
            if ds is not None and ds.num_tokens > w.base:
                self.drafter.rollback(ds, w.base)
        self._windows.clear()

    def _propose_supplied(self) -> None:
        for seq in list(self.supplied):
            sup = seq.supplied_draft_ids
            out = seq.num_output_tokens
            if seq.finished or out >= len(sup) or seq.token_ids[seq.prompt_len:] != sup[:out]:
                self.supplied.discard(seq)  # done, or the output left the supplied path
                seq.supplied_draft_ids = []
                continue
            # the scheduler attaches them once the sequence's chunk reaches its last known token
            seq.spec_token_ids = sup[out:out + SUPPLIED_CHUNK]
            self._windows[seq.seq_id] = _Window(seq, list(seq.spec_token_ids), None, False, seq.num_tokens)

    # ---- after the forward ----------------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, batch: StepBatch, num_draft_tokens: dict[int, int]) -> None:
        """Accept/reject every verifying sequence's drafts, append the tokens; plain rows go to the sampler."""
        eng = self.engine
        plain_rows, plain_seqs, spec = [], [], []
        row = 0
        for seq, n in zip(batch.sample_seqs, batch.rows_per_seq):
            if n == 1:
                plain_rows.append(row)
                plain_seqs.append(seq)
            else:
                spec.append((seq, row, n - 1))
            row += n
        if plain_seqs:
            eng._sample_and_append(logits[plain_rows] if len(plain_rows) < logits.shape[0] else logits, plain_seqs)
        if not spec:
            return
        try:
            results = self._accept(logits, spec)
        except Exception as e:
            log.exception("engine %s: verification failed", eng.name)
            for req in {id(s.request): s.request for s, _, _ in spec}.values():
                eng._fail(req, f"engine error during verification: {type(e).__name__}: {e}")
            return
        touched = {}
        now = time.monotonic()
        for (seq, start, k), (tokens, num_acc) in zip(spec, results):
            req = seq.request
            if req.error is not None or seq.finished:
                continue
            w = self._windows.pop(seq.seq_id, None)  # verified: not for _drop_unverified
            self._record(k, num_acc, w is not None and w.drafted)
            if req.metrics is not None:  # per request, for the decode span and escalation accounting
                req.metrics.num_draft_tokens += k
                req.metrics.num_accepted_tokens += num_acc
            seq.spec_token_ids.clear()
            base = seq.num_tokens
            lp_rows = (torch.log_softmax(logits[start:start + len(tokens)], -1)
                       if req.params.logprobs is not None else None)
            try:
                for j, tok in enumerate(tokens):
                    lp, pos_lp = self._logprobs(lp_rows, j, tok, req.params.logprobs)
                    eng._append_token(seq, tok, lp, pos_lp)
                    eng.num_generated_tokens += 1
                    if seq.finished:
                        break
                    if j < num_acc:  # an accepted draft: its K/V from this pass is now valid
                        eng.scheduler.commit_computed(seq, 1)
            except Exception as e:
                log.exception("engine %s: request %s failed", eng.name, req.request_id)
                eng._fail(req, f"engine error: {type(e).__name__}: {e}")
                continue
            ds = seq.draft_state
            if ds is not None and not seq.finished:
                self.drafter.rollback(ds, base + num_acc)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            touched[id(req)] = req
        for req in touched.values():
            if req.error is None:
                eng._emit(req, final=req.finished)

    def _accept(self, logits: torch.Tensor, spec: list[tuple[Sequence, int, int]]
                ) -> list[tuple[list[int], int]]:
        """(tokens to append, number of accepted drafts) per verifying sequence."""
        rows, stop_ids, windows = [], [], []
        for seq, _, k in spec:
            w = self._windows.get(seq.seq_id)
            drafts = seq.spec_token_ids[:k] if w is None else w.drafts[:k]
            q = None if w is None or w.q is None else w.q[:k]
            windows.append((drafts, q))
            stop = _stop_ids(self.engine, seq)
            for j in range(k + 1):
                rows.append(sampler_row(seq, drafts[:j]))
                stop_ids.append(stop)
        index = torch.tensor([start + j for _, start, k in spec for j in range(k + 1)], device=logits.device)
        greedy, probs = processed_distributions(logits[index], rows, stop_ids)
        greedy_l = greedy.tolist()
        results: list[tuple[list[int], int] | None] = [None] * len(spec)
        random_idx = []
        offset = 0
        for i, ((seq, _, k), (drafts, _q)) in enumerate(zip(spec, windows)):
            if seq.request.params.greedy:  # exact: keep drafts while they equal the target's argmax
                target = greedy_l[offset:offset + k + 1]
                acc = 0
                while acc < k and drafts[acc] == target[acc]:
                    acc += 1
                results[i] = (drafts[:acc] + [target[acc]], acc)
            else:
                random_idx.append((i, offset))
            offset += k + 1
        if random_idx:
            results_r = self._rejection(probs, spec, windows, random_idx)
            for (i, _), r in zip(random_idx, results_r):
                results[i] = r
        return results

    def _rejection(self, probs: torch.Tensor, spec, windows, random_idx) -> list[tuple[list[int], int]]:
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
            # uniforms: a seeded sequence draws from its own generator, so batching never changes its draws
            u = torch.rand(b, k + 1, device=dev)
            for j, (i, _) in enumerate(group):
                gen = spec[i][0].generator
                if gen is not None:
                    u[j] = torch.rand(k + 1, generator=gen, device=dev)
            if b == 1 and not p.is_cuda:  # batch 1 on the CPU: the same test and draw in a few ops
                results[group[0][0]] = self._rejection_one(draft_ids[0], q, p[0], u[0])
                continue
            tokens, num_acc = rejection_sample(draft_ids, q, p, u[:, :k].contiguous(), u[:, k].contiguous())
            for (i, _), toks, acc in zip(group, tokens.tolist(), num_acc.tolist()):
                results[i] = (toks[:acc + 1], acc)
        return [results[i] for i, _ in random_idx]

    @staticmethod
    def _rejection_one(draft_ids: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, u: torch.Tensor
                       ) -> tuple[list[int], int]:
        """`rejection_sample_batched` for one row (same uniforms, same result): accept draft j while
        u_j * q(x_j) < p(x_j); then draw from max(0, p - q) at the first rejection (p after all k: the
        bonus) by inverse CDF with the last uniform."""
        k = draft_ids.shape[0]
        pos = torch.arange(k, device=p.device)
        p_d = p[pos, draft_ids].tolist()
        q_d = q[0, pos, draft_ids].tolist() if q is not None else [1.0] * k
        u_l = u.tolist()
        drafts = draft_ids.tolist()
        acc = 0
        while acc < k and u_l[acc] * q_d[acc] < p_d[acc]:
            acc += 1
        if acc == k:
            r = p[k]
        elif q is not None:
            r = (p[acc] - q[0, acc]).clamp_min_(0.0)
        else:
            r = p[acc].clone()
            r[drafts[acc]] = 0.0
        cdf = r.cumsum(0)
        token = int(torch.searchsorted(cdf, cdf[-1:] * u_l[k], right=True))
        if token >= r.shape[0] or not r[token] > 0:  # rounding at the top end: the last live token
            token = int(torch.nonzero(r)[-1]) if bool((r > 0).any()) else 0
        return drafts[:acc] + [token], acc

    @staticmethod
    def _logprobs(lp_rows: torch.Tensor | None, j: int, token: int, k: int | None
                  ) -> tuple[float | None, PositionLogprobs | None]:
        """The target's raw logprob of `token` at window position j, plus its top k (as the sampler reports)."""
        if lp_rows is None:
            return None, None
        row = lp_rows[j]
        chosen = float(row[token])
        d: PositionLogprobs = {token: Logprob(chosen, int((row > chosen).sum()) + 1)}
        if k:
            top = row.topk(k)
            for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                if t not in d:
                    d[t] = Logprob(v, r + 1)
        return chosen, d

    def _record(self, k: int, num_acc: int, drafted: bool) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_acc
        self.num_emitted_tokens += num_acc + 1
        if len(self.accepted_per_position) < k:
            self.accepted_per_position.extend([0] * (k - len(self.accepted_per_position)))
        for j in range(num_acc):
            self.accepted_per_position[j] += 1
        if drafted:
            self.adaptive.observe_window(k, num_acc)

    def stats(self) -> dict:
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_position": list(self.accepted_per_position),
                "spec_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                         if self.num_draft_tokens else 0.0),
                "spec_mean_accepted_length": (self.num_emitted_tokens / self.num_drafts
                                              if self.num_drafts else 0.0),
                "spec_k": self.adaptive.k if self.drafter is not None else 0,
                "spec_draft_prefix_hit_tokens": self.drafter.num_prefix_hit_tokens if self.drafter else 0,
                "spec_k_max": self.k_max}
