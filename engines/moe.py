"""The mixture-of-experts block (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE): a softmax router
picks each token's top-k experts (weights renormalised to sum 1 or not, as the config says).

On the CPU (and for quantised experts) each expert runs on the tokens routed to it, so a step reads only
the chosen experts' weights: a decode token costs its active, not its total, parameters (the CPU's C decoder
stack, kernels/cpu_forward.py, runs this block the same way in C where it takes the model). On CUDA with float
weights the experts run as one fused kernel (kernels/fused_moe.py) over weights stacked once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]), as transformers routes:
    softmax in float32, top-k, optional renormalisation."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class MoE(nn.Module):
    """`forward(x [T, H]) -> [T, H]`. Parameter names follow Qwen-MoE's (`gate`, `experts.N.{gate,up,down}_proj`,
    `shared_expert`, `shared_expert_gate`); engines/weight_names.py maps Mixtral's onto them."""

    def __init__(self, cfg, make_mlp: Callable[..., nn.Module]):
        super().__init__()
        moe = cfg.traits.moe
        self.top_k, self.renormalize, self.num_experts = moe.top_k, moe.renormalize, moe.num_experts
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(make_mlp(cfg, moe.expert_intermediate) for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate:
            self.shared_expert = make_mlp(cfg, moe.shared_intermediate)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # (w_gate_up [E, 2I, H], w_down [E, H, I])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        weights, ids = route(self.gate(x2), self.top_k, self.renormalize)
        stacked = self._fused_weights(x2)
        if stacked is not None:
            from kernels.fused_moe import fused_moe

            out = fused_moe(x2, stacked[0], stacked[1], weights, ids, activation=self._activation())
        else:
            out = self._per_expert(x2, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x2)) * self.shared_expert(x2)
        return out.reshape(*lead, -1)

    def _per_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each chosen expert over its tokens; experts nobody chose are never touched."""
        if x.shape[0] == 1:  # a decode token: no sort, its k experts in turn
            chosen, scales = ids[0].tolist(), weights[0].tolist()
            out = self.experts[chosen[0]](x) * scales[0]
            for e, w in zip(chosen[1:], scales[1:]):
                out = out + self.experts[e](x) * w
            return out
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        w_sorted = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start:start + n]
                out.index_add_(0, rows, self.experts[e](x[rows]) * w_sorted[start:start + n, None])
            start += n
        return out

    def _activation(self) -> str:
        return "silu" if self.experts[0].act is F.silu else "gelu_tanh"

    def _fused_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts' weights stacked for the fused kernel: CUDA, Triton and plain float Linears only."""
        if x.device.type != "cuda" or any(type(m) is not nn.Linear for e in self.experts
                                          for m in (e.gate_proj, e.up_proj, e.down_proj)):
            return None
        from kernels.launch import HAVE_TRITON

        if not HAVE_TRITON:
            return None
        if self._stacked is None or self._stacked[0].device != x.device:
            with torch.no_grad():
                gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
                down = torch.stack([e.down_proj.weight for e in self.experts])
            self._stacked = (gate_up.contiguous(), down.contiguous())
        return self._stacked
