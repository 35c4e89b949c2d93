"""Engine throughput: tandem's continuous batching vs transformers `generate` with padded static batches on
the same ~10M-parameter random Llama and the same 64 requests (Azure conversation lengths scaled to the
context), plus prefix-cache TTFT (90% shared prompt vs cold), caching overhead at a 0% hit rate, and KV
waste at steady state. Prints a table and writes bench/results/engine_throughput.json.

    .venv/bin/python bench/engine_throughput.py [--requests 64] [--threads 1] [--hf-batch 16]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench.results_meta import write_results  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402
from traces.workloads import build_workload, fit_to_context  # noqa: E402

CONTEXT = 512
BLOCK = 16


def build_model(folder: Path) -> Path:
    from tiny_checkpoints import build_checkpoint

    return build_checkpoint(folder, "llama", vocab_size=384, hidden_size=384, num_layers=8, num_heads=6,
                            num_kv_heads=2, max_position_embeddings=CONTEXT)


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    specs, _ = fit_to_context(build_workload("chat", n, seed=seed), CONTEXT)
    rng = np.random.default_rng(seed)
    return [(rng.integers(5, 384, s.input_tokens).tolist(), s.output_tokens) for s in specs]


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


def run_tandem(llm: LLM, reqs: list[tuple[list[int], int]]) -> dict:
    """All requests arrive at once; record per-step KV waste (reserved-but-unused slots of running seqs)."""
    eng = llm.engine
    reserved = unused = 0
    alt = {8: [0, 0], 32: [0, 0]}  # the same token counts in pages of another size: [reserved, unused]
    results = {}
    t0, c0 = time.perf_counter(), time.thread_time()
    for i, (prompt, out_len) in enumerate(reqs):
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True), f"b{i}",
                        emit=lambda o: results.__setitem__(o.request_id, o), stream=False)
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        for s in eng.scheduler.running:
            slots = len(s.pages) * eng.pool.block_size
            reserved += slots
            unused += slots - s.num_computed
            for size, acc in alt.items():
                r = -(-s.num_computed // size) * size
                acc[0] += r
                acc[1] += r - s.num_computed
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    outs = [results[f"b{i}"] for i in range(len(reqs))]
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "cpu_s": cpu, "output_tokens": n_out, "output_tok_s": n_out / wall,
            "output_tok_per_cpu_s": n_out / cpu, "steps": steps,
            "ttft_mean_s": statistics.mean(ttft), "ttft_p99_s": percentile(ttft, 99),
            "kv_waste": unused / max(1, reserved),
            "kv_waste_other_block_sizes": {b: u / max(1, r) for b, (r, u) in alt.items()},
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def run_transformers(folder: Path, reqs: list[tuple[list[int], int]], batch: int) -> dict:
    """Static batches in arrival order, left-padded; a batch decodes until its longest output is done."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    first_token_at: list[float] = []

    class FirstCall(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            if len(first_token_at) == len(done_batches):
                first_token_at.append(time.perf_counter())
            return scores

    done_batches: list[int] = []
    ttft, outs = [], []
    t0, c0 = time.perf_counter(), time.thread_time()
    for b in range(0, len(reqs), batch):
        group = reqs[b:b + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, (p, _) in enumerate(group):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(n for _, n in group)
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0, logits_processor=[FirstCall()])
        done_batches.append(b)
        ttft += [first_token_at[-1] - t0] * len(group)
        outs += [gen[i, width:width + n].tolist() for i, (_, n) in enumerate(group)]
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    n_out = sum(n for _, n in reqs)
    return {"wall_s": wall, "cpu_s": cpu, "output_tokens": n_out, "output_tok_s": n_out / wall,
            "output_tok_per_cpu_s": n_out / cpu,
            "ttft_mean_s": statistics.mean(ttft), "ttft_p99_s": percentile(ttft, 99), "token_ids": outs}


def prefix_ttft(folder: Path, reps: int, prompt_len: int, shared: float) -> dict:
    """TTFT of a prompt sharing `shared` of its tokens with a cached one, vs the same prompt cold."""
    rng = np.random.default_rng(7)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    warm_llm = LLM(folder, block_size=BLOCK, max_num_batched_tokens=2048, memory_bytes=256 << 20)
    cold_llm = LLM(folder, block_size=BLOCK, max_num_batched_tokens=2048, memory_bytes=256 << 20,
                   enable_prefix_caching=False)
    warm, cold = [], []
    keep = int(prompt_len * shared)
    for _ in range(reps):
        base = rng.integers(5, 384, prompt_len).tolist()
        variant = base[:keep] + rng.integers(5, 384, prompt_len - keep).tolist()
        warm_llm.generate({"prompt_token_ids": base}, one)  # now cached
        for llm, sink in ((warm_llm, warm), (cold_llm, cold)):
            out = llm.generate({"prompt_token_ids": variant}, one)[0]
            sink.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return {"prompt_tokens": prompt_len, "shared_fraction": shared, "warm_ttft_s": statistics.median(warm),
            "cold_ttft_s": statistics.median(cold), "speedup": statistics.median(cold) / statistics.median(warm),
            "warm_hits_tokens": warm_llm.stats()["prefix_cache_hits"]}


def caching_overhead(folder: Path, reqs: list[tuple[list[int], int]], reps: int) -> dict:
    """Output tokens/s with prefix caching on vs off when nothing is ever shared (distinct random prompts)."""
    tps = {True: [], False: []}  # output tokens per CPU second: the box is shared, wall time is noisy
    hits = 0
    hash_s = [0.0]
    cpu_on = [0.0]
    for r in range(reps):
        for caching in (True, False) if r % 2 == 0 else (False, True):
            llm = LLM(folder, block_size=BLOCK, max_num_seqs=64, max_num_batched_tokens=512,
                      memory_bytes=512 << 20, enable_prefix_caching=caching)
            if caching:  # time the prefix-cache work itself (hashing, lookups, registration)
                pool = llm.core.pool
                for name in ("match_prefix", "commit_block"):
                    def timed(*a, _f=getattr(pool, name), **k):
                        c = time.thread_time()
                        try:
                            return _f(*a, **k)
                        finally:
                            hash_s[0] += time.thread_time() - c
                    setattr(pool, name, timed)
            # fresh prompts per repetition, so even the cache-on engine never sees a prompt twice
            shifted = [([(t + r * 7) % 379 + 5 for t in p], n) for p, n in reqs]
            run = run_tandem(llm, shifted)
            tps[caching].append(run["output_tok_per_cpu_s"])
            if caching:
                cpu_on[0] += run["cpu_s"]
            hits += llm.stats()["prefix_cache_hits"]
    on, off = max(tps[True]), max(tps[False])  # best of the repetitions: the least disturbed run
    return {"on_tok_s": on, "off_tok_s": off, "overhead": 1 - on / off, "hits_tokens": hits,
            "prefix_cache_cpu_fraction": hash_s[0] / cpu_on[0],
            "runs_on": tps[True], "runs_off": tps[False]}


def simulated_kv_waste(n: int, context: int, block: int, seed: int) -> dict:
    """KV waste with the real (unscaled) Azure conversation lengths: the scheduler and pool run as in the
    engine, the model is replaced by "every scheduled token is computed, every sampling row appends one".
    Steady state = the steps where requests are still waiting, so the batch is full."""
    from engines.kv_pool import KVGeometry, KVPool
    from engines.scheduler import Scheduler
    from engines.sequence import Request, Sequence

    specs, _ = fit_to_context(build_workload("chat", n, seed=seed), context)
    geom = KVGeometry(1, 1, 8, torch.float32)
    total = sum(-(-(s.input_tokens + s.output_tokens) // block) for s in specs)
    pool = KVPool([geom], total * geom.page_bytes(block), block, enable_prefix_caching=False)
    sched = Scheduler(pool, 0, max_num_seqs=64, max_num_batched_tokens=2048)
    for i, s in enumerate(specs):
        req = Request(f"s{i}", None, [7] * s.input_tokens, SamplingParams(max_tokens=s.output_tokens),
                      arrival_time=float(i))
        seq = Sequence(req, 0, list(req.prompt_token_ids), s.input_tokens, s.input_tokens + s.output_tokens)
        req.seqs.append(seq)
        sched.add(seq)
    reserved = unused = steps = 0
    while sched.has_work():
        out = sched.schedule()
        for seq, k in zip(out.seqs, out.num_tokens):
            sched.commit_computed(seq, k)
            if seq.num_computed == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_tokens >= seq.max_len:
                    sched.finish(seq)
        if sched.num_waiting:
            steps += 1
            for seq in sched.running:
                r = len(seq.pages) * block
                reserved += r
                unused += r - seq.num_computed
    mean_len = statistics.mean(s.input_tokens + s.output_tokens for s in specs)
    return {"requests": n, "context": context, "block_size": block, "steady_steps": steps,
            "mean_request_tokens": mean_len, "kv_waste": unused / max(1, reserved)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for both systems (1 on a shared 2-core box: OMP spin stalls)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overhead-reps", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_throughput.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp) / "model")
        reqs = workload(args.requests, args.seed)
        llm = LLM(folder, block_size=BLOCK, max_num_seqs=64, max_num_batched_tokens=512, memory_bytes=512 << 20)
        params = sum(p.numel() for p in llm.engine.model.parameters())
        run_tandem(llm, workload(4, args.seed + 99))  # warm-up (allocator, first-call costs)
        tandem = run_tandem(llm, reqs)
        hf = run_transformers(folder, reqs, args.hf_batch)
        agree = sum(a == b for a, b in zip(tandem.pop("token_ids"), hf.pop("token_ids"))) / len(reqs)
        prefix = prefix_ttft(folder, reps=3, prompt_len=CONTEXT - 24, shared=0.9)
        small = [(p, min(n, 16)) for p, n in reqs[:32]]
        overhead = caching_overhead(folder, small, args.overhead_reps)
    simulated = simulated_kv_waste(400, 8192, BLOCK, args.seed)

    speedup = tandem["output_tok_s"] / hf["output_tok_s"]
    cpu_speedup = tandem["output_tok_per_cpu_s"] / hf["output_tok_per_cpu_s"]
    rows = [
        ("output tokens/s", f"{tandem['output_tok_s']:.1f}", f"{hf['output_tok_s']:.1f}", f"{speedup:.2f}x (target >= 4x)"),
        ("output tok/CPU-s", f"{tandem['output_tok_per_cpu_s']:.1f}", f"{hf['output_tok_per_cpu_s']:.1f}",
         f"{cpu_speedup:.2f}x (thread CPU time: robust to other load)"),
        ("TTFT mean (s)", f"{tandem['ttft_mean_s']:.2f}", f"{hf['ttft_mean_s']:.2f}", ""),
        ("TTFT p99 (s)", f"{tandem['ttft_p99_s']:.2f}", f"{hf['ttft_p99_s']:.2f}", ""),
        ("wall (s)", f"{tandem['wall_s']:.1f}", f"{hf['wall_s']:.1f}", f"{tandem['steps']} engine steps"),
    ]
    print(f"model: random Llama, {params / 1e6:.1f}M params, context {CONTEXT}, fp32, CPU, "
          f"{args.threads} thread(s); {len(reqs)} requests (Azure conversation mix scaled), "
          f"outputs {tandem['output_tokens']} tokens; greedy outputs equal in {agree:.0%} of requests")
    print(f"{'metric':<18}{'tandem':>12}{'transformers':>14}  note")
    for name, a, b, note in rows:
        print(f"{name:<18}{a:>12}{b:>14}  {note}")
    print(f"prefix cache: TTFT {prefix['warm_ttft_s'] * 1e3:.1f} ms with {prefix['shared_fraction']:.0%} of "
          f"{prefix['prompt_tokens']} tokens cached vs {prefix['cold_ttft_s'] * 1e3:.1f} ms cold: "
          f"{prefix['speedup']:.1f}x (target >= 5x)")
    print(f"prefix caching at 0% hits: {overhead['on_tok_s']:.1f} vs {overhead['off_tok_s']:.1f} tok/CPU-s off "
          f"({overhead['overhead']:+.1%} best of {args.overhead_reps}, target within 2%; hits "
          f"{overhead['hits_tokens']} tokens); hashing+lookups took "
          f"{overhead['prefix_cache_cpu_fraction']:.3%} of the engine's CPU time")
    other = ", ".join(f"{w:.2%} at block {b}" for b, w in tandem["kv_waste_other_block_sizes"].items())
    print(f"KV waste over all steps (reserved-but-unused slots / reserved): {tandem['kv_waste']:.2%} at block "
          f"{BLOCK} (target < 4%); same sequences in other page sizes: {other}")
    print(f"KV waste at steady state with unscaled Azure conversation lengths (scheduler and pool simulated, "
          f"{simulated['requests']} requests, mean {simulated['mean_request_tokens']:.0f} tokens, context "
          f"{simulated['context']}): {simulated['kv_waste']:.2%} at block {BLOCK} (target < 4%)")

    result = {"bench": "engine_throughput", "command": "python bench/engine_throughput.py " + " ".join(argv or sys.argv[1:]),
              "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": args.threads,
                          "device": "cpu"},
              "model": {"params": params, "context": CONTEXT, "dtype": "float32", "block_size": BLOCK},
              "requests": len(reqs), "tandem": tandem, "transformers": hf, "throughput_speedup": speedup,
              "throughput_speedup_cpu_time": cpu_speedup,
              "greedy_agreement": agree, "prefix_cache": prefix, "caching_overhead_0pct_hits": overhead,
              "kv_waste_simulated_unscaled": simulated}
    out = Path(args.out)
    write_results(out, result, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
