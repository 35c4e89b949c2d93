"""CPU weight-only quantisation benchmark: batch-1 decode tokens/s of a random-weight ~300M-parameter Llama
in float32, int8 and int4 (kernels.quant_matmul.QuantLinear on torch's packed CPU ops), against the
machine's measured copy bandwidth and the bandwidth roofline (weight bytes read per token / bandwidth).
Prints a table and writes bench/results/quant_cpu.json.

    .venv/bin/python bench/quant_cpu.py [--threads 1] [--layers 20] [--rounds 3] [--steps 4]

The CPU is shared (2 cores, background jobs), so the modes are measured round-robin and each reports the
median and the best step time over all rounds.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from attention_contexts import ContiguousCache  # noqa: E402  (tests/attention_contexts.py)

from engines.model import Transformer, rope_inv_freq  # noqa: E402
from engines.model_config import ModelConfig  # noqa: E402
from kernels.quant_matmul import QuantLinear, quantize_model  # noqa: E402


def llama_300m(layers: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=1024,
                       intermediate_size=2816, num_layers=layers, num_heads=16, num_kv_heads=4, head_dim=64,
                       max_position_embeddings=2048)


def copy_bandwidth(mb: int = 512, reps: int = 5) -> float:
    """Best-of-`reps` DRAM copy bandwidth in GB/s, counting the read and the write."""
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step must read: every weight except the embedding table (one row of it)."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            total += sum(b.numel() * b.element_size() for b in mod.buffers(recurse=False))
            if mod.bias is not None:
                total += mod.bias.numel() * mod.bias.element_size()
        elif isinstance(mod, torch.nn.Linear | torch.nn.LayerNorm) or type(mod).__name__ == "RMSNorm":
            total += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
    return total


def random_model(cfg: ModelConfig) -> Transformer:
    """Random weights without nn.Linear's slow kaiming init: N(0, 0.02), norms at 1."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.inv_freq = rope_inv_freq(cfg)
    return model


class Decoder:
    """Batch-1 greedy decode with a contiguous KV cache, resumable in short timed bursts."""

    def __init__(self, model: Transformer, cfg: ModelConfig, prompt: int, max_steps: int):
        self.model, self.cfg = model, cfg
        self.cache = ContiguousCache(cfg.num_layers, 1, prompt + max_steps + 1, cfg.num_kv_heads, cfg.head_dim,
                                     torch.float32)
        with torch.inference_mode():
            self.cache.begin([prompt])
            hidden = model(torch.arange(1, prompt + 1), torch.arange(prompt), self.cache)
            self.cache.end()
            self.prefill_logits = model.compute_logits(hidden)
            self.tokens = [int(self.prefill_logits[-1].argmax(-1))]
        self.pos = prompt
        self.step_s: list[float] = []

    @torch.inference_mode()
    def run(self, steps: int) -> None:
        for _ in range(steps):
            t0 = time.perf_counter()
            self.cache.begin([1])
            hidden = self.model(torch.tensor([self.tokens[-1]]), torch.tensor([self.pos]), self.cache)
            self.cache.end()
            self.tokens.append(int(self.model.compute_logits(hidden).argmax(-1)))
            self.step_s.append(time.perf_counter() - t0)
            self.pos += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="decode steps per mode per round")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--modes", default="float32,int8,int4")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default). 1 by default: "
                    "on a shared machine a parallel step waits at every barrier for a descheduled thread")
    ap.add_argument("--out", default=str(ROOT / "bench/results/quant_cpu.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    cfg = llama_300m(args.layers)
    t0 = time.perf_counter()
    base = random_model(cfg)
    build_s = time.perf_counter() - t0
    bw = copy_bandwidth()
    print(f"model: {cfg.num_params / 1e6:.0f}M params, {args.layers} layers (built in {build_s:.1f} s); "
          f"copy bandwidth {bw:.1f} GB/s; threads {torch.get_num_threads()}")

    modes = args.modes.split(",")
    total = args.rounds * args.steps
    decoders = {}
    for mode in modes:
        model = base if mode == "float32" else quantize_model(copy.deepcopy(base), mode, args.group_size)
        decoders[mode] = Decoder(model, cfg, args.prompt, total)
        decoders[mode].run(1)  # warm-up (packs the CPU int4 weights, first-touch of every page)
        decoders[mode].step_s.clear()
    for _ in range(args.rounds):
        for mode in modes:
            decoders[mode].run(args.steps)
    bw_after = copy_bandwidth()

    rows = []
    float_logits = decoders["float32"].prefill_logits if "float32" in decoders else None
    for mode in modes:
        dec = decoders[mode]
        nbytes = bytes_per_token(dec.model)
        med, best = statistics.median(dec.step_s) * 1e3, min(dec.step_s) * 1e3
        # random weights give near-flat logits, so greedy agreement says little; the logit error does
        err = None if float_logits is None else float(
            (dec.prefill_logits - float_logits).norm() / float_logits.norm())
        roof = max(bw, bw_after) * 1e9 / nbytes
        rows.append({"mode": mode, "ms_per_token_median": round(med, 2), "ms_per_token_best": round(best, 2),
                     "tokens_per_s": round(1e3 / med, 2), "tokens_per_s_best": round(1e3 / best, 2),
                     "weight_bytes_per_token": nbytes, "roofline_tokens_per_s": round(roof, 2),
                     "fraction_of_roofline_best": round(1e3 / best / roof, 3),
                     "prefill_logit_rel_error_vs_float32": err})
    ref = next((r for r in rows if r["mode"] == "float32"), None)
    for r in rows:
        r["speedup_vs_float32"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 2) if ref else None
        r["speedup_vs_float32_best"] = round(r["tokens_per_s_best"] / ref["tokens_per_s_best"], 2) if ref else None

    print(f"\n{'mode':<8} {'ms/tok':>8} {'best':>8} {'tok/s':>7} {'MB/tok':>7} {'roofline':>9} {'of roof':>8} "
          f"{'speedup':>8} {'(best)':>7} {'logit err':>9}")
    for r in rows:
        err = r["prefill_logit_rel_error_vs_float32"]
        err = "-" if err is None else f"{err:.4f}"
        print(f"{r['mode']:<8} {r['ms_per_token_median']:>8.1f} {r['ms_per_token_best']:>8.1f} "
              f"{r['tokens_per_s']:>7.1f} {r['weight_bytes_per_token'] / 1e6:>7.0f} "
              f"{r['roofline_tokens_per_s']:>9.1f} {r['fraction_of_roofline_best']:>8.2f} "
              f"{r['speedup_vs_float32'] or 0:>8.2f} {r['speedup_vs_float32_best'] or 0:>7.2f} {err:>9}")
    print("roofline = max measured copy bandwidth (read + write) / weight bytes read per token; "
          "'of roof' uses the best step")
    result = {"bench": "quant_cpu", "params": cfg.num_params, "layers": cfg.num_layers,
              "copy_bandwidth_gb_s": [round(bw, 1), round(bw_after, 1)], "threads": torch.get_num_threads(),
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "load_average": list(os.getloadavg()), "prompt_tokens": args.prompt, "rounds": args.rounds,
              "steps_per_round": args.steps, "int4_group_size": args.group_size, "rows": rows}
    write_results(Path(args.out), result, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
