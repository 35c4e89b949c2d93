"""The kernels behind the model's attention seam: a tiny Llama decoding through PagedKVAttention (Triton
under the interpreter, and the torch references) gives the same greedy tokens as ContiguousCache, with
chunked prefill, two sequences on shuffled pages, and an int8 KV cache."""

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402
from attention_contexts import ContiguousCache, PagedKVAttention  # noqa: E402  (conftest puts tests/ on the path)

from engines.attention import resolve_backend  # noqa: E402
from engines.model import Transformer  # noqa: E402
from engines.model_config import ModelConfig  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4


def tiny_model() -> Transformer:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    return Transformer(cfg).eval().to(DEV)


@torch.inference_mode()
def greedy_contiguous(model, prompts, steps):
    cfg = model.config
    cache = ContiguousCache(cfg.num_layers, len(prompts), 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEV)
    outs = [[] for _ in prompts]
    ids = torch.tensor([t for p in prompts for t in p], device=DEV)
    pos = torch.cat([torch.arange(len(p)) for p in prompts]).to(DEV)
    lens = [len(p) for p in prompts]
    cache.begin(lens)
    h = model(ids, pos, cache)
    cache.end()
    last = torch.tensor(lens).cumsum(0) - 1
    nxt = model.compute_logits(h[last.to(DEV)]).argmax(-1).tolist()
    for _ in range(steps):
        for o, t in zip(outs, nxt):
            o.append(t)
        cache.begin([1] * len(prompts))
        h = model(torch.tensor(nxt, device=DEV), torch.tensor([lens[i] + len(outs[i]) - 1 for i in range(len(prompts))],
                                                                device=DEV), cache)
        cache.end()
        nxt = model.compute_logits(h).argmax(-1).tolist()
    return outs


class PagedRun:
    """Minimal paged bookkeeping for the test: shuffled pages per sequence, chunked prefill then decode."""

    def __init__(self, model, num_seqs, backend, kv_dtype):
        cfg = model.config
        self.model, self.backend, self.num_seqs = model, backend, num_seqs
        blocks = 40
        shape = (blocks, PAGE, cfg.num_kv_heads, cfg.head_dim)
        dtype = torch.int8 if kv_dtype == "int8" else torch.float32
        self.k = [torch.zeros(shape, dtype=dtype, device=DEV) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=DEV) for _ in range(cfg.num_layers)]
        self.ks = self.vs = None
        if kv_dtype == "int8":
            self.ks = [torch.zeros(shape[:3], device=DEV) for _ in range(cfg.num_layers)]
            self.vs = [torch.zeros(shape[:3], device=DEV) for _ in range(cfg.num_layers)]
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
        self.tables = perm[: num_seqs * 10].view(num_seqs, 10).int().to(DEV)
        self.lens = [0] * num_seqs

    @torch.inference_mode()
    def step(self, chunks):
        """chunks: list of token lists, one per sequence (may be empty). Returns last hidden per sequence."""
        ids, pos, slots, qsl = [], [], [], [0]
        for i, toks in enumerate(chunks):
            for j, t in enumerate(toks):
                p = self.lens[i] + j
                ids.append(t)
                pos.append(p)
                slots.append(int(self.tables[i, p // PAGE]) * PAGE + p % PAGE)
            qsl.append(qsl[-1] + len(toks))
        ctx = [self.lens[i] + len(c) for i, c in enumerate(chunks)]
        attn = PagedKVAttention(self.k, self.v, self.tables, torch.tensor(qsl, dtype=torch.int32, device=DEV),
                                torch.tensor(ctx, dtype=torch.int32, device=DEV), torch.tensor(slots, device=DEV),
                                max_query_len=max(len(c) for c in chunks), max_context_len=max(ctx),
                                backend=self.backend, k_scales=self.ks, v_scales=self.vs)
        h = self.model(torch.tensor(ids, device=DEV), torch.tensor(pos, device=DEV), attn)
        self.lens = ctx
        ends = [q - 1 for q in qsl[1:]]
        return [h[e] if chunks[i] else None for i, e in enumerate(ends)]


@torch.inference_mode()
def greedy_paged(model, prompts, steps, backend, kv_dtype="auto"):
    run = PagedRun(model, len(prompts), backend, kv_dtype)
    # chunked prefill: the first 5 tokens of every prompt, then the rest (over a cached prefix)
    run.step([p[:5] for p in prompts])
    last = run.step([p[5:] for p in prompts])
    nxt = [int(model.compute_logits(h[None]).argmax(-1)) for h in last]
    outs = [[] for _ in prompts]
    for _ in range(steps):
        for o, t in zip(outs, nxt):
            o.append(t)
        last = run.step([[t] for t in nxt])
        nxt = [int(model.compute_logits(h[None]).argmax(-1)) for h in last]
    return outs


PROMPTS = [[5, 17, 33, 2, 8, 91, 40, 3, 3, 60, 12], [7, 7, 21, 50, 64, 1, 9]]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_paged_backends_give_contiguous_cache_greedy_tokens(backend):
    model = tiny_model()
    expect = greedy_contiguous(model, PROMPTS, 4)
    assert greedy_paged(model, PROMPTS, 4, backend) == expect


def test_int8_kv_cache_keeps_greedy_tokens_on_tiny_model():
    model = tiny_model()
    assert greedy_paged(model, PROMPTS, 4, "triton", "int8") == greedy_contiguous(model, PROMPTS, 4)


def test_backend_resolution():
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("triton", "cpu") == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend("flash", "cpu")
