"""KV bytes one sequence holds as it grows, with sliding-window layers' pages freed (`free_window_pages`, the
default) and without (every layer keeps its KV for the whole sequence).

Measured: tiny random Gemma 2 (alternating window / global layers) and Gemma 3 (5 window : 1 global) models
generating one long greedy sequence through `LLM(...)`; the pool's used pages x page bytes read after each step
(prefix caching off: nothing else is held). Computed: the same accounting (engines/kv_layout.py's groups, one
page per group and block, window pages held = blocks - blocks_outside) for the published Gemma geometries, bf16
KV, block 16. Prints tables, writes bench/results/kv_window.json.

    .venv/bin/python bench/kv_window.py [--window 128] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.results_meta import write_results  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402
from engines.families import FamilyTraits  # noqa: E402
from engines.kv_layout import blocks_outside, kv_layout  # noqa: E402
from engines.model import Transformer  # noqa: E402
from engines.model_config import ModelConfig  # noqa: E402

BLOCK = 16
# published geometries (config.json): layers, KV heads, head_dim, sliding window, window layers pattern, context
MODELS = {
    "gemma-2-2b": (26, 4, 256, 4096, "gemma2", 8192),
    "gemma-2-9b": (42, 8, 256, 4096, "gemma2", 8192),
    "gemma-3-1b": (26, 1, 256, 512, "gemma3", 32768),
    "gemma-3-4b": (34, 4, 256, 1024, "gemma3", 131072),
    "gemma-3-27b": (62, 16, 128, 1024, "gemma3", 131072),
}


def windows_of(pattern: str, layers: int, window: int) -> tuple[int | None, ...]:
    if pattern == "gemma2":  # even layers slide
        return tuple(window if i % 2 == 0 else None for i in range(layers))
    return tuple(window if (i + 1) % 6 else None for i in range(layers))  # Gemma 3: every 6th is global


def held_bytes(windows: tuple[int | None, ...], layers: int, kv_heads: int, head_dim: int, elem: int,
               length: int, free: bool) -> int:
    """KV bytes a sequence of `length` computed tokens holds under the engine's page accounting."""
    layout = kv_layout(windows, layers, free)
    page = 2 * layout.layers_per_page * BLOCK * kv_heads * head_dim * elem
    blocks = -(-length // BLOCK)
    pages = sum(blocks - min(blocks, blocks_outside(length, w, BLOCK)) for w in layout.group_windows)
    return pages * page


def tiny(family: str, window: int, tokens: int) -> Transformer:
    layers = 8 if family == "gemma2" else 6
    traits = FamilyTraits(family=family, norm_layout="sandwich", norm_offset=1.0, hidden_act="gelu_tanh",
                          embed_scale=128 ** 0.5, attn_scale=32 ** -0.5,
                          attn_softcap=50.0 if family == "gemma2" else None,
                          final_softcap=30.0 if family == "gemma2" else None,
                          layer_windows=windows_of(family, layers, window),
                          local_rope_theta=10000.0 if family == "gemma3" else None)
    cfg = ModelConfig("Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM", vocab_size=512,
                      hidden_size=128, intermediate_size=256, num_layers=layers, num_heads=4, num_kv_heads=2,
                      head_dim=32, max_position_embeddings=tokens + 256, qk_norm=family == "gemma3",
                      traits=traits)
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def measure(family: str, window: int, tokens: int, points: list[int]) -> dict:
    out = {}
    for free in (False, True):
        model = tiny(family, window, tokens)
        llm = LLM(model, block_size=BLOCK, max_model_len=tokens + 64, enable_prefix_caching=False,
                  free_window_pages=free, memory_bytes=64 << 20)
        pool, sched = llm.core.pool, llm.engine.scheduler
        seen: dict[int, int] = {}
        update = sched.update

        def watched(sched_out, sampled, update=update, sched=sched, pool=pool, seen=seen):
            touched = update(sched_out, sampled)
            for seq in sched.running:
                seen[seq.num_computed] = pool.num_used * pool.page_bytes
            return touched

        sched.update = watched
        # two tokens past the longest point: the sequence is still running with `tokens` computed
        params = SamplingParams(temperature=0.0, max_tokens=tokens - 32 + 2, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(3, 35))}], params)
        out["freed" if free else "kept"] = {n: seen[n] for n in points}
        layers, kv, hd = model.config.num_layers, model.config.num_kv_heads, model.config.head_dim
        computed = {n: held_bytes(model.config.traits.layer_windows, layers, kv, hd, 4, n, free) for n in points}
        out[("freed" if free else "kept") + "_computed"] = computed
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    points = [n for n in (64, 128, 256, 512, 1024, 2048, 4096) if n <= args.tokens]
    result: dict = {"block_size": BLOCK, "window": args.window, "tokens": args.tokens, "measured": {},
                    "computed": {}}
    print(f"measured, tiny models (float32 KV, window {args.window}, block {BLOCK}): KiB held by one sequence")
    print(f"{'model':8} {'length':>7} {'kept':>9} {'freed':>9} {'ratio':>6}")
    for family in ("gemma2", "gemma3"):
        m = measure(family, args.window, args.tokens, points)
        for n in points:
            k, f = m["kept"][n], m["freed"][n]
            assert k == m["kept_computed"][n] and f == m["freed_computed"][n], (family, n, m)  # the accounting
            print(f"{family:8} {n:7d} {k / 1024:9.1f} {f / 1024:9.1f} {f / k:6.2f}")
        result["measured"][family] = {"kept_bytes": m["kept"], "freed_bytes": m["freed"]}
    lengths = [1024, 4096, 8192, 32768, 131072]
    print(f"\ncomputed, published geometries (bf16 KV, block {BLOCK}): MiB held by one sequence, kept -> freed")
    print(f"{'model':12} " + " ".join(f"{n:>17}" for n in lengths))
    for name, (layers, kv, hd, window, pattern, ctx) in MODELS.items():
        windows = windows_of(pattern, layers, window)
        row = {}
        cells = []
        for n in lengths:
            if n > ctx:
                cells.append(f"{'-':>17}")
                continue
            k, f = held_bytes(windows, layers, kv, hd, 2, n, False), held_bytes(windows, layers, kv, hd, 2, n, True)
            row[n] = {"kept_bytes": k, "freed_bytes": f}
            cells.append(f"{k / 2**20:7.0f} -> {f / 2**20:6.0f}")
        result["computed"][name] = {"layers": layers, "kv_heads": kv, "head_dim": hd, "window": window,
                                    "lengths": row}
        print(f"{name:12} " + " ".join(cells))
    path = write_results(ROOT / "bench" / "results" / "kv_window.json", result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
