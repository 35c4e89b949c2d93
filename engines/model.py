"""One Transformer for the Llama family (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Parameter names follow Hugging Face's so a checkpoint's state dict loads one-to-one. The model runs one
flattened variable-length batch: tokens [T], positions [T], and an `AttentionContext` that owns the KV.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engines.attention import AttentionContext, DenseCausal
from engines.model_config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs is None or rs["rope_type"] == "dynamic":
        # dynamic NTK equals the default rope inside the original context, which is all we serve
        return inv_freq
    if rs["rope_type"] == "linear":
        return inv_freq / float(rs["factor"])
    # llama3: low frequencies scaled by `factor`, high ones kept, a smooth blend between
    factor = float(rs["factor"])
    low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
    old_len = float(rs.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D] (the half-split "rotate_half" convention of HF Llama)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def cpu_weight_layout(model: nn.Module) -> nn.Module:
    """On the CPU, store each float32 `nn.Linear` weight column-major (an [in, out] contiguous tensor seen as
    [out, in]): `F.linear` then takes the GEMM's no-transpose path, 1.26-1.86x faster per op at the tiny
    models' shapes except the one-row logits head (0.95x); plain decoding 0.97x at batch 1, 1.06-1.12x at
    batch 8-32 (bench/cpu_layout.py). Values, shapes and tied parameters stay as they are; only strides
    change."""
    seen: set[int] = set()
    with torch.no_grad():
        for m in model.modules():
            w = getattr(m, "weight", None)
            if (type(m) is nn.Linear and w is not None and w.device.type == "cpu" and w.dtype == torch.float32
                    and id(w) not in seen and w.is_contiguous()):
                seen.add(id(w))
                w.data = w.data.t().contiguous().t()
        for m in model.modules():
            if isinstance(m, Attention):
                m.fused = _fuse_columns([m.q_proj, m.k_proj, m.v_proj])
                if m.fused is not None:
                    from kernels.cpu_kernels import available, rope_

                    m.rope_kernel = rope_ if available() else None
            elif isinstance(m, MLP):
                m.fused = _fuse_columns([m.gate_proj, m.up_proj])
    return model


def _fuse_columns(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """One [in, sum(out)] weight for Linears that read the same input (q/k/v, gate/up): each Linear's weight
    becomes a view into it (values, shapes and the state dict unchanged), and the forward runs one matmul
    instead of several (each costs ~10-20 us of dispatch at decode sizes). None unless all are plain float32
    CPU Linears stored column-major."""
    ws = [lin.weight for lin in linears]
    if not all(type(lin) is nn.Linear for lin in linears) or any(
            w.device.type != "cpu" or w.dtype != torch.float32 or w.stride(0) != 1 for w in ws):
        return None
    if len({lin.bias is None for lin in linears}) != 1:
        return None
    fused = torch.cat([w.t() for w in ws], dim=1).contiguous()  # [in, sum(out)]
    sizes = [w.shape[0] for w in ws]
    start = 0
    for lin, n in zip(linears, sizes):
        lin.weight.data = fused[:, start:start + n].t()
        start += n
    bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
    return fused, bias, sizes


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.fused = None  # (weight [in, q+k+v], bias, sizes) once cpu_weight_layout fuses q/k/v
        self.rope_kernel = None  # kernels.cpu_kernels.rope_ once cpu_weight_layout fuses q/k/v and it is built

    def forward(self, x, cos, sin, attn: AttentionContext):
        t = x.shape[0]
        if self.fused is not None and x.dim() == 2:
            w, b, sizes = self.fused
            qkv = torch.mm(x, w) if b is None else torch.addmm(b, x, w)
            if self.q_norm is None and self.rope_kernel is not None and cos.dtype == torch.float32:
                # RoPE on q and k in place in the fused output: one call instead of ~16 ops (bit-identical)
                self.rope_kernel(qkv, (0, self.num_heads + self.num_kv_heads), self.head_dim, cos, sin)
                q, k, v = qkv.split(sizes, dim=1)
                o = attn.forward(self.layer, q.reshape(t, self.num_heads, self.head_dim),
                                 k.reshape(t, self.num_kv_heads, self.head_dim),
                                 v.reshape(t, self.num_kv_heads, self.head_dim))
                return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))
            q, k, v = qkv.split(sizes, dim=1)
            q = q.reshape(t, self.num_heads, self.head_dim)
            k = k.reshape(t, self.num_kv_heads, self.head_dim)
            v = v.reshape(t, self.num_kv_heads, self.head_dim)
        else:
            q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn.forward(self.layer, q, k, v)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.fused = None  # (weight [in, 2 * intermediate], bias, sizes) once cpu_weight_layout fuses gate/up

    def forward(self, x):
        if self.fused is not None and x.dim() == 2:
            w, b, sizes = self.fused
            gate, up = (torch.mm(x, w) if b is None else torch.addmm(b, x, w)).split(sizes, dim=1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """`forward(input_ids[T], positions[T], attn) -> hidden[T, H]`; `compute_logits(hidden) -> [N, V]` fp32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def dense_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training/scoring path: input_ids [B, S] -> logits [B, S, V] (causal, no cache)."""
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).repeat(b)
        hidden = self.forward(input_ids.reshape(-1), positions, DenseCausal(b, s))
        return self.lm_head(hidden).view(b, s, -1)
