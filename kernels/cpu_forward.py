"""The whole decoder stack of a Llama-family model in one C call (`tk_forward_f32` in kernels/cpu_kernels.c) for
CPU steps whose every sequence runs a few queries (decodes, verify windows, short chunks).

A tiny model's decode step through PyTorch is ~100 framework ops (norms, matmuls, RoPE, residuals), each
~5-20 us of dispatch: more than the arithmetic. Here Python builds the step's index arrays once and C runs
every layer: the projections stream each weight once (float32 packed in panels of 32 columns, read in address
order: `build` repacks the column-major `wt [K, N]` `engines.model.cpu_weight_layout` stores and swaps the
modules for `cpu_kernels.PackedLinear`s, so the weight is kept once; read from a bfloat16 copy where its values
are all bf16 (a bf16 checkpoint: half the bytes, the same bits; `cpu_kernels.bf16_copy`), or int8 `[N, K]` with per-row scales or a
scale per 32 weights (GGUF Q8_0), weight-only or w8a8), many-row steps take the register tiles 8 rows at a time or the MKL SGEMM torch ships
(`cpu_kernels.calibrate` picks by timing both on the model's weights when it is built), K/V go into their pages
and attention reads the pages in place.

A mixture-of-experts layer (Mixtral, Qwen2-MoE with its gated shared expert) runs in the same call
(`moe_apply`): the router's softmax and top-k in C, then each chosen expert's projections over the tokens that
chose it, so a decode token reads its k experts' weights and no others, in any of the modes above.

`CpuForward.build(model, k_caches, v_caches)` returns None for models it does not cover (every family but the
Llama one (Qwen3's per-head q/k norm included) and the MoEs on its layers, a sliding window, int4 in groups of 32, bfloat16
weights, biases on norms...); those keep the PyTorch forward.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch
from torch import nn

from kernels import cpu_kernels, hugepages
from kernels.thread_governor import ThreadGovernor, rows_key

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Lin(ctypes.Structure):
    _fields_ = [("w", _PTR), ("scale", _PTR), ("bias", _PTR), ("ld", _I64), ("w8a8", _I64), ("zero", _PTR),
                ("group", _I64), ("w16", _PTR), ("int4", _I64), ("zoff", _I64), ("skind", _I64), ("panels", _I64),
                ("bf16", _I64)]


class _Moe(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("E", "k", "renorm", "I", "shared_I")] + [
        ("router", _Lin), ("experts", ctypes.POINTER(_Lin)), ("shared_gate_up", _Lin), ("shared_down", _Lin),
        ("shared_gate", _Lin)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _PTR), ("post_norm", _PTR), ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin),
                ("down", _Lin), ("kc", _PTR), ("vc", _PTR), ("moe", ctypes.POINTER(_Moe)), ("q_norm", _PTR),
                ("k_norm", _PTR)]


class _Model(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("L", "H", "Hq", "Hkv", "D", "I", "bs", "page_stride", "tok_stride",
                                    "head_stride")] + [
        ("eps", _F32), ("attn_scale", _F32), ("embed", _PTR), ("embed_s0", _I64), ("embed_s1", _I64),
        ("final_norm", _PTR), ("inv_freq", _PTR), ("layers", ctypes.POINTER(_Layer)), ("kv_kind", _I64)]


_bound = False


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    global _bound
    if not _bound:
        lib.tk_forward_f32.argtypes = [ctypes.POINTER(_Model), _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR,
                                       _PTR, _I64, _I64, _PTR, ctypes.c_int]
        lib.tk_forward_f32.restype = ctypes.c_int
        lib.tk_draft_greedy_f32.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Lin), _I64, _I64, _PTR, _PTR,
                                            _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR,
                                            _PTR, _PTR, _PTR, _PTR, _PTR, ctypes.c_int]
        lib.tk_draft_greedy_f32.restype = ctypes.c_int
        _bound = True
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuForward:
    """`forward(ids, positions, tables, seqs, max_ctx) -> hidden [T, H]` over the model's pool view."""

    def __init__(self, model: nn.Module, layers: list[_Layer], keep: list, k_cache: torch.Tensor):
        cfg = model.config
        self.lib = _bind(cpu_kernels.load())
        self.governor = ThreadGovernor()  # threads per call, by timing (a neighbour may hold a core)
        self.hidden = cfg.hidden_size
        # whether steps with long prefill chunks run here too: not over int4 weights, where the w4a8 kernel would
        # quantise a prompt's activations that the PyTorch forward's many-row int4 path multiplies in float
        self.takes_prefill = not any(getattr(m, "mode", None) == "int4" for m in model.modules())
        # every tensor (and MoE struct) the C structs point into (detached aliases: their storage stays alive
        # even if a module's `.data` is rebound later)
        self._keep = keep + [model.model.embed_tokens.weight.detach(), model.model.norm.weight.detach()] + [
            p.detach() for lay in model.model.layers
            for p in (lay.input_layernorm.weight, lay.post_attention_layernorm.weight)]
        self._layers = (_Layer * len(layers))(*layers)
        emb = model.model.embed_tokens.weight
        self._inv_freq = model.inv_freq.float().contiguous()
        self._model = _Model(
            L=cfg.num_layers, H=cfg.hidden_size, Hq=cfg.num_heads, Hkv=cfg.num_kv_heads, D=cfg.head_dim,
            I=cfg.intermediate_size, bs=k_cache.shape[1], page_stride=k_cache.stride(0),
            tok_stride=k_cache.stride(1), head_stride=k_cache.stride(2), eps=cfg.rms_norm_eps,
            attn_scale=cfg.head_dim ** -0.5, embed=emb.data_ptr(), embed_s0=emb.stride(0), embed_s1=emb.stride(1),
            final_norm=model.model.norm.weight.data_ptr(), inv_freq=self._inv_freq.data_ptr(), layers=self._layers,
            kv_kind=cpu_kernels.KV_KINDS[k_cache.dtype])
        self._mref = ctypes.byref(self._model)
        head = model.lm_head
        # the head as the C side's projection: a float32 Linear in panels (`build` packs an untied one) or
        # column-major (tied: the embedding lookup reads its rows), with its bf16 copy; or an int8 / w8a8
        # QuantLinear. `_head`: (the float32 weight, its bf16 copy) for `logits`
        self._head_lin, self._head = None, None
        if type(head) is cpu_kernels.PackedLinear and head.bias is None:
            packed = head.packed.detach()
            self._head = (packed, cpu_kernels.bf16_copy(cpu_kernels.unpack_f32(packed, head.out_features)))
            self._head_lin = _Lin(w=packed.data_ptr(), scale=None, bias=None, ld=0, w8a8=0,
                                  w16=_ptr(self._head[1]), panels=1)
        elif (type(head) is nn.Linear and head.bias is None
              and cpu_kernels.linear_fits(torch.empty(1, 1), head.weight)):
            self._head = (head.weight, cpu_kernels.bf16_copy(head.weight))
            self._head_lin = _Lin(w=head.weight.data_ptr(), scale=None, bias=None, ld=head.weight.stride(1), w8a8=0,
                                  w16=_ptr(self._head[1]))
        elif getattr(head, "bias", None) is None:
            self._head_lin = _lin_group([head], None, self._keep)
        self._head_ref = None if self._head_lin is None else ctypes.byref(self._head_lin)
        self.vocab = head.out_features
        self._model_ref = model

    @classmethod
    def build(cls, model: nn.Module, k_caches: Seq[torch.Tensor], v_caches: Seq[torch.Tensor]
              ) -> CpuForward | None:
        """The fast forward for `model` over these per-layer caches, or None where it does not apply. `model` is
        the engines' Llama-family `Transformer` whose layers' attention is its plain `Attention` (the caller,
        `engines.runner`, checks: kernels imports nothing of the project)."""
        if not cpu_kernels.available():
            return None
        cfg = model.config
        # the Llama family and the mixtures of experts built on its layers (`traits.c_stack`): other families
        # (Gemma, Phi-3...) keep the PyTorch forward
        traits = getattr(cfg, "traits", None)
        if cfg.sliding_window is not None or cfg.head_dim % 2 or (traits and not traits.c_stack):
            return None
        emb = model.model.embed_tokens.weight
        if emb.dtype != torch.float32 or emb.device.type != "cpu" or model.inv_freq.device.type != "cpu":
            return None
        if not cpu_kernels.attention_fits(torch.empty(1, 1, 1), k_caches[0]):
            return None
        # the float32 linears' machine-dependent choices (register blocks on large weights, the SGEMM's rows),
        # timed on this model's weights once per process (before they are packed in panels)
        cpu_kernels.calibrate([m.weight for m in model.modules() if type(m) is nn.Linear])
        keep: list = []
        layers = []
        for i, lay in enumerate(model.model.layers):
            att, mlp = lay.self_attn, lay.mlp
            if type(lay.input_layernorm.weight) is not nn.Parameter:
                return None
            _pack_panels(att, ("q_proj", "k_proj", "v_proj"))
            _pack_panels(att, ("o_proj",))
            if getattr(mlp, "experts", None) is None:
                _pack_panels(mlp, ("gate_proj", "up_proj"))
                _pack_panels(mlp, ("down_proj",))
            qkv = _lin_group([att.q_proj, att.k_proj, att.v_proj], att.fused, keep)
            o = _lin_group([att.o_proj], None, keep)
            moe = None
            if getattr(mlp, "experts", None) is not None:  # engines.moe.MoE
                moe = _moe_block(mlp, keep)
                gu = down = _Lin() if moe is not None else None
            else:
                gu = _lin_group([mlp.gate_proj, mlp.up_proj], mlp.fused, keep)
                down = _lin_group([mlp.down_proj], None, keep)
            norms = (lay.input_layernorm.weight, lay.post_attention_layernorm.weight)
            qk = () if att.q_norm is None else (att.q_norm.weight, att.k_norm.weight)  # Qwen3's, per head
            if None in (qkv, gu, o, down) or any(w.dtype != torch.float32 or not w.is_contiguous()
                                                 or type(w) is not nn.Parameter for w in norms + qk) or any(
                    w.numel() != cfg.head_dim for w in qk):
                return None
            keep.extend(w.detach() for w in qk)
            kc, vc = k_caches[i], v_caches[i]
            if kc.stride() != k_caches[0].stride() or vc.stride() != kc.stride() or vc.dtype != kc.dtype:
                return None
            layers.append(_Layer(in_norm=norms[0].data_ptr(), post_norm=norms[1].data_ptr(), qkv=qkv, o=o,
                                 gate_up=gu, down=down, kc=kc.data_ptr(), vc=vc.data_ptr(),
                                 moe=None if moe is None else ctypes.pointer(moe),
                                 q_norm=qk[0].data_ptr() if qk else None, k_norm=qk[1].data_ptr() if qk else None))
        if model.model.norm.weight.dtype != torch.float32:
            return None
        head = model.lm_head
        if type(head) is nn.Linear and head.weight.untyped_storage().data_ptr() != emb.untyped_storage().data_ptr():
            _pack_panels(model, ("lm_head",))  # (a tied head stays column-major: the embedding reads its rows)
        return cls(model, layers, keep, k_caches[0])

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, seqs: torch.Tensor,
                max_ctx: int) -> torch.Tensor:
        """ids/positions [T] int64; tables [S, max_blocks] int64 contiguous; seqs [4, S] int64 (first row,
        query count, context length, table row per sequence). Writes the step's K/V; returns [T, H] float32."""
        t = ids.shape[0]
        out = torch.empty((t, self.hidden), dtype=torch.float32)
        n = seqs.shape[1]
        p = seqs.data_ptr()
        rc = self.governor.run(rows_key("forward", t), lambda threads: self.lib.tk_forward_f32(
            self._mref, t, ids.data_ptr(), positions.data_ptr(), tables.data_ptr(), tables.shape[1], p, p + 8 * n,
            p + 16 * n, p + 24 * n, n, max_ctx, out.data_ptr(), threads))
        if rc:
            raise MemoryError("cpu forward: scratch allocation failed")
        return out

    @property
    def can_draft(self) -> bool:
        """Whether `draft_greedy` applies (the head is a column-major float32 Linear or an int8 / w8a8 one)."""
        return self._head_lin is not None

    def draft_greedy(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, seqs: torch.Tensor,
                     max_ctx: int, k: int, bans: Seq[tuple[Iterable[int], int]] | None = None,
                     temperatures: Seq[float] | None = None, uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """k greedy tokens per sequence [S, k]: `forward` of this step's rows (as there; `seqs` is overwritten),
        the head and argmax of each sequence's last row, and that token fed back, k times in one C call. The
        K/V of every pass but the last token's is written to the pages. `bans[s]` = (ids, passes): sequence s
        may not pick those ids at its first `passes` tokens (min_tokens' EOS and stop ids). `temperatures[s]`
        > 0: sequence s draws its tokens from softmax(logits / temperature) by the inverse CDF at
        `uniforms[s, t]` (float32 [S, k] in [0, 1)) instead of taking the argmax."""
        n = seqs.shape[1]
        out = torch.empty((n, k), dtype=torch.long)
        p = seqs.data_ptr()
        ban = (0, 0, 0)  # NULL: no bans
        if bans is not None and any(until > 0 and ids_ for ids_, until in bans):
            flat = [[int(i) for i in ids_] for ids_, _ in bans]
            keep = (torch.tensor([i for f in flat for i in f] or [0], dtype=torch.long),
                    torch.tensor([0, *itertools.accumulate(len(f) for f in flat)], dtype=torch.long),
                    torch.tensor([until for _, until in bans], dtype=torch.long))
            ban = tuple(t.data_ptr() for t in keep)
        temps = unif = None
        if temperatures is not None and any(t > 0 for t in temperatures):
            temps = torch.tensor(temperatures, dtype=torch.float32)
            unif = uniforms.to(torch.float32).contiguous()
            if unif.shape != (n, k):
                raise ValueError(f"draft_greedy: uniforms of shape {tuple(unif.shape)}, not ({n}, {k})")
        rc = self.governor.run(rows_key(f"draft{k}", ids.shape[0]), lambda threads: self.lib.tk_draft_greedy_f32(
            self._mref, self._head_ref, self.vocab, ids.shape[0], ids.data_ptr(), positions.data_ptr(),
            tables.data_ptr(), tables.shape[1], p, p + 8 * n, p + 16 * n, p + 24 * n, n, max_ctx, k, out.data_ptr(),
            *ban, _ptr(temps), _ptr(unif), threads))
        if rc:
            raise MemoryError("cpu draft: scratch allocation failed")
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden rows [N, H]: the head through the kernels' float32 linear where it is a plain
        float32 Linear (in panels or column-major), else the model's own `compute_logits`."""
        if self._head is not None:
            w, w16 = self._head
            if w.dim() == 3:
                return cpu_kernels.linear_packed(hidden, w, self.vocab, weight16=w16)
            return cpu_kernels.linear(hidden, w, weight16=w16)
        return self._model_ref.compute_logits(hidden)


def _moe_block(moe: nn.Module, keep: list) -> _Moe | None:
    """engines.moe.MoE as the C side's `tk_moe`: the router, each expert's gate/up and down projections (any
    mode `_lin_group` takes) and the shared expert with its gate; None where a projection is one it does not take
    or the experts' activation is not SiLU."""
    if any(e.act is not torch.nn.functional.silu for e in moe.experts):
        return None
    router = _lin_group([moe.gate], None, keep)
    experts = [lin for e in moe.experts for lin in (_lin_group([e.gate_proj, e.up_proj], e.fused, keep),
                                                    _lin_group([e.down_proj], None, keep))]
    shared, shared_i = [_Lin(), _Lin(), _Lin()], 0
    if moe.shared_expert is not None:
        s = moe.shared_expert
        if s.act is not torch.nn.functional.silu:
            return None
        shared = [_lin_group([s.gate_proj, s.up_proj], s.fused, keep), _lin_group([s.down_proj], None, keep),
                  _lin_group([moe.shared_expert_gate], None, keep)]
        shared_i = s.down_proj.in_features
    if router is None or None in experts or None in shared:
        return None
    table = (_Lin * len(experts))(*experts)
    block = _Moe(E=moe.num_experts, k=moe.top_k, renorm=int(moe.renormalize),
                 I=moe.experts[0].down_proj.in_features, shared_I=shared_i, router=router, experts=table,
                 shared_gate_up=shared[0], shared_down=shared[1], shared_gate=shared[2])
    keep.extend([table, block])
    return block


def _pack_panels(owner: nn.Module, names: tuple[str, ...]) -> None:
    """Swap `owner`'s float32 Linears `names` (one, or a group over the same input that cpu_weight_layout fused
    into `owner.fused`) for `cpu_kernels.PackedLinear`s over one tensor of panels (`pack_f32`: a one-row pass
    reads it in address order, ~1.25x the [K, N] weight's speed from memory), each viewing its own panels, and
    `owner.fused` for the panels: the [K, N] weight is then held by nothing and freed, so the weight is in memory
    once. Left as it is where a group member's width is not a whole number of panels, or TANDEM_CPU_PANELS=0."""
    linears = [getattr(owner, name) for name in names]
    fused = getattr(owner, "fused", None) if len(names) > 1 else None
    sizes = [lin.out_features for lin in linears]
    if (os.environ.get("TANDEM_CPU_PANELS", "1") == "0" or any(type(lin) is not nn.Linear for lin in linears)
            or not all(cpu_kernels.linear_fits(torch.empty(1, 1), lin.weight) for lin in linears)
            or (len(names) > 1 and (fused is None or fused[0].dim() != 2))
            or any(n % cpu_kernels.PANEL for n in sizes[:-1])):
        return
    with torch.no_grad():
        packed = cpu_kernels.pack_f32(fused[0].t() if fused is not None else linears[0].weight)
        start = 0
        for name, lin, n in zip(names, linears, sizes):
            p0 = start // cpu_kernels.PANEL
            setattr(owner, name, cpu_kernels.PackedLinear(packed[p0:p0 + (n + cpu_kernels.PANEL - 1)
                                                                 // cpu_kernels.PANEL], n, lin.bias))
            start += n
    if fused is not None:
        owner.fused = (packed, fused[1], fused[2])


def _lin_group(linears: list[nn.Module], fused: tuple | None, keep: list) -> _Lin | None:
    """One projection over the same input: float32 (the fused [K, sum N] weight of cpu_weight_layout, or one
    column-major weight; with its bf16 copy where that is exact) or int8 / w8a8 QuantLinears of one mode (their
    rows stacked into one [sum N, K] weight the modules then view, so nothing is stored twice)."""
    from kernels.quant_matmul import QuantLinear

    if any(getattr(lin, "input_perm", None) is not None or getattr(lin, "act_quant", None) for lin in linears):
        # act-order weights gather their input first, per-token int8 activations are quantised first:
        # QuantLinear.forward does, the C stack does not
        return None
    if all(type(lin) is cpu_kernels.PackedLinear for lin in linears):
        if len(linears) > 1 and (fused is None or fused[0].dim() != 3):
            return None
        packed, b = (fused[0], fused[1]) if len(linears) > 1 else (linears[0].packed.detach(), linears[0].bias)
        n = sum(lin.out_features for lin in linears)
        w16 = cpu_kernels.bf16_copy(cpu_kernels.unpack_f32(packed, n))
        b = None if b is None else b.detach().float().contiguous()
        keep.extend(t for t in (packed, w16, b) if t is not None)
        return _Lin(w=packed.data_ptr(), scale=None, bias=_ptr(b), ld=0, w8a8=0, w16=_ptr(w16), panels=1)
    if all(type(lin) is nn.Linear for lin in linears):
        if fused is not None:
            w, b, _ = fused
        elif len(linears) == 1:
            w, b = linears[0].weight.t(), linears[0].bias
        else:
            return None
        # (a one-column weight, a [H -> 1] gate, is column-major whatever its stride there)
        if w.dtype != torch.float32 or w.device.type != "cpu" or (w.stride(1) != 1 and w.shape[1] > 1):
            return None
        w16 = cpu_kernels.bf16_copy(w.t())  # w is [K, N]: the copy packs the [N, K] weight
        keep.append(w)  # a later cpu_weight_layout of the same module (a second engine) may rebind it
        if w16 is not None:
            keep.append(w16)
        if b is not None:
            b = b.detach().float().contiguous()
            keep.append(b)
        return _Lin(w=w.data_ptr(), scale=None, bias=_ptr(b), ld=w.stride(0), w8a8=0, w16=_ptr(w16))
    modes = {getattr(lin, "mode", None) for lin in linears}
    if modes == {"int4"}:
        return _int4_group(linears, keep)
    if modes == {"bf16"}:
        return _bf16_group(linears, keep)
    if len(modes) == 1 and modes <= {"int8", "w8a8"} and all(
            isinstance(lin, QuantLinear) and lin.weight.device.type == "cpu" for lin in linears):
        if len({lin.bias is None for lin in linears}) != 1 or len({lin.int8_group for lin in linears}) != 1:
            return None
        with torch.no_grad():
            # per channel float32; per 32 weights float16 (GGUF Q8_0's, as stored: tk_linear_i8g reads that)
            sdt = torch.float16 if linears[0].int8_group else torch.float32
            if len(linears) == 1:
                q, s = hugepages.copy(linears[0].weight.detach()), linears[0].scale.to(sdt).contiguous()
                if q.data_ptr() != linears[0].weight.data_ptr():  # a copy on huge pages: the module views it
                    linears[0].weight.data = q
            else:
                q = hugepages.cat([lin.weight for lin in linears])
                s = torch.cat([lin.scale.to(sdt) for lin in linears]).contiguous()
                start = 0
                for lin in linears:
                    n = lin.out_features
                    lin.weight.data, lin.scale.data = q[start:start + n], s[start:start + n]
                    start += n
            b = None
            if linears[0].bias is not None:
                b = torch.cat([lin.bias.detach().float() for lin in linears]).contiguous()
        keep.extend([q, s] + ([b] if b is not None else []))
        return _Lin(w=q.data_ptr(), scale=s.data_ptr(), bias=_ptr(b), ld=q.shape[1], w8a8=int(modes == {"w8a8"}),
                    group=linears[0].int8_group)  # group 32: int8 with a scale per 32 weights (GGUF Q8_0)
    return None


def _stack_rows(linears: list[nn.Module], names: tuple[str, ...]) -> list[torch.Tensor]:
    """Each tensor attribute `names` of `linears` stacked along its first dimension into one tensor (on huge pages)
    and each module's rebound to a view of its rows, so nothing is kept twice; the stacked tensors, in order."""
    stacked = [hugepages.cat([getattr(lin, a) for lin in linears]) for a in names]
    for a, t in zip(names, stacked):
        start = 0
        for lin in linears:
            n = getattr(lin, a).shape[0]
            getattr(lin, a).data = t[start:start + n]
            start += n
    return stacked


def _bf16_group(linears: list[nn.Module], keep: list[torch.Tensor]) -> _Lin | None:
    """Bf16Linears (bfloat16 weights and activations) over the same input: their pair panels stacked and the
    modules viewing them, nothing kept twice, where each width but the last is a whole number of 16-column
    panels (the stack is then the stacked weight's packing); else the stacked weight packed anew beside them."""
    from kernels.quant_matmul import Bf16Linear

    if (not all(isinstance(lin, Bf16Linear) and lin.packed.device.type == "cpu" for lin in linears)
            or len({lin.bias is None for lin in linears}) != 1):
        return None
    with torch.no_grad():
        if len(linears) == 1:
            w = linears[0].packed  # (packed on huge pages already, by pack_bf16_pairs)
        elif any(lin.out_features % cpu_kernels.PAIR_PANEL for lin in linears[:-1]):
            w = cpu_kernels.pack_bf16_pairs(torch.cat([cpu_kernels.unpack_bf16_pairs(
                lin.packed, lin.out_features, lin.in_features) for lin in linears]))
        else:
            w = _stack_rows(linears, ("packed",))[0]
        b = None
        if linears[0].bias is not None:
            b = torch.cat([lin.bias.detach().float() for lin in linears]).contiguous()
    keep.extend([w] + ([b] if b is not None else []))
    return _Lin(w=w.data_ptr(), bias=_ptr(b), bf16=1)


def _int4_group(linears: list[nn.Module], keep: list[torch.Tensor]) -> _Lin | None:
    """int4 QuantLinears of one group size (64 or 128, what tk_linear_w4a8 takes) over the same input: packed
    weights, scales (in their stored dtype, which the C side reads) and packed zero points (or none: 8) stacked
    by rows (the modules then view them): nothing kept twice."""
    from kernels.quant_matmul import W4A8_GROUPS, QuantLinear

    groups = {lin.group_size for lin in linears}
    if (len(groups) != 1 or groups.pop() not in W4A8_GROUPS or len({lin.bias is None for lin in linears}) != 1
            or not all(isinstance(lin, QuantLinear) and lin.weight.device.type == "cpu" for lin in linears)
            or len({lin.scale.dtype for lin in linears}) != 1
            or len({lin.zero_offset for lin in linears if lin.zero is not None}) > 1):
        return None
    with torch.no_grad():
        packed = [lin for lin in linears if lin.zero is not None]
        if packed:  # stacked, the zeros need one form: a projection whose zeros are all 8 gets them stored
            off = packed[0].zero_offset
            nib = 8 - off
            for lin in linears:
                if lin.zero is None:
                    lin.zero = torch.full((lin.out_features, (lin.scale.shape[1] + 1) // 2), nib | (nib << 4),
                                          dtype=torch.uint8)
                    lin.zero_offset = off
        names = ("weight", "scale") + (("zero",) if packed else ())
        stacked = _stack_rows(linears, names)
        q, s = stacked[0], stacked[1]
        z = stacked[2] if len(stacked) > 2 else None
        if s.dtype not in cpu_kernels.SCALE_KINDS:
            return None
        b = None
        if linears[0].bias is not None:
            b = torch.cat([lin.bias.detach().float() for lin in linears]).contiguous()
    keep.extend([t for t in (q, s, z, b) if t is not None])
    return _Lin(w=q.data_ptr(), scale=s.data_ptr(), bias=_ptr(b), ld=q.shape[1], w8a8=0, zero=_ptr(z),
                group=linears[0].group_size, int4=1, zoff=linears[0].zero_offset,
                skind=cpu_kernels.SCALE_KINDS[s.dtype])  # the scales as stored: no float32 copy
