"""Fused small kernels against their references: RMSNorm + residual, SiLU-mul, and the rejection sampler
(exact token equality, greedy semantics, and the output distribution equal to the target's)."""

import os

import torch

# CPU: run kernels under the Triton interpreter (kernels.launch also interprets CPU tensors when triton was
# imported first without it). GPU: the flag would turn triton.language's own helpers into interpreted ones.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from kernels.fused import (  # noqa: E402
    rejection_sample,
    rejection_sample_ref,
    rmsnorm_residual,
    rmsnorm_residual_ref,
    silu_mul,
    silu_mul_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rmsnorm_residual_matches_reference_and_model(dtype):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 80, generator=g).to(dtype), torch.randn(5, 80, generator=g).to(dtype)
    w = (torch.rand(80, generator=g) + 0.5).to(dtype)
    x, r, w = x.to(DEV), r.to(DEV), w.to(DEV)
    out, res = rmsnorm_residual(x, r, w, 1e-6)
    ref_out, ref_res = rmsnorm_residual_ref(x, r, w, 1e-6)
    assert torch.equal(res, ref_res)
    tol = 1e-5 if dtype == torch.float32 else 1e-3  # GPU sqrt/div are approximate
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    # the reference is the model's own RMSNorm
    from engines.model import RMSNorm
    norm = RMSNorm(80, 1e-6).to(DEV).to(dtype)
    norm.weight.data.copy_(w)
    torch.testing.assert_close(ref_out, norm(x + r), atol=0, rtol=0)
    plain, same = rmsnorm_residual(x, None, w, 1e-6)
    assert same is x
    torch.testing.assert_close(plain, norm(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(3, 1500, generator=g) * 4).to(dtype), torch.randn(3, 1500, generator=g).to(dtype)
    out = silu_mul(gate.to(DEV), up.to(DEV)).cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, silu_mul_ref(gate, up), atol=tol, rtol=tol)


def random_case(b, k, vocab, seed, greedy_draft=False):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(b, k + 1, vocab, generator=g) * 2, -1)
    draft = torch.softmax(torch.randn(b, k, vocab, generator=g) * 2, -1)
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).reshape(b, k)
    ua, ur = torch.rand(b, k, generator=g), torch.rand(b, generator=g)
    return ids, (None if greedy_draft else draft), target, ua, ur


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_rejection_sampler_matches_reference(greedy_draft):
    ids, draft, target, ua, ur = random_case(6, 4, 300, seed=2, greedy_draft=greedy_draft)
    ua[0] = 0.0  # row 0 accepts every draft with p > 0: exercises the bonus token
    args = [x.to(DEV) if x is not None else None for x in (ids, draft, target, ua, ur)]
    out, n = rejection_sample(*args)
    ref_out, ref_n = rejection_sample_ref(ids, draft, target, ua, ur)
    assert torch.equal(out.cpu(), ref_out) and torch.equal(n.cpu(), ref_n)
    assert int(n[0]) == 4 and (n < 4).any()  # both outcomes happen in this case
    for row in range(6):
        emitted = out[row, : int(n[row]) + 1]
        assert (emitted >= 0).all() and (out[row, int(n[row]) + 1:] == -1).all()
        assert torch.equal(emitted[: int(n[row])].cpu(), ids[row, : int(n[row])])


def test_rejection_sampler_greedy_keeps_drafts_while_they_equal_the_argmax():
    vocab, k = 50, 3
    target_ids = torch.tensor([[7, 8, 9, 10], [7, 8, 9, 10]])
    target = torch.nn.functional.one_hot(target_ids, vocab).float()
    drafts = torch.tensor([[7, 8, 9], [7, 3, 9]])
    ua, ur = torch.rand(2, k), torch.rand(2)
    out, n = rejection_sample(drafts.to(DEV), None, target.to(DEV), ua.to(DEV), ur.to(DEV))
    assert out.cpu().tolist() == [[7, 8, 9, 10], [7, 8, -1, -1]]
    assert n.cpu().tolist() == [3, 1]


def test_rejection_sampler_output_follows_the_target_distribution():
    # Leviathan et al.: the first emitted token is distributed exactly as the target p, whatever q is
    vocab, trials = 8, 4000
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    ids = torch.multinomial(q, trials, replacement=True, generator=g)[:, None]
    target = p.expand(trials, 2, vocab).contiguous()
    draft = q.expand(trials, 1, vocab).contiguous()
    out, _ = rejection_sample_ref(ids, draft, target, torch.rand(trials, 1, generator=g), torch.rand(trials, generator=g))
    freq = torch.bincount(out[:, 0], minlength=vocab).float() / trials
    assert (freq - p).abs().max() < 0.03
