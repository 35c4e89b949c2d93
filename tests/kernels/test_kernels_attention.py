"""Paged attention: the Triton kernel (interpreter on CPU tensors) against the PyTorch reference and against
plain dense causal attention, on adversarial shapes (permuted pages, odd lengths, GQA, splits)."""

import os

import torch

# CPU: run kernels under the Triton interpreter (kernels.launch also interprets CPU tensors when triton was
# imported first without it). GPU: the flag would turn triton.language's own helpers into interpreted ones.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16


def make_batch(ctx_lens, q_lens, hq, hkv, d, dtype=torch.float32, seed=0, extra_pages=3):
    """Random K/V scattered over shuffled pages; returns kernel inputs plus the dense K/V per sequence."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-c // PAGE) for c in ctx_lens]
    num_blocks = sum(pages_per_seq) + extra_pages
    perm = torch.randperm(num_blocks, generator=g)
    k_cache = torch.randn(num_blocks, PAGE, hkv, d, generator=g)  # garbage in unused rows on purpose
    v_cache = torch.randn(num_blocks, PAGE, hkv, d, generator=g)
    max_pages = max(pages_per_seq) + 1
    tables = torch.zeros(len(ctx_lens), max_pages, dtype=torch.int32)
    dense, used = [], 0
    for b, c in enumerate(ctx_lens):
        ids = perm[used:used + pages_per_seq[b]]
        used += pages_per_seq[b]
        tables[b, : len(ids)] = ids.int()
        tables[b, len(ids):] = perm[-1]  # stale entries past the context must never be read
        dense.append((k_cache[ids].reshape(-1, hkv, d)[:c], v_cache[ids].reshape(-1, hkv, d)[:c]))
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    to = dict(device=DEV)
    return (q.to(dtype).to(**to), k_cache.to(dtype).to(**to), v_cache.to(dtype).to(**to), tables.to(**to),
            qsl.to(**to), ctx.to(**to)), dense


def dense_attention(q, dense, q_lens, hq):
    """Independent oracle: SDPA per sequence, queries at the end of their context."""
    outs, start = [], 0
    for (k, v), n in zip(dense, q_lens):
        qs = q[start:start + n].float().cpu().transpose(0, 1)
        rep = hq // k.shape[1]
        ks = k.float().repeat_interleave(rep, 1).transpose(0, 1)
        vs = v.float().repeat_interleave(rep, 1).transpose(0, 1)
        c = k.shape[0]
        mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_odd_lengths_match_reference_and_dense_attention(group):
    ctx_lens, q_lens, hkv, d = [1, 15, 16, 17], [1, 1, 1, 1], 2 if group < 8 else 1, 32
    args, dense = make_batch(ctx_lens, q_lens, hkv * group, hkv, d, seed=group)
    out = paged_attention(*args)
    ref = paged_attention_ref(*args)
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.cpu(), dense_attention(args[0], dense, q_lens, hkv * group), atol=1e-5, rtol=1e-5)


def test_prefill_chunk_over_cached_prefix_and_speculative_verify():
    # seq0: prefill from scratch (17 tokens); seq1: chunk of 20 over a 280-token cached prefix (~300);
    # seq2: speculative verify, k+1 = 5 queries over 40 cached; seq3: plain decode.
    ctx_lens, q_lens = [17, 300, 45, 33], [17, 20, 5, 1]
    args, dense = make_batch(ctx_lens, q_lens, 8, 2, 32, seed=1)
    out = paged_attention(*args)
    torch.testing.assert_close(out.cpu(), paged_attention_ref(*args).cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu(), dense_attention(args[0], dense, q_lens, 8), atol=1e-5, rtol=1e-5)


def test_split_kv_with_empty_splits_equals_unsplit():
    # 8 splits over contexts of 1 and 17 tokens leave most splits empty; 300 uses them all
    ctx_lens, q_lens = [1, 17, 300], [1, 1, 1]
    args, _ = make_batch(ctx_lens, q_lens, 4, 1, 32, seed=2)
    ref = paged_attention_ref(*args)
    for splits in (2, 8):
        torch.testing.assert_close(paged_attention(*args, num_splits=splits).cpu(), ref.cpu(), atol=1e-5, rtol=1e-5)


def test_fp16_and_head_dim_not_power_of_two():
    args, dense = make_batch([16, 33], [3, 1], 6, 3, 24, dtype=torch.float16, seed=3)  # group 2, D=24
    out = paged_attention(*args)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), paged_attention_ref(*args).float().cpu(), atol=2e-3, rtol=2e-3)


def test_int8_kv_dequantised_in_kernel():
    args, _ = make_batch([15, 40], [1, 4], 4, 2, 32, seed=4)
    q, k, v, tables, qsl, ctx = args
    ks = k.abs().amax(-1) / 127
    vs = v.abs().amax(-1) / 127
    k8 = torch.round(k / ks[..., None]).to(torch.int8)
    v8 = torch.round(v / vs[..., None]).to(torch.int8)
    out = paged_attention(q, k8, v8, tables, qsl, ctx, k_scale=ks, v_scale=vs)
    ref = paged_attention_ref(q, k8, v8, tables, qsl, ctx, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=1e-5, rtol=1e-5)
    # and close to the unquantised attention (int8 KV costs little accuracy)
    full = paged_attention_ref(*args)
    assert (out - full).abs().max().item() < 0.05


def test_fp8_kv_reads_match_torch_casts():
    args, _ = make_batch([17, 30], [2, 1], 8, 8, 16, seed=5)
    q, k, v, tables, qsl, ctx = args
    ks, vs = torch.tensor([0.02], device=DEV), torch.tensor([0.03], device=DEV)
    k8 = (k / ks).clamp(-448, 448).to(torch.float8_e4m3fn)  # torch's own cast is the oracle for fp8 values
    v8 = (v / vs).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = paged_attention(q, k8, v8, tables, qsl, ctx, k_scale=ks, v_scale=vs, num_splits=2)
    expect = paged_attention_ref(q, k8.float() * ks, v8.float() * vs, tables, qsl, ctx)
    torch.testing.assert_close(out.cpu(), expect.cpu(), atol=1e-5, rtol=1e-5)


def test_empty_query_sequences_are_skipped():
    args, dense = make_batch([5, 9, 3], [2, 0, 3], 2, 2, 16, seed=6)
    out = paged_attention(*args)
    torch.testing.assert_close(out.cpu(), paged_attention_ref(*args).cpu(), atol=1e-5, rtol=1e-5)


def test_custom_scale_is_honoured():
    args, _ = make_batch([20], [4], 2, 1, 16, seed=7)
    s = 0.5 / math.sqrt(16)
    torch.testing.assert_close(paged_attention(*args, scale=s).cpu(), paged_attention_ref(*args, scale=s).cpu(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 output stores round wrongly in the Triton "
                    "interpreter; checked natively on a GPU only")
def test_bf16_on_gpu():
    args, _ = make_batch([15, 300, 45], [1, 20, 5], 32, 8, 128, dtype=torch.bfloat16, seed=8)
    out = paged_attention(*args)
    torch.testing.assert_close(out.float(), paged_attention_ref(*args).float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(paged_attention(*args, num_splits=4).float(), out.float(), atol=2e-2, rtol=2e-2)


def test_kernel_runs_when_triton_was_imported_without_interpret_flag():
    # `triton.jit` fixes interpreted-vs-compiled at import; our launcher must not depend on import order
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); import triton, torch\n"
            "from kernels.paged_attention import paged_attention, paged_attention_ref\n"
            "q = torch.randn(1, 2, 16); k = torch.randn(2, 16, 1, 16); v = torch.randn(2, 16, 1, 16)\n"
            "bt = torch.tensor([[1, 0]], dtype=torch.int32); qsl = torch.tensor([0, 1], dtype=torch.int32)\n"
            "ctx = torch.tensor([20], dtype=torch.int32)\n"
            "print(float((paged_attention(q, k, v, bt, qsl, ctx) - paged_attention_ref(q, k, v, bt, qsl, ctx))"
            ".abs().max()))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stderr
    assert float(res.stdout.strip()) < 1e-5


def test_int64_metadata_as_the_engine_runner_builds_it():
    args, _ = make_batch([17, 40], [3, 1], 4, 2, 16, seed=9)
    q, k, v, tables, qsl, ctx = args
    long_args = (q, k, v, tables.long(), qsl.long(), ctx.long())
    torch.testing.assert_close(paged_attention(*long_args, num_splits=2), paged_attention_ref(*args),
                               atol=1e-5, rtol=1e-5)


def capped_window_oracle(q, dense, q_lens, hq, window, softcap, scale=None):
    """Independent oracle in float64: explicit scores, soft-cap c * tanh(s / c), then a mask of the keys
    i - window < j <= i (transformers' eager order)."""
    outs, start = [], 0
    for (k, v), n in zip(dense, q_lens):
        rep = hq // k.shape[1]
        qs = q[start:start + n].double().cpu()
        ks = k.double().repeat_interleave(rep, 1)
        vs = v.double().repeat_interleave(rep, 1)
        c = k.shape[0]
        s = torch.einsum("qhd,khd->hqk", qs, ks) * (scale or qs.shape[-1] ** -0.5)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        i = torch.arange(c - n, c)[:, None]
        j = torch.arange(c)[None, :]
        ok = (j <= i) & ((j > i - window) if window is not None else True)
        outs.append(torch.einsum("hqk,khd->qhd", s.masked_fill(~ok, float("-inf")).softmax(-1), vs))
        start += n
    return torch.cat(outs).float()


@pytest.mark.parametrize("window,softcap", [(7, None), (None, 2.0), (20, 1.5), (1, None), (500, 3.0)])
def test_sliding_window_and_softcap_match_reference_and_oracle(window, softcap):
    # decodes past the window (40, 33), a prefill chunk crossing it over a cached prefix (300: 20 new), a
    # verify run of 5 (45), a fresh prompt (17); window 500 covers every context; window 1 sees only itself
    ctx_lens, q_lens = [40, 300, 45, 17, 33], [1, 20, 5, 17, 1]
    args, dense = make_batch(ctx_lens, q_lens, 8, 2, 32, seed=11)
    out = paged_attention(*args, window=window, softcap=softcap)
    ref = paged_attention_ref(*args, window=window, softcap=softcap)
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=1e-5, rtol=1e-5)
    oracle = capped_window_oracle(args[0], dense, q_lens, 8, window, softcap)
    torch.testing.assert_close(ref.cpu(), oracle, atol=1e-5, rtol=1e-5)
    if window is not None and window < 40:  # the window changed the answer (the test can fail)
        assert (ref - paged_attention_ref(*args, softcap=softcap)).abs().max().item() > 1e-3


def test_sliding_window_reads_no_page_outside_it():
    # pages wholly before the window hold NaN: a kernel that read them (even masked) would return NaN
    ctx_lens, q_lens, window = [70, 100], [1, 3], 16
    args, dense = make_batch(ctx_lens, q_lens, 4, 2, 16, seed=12)
    q, k, v, tables, qsl, ctx = args
    k, v = k.clone(), v.clone()
    for b, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        first_needed = (c - n - window + 1) // PAGE
        dead = tables[b, :first_needed].long()
        k[dead] = float("nan")
        v[dead] = float("nan")
    out = paged_attention(q, k, v, tables, qsl, ctx, window=window, num_splits=1)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), capped_window_oracle(q, dense, q_lens, 4, window, None),
                               atol=1e-5, rtol=1e-5)


def test_sliding_window_with_splits_and_int8():
    ctx_lens, q_lens, window = [1, 17, 300, 129], [1, 1, 1, 4], 50
    args, _ = make_batch(ctx_lens, q_lens, 4, 1, 32, seed=13)
    ref = paged_attention_ref(*args, window=window, softcap=5.0)
    for splits in (2, 8):
        torch.testing.assert_close(paged_attention(*args, num_splits=splits, window=window, softcap=5.0).cpu(),
                                   ref.cpu(), atol=1e-5, rtol=1e-5)
    q, k, v, tables, qsl, ctx = args
    ks, vs = k.abs().amax(-1) / 127, v.abs().amax(-1) / 127
    k8, v8 = torch.round(k / ks[..., None]).to(torch.int8), torch.round(v / vs[..., None]).to(torch.int8)
    out = paged_attention(q, k8, v8, tables, qsl, ctx, k_scale=ks, v_scale=vs, window=window, softcap=5.0)
    torch.testing.assert_close(out.cpu(), paged_attention_ref(q, k8, v8, tables, qsl, ctx, k_scale=ks, v_scale=vs,
                                                              window=window, softcap=5.0).cpu(), atol=1e-5, rtol=1e-5)


def test_window_and_softcap_arguments_are_checked():
    args, _ = make_batch([5], [1], 2, 1, 16, seed=14)
    with pytest.raises(ValueError, match="window"):
        paged_attention(*args, window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(*args, softcap=0.0)
