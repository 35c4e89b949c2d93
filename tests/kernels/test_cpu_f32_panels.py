"""The float32 linears over the weight packed in panels (`cpu_kernels.pack_f32`, read in address order): every
path (1-8 rows, one or two panels a pass, more rows in 6-row blocks over two panels at a time, column tails past the last panel, K past
1024 and not a multiple of 4, bias, two threads, with its bf16 copy, the AVX2 build) gives the bits of the
[K, N] weight through the streams and register blocks; the SGEMM rows read strips unpacked from the panels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_kernels as ck

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.build_error}")]

SHAPES = [(256, 256), (37, 19), (40, 63), (1409, 96), (3, 5), (200, 1030), (77, 1283), (2048, 640)]  # (N, K)


def _column_major(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k, generator=g).t().contiguous().t()  # [N, K], as cpu_weight_layout stores it


@pytest.mark.parametrize("rows", [range(1, 9), range(9, 20), range(32, 65, 9)])
def test_the_panels_give_the_kn_weights_bits(register_tiles, rows):
    g = torch.Generator().manual_seed(rows.start)
    for n, k in SHAPES:
        w = _column_major(n, k, g)
        packed = ck.pack_f32(w)
        assert packed.shape == ((n + 31) // 32, k, 32) and torch.equal(ck.unpack_f32(packed, n), w)
        b = torch.randn(n, generator=g)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            for blocks in (0, ck.NEVER):  # the [K, N] weight through the 5-8 row register blocks, or the streams
                ck.block_max_kn(blocks)
                for bias in (None, b):
                    assert torch.equal(ck.linear_packed(x, packed, n, bias), ck.linear(x, w, bias)), (m, n, k)
    torch.set_num_threads(2)
    try:
        for m in (1, 4, 11):
            x = torch.randn(m, w.shape[1], generator=g)
            assert torch.equal(ck.linear_packed(x, packed, n, b), ck.linear(x, w, b))
    finally:
        torch.set_num_threads(1)


def test_the_panels_put_each_weight_where_the_kernels_read_it():
    """pack_f32's layout, element by element: panel p, row k, value i is column 32p + i; past N, zeros."""
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    packed = ck.pack_f32(w)
    assert packed.shape == (3, 3, 32)
    for n in range(70):
        for k in range(3):
            assert packed[n // 32, k, n % 32] == w[n, k]
    assert not packed[2, :, 6:].any()


def test_with_a_bf16_copy_the_panels_read_it(register_tiles):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(77, 1030, generator=g).bfloat16().float().t().contiguous().t()
    packed, w16 = ck.pack_f32(w), ck.bf16_copy(w)
    for m in (1, 5, 12):
        x = torch.randn(m, 1030, generator=g)
        assert torch.equal(ck.linear_packed(x, packed, 77, weight16=w16), ck.linear(x, w))


def test_the_sgemm_rows_read_strips_of_the_panels():
    if ck.sgemm_address() is None:
        pytest.skip("this torch exports no SGEMM")
    rows = ck.sgemm_min_rows()
    ck.sgemm_min_rows(1)
    try:
        g = torch.Generator().manual_seed(5)
        for n, k in ((600, 1283), (37, 19), (256, 96)):  # strips of 256 columns and a ragged last one
            w = _column_major(n, k, g)
            x, b = torch.randn(17, k, generator=g), torch.randn(n, generator=g)
            torch.testing.assert_close(ck.linear_packed(x, ck.pack_f32(w), n, b), F.linear(x, w, b),
                                       rtol=1e-4, atol=1e-4)
    finally:
        ck.sgemm_min_rows(rows)


def test_the_avx2_build_reads_the_panels_to_the_same_bits():
    if not ck.simd_level().startswith("avx512"):
        pytest.skip(f"this CPU runs the {ck.simd_level()} paths only: nothing to compare")
    wide, narrow = ck.build_variant("native"), ck.build_variant("avx2")
    g = torch.Generator().manual_seed(11)
    for n, k in ((1409, 96), (77, 1283), (40, 63)):
        w = _column_major(n, k, g)
        packed, wt = ck.pack_f32(w), w.t().contiguous()
        for m in (1, 2, 3, 5, 6, 7, 8, 11):
            x = torch.randn(m, k, generator=g)
            outs = []
            for lib in (wide, narrow):
                for panels in (True, False):
                    y = torch.empty(m, n)
                    if panels:
                        assert lib.tk_linear_f32_panels(x.data_ptr(), m, k, packed.data_ptr(), None, n, None,
                                                        y.data_ptr(), 1) == 0
                    else:
                        lib.tk_linear_f32(x.data_ptr(), m, k, wt.data_ptr(), n, n, None, y.data_ptr(), 1)
                    outs.append(y)
            assert all(torch.equal(o, outs[0]) for o in outs[1:]), (m, n, k)


def test_linear_packed_refuses_what_is_not_packed():
    w = torch.randn(64, 32)
    with pytest.raises(ValueError, match="pack_f32"):
        ck.linear_packed(torch.randn(2, 32), w, 64)
    with pytest.raises(ValueError, match="bf16_copy"):
        ck.linear_packed(torch.randn(2, 32), ck.pack_f32(w), 64, weight16=w.bfloat16())


def test_packing_a_group_frees_its_kn_weight_and_keeps_the_modules_working():
    import gc
    import weakref

    from engines.attention import DenseCausal
    from engines.model import Transformer, cpu_weight_layout
    from engines.model_config import ModelConfig
    from kernels.cpu_forward import _pack_panels

    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                                 "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "max_position_embeddings": 64})
    torch.manual_seed(0)
    model = cpu_weight_layout(Transformer(cfg).eval())
    att, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(3, 64)
    want_qkv = torch.cat([att.q_proj(x), att.k_proj(x), att.v_proj(x)], dim=1)
    want_down = mlp.down_proj(torch.randn(3, 96, generator=torch.Generator().manual_seed(1)))
    q_weight = att.q_proj.weight.detach().clone()
    gone = weakref.ref(att.fused[0])
    _pack_panels(att, ("q_proj", "k_proj", "v_proj"))
    _pack_panels(mlp, ("down_proj",))
    gc.collect()
    assert gone() is None  # nothing holds the [K, N] weight any more
    assert type(att.q_proj) is ck.PackedLinear and att.fused[0].dim() == 3
    assert att.q_proj.packed.data_ptr() == att.fused[0].data_ptr()  # the members view the group's panels
    assert torch.equal(att.q_proj.weight, q_weight)
    got_qkv = torch.cat([att.q_proj(x), att.k_proj(x), att.v_proj(x)], dim=1)
    torch.testing.assert_close(got_qkv, want_qkv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlp.down_proj(torch.randn(3, 96, generator=torch.Generator().manual_seed(1))),
                               want_down, rtol=1e-5, atol=1e-5)
    assert model.forward(torch.arange(5), torch.arange(5), DenseCausal(1, 5)).isfinite().all()  # the torch forward


def test_the_decoder_stack_and_an_untied_head_give_the_same_logprobs_over_panels(tmp_path, monkeypatch):
    from tiny_checkpoints import build_checkpoint

    from engines import LLM, SamplingParams

    path = build_checkpoint(tmp_path / "llama", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=96, seed=9, tie_word_embeddings=False)
    rows = ck.sgemm_min_rows()
    engines = {}
    try:
        for flag in ("0", "1"):
            monkeypatch.setenv("TANDEM_CPU_PANELS", flag)
            engines[flag] = LLM(path, max_model_len=256)
            assert engines[flag].engine.runner.cpu_forward is not None
        ck.sgemm_min_rows(ck.NEVER)  # many-row prefill through the register tiles both ways (the same bits)
        layer = engines["1"].engine.model.model.layers[0]
        assert {type(m) for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj,
                                  layer.mlp.down_proj)} == {ck.PackedLinear}
        assert type(engines["1"].engine.model.lm_head) is ck.PackedLinear  # untied: packed too
        assert type(engines["0"].engine.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        hidden = torch.randn(3, 64)
        fast = [e.engine.runner.cpu_forward for e in (engines["0"], engines["1"])]
        assert torch.equal(fast[0].logits(hidden), fast[1].logits(hidden))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
        prompts = [[5, 9, 17, 33, 2, 8] * 5, [7] * 3]
        kn, packed = (engines[f].generate(prompts, params) for f in ("0", "1"))
        for a, b in zip(kn, packed):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert [{t: p.logprob for t, p in d.items()} for d in a.outputs[0].logprobs] == [
                {t: p.logprob for t, p in d.items()} for d in b.outputs[0].logprobs]
    finally:
        ck.sgemm_min_rows(rows)
