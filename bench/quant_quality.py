"""Quantisation quality on the default large model's held-out set: perplexity with float32 weights, int8 and
int4 weight-only quantisation (both the CPU serving path, whose packed ops take bf16 activations, and the
weights-only effect with float32 activations), and with an int8 or fp8 KV cache (K/V stored quantised,
attention in float32). Prints a table and writes bench/results/quant_quality.json.

    .venv/bin/python bench/quant_quality.py [--model models/tandem-tiny-l] [--chunks 64] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engines.attention import DenseCausal  # noqa: E402
from engines.corpus import load_corpus_split  # noqa: E402
from engines.loader import load_checkpoint  # noqa: E402
from engines.tokenizer import Tokenizer  # noqa: E402
from kernels.kv_write import FP8_MAX, quantize_kv_int8  # noqa: E402
from kernels.quant_matmul import QuantLinear, quantize_model  # noqa: E402

LIMITS = {"int8": 0.01, "int4 g64": 0.05, "int8 KV": 0.01}  # issue 8: allowed perplexity increase


class QuantizedKV:
    """DenseCausal attention over K/V that went through the pool's int8 (per token-head) or fp8 storage."""

    def __init__(self, batch: int, seqlen: int, kind: str):
        self.inner, self.kind = DenseCausal(batch, seqlen), kind

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "int8":
            q, s = quantize_kv_int8(x)
            return (q.float() * s[..., None]).to(x.dtype)
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().to(x.dtype)  # scale 1.0

    def forward(self, layer: int, q, k, v):
        return self.inner.forward(layer, q, self._store(k), self._store(v))


def heldout_chunks(tokenizer: Tokenizer, seq_len: int, limit: int) -> list[list[int]]:
    chunks = []
    for _, text in load_corpus_split("heldout"):
        ids = tokenizer.encode(text)
        chunks += [ids[i:i + seq_len + 1] for i in range(0, len(ids) - seq_len, seq_len)]
    step = max(1.0, len(chunks) / limit)
    return [chunks[int(i * step)] for i in range(min(limit, len(chunks)))]


@torch.inference_mode()
def perplexity(model, chunks: list[list[int]], kv: str | None = None, batch_size: int = 8) -> float:
    total, count = 0.0, 0
    for i in range(0, len(chunks), batch_size):
        x = torch.tensor(chunks[i:i + batch_size], dtype=torch.long)
        inp, tgt = x[:, :-1], x[:, 1:]
        b, s = inp.shape
        attn = DenseCausal(b, s) if kv is None else QuantizedKV(b, s, kv)
        hidden = model(inp.reshape(-1), torch.arange(s).repeat(b), attn)
        logits = model.compute_logits(hidden)
        total += F.cross_entropy(logits, tgt.reshape(-1), reduction="sum").item()
        count += tgt.numel()
    return math.exp(total / count)


def weights_only(model, mode: str, group: int):
    """The float model with each quantised layer's dequantised weight: isolates the weight error."""
    q = quantize_model(copy.deepcopy(model), mode, group)
    for mod in list(q.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, QuantLinear):
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight.data = child.dequantized_weight()
                if child.bias is not None:
                    lin.bias.data = child.bias.data.float()
                setattr(mod, child_name, lin)
    return q


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models/tandem-tiny-l"))
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench/results/quant_quality.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.model, dtype="float32")
    model = ckpt.model
    chunks = heldout_chunks(Tokenizer.from_pretrained(args.model), args.seq_len, args.chunks)
    g = args.group_size
    variants = [
        ("float32", lambda: (model, None)),
        ("int8", lambda: (quantize_model(copy.deepcopy(model), "int8"), None)),
        ("int8 weights only (fp32 activations)", lambda: (weights_only(model, "int8", g), None)),
        (f"int4 g{g}", lambda: (quantize_model(copy.deepcopy(model), "int4", g), None)),
        (f"int4 g{g} weights only (fp32 activations)", lambda: (weights_only(model, "int4", g), None)),
        ("int8 KV", lambda: (model, "int8")),
        ("fp8 e4m3 KV (scale 1.0)", lambda: (model, "fp8")),
    ]
    rows, base = [], None
    for name, build in variants:
        m, kv = build()
        ppl = perplexity(m, chunks, kv)
        base = ppl if base is None else base
        inc = ppl / base - 1
        limit = LIMITS.get(name)
        rows.append({"variant": name, "perplexity": round(ppl, 4), "increase": round(inc, 5),
                     "limit": limit, "within_limit": None if limit is None else inc <= limit})
    tokens = sum(len(c) - 1 for c in chunks)
    print(f"model {args.model} ({ckpt.config.num_params / 1e6:.1f}M params), {len(chunks)} held-out chunks, "
          f"{tokens} tokens, {time.perf_counter() - t0:.0f} s")
    print(f"\n{'variant':<42} {'ppl':>9} {'increase':>9} {'limit':>6}  ok")
    for r in rows:
        lim = "" if r["limit"] is None else f"{100 * r['limit']:.0f}%"
        ok = "" if r["within_limit"] is None else ("yes" if r["within_limit"] else "NO")
        print(f"{r['variant']:<42} {r['perplexity']:>9.3f} {100 * r['increase']:>8.2f}% {lim:>6}  {ok}")
    result = {"bench": "quant_quality", "model": str(args.model), "params": ckpt.config.num_params,
              "chunks": len(chunks), "tokens": tokens, "seq_len": args.seq_len, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
