"""The attention seam: the model computes q/k/v and RoPE; an `AttentionContext` stores K/V and attends.

Every context sees one flattened variable-length batch (no padding). `VarlenCausal` needs no cache (training,
scoring); `ContiguousCache` keeps per-sequence caches for simple generation; the engine's paged KV pool
implements the same `forward(layer, q, k, v)` contract.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionContext(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (RoPE applied). Returns [T, Hq, D]."""
        ...


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


class DenseCausal:
    """A dense [B, S] batch of equal-length sequences (training): tokens flattened as B*S."""

    def __init__(self, batch: int, seqlen: int):
        self.batch, self.seqlen = batch, seqlen

    def forward(self, layer: int, q, k, v):
        b, s = self.batch, self.seqlen
        q = q.view(b, s, q.shape[1], q.shape[2]).transpose(1, 2)
        k = k.view(b, s, k.shape[1], k.shape[2]).transpose(1, 2)
        v = v.view(b, s, v.shape[1], v.shape[2]).transpose(1, 2)
        if q.shape[1] != k.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b * s, q.shape[1], q.shape[3])


class VarlenCausal:
    """Several sequences of different lengths concatenated, each attending causally to itself only."""

    def __init__(self, seq_lens: list[int]):
        self.seq_lens = list(seq_lens)

    def forward(self, layer: int, q, k, v):
        outs, start = [], 0
        for n in self.seq_lens:
            qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
            outs.append(_sdpa_gqa(qs, ks, vs, causal_offset=0).transpose(0, 1))
            start += n
        return torch.cat(outs, dim=0)


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

    def forward(self, layer: int, q, k, v):
        outs, start = [], 0
        for sid, n in self._new:
            pos = self.lens[sid]
            self.k[layer, sid, :, pos:pos + n] = k[start:start + n].transpose(0, 1)
            self.v[layer, sid, :, pos:pos + n] = v[start:start + n].transpose(0, 1)
            ks = self.k[layer, sid, :, :pos + n]
            vs = self.v[layer, sid, :, :pos + n]
            outs.append(_sdpa_gqa(q[start:start + n].transpose(0, 1), ks, vs, causal_offset=pos).transpose(0, 1))
            start += n
        return torch.cat(outs, dim=0)
