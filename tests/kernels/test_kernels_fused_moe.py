"""The fused-MoE kernel (rows sorted by expert, one grouped GEMM per projection) against its PyTorch reference,
and the reference against the model's MoE block (engines/moe.py's per-expert CPU path)."""

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from kernels.fused_moe import fused_moe, fused_moe_ref, moe_align  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_moe_align_sorts_rows_by_expert_in_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    rows, tiles = moe_align(ids, num_experts=4, block_m=2)
    sentinel = ids.numel()
    # expert 0: rows 1, 4; expert 1: row 3 (+ pad); expert 2: rows 0, 2, 5 (+ pad); expert 3: nothing
    assert rows.tolist() == [1, 4, 3, sentinel, 0, 2, 5, sentinel]
    assert tiles.tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (7, 4, 2), (19, 6, 3)])
def test_fused_moe_matches_reference(tokens, experts, top_k, activation):
    g = torch.Generator().manual_seed(tokens * 31 + experts)
    h, i = 24, 20  # not multiples of the tiles: the masks are exercised
    x = torch.randn(tokens, h, generator=g)
    w_gate_up = torch.randn(experts, 2 * i, h, generator=g) * 0.2
    w_down = torch.randn(experts, h, i, generator=g) * 0.2
    probs = torch.softmax(torch.randn(tokens, experts, generator=g), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    args = [t.to(DEV) for t in (x, w_gate_up, w_down, weights, ids)]
    ours = fused_moe(*args, activation=activation)
    ref = fused_moe_ref(*args, activation=activation)
    assert ours.shape == (tokens, h)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_reference_equals_the_model_moe_block():
    from engines.families import FamilyTraits, MoETraits
    from engines.model import MLP
    from engines.model_config import ModelConfig
    from engines.moe import MoE, route

    traits = FamilyTraits(family="qwen3_moe", moe=MoETraits(6, 2, 20, renormalize=True))
    cfg = ModelConfig("Qwen3MoeForCausalLM", 64, 24, 40, 1, 2, 2, 12, 64, traits=traits)
    torch.manual_seed(0)
    block = MoE(cfg, MLP).eval()
    x = torch.randn(9, 24)
    with torch.no_grad():
        weights, ids = route(block.gate(x), 2, True)
        w_gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in block.experts])
        w_down = torch.stack([e.down_proj.weight for e in block.experts])
        torch.testing.assert_close(block(x), fused_moe_ref(x, w_gate_up, w_down, weights, ids), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(block(x[:1]), fused_moe_ref(x[:1], w_gate_up, w_down, weights[:1], ids[:1]),
                                   atol=1e-6, rtol=1e-5)
