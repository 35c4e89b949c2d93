"""A function-preserving widening of a Llama checkpoint (Net2Net-style): every hidden unit, attention head,
KV head and MLP unit repeated `factor` times and the weights that read them divided by `factor`, so the wide
model computes the same logits (up to float rounding) at ~factor^2 the weight bytes.

A benchmark device, not a better model: it predicts exactly what the source predicts, but its decode is bound
by memory bandwidth as a real 0.1B model's is, so speculative decoding can be measured where it pays (tiny-s
keeps tiny-l's real acceptance when drafting for it). Written at bench time under a cache folder, never
committed:

    python -m training.widen --src models/tandem-tiny-l --factor 5 --out /tmp/tiny-l-x5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY_L = ROOT / "models" / "tandem-tiny-l"
DEFAULT_FACTOR = 5  # tandem-tiny-l (5.5M parameters) -> 116M: 21x the bytes, decode bound by memory
CACHE = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "widen"
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _tile(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`w` repeated `rows` times along dim 0 and `cols` times along dim 1, divided by `cols`: an output
    dimension whose units are copied, an input dimension whose copies each carry 1/cols of the weight."""
    return w.repeat(rows, cols) / cols


def widen_state(state: dict[str, torch.Tensor], config: dict, factor: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The wide state dict (float32) and config. The hidden state is the source's tiled `factor` times
    (unit c * hidden + j is unit j), so RMSNorm sees the same mean of squares; heads are tiled the same way
    (head c * heads + i is head i, which reads KV head c * kv_heads + i // group: the source's grouping), so
    head_dim and the softmax scale stay; the final norm's weight is divided by `factor` so the tied (or
    widened) output head gives the source's logits, not `factor` times them."""
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    cfg = dict(config)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("biases are not handled by the widening")
    w = factor
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = t.to(torch.float32)
        if name == "model.embed_tokens.weight":
            out[name] = t.repeat(1, w)  # a lookup: each copy of a unit holds the unit's value
        elif name == "lm_head.weight":  # reads the final norm's output, already divided by w
            out[name] = t.repeat(1, w)
        elif name == "model.norm.weight":
            out[name] = t.repeat(w) / w
        elif name.endswith("layernorm.weight"):
            out[name] = t.repeat(w)
        elif name.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight",
                            ".gate_proj.weight", ".up_proj.weight", ".o_proj.weight", ".down_proj.weight")):
            out[name] = _tile(t, w, w)
        elif name.endswith("rotary_emb.inv_freq"):
            continue
        else:
            raise ValueError(f"widening does not know the tensor {name!r}")
    cfg.update(hidden_size=cfg["hidden_size"] * w, intermediate_size=cfg["intermediate_size"] * w,
               num_attention_heads=heads * w, num_key_value_heads=kv_heads * w, head_dim=head_dim,
               torch_dtype="float32")
    return out, cfg


def widen(src: Path, out: Path, factor: int) -> Path:
    """Writes the widened checkpoint of the HF folder `src` to `out` (config, float32 safetensors, the
    tokenizer and generation config copied, `widened_from.json`); returns `out`."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    wide, cfg = widen_state(state, config, factor)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in wide.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in COPIED:
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    params = sum(v.numel() for v in wide.values())
    (tmp / "widened_from.json").write_text(json.dumps({
        "source": str(src), "source_sha256": _digest(src), "factor": factor, "parameters": params,
        "note": "function-preserving widening, a benchmark device: same predictions as the source"}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _digest(src: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((src / name).read_bytes())
    return h.hexdigest()


def cached_wide(factor: int = DEFAULT_FACTOR, src: Path = TINY_L) -> Path:
    """The widened `src` under the cache folder, built on first use (keyed by the source's bytes)."""
    out = CACHE / f"{src.name}-x{factor}-{_digest(src)[:12]}"
    if not (out / "model.safetensors").exists():
        widen(src, out, factor)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=TINY_L)
    ap.add_argument("--factor", type=int, default=DEFAULT_FACTOR)
    ap.add_argument("--out", type=Path, default=None, help="default: the cache folder")
    args = ap.parse_args(argv)
    out = widen(args.src, args.out, args.factor) if args.out else cached_wide(args.factor, args.src)
    meta = json.loads((out / "widened_from.json").read_text())
    print(f"{out}: {meta['parameters'] / 1e6:.1f}M parameters ({meta['parameters'] * 4 / 1e6:.0f} MB float32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
