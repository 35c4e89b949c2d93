"""int8 weights with a scale per block of 32 (GGUF Q8_0's own layout, kernels/quant_formats.py): the format's
dequantisation against the gguf package's, the C kernels (weight-only and w8a8), the Triton matmul and
QuantLinear against the dequantised reference, at every row count the paths split at."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from kernels import cpu_kernels as ck  # noqa: E402
from kernels.quant_matmul import CPU_KERNEL_MAX_ROWS, QuantLinear, dequantize_int8, wq_matmul, wq_matmul_ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_kernels = pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.build_error}")


def q8_0(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """A random weight quantised to Q8_0 by the gguf package: (int8 q [N, K], float16 d [N, K / 32], gguf's own
    dequantisation [N, K]), q and d read from the blocks' bytes (fp16 d, then 32 int8)."""
    import gguf

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, 34)
    d = torch.from_numpy(blocks[:, :2].copy().view(np.float16)).reshape(n, k // 32)
    q = torch.from_numpy(blocks[:, 2:].copy().view(np.int8)).reshape(n, k)
    return q, d, gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)


def test_grouped_dequantisation_is_the_gguf_packages():
    q, d, ref = q8_0(24, 96)
    assert torch.equal(dequantize_int8(q, d), torch.from_numpy(ref))
    assert int(q.abs().max()) == 127 and len(set(d.flatten().tolist())) > 24  # a scale per block, not per row


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 5, 12, 13, 40])
@pytest.mark.parametrize("n,k", [(64, 256), (37, 96), (7, 32)])
def test_c_grouped_int8_matches_the_dequantised_reference(m, n, k):
    """Weight-only: float32 activations against the dequantised weight (the GEMV tiles up to 12 rows, the
    widened SGEMM from 13; odd N takes the scalar tail), with and without bias, on one and two threads."""
    q, d, _ = q8_0(n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    b = torch.randn(n)
    wf = dequantize_int8(q, d)
    for bias in (None, b):
        torch.testing.assert_close(ck.linear_int8(x, q, d, bias), F.linear(x, wf, bias), rtol=1e-5, atol=1e-5)
    torch.set_num_threads(2)
    try:
        torch.testing.assert_close(ck.linear_int8(x, q, d, b), F.linear(x, wf, b), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(1)
    if k > 32:  # the per-block scales matter: one scale per row (the block scales' mean) gives another answer
        per_row = F.linear(x, q.float() * d.mean(1, keepdim=True))
        assert (per_row - F.linear(x, wf)).abs().max() > 1e-3


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k", [(64, 256), (37, 96)])
def test_c_grouped_w8a8_matches_the_reference(m, n, k):
    """w8a8: the activations quantised per 32 (`quantize_act_q8`), integer dots scaled by both blocks' scales
    (llama.cpp's q8_0 x q8_0): the reference up to float summation order."""
    q, d, _ = q8_0(n, k, seed=m + 2 * n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    b = torch.randn(n)
    ref = ck.linear_w8a8_ref(x, q, d, b)
    tol = dict(rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    torch.testing.assert_close(ck.linear_w8a8(x, q, d, b), ref, **tol)
    full = F.linear(x, dequantize_int8(q, d), b)  # float activations: differs by the activation rounding only
    assert 0 < (ck.linear_w8a8(x, q, d, b) - full).norm() / full.norm() < 0.02


@needs_kernels
def test_c_grouped_int8_refuses_in_features_not_divisible_by_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        ck.linear_int8(torch.randn(2, 48), torch.zeros(8, 48, dtype=torch.int8), torch.ones(8, 1))


@pytest.mark.parametrize("m", [1, 5, 33])
def test_triton_grouped_int8_matches_the_reference(m):
    n, k = 40, 192  # N not a multiple of the tile; K spans 3 tiles -> split-K with a ragged split
    q, d, _ = q8_0(n, k, seed=m)
    x = torch.randn(m, k)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = wq_matmul_ref(x, q, d)
    torch.testing.assert_close(ref, F.linear(x, dequantize_int8(q, d)))
    for split in (1, 2, 3):
        got = wq_matmul(x.to(dev), q.to(dev), d.to(dev), split_k=split).cpu()
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "w8a8"])
@pytest.mark.parametrize("rows", [1, 13, CPU_KERNEL_MAX_ROWS + 5])
def test_quantlinear_grouped_int8_forward(mode, rows):
    n, k = 48, 128
    q, d, _ = q8_0(n, k, seed=rows)
    lin = QuantLinear(k, n, True, mode, int8_group=32)
    lin.weight.copy_(q)
    lin.scale.copy_(d)
    lin.bias.data.normal_()
    assert lin.scale.shape == (n, k // 32) and "scale per 32" in repr(lin)
    x = torch.randn(rows, k)
    ref = F.linear(x, dequantize_int8(q, d), lin.bias)
    y = lin(x)
    if mode == "int8":
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:
        assert (y - ref).norm() / ref.norm() < 0.02
    torch.testing.assert_close(lin.dequantized_weight(), dequantize_int8(q, d), rtol=0, atol=0)
    with pytest.raises(ValueError, match="blocks of 32"):
        QuantLinear(48, 8, False, "int8", int8_group=32)
