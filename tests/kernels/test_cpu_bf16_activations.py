"""`quantization = "bf16"`: bfloat16 weights with bfloat16 activations (`cpu_kernels.linear_bf16`, llama.cpp's BF16
numerics). Every output is the float32 sum of exact products of the bfloat16-rounded inputs: checked against
those products summed in float64, within float32 summation's error bound, over row counts 1-40 (the 6-row
tiles and their tails), column and K tails (odd K), bias, two threads, and the build without AVX512-BF16
(float32 FMAs over the same products); the rounding is torch's round-to-nearest-even with subnormals to zero;
the packing round-trips and stacks; and `quantize_model` swaps the head too and leaves the embeddings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_kernels as ck
from kernels.quant_matmul import Bf16Linear, quantize_model

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.build_error}")]

SHAPES = [(256, 256), (37, 19), (40, 63), (1409, 96), (3, 5), (200, 1030), (130, 1)]  # (N, K)


def _exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 sums of the exact products of the bf16-rounded inputs, and float32 summation's error bound
    for them (K * eps * sum |products|, plus the bias's rounding)."""
    xb, wb = ck.round_bf16(x).double(), w.bfloat16().double()
    y = xb @ wb.t()
    mag = xb.abs() @ wb.abs().t()
    if bias is not None:
        y, mag = y + bias.double(), mag + bias.double().abs()
    return y, mag * (x.shape[1] + 2) * 2.0 ** -24


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    want, bound = _exact(x, w, bias)
    err = (y.double() - want).abs()
    assert bool((err <= bound + 1e-30).all()), float((err - bound).max())


@pytest.mark.parametrize("rows", [range(1, 13), range(13, 41, 3)])
def test_linear_bf16_sums_the_exact_products_of_the_rounded_inputs(rows):
    g = torch.Generator().manual_seed(rows.start)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g)
        packed = ck.pack_bf16_pairs(w)
        b = torch.randn(n, generator=g)
        for m in rows:
            x = torch.randn(m, k, generator=g) * 3
            for bias in (None, b):
                y = ck.linear_bf16(x, packed, n, bias)
                _check(y, x, w, bias)
                _check(ck.linear_bf16_ref(x, packed, n, bias), x, w, bias)


def test_two_threads_give_one_threads_bits():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1000, 300, generator=g)  # columns split in chunks of 64: 8 chunks, the last short
    packed = ck.pack_bf16_pairs(w)
    x = torch.randn(20, 300, generator=g)
    one = ck.linear_bf16(x, packed, 1000)
    torch.set_num_threads(2)
    try:
        assert torch.equal(ck.linear_bf16(x, packed, 1000), one)
    finally:
        torch.set_num_threads(1)


def test_the_build_without_bf16_dots_sums_the_same_products():
    try:
        lib = ck.build_variant("avx2")  # -mno-avx512f: no AVX512-BF16 either
    except Exception as exc:  # no compiler for the variant: the native build's test covers this CPU
        pytest.skip(f"no AVX2 build: {exc}")
    assert lib.tk_has_bf16_dots() == 0
    g = torch.Generator().manual_seed(11)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g)
        packed = ck.pack_bf16_pairs(w)
        b = torch.randn(n, generator=g)
        for m in (1, 2, 7, 13):
            x = torch.randn(m, k, generator=g)
            y = torch.empty(m, n)
            assert lib.tk_linear_bf16(x.data_ptr(), m, k, packed.data_ptr(), n, b.data_ptr(), y.data_ptr(), 1) == 0
            _check(y, x, w, b)
            rounded = torch.empty(m, k, dtype=torch.bfloat16)
            lib.tk_round_bf16(x.data_ptr(), m, k, rounded.data_ptr())
            assert torch.equal(rounded, ck.round_bf16(x))


def test_the_activations_round_to_nearest_even_and_subnormals_to_zero():
    g = torch.Generator().manual_seed(2)
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (64, 96), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    x[0, :40] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8), 2.0 ** -130, -(2.0 ** -140),
                              3.4028235e38, -3.4028235e38, float("inf"), float("-inf"), 0.0, -0.0,
                              1.1754944e-38] + [1.5] * 28)  # ties go to even; subnormals; rounding past the max
    got, want = ck.round_bf16_kernel(x), ck.round_bf16(x)
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(got.float()), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])  # (NaN payloads aside)
    assert got[0, :5].float().tolist() == [1.0, 1.0 + 2 * 2.0 ** -7, -1.0, 0.0, 0.0]
    assert got[0, 5].float().item() == float("inf") and got[0, 11].float().item() == torch.finfo(torch.float32).tiny


def test_the_pair_panels_round_trip_and_stack():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(48, 77, generator=g), torch.randn(21, 77, generator=g)
    pa, pb = ck.pack_bf16_pairs(a), ck.pack_bf16_pairs(b)
    assert pa.shape == (3, 39, 32) and torch.equal(ck.unpack_bf16_pairs(pa, 48, 77), a.bfloat16())
    both = torch.cat([pa, pb])  # a whole number of panels first: the stack is the stacked weight's packing
    assert torch.equal(both, ck.pack_bf16_pairs(torch.cat([a, b])))
    assert torch.equal(pa.view(torch.int16)[:, -1, 1::2], torch.zeros(3, 16, dtype=torch.int16))  # k = 77: zero
    x = torch.randn(4, 77, generator=g)
    _check(ck.linear_bf16(x, both, 69), x, torch.cat([a, b]), None)


def test_quantize_model_swaps_every_linear_but_the_embeddings():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 32)
            self.proj = nn.Linear(32, 48, bias=True)
            self.lm_head = nn.Linear(48, 50, bias=False)

        def forward(self, ids):
            return self.lm_head(self.proj(self.embed_tokens(ids)))

    torch.manual_seed(0)
    model = Tiny()
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    quantize_model(model, "bf16")
    assert isinstance(model.proj, Bf16Linear) and isinstance(model.lm_head, Bf16Linear)
    assert type(model.embed_tokens) is nn.Embedding and model.quantized_layers["swapped"] == 2
    assert torch.equal(model.proj.weight, ref["proj.weight"].bfloat16().float())
    ids = torch.tensor([[1, 7, 49]])
    h = ref["embed_tokens.weight"][ids[0]]
    mid = ck.round_bf16(h).float() @ ref["proj.weight"].bfloat16().float().t() + ref["proj.bias"]
    out = ck.round_bf16(mid).float() @ ref["lm_head.weight"].bfloat16().float().t()
    torch.testing.assert_close(model(ids)[0], out, rtol=1e-5, atol=1e-5)


def test_the_chunks_a_thread_takes_change_no_bits():
    """Two threads take the quantised and bf16 linears' columns in `split_per_thread` chunks each, in turn as they
    finish one (so a preempted thread holds up one chunk): 1, 4 or 16 chunks a thread, the same bits."""
    from kernels.quant_formats import quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(8)
    lib = ck.load()
    w = torch.randn(1000, 256, generator=g)
    q, s = quantize_int8(w)
    q4, s4, z4 = quantize_int4(w, 64)
    packed = ck.pack_bf16_pairs(w)
    x = torch.randn(3, 256, generator=g)
    calls = {"bf16": lambda: ck.linear_bf16(x, packed, 1000), "w8a8": lambda: ck.linear_w8a8(x, q, s),
             "int8": lambda: ck.linear_int8(x, q, s),
             "w4a8": lambda: ck.linear_w4a8(x, q4, s4.float(), None, 64)}
    before = lib.tk_split_per_thread(-1)
    torch.set_num_threads(2)
    try:
        for name, call in calls.items():
            outs = []
            for split in (1, 4, 16):
                lib.tk_split_per_thread(split)
                outs.append(call())
            assert all(torch.equal(o, outs[0]) for o in outs), name
    finally:
        lib.tk_split_per_thread(before)
        torch.set_num_threads(1)
