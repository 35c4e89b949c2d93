"""Long-context quality of the embedded default models: held-out next-token loss per position bucket on
windows longer than the models were trained on, as shipped and under RoPE variants applied at load time
(NTK-aware base change, linear position interpolation, a sliding window). Prints a table and writes
bench/results/long_context.json.

    .venv/bin/python bench/long_context.py [--models models/tandem-tiny-s models/tandem-tiny-l] [--seq-len 2048]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from engines.loader import load_checkpoint  # noqa: E402
from engines.model import _base_inv_freq  # noqa: E402
from training.train import token_cache  # noqa: E402

BUCKETS = [(0, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096)]


def variant_inv_freq(model, variant: str) -> torch.Tensor:
    """The rotary frequencies of a variant: `base` (as shipped), `ntkF` (base * F ** (d / (d - 2))),
    `linearF` (positions divided by F)."""
    cfg = model.config
    dim = cfg.head_dim
    if variant == "base" or variant.startswith("window"):
        return _base_inv_freq(cfg.rope_theta, dim)
    if variant.startswith("ntk"):
        factor = float(variant[3:])
        return _base_inv_freq(cfg.rope_theta * factor ** (dim / (dim - 2)), dim)
    if variant.startswith("linear"):
        return _base_inv_freq(cfg.rope_theta, dim) / float(variant[6:])
    raise SystemExit(f"unknown variant {variant!r}")


def bucket_losses(model, windows: np.ndarray, variant: str, batch_size: int) -> list[float]:
    """Mean loss of the positions in each bucket (prediction of token p+1 from positions 0..p)."""
    model.inv_freq = variant_inv_freq(model, variant)
    window = int(variant[6:]) if variant.startswith("window") else None
    for layer in model.model.layers:
        layer.self_attn.attn_options = {"window": window} if window else {}
    seq = windows.shape[1] - 1
    total = torch.zeros(seq, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            x = torch.from_numpy(windows[i:i + batch_size].astype(np.int64))
            logits = model.dense_logits(x[:, :-1]).float()
            loss = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # [B, S]
            total += loss.sum(0).double()
    per_pos = total / len(windows)
    return [float(per_pos[lo:min(hi, seq)].mean()) if lo < seq else float("nan") for lo, hi in BUCKETS]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["models/tandem-tiny-s", "models/tandem-tiny-l"])
    p.add_argument("--variants", nargs="+", default=["base", "ntk8", "linear8", "window256"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--windows", type=int, default=24, help="held-out windows (evenly spaced)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "long_context.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for path in args.models:
        ckpt = load_checkpoint(path, dtype="float32")
        heldout = token_cache(Path(path), "heldout")
        starts = np.linspace(0, len(heldout) - args.seq_len - 2, args.windows).astype(np.int64)
        windows = np.stack([heldout[s:s + args.seq_len + 1] for s in starts])
        for variant in args.variants:
            t0 = time.monotonic()
            losses = bucket_losses(ckpt.model, windows, variant, args.batch_size)
            rows.append({"model": path, "variant": variant, "buckets": dict(zip(
                [f"{lo}-{hi}" for lo, hi in BUCKETS], losses)), "seconds": round(time.monotonic() - t0, 1)})
            cells = " ".join(f"{v:7.3f}" for v in losses)
            print(f"{Path(path).name:15s} {variant:10s} {cells}  ({rows[-1]['seconds']} s)", flush=True)
    print("buckets: " + " ".join(f"{lo}-{hi}" for lo, hi in BUCKETS))
    write_results(Path(args.out), {"seq_len": args.seq_len, "windows": args.windows, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
