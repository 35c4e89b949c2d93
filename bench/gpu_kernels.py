"""GPU kernel and decode benchmark (run by bench/gpu_check.sh on one H200): copy bandwidth, paged attention
and weight-only int8/int4 matmuls timed with triton.testing.do_bench (achieved GB/s against the copy
bandwidth), then batch-1 and batch-64 decode tokens/s of a random-weight Llama-3-8B-shaped model in bf16,
int8 and int4 (Triton paged attention + KV write, CUDA-graph replay) against the bandwidth roofline.
Prints one table and writes bench/results/gpu_kernels.json. Every row is independent: a failure prints
its error in the table and the run goes on.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from triton.testing import do_bench as triton_do_bench  # noqa: E402

from bench.results_meta import write_results  # noqa: E402
from engines.model import Transformer, rope_inv_freq  # noqa: E402
from engines.model_config import ModelConfig  # noqa: E402
from kernels.kv_write import write_kv  # noqa: E402
from kernels.paged_attention import paged_attention  # noqa: E402
from kernels.quant_matmul import (  # noqa: E402
    QuantLinear,
    pack_zero,
    quantize_int4,
    quantize_int8,
    quantize_model,
    wq_matmul,
)

ROWS: list[dict] = []
PAGE = 16
DEV = "cuda"
SMOKE = False  # --smoke: tiny shapes on CPU tensors (Triton interpreter) to check this script without a GPU


def do_bench(fn, warmup: int = 10, rep: int = 100) -> float:
    if not SMOKE:
        return triton_do_bench(fn, warmup=warmup, rep=rep)
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def row(section: str, name: str, **fields) -> None:
    ROWS.append({"section": section, "name": name, **fields})
    print(f"  [{section}] {name}: " + ", ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def guarded(section: str, name: str):
    """Decorator: run a benchmark row, recording the exception instead of stopping the run."""
    def wrap(fn):
        def run(*a, **k):
            try:
                return fn(*a, **k)
            except Exception as e:  # a blind GPU run must still print every other row
                traceback.print_exc()
                row(section, name, error=f"{type(e).__name__}: {str(e)[:160]}")
        return run
    return wrap


def copy_bandwidth() -> float:
    x = torch.empty(2**20 if SMOKE else 2**30, dtype=torch.uint8, device=DEV)  # 1 GiB
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    gbs = 2 * x.numel() / (ms * 1e-3) / 1e9
    row("bandwidth", "copy 1 GiB (read+write)", us=round(ms * 1e3, 1), gb_s=round(gbs, 1))
    return gbs


# ----------------------------------------------------------------------------------------------------------
# paged attention


def attention_inputs(batch: int, ctx: int, q_len: int, kv_dtype: str, hq=32, hkv=8, d=128):
    if SMOKE:
        batch, ctx, q_len, hq, hkv, d = min(batch, 2), min(ctx, 40), min(q_len, 5), 4, 2, 32
    pages_per_seq = -(-ctx // PAGE)
    num_blocks = batch * pages_per_seq
    perm = torch.randperm(num_blocks, device=DEV).int()
    tables = perm.view(batch, pages_per_seq)
    k = torch.randn(num_blocks, PAGE, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    extra = {}
    if kv_dtype == "int8":
        extra = dict(k_scale=k.float().abs().amax(-1) / 127, v_scale=v.float().abs().amax(-1) / 127)
        k = torch.round(k.float() / extra["k_scale"][..., None]).to(torch.int8)
        v = torch.round(v.float() / extra["v_scale"][..., None]).to(torch.int8)
    elif kv_dtype == "fp8":
        extra = dict(k_scale=torch.ones(1, device=DEV), v_scale=torch.ones(1, device=DEV))
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    q = torch.randn(batch * q_len, hq, d, device=DEV, dtype=torch.float32 if SMOKE else torch.bfloat16)
    qsl = torch.arange(0, batch + 1, device=DEV, dtype=torch.int32) * q_len
    ctx_lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    kv_bytes = batch * ctx * hkv * d * 2 * k.element_size()
    return (q, k, v, tables, qsl, ctx_lens), extra, kv_bytes


def bench_attention(copy_gbs: float) -> None:
    cases = [  # (label, batch, ctx, q_len, kv dtype, splits or None)
        ("decode b64 ctx2048 bf16", 64, 2048, 1, "bf16", None),
        ("decode b64 ctx2048 int8", 64, 2048, 1, "int8", None),
        ("decode b64 ctx2048 fp8", 64, 2048, 1, "fp8", None),
        ("decode b1 ctx32768 bf16 split-auto", 1, 32768, 1, "bf16", None),
        ("decode b1 ctx32768 bf16 no-split", 1, 32768, 1, "bf16", 1),
        ("verify b16 k+1=5 ctx2048 bf16", 16, 2048, 5, "bf16", None),
        ("prefill b4 1024 tokens bf16", 4, 1024, 1024, "bf16", None),
        ("chunk b4 256 over 1792 cached bf16", 4, 2048, 256, "bf16", None),
    ]
    for label, b, ctx, ql, kvd, splits in cases:
        guarded("paged_attention", label)(attention_case)(copy_gbs, label, b, ctx, ql, kvd, splits)
        torch.cuda.empty_cache()


def attention_case(copy_gbs: float, label: str, b: int, ctx: int, ql: int, kvd: str, splits: int | None) -> None:
    args, extra, kv_bytes = attention_inputs(b, ctx, ql, kvd)
    if SMOKE:
        b, ctx, ql = args[3].shape[0], int(args[5][0]), int(args[4][1])
    kw = dict(max_query_len=ql, max_context_len=ctx, num_splits=splits, **extra)
    ms = do_bench(lambda: paged_attention(*args, **kw), warmup=10, rep=100)
    q = args[0]
    moved = kv_bytes + 2 * q.numel() * q.element_size()
    flops = 4 * b * ql * ctx * q.shape[1] * q.shape[2] * (0.5 if ql == ctx else 1.0)
    row("paged_attention", label, us=round(ms * 1e3, 1), gb_s=round(moved / ms / 1e6, 1),
        pct_copy_bw=round(100 * moved / ms / 1e6 / copy_gbs, 1), tflop_s=round(flops / ms / 1e9, 1))


# ----------------------------------------------------------------------------------------------------------
# weight-only matmul


def bench_matmuls(copy_gbs: float) -> None:
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336)]
    for m in (1, 16, 64, 2048):
        for n, k in shapes:
            guarded("wq_matmul", f"M={m} N={n} K={k}")(matmul_shape)(copy_gbs, m, n, k)
        torch.cuda.empty_cache()


def matmul_shape(copy_gbs: float, m: int, n: int, k: int) -> None:
    if SMOKE:
        m, n, k = min(m, 20), n // 128, k // 32
    dtype = torch.float32 if SMOKE else torch.bfloat16
    w = torch.randn(n, k, device=DEV, dtype=dtype) * 0.02
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    q8, s8 = quantize_int8(w)
    p4, s4, z4 = quantize_int4(w, 64)
    z4 = pack_zero(z4)
    variants = [
        ("bf16 torch", lambda: x @ w.T, w.numel() * 2),
        ("int8 triton", lambda: wq_matmul(x, q8, s8), q8.numel() + s8.numel() * 4),
        ("int4 g64 triton", lambda: wq_matmul(x, p4, s4, z4), p4.numel() + s4.numel() * 2 + z4.numel()),
    ]
    for name, fn, wbytes in variants:
        label = f"M={m} N={n} K={k} {name}"
        guarded("wq_matmul", label)(matmul_case)(copy_gbs, label, fn, wbytes, m, n, k)


def matmul_case(copy_gbs: float, label: str, fn, wbytes: int, m: int, n: int, k: int) -> None:
    ms = do_bench(fn, warmup=10, rep=100)
    moved = wbytes + (m * k + m * n) * 2
    row("wq_matmul", label, us=round(ms * 1e3, 1), gb_s=round(moved / ms / 1e6, 1),
        pct_copy_bw=round(100 * moved / ms / 1e6 / copy_gbs, 1), tflop_s=round(2 * m * n * k / ms / 1e9, 1))


# ----------------------------------------------------------------------------------------------------------
# decode


def llama3_8b() -> ModelConfig:
    if SMOKE:
        return ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                       max_position_embeddings=8192, rope_theta=500000.0, torch_dtype="bfloat16")


def random_model(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=DEV).to(torch.float32 if SMOKE else torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.inv_freq = rope_inv_freq(cfg).to(DEV)
    return model


class TritonPagedKV:
    """The engine's attention seam over per-layer paged caches, with the Triton KV write + attention.

    Static tensors, host-known maxima and a fixed split count: every launch is CUDA-graph capturable.
    """

    def __init__(self, cfg: ModelConfig, batch: int, ctx: int):
        pages = -(-ctx // PAGE)
        shape = (batch * pages, PAGE, cfg.num_kv_heads, cfg.head_dim)
        dtype = torch.float32 if SMOKE else torch.bfloat16
        self.k = [torch.randn(shape, device=DEV, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.randn(shape, device=DEV, dtype=dtype) for _ in range(cfg.num_layers)]
        self.tables = torch.randperm(batch * pages, device=DEV).int().view(batch, pages)
        self.qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
        self.ctx_lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
        pos = ctx - 1  # the new token's slot: last row of its context
        self.slots = (self.tables[:, pos // PAGE].long() * PAGE + pos % PAGE)
        self.ctx = ctx
        sms = 4 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
        self.splits = max(1, min(16, -(-2 * sms // (batch * cfg.num_kv_heads)), ctx // 256))
        self.kv_bytes = 2 * cfg.num_layers * batch * ctx * cfg.num_kv_heads * cfg.head_dim * 2

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(k, v, self.k[layer], self.v[layer], self.slots)
        return paged_attention(q, self.k[layer], self.v[layer], self.tables, self.qsl, self.ctx_lens,
                               max_query_len=1, max_context_len=self.ctx, num_splits=self.splits)


def weight_bytes(model: torch.nn.Module) -> int:
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            total += sum(b.numel() * b.element_size() for b in mod.buffers(recurse=False))
        elif isinstance(mod, torch.nn.Linear) or type(mod).__name__ == "RMSNorm":
            total += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
    return total


def bench_decode(copy_gbs: float, ctx: int, batches: list[int]) -> None:
    cfg = llama3_8b()
    t0 = time.perf_counter()
    base = random_model(cfg)
    print(f"  built Llama-3-8B-shaped bf16 model in {time.perf_counter() - t0:.1f} s", flush=True)
    for mode in ("bf16", "int8", "int4"):
        if mode == "bf16":
            model = base
        else:
            model = quantize_model(copy.deepcopy(base) if mode == "int8" else base, mode, 64)
        wbytes = weight_bytes(model)
        for batch in batches:
            label = f"{mode} batch {batch} ctx {ctx}"
            guarded("decode", label)(decode_case)(copy_gbs, label, cfg, model, wbytes, batch, ctx)
            gc.collect()
            torch.cuda.empty_cache()
        if mode == "int8":
            del model
            gc.collect()
            torch.cuda.empty_cache()


def decode_case(copy_gbs: float, label: str, cfg: ModelConfig, model: Transformer, wbytes: int, batch: int,
                ctx: int) -> None:
    kv = TritonPagedKV(cfg, batch, ctx)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=DEV)
    pos = torch.full((batch,), ctx - 1, device=DEV)

    def step():
        return model.compute_logits(model(ids, pos, kv))

    with torch.inference_mode():
        for _ in range(1 if SMOKE else 3):
            step()  # compile every kernel specialisation before capture
        graph_note = "cuda graph"
        try:
            if SMOKE:
                raise RuntimeError("no CUDA graphs on the CPU")
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(g):
                step()
            ms = do_bench(g.replay, warmup=5, rep=200)
        except Exception as e:  # report eager numbers rather than none
            graph_note = f"eager (graph failed: {type(e).__name__})"
            ms = do_bench(step, warmup=5, rep=100)
    roof_w = copy_gbs * 1e9 / wbytes * batch
    roof_wkv = copy_gbs * 1e9 / (wbytes + kv.kv_bytes) * batch
    tok_s = batch / (ms * 1e-3)
    row("decode", label, ms_per_step=round(ms, 3), tokens_per_s=round(tok_s, 1),
        weight_gb=round(wbytes / 1e9, 2), kv_gb=round(kv.kv_bytes / 1e9, 2),
        roofline_weights_tok_s=round(roof_w, 1), pct_roofline_weights=round(100 * tok_s / roof_w, 1),
        roofline_weights_kv_tok_s=round(roof_wkv, 1), splits=kv.splits, mode=graph_note)


def print_table() -> None:
    print("\n" + "=" * 118)
    print(f"{'section':<16} {'case':<44} {'time':>12} {'achieved':>16} {'of bound':>9}  note")
    print("-" * 118)
    for r in ROWS:
        if "error" in r:
            print(f"{r['section']:<16} {r['name']:<44} {'ERROR':>12}  {r['error']}")
            continue
        if r["section"] == "decode":
            t, a = f"{r['ms_per_step']:.3f} ms", f"{r['tokens_per_s']:.0f} tok/s"
            b = f"{r['pct_roofline_weights']:.0f}%"
            note = (f"roofline {r['roofline_weights_tok_s']:.0f} tok/s (weights {r['weight_gb']} GB), "
                    f"{r['roofline_weights_kv_tok_s']:.0f} with KV {r['kv_gb']} GB; {r['mode']}")
        else:
            t, a = f"{r['us']:.1f} us", f"{r['gb_s']:.0f} GB/s"
            b = f"{r['pct_copy_bw']:.0f}%" if "pct_copy_bw" in r else ""
            note = f"{r['tflop_s']} TFLOP/s" if "tflop_s" in r else ""
        print(f"{r['section']:<16} {r['name']:<44} {t:>12} {a:>16} {b:>9}  {note}")
    print("=" * 118)
    print("'of bound': % of the measured copy bandwidth (kernels) or of the weights-only roofline (decode).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", default="", help="comma list of sections to skip: attention,matmul,decode")
    ap.add_argument("--ctx", type=int, default=1024, help="decode context length")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu_kernels.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter): script check only")
    args = ap.parse_args(argv)
    global DEV, SMOKE
    if args.smoke:
        DEV, SMOKE = "cpu", True
        args.ctx, args.out = min(args.ctx, 40), str(ROOT / "bench/results/gpu_kernels_smoke.json")
    elif not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU")
        return 2
    skip = set(filter(None, args.skip.split(",")))
    import triton
    device_name = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(0)
    print(f"device {device_name}, torch {torch.__version__}, triton {triton.__version__}")
    torch.manual_seed(0)
    gbs = copy_bandwidth()
    if "attention" not in skip:
        bench_attention(gbs)
    if "matmul" not in skip:
        bench_matmuls(gbs)
    if "decode" not in skip:
        guarded("decode", "setup")(bench_decode)(gbs, args.ctx, [int(b) for b in args.batches.split(",")])
    print_table()
    out = {"bench": "gpu_kernels", "device": device_name, "torch": torch.__version__,
           "triton": triton.__version__, "copy_bandwidth_gb_s": round(gbs, 1), "rows": ROWS}
    write_results(Path(args.out), out, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
