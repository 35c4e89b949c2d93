"""The engine's configuration: one `EngineSpec` per model and one `PoolSpec` for the shared KV pool."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.model import Transformer


@dataclass
class EngineSpec:
    name: str
    model: str | Path | Transformer  # a checkpoint folder, or a built Transformer (token-id prompts only)
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    draft: str | None = None
    num_speculative_tokens: int = 0
    quantization: str = "none"  # none | int8 | int4: weight-only, applied at load (lm_head, embeddings stay float)
    attention_backend: str = "auto"
    quantization_group_size: int = 64  # int4 only: 32, 64 or 128
    cuda_graphs: bool = True  # CUDA + Triton attention: decode steps replay graphs captured per batch bucket
    # waiting requests by priority then TTFT deadline, batch caps from the running TPOT targets; False: plain
    # (priority, arrival) order under the configured limits only
    slo_scheduling: bool = True
    # seconds of TTFT deadline one priority class is worth (waiting_queue.py): small is close to earliest-
    # deadline-first, which meets the most deadlines when admission keeps them feasible; large starves lower
    # classes for that long under sustained load
    priority_aging_s: float = 30.0
    # a waiting request past its TTFT deadline (before any token) ends with ErrorCode.TTFT_EXPIRED instead of being
    # served late: it can no longer count as goodput, and serving it delays requests that still can
    drop_expired_requests: bool = False


@dataclass
class PoolSpec:
    memory_bytes: int | None = None  # None: memory_fraction of free device memory (CUDA) or a sized default (CPU)
    memory_fraction: float = 0.9
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto: each model's own dtype; float32 | bfloat16 | float16 | int8 | fp8
