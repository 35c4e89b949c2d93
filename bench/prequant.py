"""Pre-quantised 4-bit checkpoints vs tandem's own quantise-on-load, on the CPU: one random Llama (float
safetensors) and its GPTQ (sym and asym, groups of 128), AWQ (GEMM, groups of 128) and compressed-tensors W4A16
copies (tests/prequant_files.py), each decoded greedily by `LLM(...)` (round-robin over the models, rotated each
round, median of the repeats), next to `LLM(float, quantization="int4", quantization_group_size=128)` (built
twice: the second copy's ratio is the noise between identical models in the run). Prints decode tokens/s, the
ratio to tandem's int4 in the same run, weight bytes in memory (`load_info`), the checkpoint's bytes on disk and
their ratio (loaded / file); writes bench/results/prequant.json.

    .venv/bin/python bench/prequant.py [--hidden 1024 --layers 8 --tokens 64 --repeats 3 --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench.results_meta import write_results  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402


def decode_rate(llm: LLM, tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(10, 26))}
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        rates.append(len(out.outputs[0].token_ids) / (time.perf_counter() - t0))
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prequant.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from prequant_files import awq, compressed_tensors, gptq
    from tiny_checkpoints import build_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="tandem-prequant-"))
    src = build_checkpoint(tmp / "float", "llama", hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                           num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=args.hidden // 256,
                           vocab_size=384)
    folders = {"gptq g128": gptq(src, tmp / "gptq", group=128),
               "gptq asym g128": gptq(src, tmp / "gptq-asym", group=128, sym=False),
               "awq g128": awq(src, tmp / "awq", group=128),
               "compressed-tensors w4a16": compressed_tensors(src, tmp / "ct", "W4A16")}
    llms = {"tandem int4 g128 (at load)": (LLM(src, quantization="int4", quantization_group_size=128,
                                                max_model_len=256), src)}
    llms.update({name: (LLM(folder, max_model_len=256), folder) for name, folder in folders.items()})
    # the same at-load model built a second time: the spread between two identical models in one run (their
    # weights lie at different addresses) is the noise floor the formats' ratios are read against
    llms["tandem int4 g128 (at load, 2nd copy)"] = (LLM(src, quantization="int4", quantization_group_size=128,
                                                         max_model_len=256), src)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    names = list(llms)
    for rep in range(args.repeats):  # round-robin, so a busy moment of the machine hits every model alike,
        # starting one model further on each round, so each takes every place in the order equally often
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            rates[name].append(decode_rate(llms[name][0], args.tokens, 1))
    base_rate = statistics.median(rates["tandem int4 g128 (at load)"])
    rows = [{"model": name, "tok_s": statistics.median(rates[name]),
             "ratio": statistics.median(rates[name]) / base_rate,
             "weight_bytes": llm.engine.model.load_info["weight_bytes"],
             "file_bytes": (folder / "model.safetensors").stat().st_size} for name, (llm, folder) in llms.items()]
    for r in rows:
        r["loaded_over_file"] = r["weight_bytes"] / r["file_bytes"]
    print(f"{'model':<36} {'tok/s':>8} {'vs int4':>8} {'weights MB':>11} {'file MB':>8} {'loaded/file':>12}")
    for r in rows:
        print(f"{r['model']:<36} {r['tok_s']:>8.1f} {r['ratio']:>8.2f} {r['weight_bytes'] / 1e6:>11.2f} "
              f"{r['file_bytes'] / 1e6:>8.2f} {r['loaded_over_file']:>12.3f}")
    spread = abs(rows[-1]["ratio"] - 1.0)
    print(f"identical-model spread in this run: {spread:.3f}")
    write_results(Path(args.out), {"args": vars(args), "torch": torch.__version__, "rows": rows,
                                   "identical_model_spread": spread})
    return 0


if __name__ == "__main__":
    sys.exit(main())
