"""`PagedKVAttention`: the model's attention seam (`forward(layer, q, k, v)`) over per-layer paged KV caches,
backed by `write_kv` + `paged_attention` ("triton") or by their PyTorch references ("torch"), with an
optional int8 / fp8 KV cache. One object describes one flattened varlen step; build a new one per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.kv_write import write_kv, write_kv_ref
from kernels.paged_attention import paged_attention, paged_attention_ref

BACKENDS = ("triton", "torch")


def resolve_backend(name: str, device: torch.device | str) -> str:
    """"auto" -> "triton" on CUDA, "torch" elsewhere; "triton" on the CPU means the Triton interpreter."""
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto', 'triton' or 'torch', got {name!r}")
    return name


class PagedKVAttention:
    """Attention over k_caches[layer] / v_caches[layer] [num_blocks, block_size, Hkv, D] for one step.

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

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.k_caches[layer], self.v_caches[layer]
        ks = self.k_scales[layer] if self.k_scales is not None else None
        vs = self.v_scales[layer] if self.v_scales is not None else None
        triton = self.backend == "triton"
        (write_kv if triton else write_kv_ref)(k, v, kc, vc, self.slot_mapping, k_scale=ks, v_scale=vs)
        attend = paged_attention if triton else paged_attention_ref
        return attend(q, kc, vc, self.block_tables, self.query_start_loc, self.context_lens,
                      max_query_len=self.max_query_len, max_context_len=self.max_context_len, scale=self.scale,
                      k_scale=ks, v_scale=vs, num_splits=self.num_splits)
