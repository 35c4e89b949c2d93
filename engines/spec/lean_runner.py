"""The CPU draft runner for tiny draft models: the runner's contract (`execute(seqs, num_tokens)` -> logits of
each sequence's last token) over the draft model's pool view, built for per-op overhead instead of FLOPs."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F

from engines.spec.state import DraftState


class LeanDraftRunner:
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
                or cfg.qk_norm or getattr(cfg, "hidden_act", "silu") != "silu" or not cfg.traits.plain):
            return False
        dtype = next(model.parameters()).dtype
        from kernels.cpu_kernels import PackedLinear

        linears = [m for m in model.modules() if m.__class__.__name__.endswith("Linear")]
        # (a PackedLinear is float32 in panels, read here through its unpacked `weight`)
        if (any(type(m) not in (torch.nn.Linear, PackedLinear) for m in linears)
                or dtype not in (torch.float32, torch.bfloat16)):
            return False  # quantised layers or an unusual dtype: the model's own forward knows them
        table = cfg.max_position_embeddings * cfg.head_dim * cfg.head_dim * torch.finfo(dtype).bits // 8
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        # for tiny drafts, where per-op dispatch dominates; it keeps fused copies of the layer weights
        return (caches[0].dtype == dtype and table <= LeanDraftRunner.MAX_TABLE_BYTES
                and weights <= LeanDraftRunner.MAX_WEIGHT_BYTES)

    @torch.inference_mode()
    def execute(self, states: Seq[DraftState], num_new: Seq[int]) -> tuple[torch.Tensor, None]:
        """Forward each state's next `num_new` tokens (K/V written into its pages); logits [S, V] of each
        state's last token (every draft row samples, so no batch layout comes back)."""
        if len(states) <= self.max_dense_seqs and max(num_new) <= 4:
            return self._dense(states, num_new), None
        return self._paged(states, num_new), None

    def _paged(self, states: Seq[DraftState], num_new: Seq[int]) -> torch.Tensor:
        """Every query token attends over its sequence's pages as its own batch row (any batch size)."""
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
