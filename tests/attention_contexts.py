"""Attention contexts only tests and benchmarks use, beside the serving ones in engines/attention.py (and
`VarlenCausal`, several sequences with no cache, from engines/embedding.py): `ContiguousCache` (per-sequence contiguous caches for simple
generation) and `PagedKVAttention` (the kernels' context over raw paged tensors)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engines.attention import attend_masked, needs_mask, paged_masked, resolve_backend
from engines.embedding import VarlenCausal  # noqa: F401  (the embedding forward's context, for tests)


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal_offset: int | None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Hq, Sq, D], k/v: [Hkv, Sk, D]. Queries sit at the last Sq of the Sk positions when causal."""
    hq, hkv = q.shape[0], k.shape[0]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=0)
        v = v.repeat_interleave(hq // hkv, dim=0)
    if mask is None and causal_offset is not None:
        sq, sk = q.shape[1], k.shape[1]
        if sq == sk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if sq == 1:
            return F.scaled_dot_product_attention(q, k, v)
        qpos = torch.arange(sk - sq, sk, device=q.device)[:, None]
        mask = torch.arange(sk, device=q.device)[None, :] <= qpos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class ContiguousCache:
    """Per-sequence contiguous K/V caches for simple generation (`tandem generate`, tests).

    `begin(seq_lens)` declares how many new tokens each sequence contributes this forward pass; the cache
    appends them and the new queries attend to everything cached so far.
    """

    def __init__(self, num_layers: int, num_seqs: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_seqs, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = [0] * num_seqs
        self.max_len = max_len
        self._new: list[tuple[int, int]] = []

    def begin(self, new_tokens: list[int], seq_ids: list[int] | None = None) -> None:
        seq_ids = list(range(len(new_tokens))) if seq_ids is None else seq_ids
        self._new = list(zip(seq_ids, new_tokens))
        for sid, n in self._new:
            if self.lens[sid] + n > self.max_len:
                raise ValueError(f"sequence {sid} exceeds the cache length {self.max_len}")

    def end(self) -> None:
        for sid, n in self._new:
            self.lens[sid] += n
        self._new = []

    def forward(self, layer: int, q, k, v, *, window: int | None = None, softcap: float | None = None):
        outs, start = [], 0
        for sid, n in self._new:
            pos = self.lens[sid]
            self.k[layer, sid, :, pos:pos + n] = k[start:start + n].transpose(0, 1)
            self.v[layer, sid, :, pos:pos + n] = v[start:start + n].transpose(0, 1)
            ks = self.k[layer, sid, :, :pos + n]
            vs = self.v[layer, sid, :, :pos + n]
            if needs_mask(window, softcap, pos + n):
                outs.append(attend_masked(q[start:start + n], ks.transpose(0, 1), vs.transpose(0, 1), pos,
                                          window=window, softcap=softcap))
                start += n
                continue
            outs.append(_sdpa_gqa(q[start:start + n].transpose(0, 1), ks, vs, causal_offset=pos).transpose(0, 1))
            start += n
        return torch.cat(outs, dim=0)


class PagedKVAttention:
    """The kernels' context: attention over k_caches[layer] / v_caches[layer] [num_blocks, block_size, Hkv, D]
    for one step described by raw tensors, through `write_kv` + `paged_attention` ("triton") or their PyTorch
    references in kernels/ ("torch"); the kernels' tests drive the model through it.

    block_tables [B, max_blocks] int32, query_start_loc [B+1] int32, context_lens [B] int32 (keys after
    this step), slot_mapping [T] int64 (-1 = do not store). k_scales/v_scales: per-layer
    [num_blocks, block_size, Hkv] float32 for int8 caches, 1-element tensors for fp8 ones.
    `max_query_len`/`max_context_len` are host ints, so a step never synchronises with the device.
    """

    def __init__(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                 block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                 slot_mapping: torch.Tensor, *, max_query_len: int, max_context_len: int, backend: str = "triton",
                 k_scales: Sequence[torch.Tensor] | None = None, v_scales: Sequence[torch.Tensor] | None = None,
                 num_splits: int | None = None, scale: float | None = None):
        self.k_caches, self.v_caches = k_caches, v_caches
        self.block_tables, self.query_start_loc, self.context_lens = block_tables, query_start_loc, context_lens
        self.slot_mapping = slot_mapping
        self.max_query_len, self.max_context_len = max_query_len, max_context_len
        self.backend = resolve_backend(backend, block_tables.device)
        self.k_scales, self.v_scales = k_scales, v_scales
        self.num_splits, self.scale = num_splits, scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        kc, vc = self.k_caches[layer], self.v_caches[layer]
        ks = self.k_scales[layer] if self.k_scales is not None else None
        vs = self.v_scales[layer] if self.v_scales is not None else None
        if needs_mask(window, softcap, self.max_context_len):
            from kernels.kv_write import write_kv_ref

            write_kv_ref(k, v, kc, vc, self.slot_mapping, k_scale=ks, v_scale=vs)
            return paged_masked(q, kc, vc, ks, vs, self.block_tables, self.query_start_loc, self.context_lens,
                                 window, softcap)
        if self.backend == "triton":
            from kernels.kv_write import write_kv as write
            from kernels.paged_attention import paged_attention as attend
        else:
            from kernels.kv_write import write_kv_ref as write
            from kernels.paged_attention import paged_attention_ref as attend
        write(k, v, kc, vc, self.slot_mapping, k_scale=ks, v_scale=vs)
        return attend(q, kc, vc, self.block_tables, self.query_start_loc, self.context_lens,
                      max_query_len=self.max_query_len, max_context_len=self.max_context_len, scale=self.scale,
                      k_scale=ks, v_scale=vs, num_splits=self.num_splits)
