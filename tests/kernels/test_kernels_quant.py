"""Weight-only int8/int4: quantisers (exact properties), the Triton matmul against the reference (split-K
and large-M paths), the CPU packed ops behind QuantLinear, and quantize_model's module swap."""

import os

import torch

# CPU: run kernels under the Triton interpreter (kernels.launch also interprets CPU tensors when triton was
# imported first without it). GPU: the flag would turn triton.language's own helpers into interpreted ones.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from kernels.quant_matmul import (  # noqa: E402
    QuantLinear,
    dequantize_int4,
    dequantize_int8,
    pack_zero,
    quantize_int4,
    quantize_int8,
    quantize_model,
    unpack_int4,
    wq_matmul,
    wq_matmul_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def weight(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_quantiser_exact_properties():
    w = weight(48, 96)
    w[5] = 0.0
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (48,)
    assert torch.equal(q[5], torch.zeros(96, dtype=torch.int8))
    live = torch.arange(48) != 5
    assert q[live].abs().amax(1).eq(127).all()  # the largest weight of a row maps to +-127
    err = (w - dequantize_int8(q, s)).abs()
    assert err.le(s[:, None] / 2 + 1e-9).all()
    # bit-exact against the formula written out independently
    expect = torch.round(w / (w.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127)).clamp(-127, 127)
    assert torch.equal(q, expect.to(torch.int8))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_quantiser_packing_round_trips(group):
    w = weight(16, 256, seed=group)
    packed, s, z = quantize_int4(w, group)
    assert packed.shape == (16, 128) and packed.dtype == torch.uint8
    assert s.shape == z.shape == (16, 256 // group)
    q = unpack_int4(packed)
    assert int(q.max()) <= 15
    # packing is exact: re-pack the unpacked nibbles
    assert torch.equal(q[:, 0::2] | (q[:, 1::2] << 4), packed)
    # within half a step, except at a group's ends where the rounded zero point can cost up to one step
    err = (w - dequantize_int4(packed, s, z)).abs().view(16, -1, group)
    step = s.float()[..., None]
    assert err.le(step + 1e-6).all()
    assert err.le(step / 2 + 1e-6).float().mean() > 0.97


def test_int4_rejects_bad_group():
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(weight(4, 64), 48)
    with pytest.raises(ValueError, match="multiple"):
        quantize_int4(weight(4, 96), 64)


@pytest.mark.parametrize("m", [1, 5, 33])
def test_int8_triton_matmul_matches_reference(m):
    n, k = 40, 192  # N not a multiple of the tile; K spans 3 tiles -> split-K with a ragged split
    q, s = quantize_int8(weight(n, k, seed=m))
    x = torch.randn(m, k)
    q, s, x = q.to(DEV), s.to(DEV), x.to(DEV)
    ref = wq_matmul_ref(x, q, s)
    for split in (1, 2, 3):
        torch.testing.assert_close(wq_matmul(x, q, s, split_k=split), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_triton_matmul_matches_reference(group):
    n, k, m = 24, 256, 3
    packed, s, z = quantize_int4(weight(n, k, seed=group), group)
    z = pack_zero(z)  # the kernels take the zeros packed two per byte
    x = torch.randn(m, k)
    packed, s, z, x = packed.to(DEV), s.to(DEV), z.to(DEV), x.to(DEV)
    ref = wq_matmul_ref(x, packed, s, z)
    for split in (1, 2):
        torch.testing.assert_close(wq_matmul(x, packed, s, z, split_k=split), ref, atol=1e-5, rtol=1e-5)


def test_fp16_activations_in_interpreter():
    q, s = quantize_int8(weight(32, 64))
    x = torch.randn(4, 64).half()
    out = wq_matmul(x.to(DEV), q.to(DEV), s.to(DEV))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), wq_matmul_ref(x.float(), q, s), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8"])
def test_quantlinear_cpu_path_close_to_float_linear(mode):
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True)
    ql = QuantLinear.from_linear(lin, mode, group_size=64)
    x = torch.randn(3, 7, 256)
    y = ql(x)
    assert y.shape == (3, 7, 96) and y.dtype == torch.float32
    # CPU packed ops equal the dequantised reference up to their bf16 activation rounding
    ref = x @ ql.dequantized_weight().T + lin.bias.detach()
    torch.testing.assert_close(y, ref, atol=3e-2, rtol=3e-2)
    # and the quantisation error against the float layer stays small
    rel = (y - lin(x)).norm() / lin(x).norm()
    assert rel < (0.02 if mode == "int8" else 0.1)


def test_quantize_model_swaps_linears_but_not_lm_head_or_embeddings():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(10, 64)
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 64))])
            self.odd = nn.Linear(96, 8)  # 96 is not a multiple of 64: stays float under int4
            self.lm_head = nn.Linear(64, 10, bias=False)

    m = quantize_model(Tiny(), "int4", group_size=64)
    assert isinstance(m.blocks[0][0], QuantLinear) and isinstance(m.blocks[0][2], QuantLinear)
    assert isinstance(m.lm_head, nn.Linear) and isinstance(m.embed_tokens, nn.Embedding)
    assert type(m.odd) is nn.Linear
    assert m.quantized_layers == {"mode": "int4", "swapped": 2, "kept_float": ["odd"]}
    m8 = quantize_model(Tiny(), "int8")
    assert isinstance(m8.odd, QuantLinear) and m8.quantized_layers["swapped"] == 3
    # w8a8 quantises the head as well (q8_0's choice), keeps the embeddings, and layers whose in_features 32
    # does not divide stay float; a tied head gets its own int8 copy, the embedding table stays as it was
    t = Tiny()
    t.lm_head.weight = t.embed_tokens.weight
    emb = t.embed_tokens.weight.detach().clone()
    ma = quantize_model(t, "w8a8")
    assert isinstance(ma.lm_head, QuantLinear) and ma.lm_head.mode == "w8a8"
    assert isinstance(ma.embed_tokens, nn.Embedding) and torch.equal(ma.embed_tokens.weight, emb)
    assert ma.quantized_layers == {"mode": "w8a8", "swapped": 4, "kept_float": []}
    t2 = Tiny()
    t2.odd = nn.Linear(40, 8)
    assert quantize_model(t2, "w8a8").quantized_layers == {"mode": "w8a8", "swapped": 3, "kept_float": ["odd"]}
    with pytest.raises(ValueError, match="divisible by 32"):
        QuantLinear(40, 8, False, "w8a8")
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(Tiny(), "int3")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 activations in the Triton matmul need a GPU "
                    "(the interpreter computes bf16 wrongly)")
@pytest.mark.parametrize("m", [1, 64, 300])
def test_bf16_quantlinear_on_gpu(m):
    torch.manual_seed(1)
    lin = nn.Linear(4096, 1024, bias=False).cuda().bfloat16()
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    for mode in ("int8", "int4"):
        ql = QuantLinear.from_linear(lin, mode, 64)
        ref = x.float() @ ql.dequantized_weight().T
        torch.testing.assert_close(ql(x).float(), ref, atol=0.1, rtol=2e-2)


@pytest.mark.parametrize("mode,in_features,out_features", [
    ("int8", 136, 64),  # K % 16 != 0: torch's int8 packed op segfaulted / returned NaN for M > 1
    ("int8", 72, 40),
    ("int4", 64, 136),  # N % 16 != 0: torch's int4 packing refuses it
    ("int4", 128, 24),
])
def test_quantlinear_shapes_the_cpu_packed_ops_cannot_take_use_the_reference(mode, in_features, out_features):
    """Regression: the engine's tiny llama (hidden 64, intermediate 136) crashed inside _weight_int8pack_mm."""
    from kernels.quant_matmul import cpu_packed_op_fits

    assert not cpu_packed_op_fits(mode, out_features, in_features)
    torch.manual_seed(2)
    lin = nn.Linear(in_features, out_features, bias=False)
    ql = QuantLinear.from_linear(lin, mode, group_size=32 if mode == "int4" else 64)
    for m in (1, 2, 3, 7, 17):
        x = torch.randn(m, in_features)
        y = ql(x)
        assert torch.isfinite(y).all()
        # the reference path: exactly the dequantised weight in float32
        torch.testing.assert_close(y, wq_matmul_ref(x, ql.weight, ql.scale, ql.zero, zero_offset=ql.zero_offset),
                                   atol=1e-5, rtol=1e-5)


def test_quantlinear_takes_strided_bf16_activations():
    """The packed ops demand a contiguous last dimension; a strided bf16 view must still work."""
    torch.manual_seed(3)
    lin = nn.Linear(64, 32, bias=False)
    for mode in ("int8", "int4"):
        ql = QuantLinear.from_linear(lin, mode, group_size=32)
        x = torch.randn(5, 128).bfloat16()[:, ::2]
        ref = x.float() @ ql.dequantized_weight().T
        torch.testing.assert_close(ql(x).float(), ref, atol=5e-2, rtol=3e-2)
