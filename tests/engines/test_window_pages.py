"""Sliding-window layers in their own page groups (engines/kv_layout.py): pages a window has passed go back to
the pool during decoding. Greedy tokens of long generations past the window stay transformers' (Gemma 2 and 3,
tiny random checkpoints built with transformers' own classes) with chunked prefill, prefix caching, preemption
and speculative decoding; the held pages of a long sequence's window groups stay bounded by the window."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_checkpoints import build_tokenizer

from engines.kv_layout import kv_layout
from engines.kv_pool import KVGeometry, KVPool
from engines.llm import LLM
from engines.sampling_params import SamplingParams

VOCAB = 256
BLOCK = 4
# family -> (config class, model class, window, overrides); 4 layers: Gemma 2's alternate, Gemma 3's 3:1
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", 6, {
        "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", 5, {
        "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
}
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 120, 33, 2, 64, 19], [200, 12, 12], list(range(20, 31))]
NEW = 40


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    import transformers

    out = {}
    for family, (config_cls, model_cls, window, overrides) in FAMILIES.items():
        path = tmp_path_factory.mktemp(family)
        config = getattr(transformers, config_cls)(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=72, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
            tie_word_embeddings=False, sliding_window=window, **overrides)
        torch.manual_seed(1)
        model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
        with torch.no_grad():  # far from uniform logits: greedy is stable, windows change the answer
            for name, p in model.named_parameters():
                p.normal_(0, 0.2 if "norm" in name else 0.08)
        model.save_pretrained(path, safe_serialization=True)
        build_tokenizer(path, vocab_size=VOCAB)
        out[family] = path
    return out


def transformers_greedy(folder: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():  # argmax over transformers' full forward at every step (its own window masks)
        for p in prompts:
            seq = list(p)
            for _ in range(new):
                seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(p):])
    return out


def generate(llm: LLM, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def expected(folders) -> dict[str, list[list[int]]]:
    return {f: transformers_greedy(folders[f], PROMPTS, NEW) for f in FAMILIES}


def test_layout_groups_global_and_window_layers_in_pages_of_equal_layer_count():
    g2 = kv_layout((4, None) * 13, 26)  # Gemma 2: 13 global + 13 window layers, one group each
    assert g2.layers_per_page == 13 and g2.group_windows == (None, 4)
    assert g2.layer_group[:4] == (1, 0, 1, 0) and g2.layer_slot[:4] == (0, 0, 1, 1)
    g3 = kv_layout(tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26)), 26)  # Gemma 3 1B: 4 + 22
    assert g3.layers_per_page == 4 and g3.group_windows == (None,) + (512,) * 6  # 22 = 5 x 4 + 2
    assert sorted(zip(g3.layer_group, g3.layer_slot)) == sorted(set(zip(g3.layer_group, g3.layer_slot)))
    assert not kv_layout((4096,) * 8, 8).grouped  # Mistral: every layer slides, nothing global: one group
    assert not kv_layout((), 8).grouped and not kv_layout((4, None) * 2, 4, free_window_pages=False).grouped


@pytest.mark.parametrize("family", list(FAMILIES))
def test_long_generation_past_the_window_keeps_transformers_tokens_with_pages_freed(folders, expected, family):
    # chunked prefill (8 tokens a step over 3 prompts), prefix caching (the second pass hits the first's pages)
    llm = LLM(folders[family], block_size=BLOCK, max_num_batched_tokens=8, max_model_len=128)
    runner = llm.engine.runner
    assert runner.kv_layout is not None and runner.kv_layout.grouped
    for _ in range(2):
        assert generate(llm, PROMPTS) == expected[family]
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    flat = LLM(folders[family], block_size=BLOCK, max_model_len=128, free_window_pages=False)
    assert flat.engine.runner.kv_layout is None and generate(flat, PROMPTS) == expected[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_held_window_pages_of_a_long_sequence_are_bounded_by_the_window(folders, family):
    window = FAMILIES[family][2]
    llm = LLM(folders[family], block_size=BLOCK, max_num_batched_tokens=8, max_model_len=128,
              enable_prefix_caching=False)
    sched, pool = llm.engine.scheduler, llm.core.pool
    layout = pool.geometries[llm.engine.model_id].layout
    seen = []
    update = sched.update

    def watched(out, sampled):
        touched = update(out, sampled)
        for seq in sched.running:
            held = [sum(p >= 0 for p in g) for g in seq.group_pages]
            seen.append((seq.num_computed, len(seq.pages), held, pool.num_used))
        return touched

    sched.update = watched
    generate(llm, [PROMPTS[0]], 90)
    bound = (window - 1) // BLOCK + 2  # blocks reaching back `window` keys from the next query, at most
    assert len(seen) > 80
    for computed, blocks, held, used in seen:
        assert blocks == -(-computed // BLOCK) or blocks == -(-(computed + 1) // BLOCK)  # global: every block
        assert all(h <= min(bound, blocks) for h in held), (computed, blocks, held)
        assert used == blocks + sum(held)  # the only sequence: the pool holds exactly its pages
    computed, blocks, held, _ = seen[-1]
    assert blocks >= 25 and len(held) == layout.num_groups - 1 and max(held) <= bound


def test_preemption_with_window_groups_keeps_the_tokens(folders, expected):
    # a pool of 56 one-layer pages (4 page groups): four sequences cannot all keep their global pages, some are
    # preempted and recomputed (their window pages came back too)
    prompts = PROMPTS + [list(range(40, 52))]
    ample = generate(LLM(folders["gemma3"], block_size=BLOCK, max_model_len=128), prompts)
    assert ample[:3] == expected["gemma3"]
    llm = LLM(folders["gemma3"], block_size=BLOCK, max_model_len=128, memory_bytes=56 * 2 * BLOCK * 2 * 16 * 4,
              max_num_batched_tokens=8)
    assert llm.core.pool.num_pages == 56
    assert generate(llm, prompts) == ample
    assert llm.engine.scheduler.num_preemptions > 0


def test_speculative_decoding_with_window_groups_keeps_the_tokens_and_frees_draft_pages(folders, expected):
    freed = []
    llm = LLM(folders["gemma2"], draft_model=folders["gemma2"], num_speculative_tokens=3, block_size=BLOCK,
              max_model_len=128)
    drafter = llm.engine.speculator.drafter
    rollback = drafter.rollback

    def watched(seq, num_valid):
        rollback(seq, num_valid)
        ds = seq.draft_state
        if ds is not None and ds.group_pages:
            freed.append(sum(p < 0 for g in ds.group_pages for p in g))

    drafter.rollback = watched
    assert generate(llm, PROMPTS) == expected["gemma2"]
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    assert freed and max(freed) > 0  # the draft's window pages were freed as verification moved on


def _holder(pool: KVPool, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=list(tokens), pages=[], group_pages=[], block_hashes=[], num_computed=0)


def test_prefix_hits_need_the_window_pages_the_next_token_reaches():
    # one global and one window group (window 6, block 4): a hit of n blocks needs window pages of the blocks
    # from (4n - 5) // 4 on; older ones may be gone
    layout = kv_layout((6, None), 2)
    pool = KVPool([KVGeometry(1, 1, 4, torch.float32, layout)], memory_bytes=40 * 2 * 4 * 4 * 4, block_size=4)
    tokens = list(range(100, 125))  # 6 full blocks + 1
    a = _holder(pool, tokens)
    pool.grow(0, a, 7)
    a.num_computed = 24
    pool.commit_blocks(0, a, 6)
    assert pool.free_outside_window(0, a) == 4  # blocks 0..3: their last keys (15) <= 24 - 6
    assert a.group_pages[0][:4] == [-1] * 4 and min(a.group_pages[0][4:]) >= 0
    hit = pool.match(0, tokens)
    assert hit.num_blocks == 6 and hit.group_pages[0][:4] == [-1] * 4  # the dropped pages are not needed
    assert hit.group_pages[0][4:] == a.group_pages[0][4:6]
    # a shorter prompt needs window pages the first sequence dropped: they are cached until reused
    short = tokens[:13]
    hit = pool.match(0, short)
    assert hit.num_blocks == 3 and hit.group_pages[0][0] == -1 and min(hit.group_pages[0][1:]) >= 0
    # evict every cached free page (allocate the whole free list): the short prompt's window pages are gone,
    # so its hit shrinks to where nothing reused is needed
    pool.allocate(0, pool.num_free)
    hit = pool.match(0, short)
    assert hit.num_blocks == 0
    hit = pool.match(0, tokens)  # the held pages still serve the long prompt
    assert hit.num_blocks == 6
