"""Quantisation through the engine on tiny random checkpoints: int8/int4 weights (quantised on load) and
int8/fp8 KV pools keep the float engine's greedy tokens except at near-ties, with log-probabilities within a
stated tolerance; quantised pools hold more tokens in the same bytes and store what the model wrote; the
Triton kernels (interpreter) read a quantised pool like the torch path does."""

from __future__ import annotations

import os
import random

# CPU: the Triton kernels run under the interpreter (see tests/test_kernels_*.py)
os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from engines import LLM, EngineCore, EngineSpec, PoolSpec, SamplingParams  # noqa: E402
from engines.model import Transformer  # noqa: E402
from engines.model_config import ModelConfig  # noqa: E402
from kernels.cpu_kernels import PackedLinear  # noqa: E402
from kernels.quant_matmul import QuantLinear  # noqa: E402

BLOCK = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    # hidden 64, intermediate 136: the shapes whose int8 down_proj crashed torch's packed op
    return tiny_checkpoint("llama", num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def float_run(llama):
    return generate(llama)


def prompts(n: int = 6, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, 384) for _ in range(rng.randint(10, 30))]} for _ in range(n)]


def generate(model, n_prompts: int = 6, max_tokens: int = 8, **options):
    # small token budget: prompts prefill in chunks that read earlier chunks' (quantised) K/V from the pool
    llm = LLM(model, block_size=BLOCK, max_num_batched_tokens=8, **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts(n_prompts), params)
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs)
    return llm, [o.outputs[0] for o in outs]


def compare(ref, got, tol: float) -> int:
    """Walk each sequence while the contexts agree: the log-probabilities of tokens in both top-5 lists differ
    by at most `tol`, and a different greedy token is allowed only where the float model's top-2 margin is
    under 2 * tol (a near-tie). Returns the number of positions compared."""
    compared = 0
    for a, b in zip(ref, got):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            la, lb = a.logprobs[i], b.logprobs[i]
            common = set(la) & set(lb)
            assert common
            worst = max(abs(la[t].logprob - lb[t].logprob) for t in common)
            assert worst <= tol, f"position {i}: logprob off by {worst:.4f} > {tol}"
            compared += 1
            if ta != tb:
                top = sorted((lp.logprob for lp in la.values()), reverse=True)
                assert top[0] - top[1] < 2 * tol, f"position {i}: token {tb} != {ta} at margin {top[0] - top[1]:.3f}"
                break  # the contexts differ from here on
    return compared


@pytest.mark.parametrize("options,tol,min_compared", [
    (dict(quantization="int8"), 0.08, 40),
    (dict(quantization="int4", quantization_group_size=64), 0.5, 20),
    (dict(kv_cache_dtype="int8"), 0.04, 45),
    (dict(kv_cache_dtype="fp8"), 0.25, 45),
    (dict(quantization="int8", kv_cache_dtype="int8"), 0.1, 40),
])
def test_quantised_engines_keep_the_float_greedy_tokens_except_at_near_ties(llama, float_run, options, tol,
                                                                            min_compared):
    _, ref = float_run
    _, got = generate(llama, **options)
    assert compare(ref, got, tol) >= min_compared  # 6 prompts x 8 tokens = 48 positions at most


def test_weights_are_quantised_on_load_except_lm_head_embeddings_and_odd_shapes(llama):
    llm8 = LLM(llama, block_size=BLOCK, quantization="int8")
    m8 = llm8.engine.model
    assert m8.quantized_layers == {"mode": "int8", "swapped": 14, "kept_float": []}  # 7 linears x 2 layers
    assert isinstance(m8.model.layers[0].mlp.down_proj, QuantLinear)
    assert m8.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    # (the float head in panels where the C decoder stack took the model)
    assert type(m8.lm_head) in (nn.Linear, PackedLinear) and type(m8.model.embed_tokens) is nn.Embedding
    m4 = LLM(llama, block_size=BLOCK, quantization="int4", quantization_group_size=64).engine.model
    # down_proj's in_features 136 is no multiple of 64: it stays float
    assert m4.quantized_layers["swapped"] == 12
    assert m4.quantized_layers["kept_float"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert m4.model.layers[0].self_attn.q_proj.weight.dtype == torch.uint8


def test_quantised_kv_pools_hold_more_tokens_in_the_same_bytes(llama):
    budget = 1 << 20
    pools = {d: LLM(llama, block_size=BLOCK, memory_bytes=budget, kv_cache_dtype=d).core.pool
             for d in ("auto", "bfloat16", "int8", "fp8")}
    # 2 (K, V) x 2 layers x 4 tokens x 2 heads x 16 dims: float32 4 bytes each, int8 1 + a float32 scale
    # per token-head (16 + 4 bytes per 16 values), fp8 1 byte (its scales live outside the pages)
    assert {d: p.page_bytes for d, p in pools.items()} == {"auto": 2048, "bfloat16": 1024, "int8": 640, "fp8": 512}
    assert {d: p.num_pages for d, p in pools.items()} == {"auto": 512, "bfloat16": 1024, "int8": 1638, "fp8": 2048}
    assert pools["int8"].num_pages / pools["auto"].num_pages > 3.1
    assert pools["int8"].num_pages / pools["bfloat16"].num_pages > 1.55


def _prefill_pages(model, **options):
    llm = LLM(model, block_size=BLOCK, **options)
    eng = llm.engine
    eng.add_request(prompts(1, seed=3)[0]["prompt_token_ids"],
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "r")
    eng.step()  # the whole prompt in one step; the sequence keeps its pages while it decodes
    (seq,) = eng.scheduler.running
    pages = torch.tensor(seq.pages)
    view = llm.core.pool.view(eng.model_id)[pages]
    scales = llm.core.pool.scales(eng.model_id)
    return view, (scales[pages] if scales is not None and scales.dim() > 2 else scales), seq.num_computed


def test_int8_and_fp8_pages_hold_the_kv_the_model_wrote(llama):
    ref, none, n = _prefill_pages(llama)
    assert none is None
    q8, s8, _ = _prefill_pages(llama, kv_cache_dtype="int8")
    assert q8.dtype == torch.int8 and s8.shape == (q8.shape[0], 2, 2, BLOCK, 2)
    scale = s8[:, :, 0].permute(1, 0, 2, 3).reshape(2, -1, 2)[:, :n]
    deq = q8[:, :, 0].permute(1, 0, 2, 3, 4).reshape(2, -1, 2, 16)[:, :n].float() * scale[..., None]
    # layer 0 (the same inputs in every engine) as [K/V, token, head, dim]
    k_ref = ref[:, :, 0].permute(1, 0, 2, 3, 4).reshape(2, -1, 2, 16)[:, :n]
    # scales sit beside the data without overlapping it: amax / 127 per token-head, half a step of error
    torch.testing.assert_close(scale, k_ref.abs().amax(-1) / 127, rtol=1e-6, atol=0)
    assert ((deq - k_ref).abs() <= scale[..., None] / 2 * (1 + 1e-5)).all()
    f8, s, _ = _prefill_pages(llama, kv_cache_dtype="fp8")
    assert f8.dtype == torch.float8_e4m3fn and torch.equal(s, torch.ones(2, 2))
    got = f8[:, :, 0].permute(1, 0, 2, 3, 4).reshape(2, -1, 2, 16)[:, :n].float()
    assert torch.equal(got, k_ref.to(torch.float8_e4m3fn).float())  # scale 1.0: the e4m3 cast itself


def test_the_triton_kernels_read_an_int8_pool_like_the_torch_path(llama):
    """write_kv + paged_attention (interpreted) against write_kv_ref + the runner's torch attention."""
    _, torch_out = generate(llama, n_prompts=2, max_tokens=4, kv_cache_dtype="int8")
    llm, tri_out = generate(llama, n_prompts=2, max_tokens=4, kv_cache_dtype="int8", attention_backend="triton")
    assert llm.engine.runner.use_kernel
    assert [o.token_ids for o in tri_out] == [o.token_ids for o in torch_out]
    assert compare(torch_out, tri_out, 1e-4) == 8


def random_transformer(vocab: int = 64, hidden: int = 32, layers: int = 1, seed: int = 0) -> Transformer:
    """A built model (no checkpoint, no transformers), weights scaled up so greedy choices are not near-ties."""
    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
                                 "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128})
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    return model


def test_quantising_a_built_transformer_leaves_the_callers_model_float():
    model = random_transformer()
    llm = LLM(model, block_size=BLOCK, quantization="int8")
    assert isinstance(llm.engine.model.model.layers[0].mlp.up_proj, QuantLinear)
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("spec,pool,match", [
    (dict(quantization="int3"), {}, "quantization='int3' is invalid"),
    (dict(quantization="int4", quantization_group_size=48), {}, "quantization_group_size=48"),
    ({}, dict(kv_cache_dtype="int4"), "kv_cache_dtype='int4'"),
])
def test_invalid_quantisation_options_fail_at_start_up_naming_the_field(llama, spec, pool, match):
    with pytest.raises(ValueError, match=match):
        EngineCore([EngineSpec("m", llama, **spec)], PoolSpec(**pool))


def count_graph_runs(runner) -> list[int]:
    """Instrument the runner's DecodeGraphs.run: the batch sizes it served."""
    served = []
    graphs = runner.decode_graphs
    run = graphs.run

    def counted(batch):
        served.append(batch.input_ids.shape[0])
        return run(batch)

    graphs.run = counted
    return served


def test_padded_static_decode_forward_gives_the_eager_tokens(llama):
    """What a CUDA graph replays, run eagerly on the CPU: decode batches padded to a bucket (slot -1, no query
    for the padding) over static buffers, here on an int8 pool with the interpreted Triton kernels."""
    from engines.cuda_graphs import bucket_sizes

    assert bucket_sizes(1) == [1] and bucket_sizes(6) == [1, 2, 4, 6] and bucket_sizes(64)[-2:] == [32, 64]
    _, eager = generate(llama, n_prompts=3, max_tokens=4, kv_cache_dtype="int8")
    # one prefill step for all three, so they decode together
    llm = LLM(llama, block_size=BLOCK, max_num_batched_tokens=128, kv_cache_dtype="int8", attention_backend="triton")
    llm.engine.runner.enable_decode_graphs(4, llm.engine.max_model_len, capture=False)
    served = count_graph_runs(llm.engine.runner)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    static = [o.outputs[0] for o in llm.generate(prompts(3), params)]
    assert 3 in served  # three decoding sequences padded into the bucket of 4
    assert [o.token_ids for o in static] == [o.token_ids for o in eager]
    assert compare(eager, static, 1e-4) == 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run by bench/gpu_check.sh)")
@pytest.mark.parametrize("options", [{}, dict(quantization="int8", kv_cache_dtype="int8")])
def test_cuda_graph_replay_gives_the_eager_greedy_tokens(options):
    model = random_transformer(vocab=256, hidden=64, layers=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    rng = random.Random(5)
    batch = [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(3, 40))]} for _ in range(5)]
    outs = {}
    for graphs in (False, True):
        llm = LLM(model, device="cuda", block_size=16, memory_bytes=64 << 20, max_num_seqs=8, cuda_graphs=graphs,
                  **options)
        runner = llm.engine.runner
        assert runner.use_kernel and (runner.decode_graphs is not None) == graphs
        served = count_graph_runs(runner) if graphs else []
        outs[graphs] = [o.outputs[0] for o in llm.generate(batch, params)]
        if graphs:
            assert sorted(runner.decode_graphs.graphs) == [1, 2, 4, 8] and 5 in served
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert compare(outs[False], outs[True], 1e-3) == 60


def test_two_models_share_an_int8_pool_each_with_its_own_scale_offsets(llama, tiny_checkpoint):
    """Different geometries place their scales at different offsets inside the shared pages; a page reused by
    the other model (zeroed on the hand-over) must serve it exactly as a pool of its own would."""
    large = tiny_checkpoint("qwen3", num_layers=3, num_heads=4, num_kv_heads=1, head_dim=32, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompt = prompts(1, seed=9)[0]
    alone = {name: LLM(path, block_size=BLOCK, kv_cache_dtype="int8").generate(prompt, params)[0].outputs[0]
             for name, path in (("small", llama), ("large", large))}
    core = EngineCore([EngineSpec("small", llama), EngineSpec("large", large)],
                      PoolSpec(memory_bytes=12 * 1024, block_size=BLOCK, kv_cache_dtype="int8",
                               enable_prefix_caching=False))
    # the larger page: qwen3's 3 layers x 1 head x (32 int8 + one float32 scale) x 4 tokens x K/V = 864 bytes,
    # rounded up to 64
    assert core.pool.page_bytes == 896 and core.pool.num_pages == 13
    shared, owners = {}, []
    for name in ("small", "large", "small"):  # each run takes over pages the previous model wrote
        eng = core.engines[name]
        emitted = []
        eng.add_request(prompt["prompt_token_ids"], params, f"{name}{len(shared)}", emit=emitted.append)
        while eng.has_work():
            eng.step()
        assert emitted[-1].finished
        shared[f"{name}{len(shared)}"] = emitted[-1].outputs[0]
        owners.append(list(core.pool.owner))
    large_pages = {p for p, o in enumerate(owners[1]) if o == 1}
    assert len(large_pages) >= 5 and all(owners[0][p] == 0 for p in large_pages)
    assert all(owners[2][p] == 0 for p in large_pages)
    for rid, got in shared.items():
        want = alone[rid.rstrip("0123456789")]
        assert got.token_ids == want.token_ids
        assert compare([want], [got], 1e-5) == 12


@pytest.mark.parametrize("mode", ["w8a8", "bf16"])
def test_cpu_only_modes_are_refused_on_cuda_before_anything_loads(tiny_checkpoint, mode):
    with pytest.raises(ValueError, match=f"{mode}.*CPU only"):
        EngineCore([EngineSpec(name="x", model=tiny_checkpoint(), quantization=mode)], device="cuda")
