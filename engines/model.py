"""One Transformer for the Llama family (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) and the
families that differ from it in small, config-driven pieces (`ModelConfig.traits`, engines/families.py): Phi-3/4,
OLMo 2, Granite, Gemma 2/3, and the mixtures of experts (the MoE block is engines/moe.py).

Parameter names follow Hugging Face's so a checkpoint's state dict loads one-to-one (engines/weight_names.py
maps the few that differ). The model runs one flattened variable-length batch: tokens [T], positions [T], and an
`AttentionContext` that owns the KV.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engines.attention import AttentionContext, DenseCausal
from engines.model_config import ModelConfig
from engines.moe import MoE
from kernels import hugepages


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[rotary_dim / 2], or [2, rotary_dim / 2] for two tables: LongRoPE's (short, long) factors, or Gemma 3's
    (global, local) bases."""
    dim = int(cfg.head_dim * cfg.traits.partial_rotary)
    inv_freq = _global_inv_freq(cfg, _base_inv_freq(cfg.rope_theta, dim))
    if cfg.traits.local_rope_theta is not None:
        return torch.stack([inv_freq, _base_inv_freq(cfg.traits.local_rope_theta, dim)])
    return inv_freq


def longrope_limits(cfg: ModelConfig) -> tuple[int, float]:
    """LongRoPE: (the original context, past which positions take the long factors; the cos/sin scale)."""
    rs = cfg.rope_scaling
    original = int(rs.get("original_max_position_embeddings") or cfg.raw.get("original_max_position_embeddings")
                   or cfg.max_position_embeddings)
    factor = rs.get("factor") or cfg.max_position_embeddings / original
    scale = rs.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return original, float(scale)


def _global_inv_freq(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    rs = cfg.rope_scaling
    if rs is None or rs["rope_type"] == "dynamic":
        # dynamic NTK equals the default rope inside the original context, which is all we serve
        return inv_freq
    if rs["rope_type"] == "linear":
        return inv_freq / float(rs["factor"])
    if rs["rope_type"] == "longrope":
        return torch.stack([inv_freq / torch.tensor(rs["short_factor"], dtype=torch.float32),
                            inv_freq / torch.tensor(rs["long_factor"], dtype=torch.float32)])
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
    """x: [T, H, D]; cos/sin: [T, R] (the half-split "rotate_half" convention of HF Llama) over the first R <= D
    dimensions (partial rotary: the rest pass through)."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def cpu_weight_layout(model: nn.Module) -> nn.Module:
    """On the CPU, store each float32 `nn.Linear` weight column-major (an [in, out] contiguous tensor seen as
    [out, in]): `F.linear` then takes the GEMM's no-transpose path, 1.26-1.86x faster per op at the tiny
    models' shapes except the one-row logits head (0.95x); plain decoding 0.97x at batch 1, 1.06-1.12x at
    batch 8-32 (bench/cpu_layout.py), on transparent huge pages where the kernel grants them
    (kernels/hugepages.py). Values, shapes and tied parameters stay as they are; only strides change."""
    seen: set[int] = set()
    with torch.no_grad():
        for m in model.modules():
            w = getattr(m, "weight", None)
            if (type(m) is nn.Linear and w is not None and w.device.type == "cpu" and w.dtype == torch.float32
                    and id(w) not in seen and w.is_contiguous()):
                seen.add(id(w))
                w.data = hugepages.copy(w.data.t()).t()
        for m in model.modules():
            if isinstance(m, Attention):
                m.fused = _fuse_columns([m.q_proj, m.k_proj, m.v_proj]) or m.fused  # (or packed already)
                if m.fused is not None:
                    from kernels.cpu_kernels import available, rope_

                    m.rope_kernel = rope_ if available() else None
            elif isinstance(m, MLP):
                m.fused = _fuse_columns([m.gate_proj, m.up_proj]) or m.fused
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
    fused = hugepages.cat([w.t() for w in ws], dim=1)  # [in, sum(out)]
    sizes = [w.shape[0] for w in ws]
    start = 0
    for lin, n in zip(linears, sizes):
        lin.weight.data = fused[:, start:start + n].t()
        start += n
    bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
    return fused, bias, sizes


def _fused_matmul(x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None, list[int]]) -> torch.Tensor:
    """x @ the fused weight (+ bias): [in, sum(out)], or packed in panels where the C decoder stack took the model
    (kernels/cpu_forward.py `_pack_panels`)."""
    w, b, sizes = fused
    if w.dim() == 3:
        from kernels.cpu_kernels import linear_packed

        return linear_packed(x, w, sum(sizes), b)
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


class RMSNorm(nn.Module):
    """`offset` 1.0 is Gemma's (1 + w) form, multiplied in float32 before the cast back."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        tr = cfg.traits
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        window = tr.layer_windows[layer] if tr.layer_windows else None
        # per-layer attention options the context applies (Gemma's soft-cap, sliding windows); {} for Llama
        self.attn_options = {k: v for k, v in (("window", window), ("softcap", tr.attn_softcap)) if v is not None}
        self.rope_index = 1 if tr.local_rope_theta is not None and window is not None else 0
        # a non-default score scale, applied to q (the context scales by head_dim ** -0.5)
        self.q_scale = None if tr.attn_scale is None else tr.attn_scale * cfg.head_dim ** 0.5
        self.qk_norm_full = tr.qk_norm_full
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            nq, nk = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim) if tr.qk_norm_full else (
                cfg.head_dim, cfg.head_dim)
            self.q_norm = RMSNorm(nq, cfg.rms_norm_eps, tr.norm_offset)
            self.k_norm = RMSNorm(nk, cfg.rms_norm_eps, tr.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.fused = None  # (weight [in, q+k+v], bias, sizes) once cpu_weight_layout fuses q/k/v
        self.rope_kernel = None  # kernels.cpu_kernels.rope_ once cpu_weight_layout fuses q/k/v and it is built

    def forward(self, x, cos, sin, attn: AttentionContext):
        t = x.shape[0]
        if self.fused is not None and x.dim() == 2:
            qkv = _fused_matmul(x, self.fused)
            sizes = self.fused[2]
            if (self.q_norm is None and self.rope_kernel is not None and cos.dtype == torch.float32
                    and cos.shape[-1] == self.head_dim):
                # RoPE on q and k in place in the fused output: one call instead of ~16 ops (bit-identical)
                self.rope_kernel(qkv, (0, self.num_heads + self.num_kv_heads), self.head_dim, cos, sin)
                q, k, v = qkv.split(sizes, dim=1)
                return self._attend(q.reshape(t, self.num_heads, self.head_dim),
                                    k.reshape(t, self.num_kv_heads, self.head_dim),
                                    v.reshape(t, self.num_kv_heads, self.head_dim), attn)
            q, k, v = qkv.split(sizes, dim=1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        return self._attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, attn)

    def _attend(self, q, k, v, attn: AttentionContext) -> torch.Tensor:
        if self.q_scale is not None:
            q = q * self.q_scale
        o = attn.forward(self.layer, q, k, v, **self.attn_options) if self.attn_options else attn.forward(
            self.layer, q, k, v)
        return self.o_proj(o.reshape(q.shape[0], self.num_heads * self.head_dim))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act is SiLU (SwiGLU) or tanh-GELU (Gemma's GeGLU)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        h, i = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.act = F.silu if cfg.traits.hidden_act == "silu" else _gelu_tanh
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.fused = None  # (weight [in, 2 * intermediate], bias, sizes) once cpu_weight_layout fuses gate/up

    def forward(self, x):
        if self.fused is not None and x.dim() == 2:
            gate, up = _fused_matmul(x, self.fused).split(self.fused[2], dim=1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# the norms around attention and the MLP by layout: (before attention, after it, before the MLP, after it)
_NORMS = {"pre": ("input_layernorm", None, "post_attention_layernorm", None),
          "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
          "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                       "post_feedforward_layernorm")}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        tr = cfg.traits
        self.self_attn = Attention(cfg, layer)
        moe = tr.moe is not None and layer not in tr.moe.dense_layers
        self.mlp = MoE(cfg, MLP) if moe else MLP(cfg)
        self.norm_names = _NORMS[tr.norm_layout]
        for name in self.norm_names:
            if name is not None:
                setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tr.norm_offset))
        self.residual_scale = tr.residual_scale

    def _norm(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        name = self.norm_names[slot]
        return x if name is None else getattr(self, name)(x)

    def forward(self, x, cos, sin, attn):
        h = self._norm(1, self.self_attn(self._norm(0, x), cos, sin, attn))
        x = x + (h if self.residual_scale == 1.0 else h * self.residual_scale)
        h = self._norm(3, self.mlp(self._norm(2, x)))
        return x + (h if self.residual_scale == 1.0 else h * self.residual_scale)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # built on the meta device (the loader fills it), the embedding skips its random init: normal_ on meta
        # tensors goes through torch._refs, whose first call imports torch._dynamo (1-4 s of start-up)
        meta = torch.get_default_device().type == "meta"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size) if meta else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.traits.norm_offset)


class Transformer(nn.Module):
    """`forward(input_ids[T], positions[T], attn) -> hidden[T, H]`; `compute_logits(hidden) -> [N, V]` fp32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # computed on the CPU even when built on meta (arithmetic on meta tensors imports torch._dynamo)
        device = torch.get_default_device()
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rotary_dim] of the (first) table."""
        return self.rope_tables(positions, dtype)[0]

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (cos, sin) per table layers index by `Attention.rope_index`: LongRoPE takes the long factors at
        positions past the original context (what transformers computes for them when generating with a
        cache), with its cos/sin scale; Gemma 3 has a global and a local table."""
        pos = positions.to(torch.float32)[:, None]
        inv = self.inv_freq.float()
        scale = 1.0
        if (self.config.rope_scaling or {}).get("rope_type") == "longrope":
            original, scale = longrope_limits(self.config)
            tables = [torch.where(pos >= original, inv[1][None, :], inv[0][None, :])]  # [T, R / 2]
        else:
            tables = [row[None, :] for row in inv] if inv.dim() == 2 else [inv[None, :]]
        out = []
        for table in tables:
            freqs = pos * table
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
            out.append((cos.to(dtype), sin.to(dtype)))
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.config.traits.embed_scale != 1.0:
            x = x * torch.tensor(self.config.traits.embed_scale, dtype=x.dtype)
        tables = self.rope_tables(positions, x.dtype)
        for layer in self.model.layers:
            cos, sin = tables[layer.self_attn.rope_index]
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's logits divisor and Gemma 2's final soft-cap: tanh(l / c) * c."""
        tr = self.config.traits
        if tr.logits_divisor != 1.0:
            logits = logits / tr.logits_divisor
        if tr.final_softcap is not None:
            logits = torch.tanh(logits / tr.final_softcap) * tr.final_softcap
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._finish_logits(self.lm_head(hidden).float())

    def dense_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training/scoring path: input_ids [B, S] -> logits [B, S, V] (causal, no cache)."""
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).repeat(b)
        hidden = self.forward(input_ids.reshape(-1), positions, DenseCausal(b, s))
        return self._finish_logits(self.lm_head(hidden)).view(b, s, -1)
