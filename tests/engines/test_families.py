"""Each model family beyond Llama against transformers' own model class on a tiny random checkpoint: logits of a
variable-length batch (max |diff| < 1e-4, float32), and greedy tokens through the user's `LLM(...)` entry with
prefix caching and chunked prefill on (a second pass over the same prompts hits the cache)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention_contexts import VarlenCausal  # conftest puts tests/ on the path
from tiny_checkpoints import build_tokenizer

from engines.llm import LLM
from engines.loader import load_checkpoint
from engines.sampling_params import SamplingParams

VOCAB = 384
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0], "original_max_position_embeddings": 40,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.75}

# family -> (config class, model class, config overrides): each exercises what the family is known for
FAMILIES = {
    "phi3-longrope-partial-rotary": ("Phi3Config", "Phi3ForCausalLM", {
        "rope_parameters": LONGROPE, "max_position_embeddings": 160, "original_max_position_embeddings": 40,
        "pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "embedding_multiplier": 6.0, "residual_multiplier": 0.4, "attention_multiplier": 0.05,
        "logits_scaling": 3.0}),
    "gemma2-softcap-window": ("Gemma2Config", "Gemma2ForCausalLM", {
        "sliding_window": 5, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0, "num_hidden_layers": 3}),
    "gemma3-local-rope-window": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": 4, "query_pre_attn_scalar": 24, "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe-shared-expert": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
        "shared_expert_intermediate_size": 56, "norm_topk_prob": False, "mlp_only_layers": [1]}),
    "qwen3-moe-renormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 5, "num_experts_per_tok": 3, "moe_intermediate_size": 40, "norm_topk_prob": True}),
}
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 120, 33, 2, 64, 19], [300, 12, 12, 45], [77] * 3 + list(range(20, 37))]


def build_family(out: Path, family: str) -> Path:
    import transformers

    config_cls, model_cls, overrides = FAMILIES[family]
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
              tie_word_embeddings=False)
    kw.update(overrides)
    config = getattr(transformers, config_cls)(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():  # larger-than-default init so logits are far from uniform and greedy is stable
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.normal_(0, 0.2)  # Gemma's (1 + w) and the others' w both far from their defaults
                if "gemma" not in family:
                    p.add_(1.0)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(out, vocab_size=VOCAB)
    return out


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    return {}


def _folder(family_dirs, tmp_path_factory, family: str) -> Path:
    if family not in family_dirs:
        family_dirs[family] = build_family(tmp_path_factory.mktemp(family), family)
    return family_dirs[family]


def _reference(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_logits_match_transformers(family_dirs, tmp_path_factory, family):
    folder = _folder(family_dirs, tmp_path_factory, family)
    ckpt = load_checkpoint(folder)
    assert ckpt.config.family == family.split("-")[0] + ("_moe" if "-moe" in family else "")
    seqs = [torch.tensor(p) for p in PROMPTS]
    ref = _reference(folder)
    with torch.no_grad():
        theirs = torch.cat([ref(s[None]).logits[0] for s in seqs])
        ids = torch.cat(seqs)
        positions = torch.cat([torch.arange(len(s)) for s in seqs])
        ours = ckpt.model.compute_logits(ckpt.model(ids, positions, VarlenCausal([len(s) for s in seqs])))
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    assert theirs.std().item() > 0.1  # logits far from uniform: the comparison means something


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_greedy_tokens_match_transformers_through_llm(family_dirs, tmp_path_factory, family):
    folder = _folder(family_dirs, tmp_path_factory, family)
    new = 14
    ref = _reference(folder)
    expected = []
    with torch.no_grad():
        for p in PROMPTS:  # plain argmax over transformers' full forward (no logits processors, EOS included)
            seq = list(p)
            for _ in range(new):
                seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
            expected.append(seq[len(p):])
    llm = LLM(folder, max_num_batched_tokens=8, block_size=4, enable_prefix_caching=True, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for _ in range(2):  # the second pass reuses the first's cached prompt pages
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        assert got == expected
    assert llm.stats()["prefix_cache_hits"] > 0


def test_phi3_longrope_positions_past_the_original_context_take_the_long_factors(family_dirs, tmp_path_factory):
    # transformers' own forward with a cache: the first 40 positions (short factors) cached, then 6 more (long
    # factors). (Its `generate` instead drops the cache when a sequence crosses the original context and
    # recomputes every position with the long factors; tandem keeps the cached pages, as this forward does.)
    folder = _folder(family_dirs, tmp_path_factory, "phi3-longrope-partial-rotary")
    ckpt = load_checkpoint(folder)
    ref = _reference(folder)
    seq = torch.randint(2, VOCAB, (46,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first = ref(seq[None, :40], use_cache=True)
        theirs = ref(seq[None, 40:], past_key_values=first.past_key_values, use_cache=True).logits[0]
        all_long = ref(seq[None]).logits[0, 40:]
        ours = ckpt.model.compute_logits(ckpt.model(seq, torch.arange(46), VarlenCausal([46])))[40:]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert (ours - all_long).abs().max().item() > 1e-2  # the two readings differ: the test can tell them apart


def test_moe_experts_quantise_to_int8_and_stay_close_to_transformers(family_dirs, tmp_path_factory):
    from kernels.quant_matmul import QuantLinear, quantize_model

    folder = _folder(family_dirs, tmp_path_factory, "mixtral")
    ckpt = load_checkpoint(folder)
    quantize_model(ckpt.model, "int8")
    experts = ckpt.model.model.layers[0].mlp.experts
    assert all(isinstance(e.gate_proj, QuantLinear) and isinstance(e.down_proj, QuantLinear) for e in experts)
    seq = torch.tensor(PROMPTS[0])
    with torch.no_grad():
        theirs = _reference(folder)(seq[None]).logits[0]
        ours = ckpt.model.compute_logits(ckpt.model(seq, torch.arange(len(seq)), VarlenCausal([len(seq)])))
    err = (ours - theirs).abs().max().item()
    assert 0 < err < 0.05 * theirs.abs().max().item()  # quantised (not equal), and close


def test_num_params_counts_every_expert(family_dirs, tmp_path_factory):
    ckpt = load_checkpoint(_folder(family_dirs, tmp_path_factory, "mixtral"))  # no biases: the count is exact
    assert ckpt.config.num_params == sum(p.numel() for p in ckpt.model.parameters())


@pytest.mark.parametrize("family", ["gemma2-softcap-window", "gemma3-local-rope-window"])
def test_windowed_layers_through_the_contiguous_cache_and_raw_pages_match_the_varlen_forward(
        family_dirs, tmp_path_factory, family):
    from attention_contexts import ContiguousCache, PagedKVAttention

    ckpt = load_checkpoint(_folder(family_dirs, tmp_path_factory, family))
    cfg, model = ckpt.config, ckpt.model
    seq = torch.tensor(PROMPTS[2])  # 20 tokens: past every window
    with torch.no_grad():
        full = model.compute_logits(model(seq, torch.arange(len(seq)), VarlenCausal([len(seq)])))
        cache = ContiguousCache(cfg.num_layers, 1, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        steps = [(0, 12)] + [(i, i + 1) for i in range(12, len(seq))]  # a prefill, then one token at a time
        rows = []
        for a, b in steps:
            cache.begin([b - a])
            rows.append(model.compute_logits(model(seq[a:b], torch.arange(a, b), cache))[-1])
            cache.end()
        assert (torch.stack(rows) - full[11:]).abs().max().item() < 1e-4
        # the kernels' context over raw pages (block 4): the prefix written, then the last 3 tokens at once
        bs, pages = 4, 8
        kc = [torch.zeros(pages, bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        vc = [torch.zeros_like(t) for t in kc]
        table = torch.arange(pages, dtype=torch.int32)[None]
        for a, b in ((0, 17), (17, 20)):
            attn = PagedKVAttention(kc, vc, table, torch.tensor([0, b - a], dtype=torch.int32),
                                    torch.tensor([b], dtype=torch.int32), torch.arange(a, b), max_query_len=b - a,
                                    max_context_len=b, backend="torch")
            out = model.compute_logits(model(seq[a:b], torch.arange(a, b), attn))
        assert (out - full[17:]).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["gemma2-softcap-window", "gemma3-local-rope-window"])
def test_triton_backend_attends_soft_capped_windowed_layers_in_the_kernel(family_dirs, tmp_path_factory, family,
                                                                           monkeypatch):
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")  # the KV write and attention run as Triton kernels on CPU
    import engines.attention as attention
    from engines.cuda_graphs import capturable

    def no_fallback(*a, **k):
        raise AssertionError("the Triton path fell back to the PyTorch masked attention")

    folder = _folder(family_dirs, tmp_path_factory, family)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(folder, block_size=4, max_model_len=64)
    expect = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    monkeypatch.setattr(attention, "paged_masked", no_fallback)  # (the plain run above attends through it)
    kernel = LLM(folder, attention_backend="triton", block_size=4, max_model_len=64, max_num_batched_tokens=128)
    assert kernel.engine.runner.use_kernel and capturable(kernel.engine.model)  # graphs may hold it now
    # what a CUDA graph replays, run eagerly: decodes padded to a bucket over static buffers
    kernel.engine.runner.enable_decode_graphs(4, kernel.engine.max_model_len, capture=False)
    served = []
    graphs = kernel.engine.runner.decode_graphs
    run = graphs.run
    graphs.run = lambda batch: served.append(batch.input_ids.shape[0]) or run(batch)
    assert [o.outputs[0].token_ids for o in kernel.generate(prompts, params)] == expect
    assert 3 in served  # three decoding sequences padded into the bucket of 4
    assert not capturable(load_checkpoint(_folder(family_dirs, tmp_path_factory, "mixtral")).model)


@pytest.mark.parametrize("family", ["gemma3-local-rope-window", "qwen3-moe-renormalised"])
def test_speculative_decoding_with_a_same_family_draft_keeps_greedy_tokens(family_dirs, tmp_path_factory, family):
    folder = _folder(family_dirs, tmp_path_factory, family)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = [o.outputs[0].token_ids for o in LLM(folder, block_size=4, max_model_len=64).generate(prompts, params)]
    spec = LLM(folder, draft_model=folder, num_speculative_tokens=3, block_size=4, max_model_len=64)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == plain
    assert spec.engine.stats()["spec_num_draft_tokens"] > 0  # drafts were made and verified


def test_int8_kv_cache_serves_windowed_soft_capped_layers(family_dirs, tmp_path_factory):
    folder = _folder(family_dirs, tmp_path_factory, "gemma2-softcap-window")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(folder, block_size=4, max_model_len=64).generate(prompts, params)
    int8 = LLM(folder, block_size=4, max_model_len=64, kv_cache_dtype="int8").generate(prompts, params)
    same = sum(a == b for p, q in zip(plain, int8) for a, b in zip(p.outputs[0].token_ids, q.outputs[0].token_ids))
    assert same >= 0.8 * 3 * 12  # int8 K/V (per token-head scales) keeps most greedy tokens
    assert [o.outputs[0].token_ids[:3] for o in int8] == [o.outputs[0].token_ids[:3] for o in plain]


# ---- the mixtures of experts in the C decoder stack (kernels/cpu_forward.py) -----------------------------------
MOE_C_STACK = ["mixtral", "qwen2-moe-shared-expert", "qwen3-moe-renormalised"]
needs_c_kernels = pytest.mark.skipif(not __import__("kernels.cpu_kernels").cpu_kernels.available(),
                                     reason="the CPU C kernels are not built here (no compiler or no AVX2)")


class _Seq:  # the few Sequence fields `ModelRunner.layout` reads
    def __init__(self, sid: int, toks: list[int], pages: list[int], computed: int):
        self.seq_id, self.token_ids, self.pages, self.num_computed = sid, toks, pages, computed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _c_step(runner, seqs: list[_Seq], num: list[int]) -> torch.Tensor:
    """The C stack's logits for every row of one step (its K/V written to the sequences' pages)."""
    b = runner.layout(seqs, num)
    hidden = runner.cpu_forward.forward(torch.tensor(b.ids), torch.tensor(b.host_positions), b.block_tables,
                                        torch.tensor(b.meta), b.max_context_len)
    for s, n in zip(seqs, num):
        s.num_computed += n
    return runner.cpu_forward.logits(hidden)


@needs_c_kernels
@pytest.mark.parametrize("family", MOE_C_STACK)
def test_moe_in_the_c_stack_matches_transformers_logits_over_a_prefill_and_decodes(family_dirs, tmp_path_factory,
                                                                                   family):
    folder = _folder(family_dirs, tmp_path_factory, family)
    llm = LLM(folder, block_size=4, max_model_len=64)
    runner, pool = llm.engine.runner, llm.core.pool
    assert runner.cpu_forward is not None  # the MoE layers run in the C stack, not the PyTorch forward
    rng = torch.Generator().manual_seed(5)
    full = [p + torch.randint(2, VOCAB, (6,), generator=rng).tolist() for p in PROMPTS]
    with torch.no_grad():
        theirs = [_reference(folder)(torch.tensor([f])).logits[0] for f in full]
    seqs = [_Seq(i, f, pool.allocate(llm.engine.model_id, -(-len(f) // 4)), 0) for i, f in enumerate(full)]
    try:
        # every prompt in one many-row step (each expert's tokens gathered), then 6 one-token steps of 3 rows
        got = _c_step(runner, seqs, [len(p) for p in PROMPTS])
        want = torch.cat([t[:len(p)] for t, p in zip(theirs, PROMPTS)])
        assert (got - want).abs().max().item() < 1e-4
        for j in range(6):
            got = _c_step(runner, seqs, [1, 1, 1])
            want = torch.stack([t[len(p) + j] for t, p in zip(theirs, PROMPTS)])
            assert (got - want).abs().max().item() < 1e-4
        assert want.std().item() > 0.1
    finally:
        for s in seqs:
            pool.release(s.pages)


@needs_c_kernels
@pytest.mark.parametrize("family", MOE_C_STACK)
def test_a_c_stack_decode_token_reads_only_its_chosen_experts(family_dirs, tmp_path_factory, family):
    """Every expert the router did not pick for this token (in any layer) is overwritten with NaN: the C step's
    logits stay finite and equal to the PyTorch forward's before the overwrite."""
    from engines.moe import route

    folder = _folder(family_dirs, tmp_path_factory, family)
    llm = LLM(folder, block_size=4, max_model_len=64)
    runner, pool, model = llm.engine.runner, llm.core.pool, llm.engine.model
    fast = runner.cpu_forward
    toks = PROMPTS[0] + [42]
    seq = _Seq(0, toks, pool.allocate(llm.engine.model_id, -(-len(toks) // 4)), 0)
    try:
        _c_step(runner, [seq], [len(toks) - 1])
        chosen = {}
        moes = {i: lay.mlp for i, lay in enumerate(model.model.layers) if hasattr(lay.mlp, "experts")}
        hooks = [m.gate.register_forward_hook(lambda mod, x, out, i=i: chosen.__setitem__(
            i, set(route(out, moes[i].top_k, moes[i].renormalize)[1][0].tolist()))) for i, m in moes.items()]
        runner.cpu_forward = None
        try:
            snapshot = runner.kv_view.clone()
            ref, _ = runner.execute([seq], [1])  # the PyTorch forward of the decode token
            runner.kv_view.copy_(snapshot)
        finally:
            runner.cpu_forward = fast
            for h in hooks:
                h.remove()
        assert len(chosen) == len(moes) and all(len(c) == moes[i].top_k for i, c in chosen.items())
        with torch.no_grad():
            for i, m in moes.items():
                for e, expert in enumerate(m.experts):
                    if e not in chosen[i]:
                        expert.fused[0].fill_(float("nan"))  # gate/up (the projections view it) and down
                        expert.down_proj.weight.fill_(float("nan"))
        got = _c_step(runner, [seq], [1])
        assert torch.isfinite(got).all()
        assert (got - ref).abs().max().item() < 1e-4
    finally:
        pool.release(seq.pages)  # (the NaNs are in this engine's loaded copy only, not the checkpoint)


@needs_c_kernels
@pytest.mark.parametrize("family,quant", [("mixtral", "int8"), ("qwen2-moe-shared-expert", "int8"),
                                          ("mixtral", "int4"), ("qwen2-moe-shared-expert", "w8a8")])
def test_quantised_experts_in_the_c_stack_match_the_pytorch_forward(family_dirs, tmp_path_factory, family,
                                                                     quant):
    from kernels.quant_matmul import QuantLinear

    llm = LLM(_folder(family_dirs, tmp_path_factory, family), quantization=quant, block_size=4, max_model_len=64)
    runner = llm.engine.runner
    fast = runner.cpu_forward
    assert fast is not None
    assert isinstance(llm.engine.model.model.layers[0].mlp.experts[0].gate_proj, QuantLinear)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got = llm.generate(prompts, params)
    runner.cpu_forward = None
    try:
        want = llm.generate(prompts, params)
    finally:
        runner.cpu_forward = fast
    # w8a8 / int4 quantise activations per 32 values: a value on a rounding edge may round the other way in one
    # path (float summation order), ~1e-2 in a logprob; the tokens stay equal
    tol = 5e-2 if quant in ("w8a8", "int4") else 2e-4
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < tol
