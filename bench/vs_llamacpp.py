"""tandem against llama.cpp's `llama-server` on the same model, the same client and the same threads: output
tokens/s, TTFT and TPOT p50/p99 at 1, 8 and 32 concurrent streams (closed loop, streaming, greedy, ignore_eos),
the two servers' runs alternated, and the ratio tandem / llama.cpp per cell. Prints a table and writes
bench/results/vs_llamacpp.json.

llama-server is found (`--llama-server PATH`, `$LLAMA_SERVER`, or a previous `--build`) or built with `--build`:
the llama-cpp-python sdist (`pip download`, its vendored llama.cpp) configured with cmake and its llama-server
target built with `-j2` into `~/.cache/tandem/llama.cpp` (outside the repository; never part of `make test`;
about 20-40 minutes on 2 cores). The models are converted to GGUF here (this file's own converter, through the
`gguf` package vendored in that llama.cpp tree): tandem-tiny-l and, with `--models tiny-l,llama80m`, a random
~80M-parameter Llama built with the same tokenizer; f32 (tandem told to read float32, TANDEM_CPU_BF16_WEIGHTS=0),
bf16 (both models rounded to bfloat16: a BF16 GGUF against tandem's `quantization = "bf16"`, bfloat16 weights and
activations as llama.cpp computes BF16; `--tandem-bf16 f32`: tandem's float32 math over its bf16 weight copies),
and 8-bit: by default q8_0 for every matrix for
llama.cpp (the tied embedding / output head too, as `convert_hf_to_gguf.py --outtype q8_0` writes it) against
tandem's `w8a8` (int8 weights and head, activations quantised per 32 as q8_0's dots do); with
`--tandem-8bit int8`, tandem's weight-only int8 against q8_0 layers with an f32 head (both heads f32).
`--adaptive-threads` makes --threads tandem's maximum (each kind of kernel call takes the fastest count up to it,
as by default where no count is given), not its fixed count; llama-server keeps `-t` either way.
`--cells spec` runs speculation on both servers: the widened pair (training/widen.py's tandem-tiny-l x5, f32,
with tandem-tiny-s drafting: w8a8 in tandem, Q8_0 in llama-server's `-md`), each server with and without its
draft, on held-out code.

    .venv/bin/python bench/vs_llamacpp.py --build              # once: build llama-server
    .venv/bin/python bench/vs_llamacpp.py [--models tiny-l,llama80m] [--quant f32,8bit] [--streams 1 8 32]
        [--threads 1] [--rounds 2] [--max-tokens 64] [--prompt-tokens 64] [--seconds 12] [--warmup-seconds 4]
        [--tandem-8bit w8a8] [--tandem-bf16 bf16] [--adaptive-threads]
    .venv/bin/python bench/vs_llamacpp.py --cells spec [--spec-streams 1] [--threads 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench.results_meta import write_results  # noqa: E402

CACHE = Path(os.environ.get("TANDEM_BENCH_CACHE", Path.home() / ".cache" / "tandem"))
LLAMA_CPP_PYTHON = "0.3.36"


# ---- llama-server ------------------------------------------------------------------------------------------


def llama_source() -> Path:
    return CACHE / "llama.cpp" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def build_llama_server(jobs: int = 2) -> Path:
    base = CACHE / "llama.cpp"
    base.mkdir(parents=True, exist_ok=True)
    if not llama_source().exists():
        # pip prepares the sdist's metadata even to download it; in an isolated build environment that means
        # building scikit-build-core's own dependencies from source (--no-binary :all:), which took minutes and
        # stalled on one VM: its wheel in a side folder and no isolation instead
        tools = base / "build-tools"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(tools),
                        "scikit-build-core>=0.9.2"], check=True)
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                        "--no-binary", ":all:", "--no-deps", "--no-build-isolation", "-d", str(base)], check=True,
                       env=dict(os.environ, PYTHONPATH=str(tools)))
        with tarfile.open(base / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
            tar.extractall(base, filter="data")
    build = base / "build"
    subprocess.run(["cmake", "-S", str(llama_source()), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], check=True)
    return build / "bin" / "llama-server"


def find_llama_server(explicit: str | None) -> Path | None:
    for cand in (explicit, os.environ.get("LLAMA_SERVER"), CACHE / "llama.cpp" / "build" / "bin" / "llama-server",
                 shutil.which("llama-server")):
        if cand and Path(cand).is_file():
            return Path(cand)
    return None


def gguf_module(server: Path):
    """The `gguf` package: installed, or the one vendored beside the llama-server's sources."""
    try:
        import gguf
        return gguf
    except ImportError:
        pass
    for src in (llama_source(), server.parents[2] / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"):
        if (src / "gguf-py").is_dir():
            sys.path.insert(0, str(src / "gguf-py"))
            import gguf
            return gguf
    raise SystemExit("the gguf package is missing: pip install gguf, or build llama-server with --build")


# ---- models and GGUF conversion ----------------------------------------------------------------------------


# random Llamas with tandem-tiny-l's tokenizer (vocab 4096, tied head): (hidden, layers, heads, kv heads, MLP)
RANDOM_LLAMAS = {"llama80m": (768, 12, 12, 4, 2048),  # 82M parameters
                 "llama200m": (1024, 16, 16, 4, 3072),  # 195M
                 "llama250m": (1024, 20, 16, 4, 3072),  # 243M
                 "llama1b": (2048, 22, 32, 4, 5632)}  # 977M (TinyLlama-1.1B's shape)


def random_llama(folder: Path, name: str = "llama80m") -> Path:
    """The random Llama `name` of RANDOM_LLAMAS, built once into `folder`."""
    if (folder / "model.safetensors").exists():
        return folder
    from tiny_checkpoints import build_checkpoint

    h, n_layers, nh, nkv, inter = RANDOM_LLAMAS[name]
    build_checkpoint(folder, "llama", vocab_size=4096, hidden_size=h, num_layers=n_layers, num_heads=nh,
                     num_kv_heads=nkv, intermediate_size=inter, max_position_embeddings=4096, with_tokenizer=False,
                     tie_word_embeddings=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "tandem-tiny-l" / name, folder / name)
    return folder


def llama80m(folder: Path) -> Path:
    """The random ~80M-parameter Llama (bench/cpu_prefill.py's model too)."""
    return random_llama(folder, "llama80m")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved RoPE order (what convert_hf_to_gguf.py does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def bf16_variant(folder: Path, out: Path) -> Path:
    """The checkpoint with every weight rounded to bfloat16 (itself if it already is: tandem-tiny-l), so that
    llama.cpp's BF16 GGUF and tandem's float32 upcast hold the same values and tandem reads its bf16 copies."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        if all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys()):
            return folder
    if (out / "model.safetensors").exists():
        return out
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(folder / "model.safetensors")).items()},
              str(out / "model.safetensors"))
    for f in folder.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def to_gguf(gguf, folder: Path, out: Path, eight_bit: bool, head_8bit: bool = False, bf16: bool = False,
            four_bit: bool = False) -> Path:
    """The GGUF of `folder`: f32, BF16, Q8_0 layers (and head with `head_8bit`) or Q4_0 layers (`four_bit`,
    f32 head, as tandem's int4 keeps its head float)."""
    if out.exists():
        return out
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    sd = {k: v.to(torch.float32).numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(folder.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(hd)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if eight_bit else gguf.LlamaFileType.MOSTLY_Q4_0 if four_bit
                    else gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    tokens = [t for t, _ in vocab]
    for i, t in added.items():
        if i < len(tokens):
            tokens[i] = t["content"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for i in range(len(tokens))])
    merges = tok["model"].get("merges", [])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(cfg.get("bos_token_id", 0))
    eos = cfg.get("eos_token_id", 1)
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_add_bos_token(False)

    def add(name: str, arr: np.ndarray, quant: bool) -> None:
        kind = (gguf.GGMLQuantizationType.Q4_0 if quant and four_bit and arr.ndim == 2 and arr.shape[1] % 32 == 0
                else gguf.GGMLQuantizationType.Q8_0 if quant and arr.ndim == 2 and arr.shape[1] % 32 == 0
                else gguf.GGMLQuantizationType.BF16 if bf16 and arr.ndim == 2 else None)
        if kind is not None:
            from gguf.quants import quantize

            q = quantize(arr, kind)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr))

    add("token_embd.weight", sd["model.embed_tokens.weight"], head_8bit)  # the tied output head
    add("output_norm.weight", sd["model.norm.weight"], False)
    if not cfg.get("tie_word_embeddings", False):
        add("output.weight", sd["lm_head.weight"], head_8bit)
    lq = eight_bit or four_bit
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], False)
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], False)
        add(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], nh), lq)
        add(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], nkv), lq)
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], lq)
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], lq)
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"], lq)
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"], lq)
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"], lq)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ---- servers -----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def start_llama(server: Path, gguf_path: Path, threads: int, slots: int, ctx: int, log: Path,
                extra: tuple[str, ...] = ()):
    port = free_port()
    cmd = [str(server), "-m", str(gguf_path), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
           "-c", str(ctx * slots), "--port", str(port), "--host", "127.0.0.1", "-ngl", "0", "--no-webui",
           "--threads-http", str(slots + 4), *extra]  # one HTTP thread per stream: its default is the core count
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return proc, f"http://127.0.0.1:{port}", "llama"


TANDEM_KV = "auto"  # tandem's --kv-cache-dtype (main's --tandem-kv); llama-server's cache is float16 by default


def start_tandem(folder: Path, threads: int, eight_bit: str | None, ctx: int, log: Path, bf16_reads: bool = True,
                 extra: tuple[str, ...] = ()):
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", str(folder), "--served-model-name", "tandem",
           "--port", str(port), "--max-model-len", str(ctx), "--log-level", "warning",
           *(["--kv-cache-dtype", TANDEM_KV] if TANDEM_KV != "auto" else []), *extra]
    if eight_bit:
        cmd += ["--quantization", eight_bit]
    env = dict(os.environ, TANDEM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    if not bf16_reads:  # the f32 cells: tandem reads float32 weights as llama.cpp's f32 GGUF does, not the bf16
        env["TANDEM_CPU_BF16_WEIGHTS"] = "0"  # copies it keeps of a bf16 checkpoint's (exact) values
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    wait_ready(f"http://127.0.0.1:{port}/ready", proc)
    return proc, f"http://127.0.0.1:{port}", "tandem"


def server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the client --------------------------------------------------------------------------------------------


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int,
                      extra: dict | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, **(extra or {})}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError(f"{url}: no tokens streamed")
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / (max_tokens - 1) if max_tokens > 1 else 0.0
    return {"ttft": ttft, "tpot": tpot, "tokens": max_tokens, "start": t0, "end": times[-1]}


async def greedy_text(url: str, model: str, prompt: list[int], n: int) -> str:
    import httpx

    async with httpx.AsyncClient() as client:
        r = await client.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n,
                                                             "temperature": 0, "ignore_eos": True}, timeout=120)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]


async def closed_loop(url: str, model: str, prompts: list[list[int]], streams: int, max_tokens: int,
                      seconds: float, keep: list[dict] | None = None) -> dict:
    """`streams` clients, each sending its next request when its last ends, for `seconds`; the summary (and each
    request's own figures appended to `keep`, when given: bench/server_probe.py)."""
    import httpx

    results: list[dict] = []
    # idle connections expire before llama-server's 5 s keep-alive timeout closes them under us
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(limits=limits) as client:
        await one_request(client, url, model, prompts[0], 4)  # warm
        t0 = time.perf_counter()
        stop = t0 + seconds

        async def worker(w: int) -> None:
            i = w
            while time.perf_counter() < stop:
                try:
                    results.append(await one_request(client, url, model, prompts[i % len(prompts)], max_tokens))
                except (httpx.RemoteProtocolError, httpx.ReadError):  # a keep-alive connection the server closed
                    results.append(await one_request(client, url, model, prompts[i % len(prompts)], max_tokens))
                i += streams

        await asyncio.gather(*(worker(w) for w in range(streams)))
        wall = time.perf_counter() - t0
    if keep is not None:
        keep.extend(dict(r, start=r["start"] - t0) for r in results)
    return {"requests": len(results), "tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_ms": 1e3 * float(np.percentile([r["ttft"] for r in results], 50)),
            "ttft_p99_ms": 1e3 * float(np.percentile([r["ttft"] for r in results], 99)),
            "tpot_p50_ms": 1e3 * float(np.percentile([r["tpot"] for r in results], 50)),
            "tpot_p99_ms": 1e3 * float(np.percentile([r["tpot"] for r in results], 99)), "wall_s": wall}


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 4000, length).tolist() for _ in range(n)]


# ---- main --------------------------------------------------------------------------------------------------


def stream_bandwidth(threads: int, reps: int = 5) -> float:
    """This machine's streaming read bandwidth, GB/s: the best of `reps` torch.sum passes over 1 GiB of float32
    (far past the caches) on `threads` threads: the roofline decode's weight reads are held against. The GiB
    sits on transparent huge pages where the kernel grants them, as tandem's weights do (kernels/hugepages.py;
    a read from 4 KiB pages measured 26-29 GB/s on a Zen 4 VM against 33-34 from huge pages)."""
    import torch

    from kernels import hugepages

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = hugepages.empty((1 << 28,), torch.float32)
        x.fill_(1.0)
        float(x.sum())
        best = min(_timed(lambda: float(x.sum())) for _ in range(reps))
        return x.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(old)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes(folder: Path, quant: str, gguf_path: Path, gguf) -> dict:
    """Bytes one decode token reads: every layer projection and the (tied) head, once. llama.cpp's from its GGUF's
    tensors (norms aside; the embedding table is the tied head); tandem's from its own formats' bytes per weight
    (one QuantLinear of the model's first projection shape, built here, for int8 / int4)."""
    r = gguf.GGUFReader(str(gguf_path))
    ll = sum(int(t.n_bytes) for t in r.tensors if "norm" not in t.name)
    return {**tandem_bytes(folder, quant), "llama_bytes": float(ll)}


def tandem_bytes(folder: Path, quant: str) -> dict:
    """tandem's side of `weight_bytes`: the bytes a decode token reads, and the parameters they hold."""
    cfg = json.loads((folder / "config.json").read_text())
    h, inter, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    per_layer = h * hd * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) + 3 * h * inter
    head = cfg["vocab_size"] * h
    if quant in ("f32", "bf16"):
        per_w = 4.0 if quant == "f32" else 2.0
        tb = (per_layer * n_layers + head) * per_w
    else:
        from torch import nn

        from kernels.quant_matmul import QuantLinear

        mode = {"8bit": "w8a8", "int8": "int8", "int4": "int4"}[quant]
        q = QuantLinear.from_linear(nn.Linear(h, inter, bias=False), mode)
        per_w = sum(b.numel() * b.element_size() for b in q.buffers() if b is not None) / (h * inter)
        head_w = per_w if mode == "w8a8" else 4.0  # w8a8 quantises the head as q8_0 does; int8/int4 keep it f32
        tb = per_layer * n_layers * per_w + head * head_w
    return {"tandem_bytes": tb, "params": per_layer * n_layers + head}


def prepare(gguf, work: Path, name: str, quant: str, tandem_8bit: str, tandem_bf16: str = "bf16") -> dict:
    """The checkpoint folder, GGUF and tandem options of one (model, weights) cell."""
    base = ROOT / "models" / "tandem-tiny-l" if name == "tiny-l" else random_llama(work / name, name)
    eight, four, bf16 = quant == "8bit", quant == "int4", quant == "bf16"
    head8 = eight and tandem_8bit == "w8a8"
    gguf_kind = ("q8_0-all" if head8 else "q8_0-f32head") if eight else "q4_0-f32head" if four else quant
    folder = bf16_variant(base, work / f"{name}-bf16") if bf16 else base
    path = to_gguf(gguf, folder, work / f"{name}-{gguf_kind}.gguf", eight, head8, bf16, four_bit=four)
    return {"folder": folder, "gguf": path, "gguf_kind": gguf_kind, "bf16_reads": quant != "f32",
            "tandem_quant": tandem_8bit if eight else "int4" if four else "bf16" if bf16 and tandem_bf16 == "bf16"
            else None}


def model_of(kind: str) -> str:
    return "tandem" if kind == "tandem" else "m"


def start_pair(server: Path, cell: dict, threads: int, slots: int, ctx: int, work: Path) -> list:
    procs = [start_llama(server, cell["gguf"], threads, slots, ctx, work / "llama.log")]
    try:
        procs.append(start_tandem(cell["folder"], threads, cell["tandem_quant"], ctx, work / "tandem.log",
                                  bf16_reads=cell["bf16_reads"]))
    except BaseException:
        stop_all(procs)
        raise
    return procs


def stop_all(procs: list) -> None:
    for proc, _, _ in procs:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def greedy_check(procs: list, prompts: list[list[int]], label: str):
    texts = [[asyncio.run(greedy_text(url, model_of(kind), p, 16)) for p in prompts[:2]] for _, url, kind in procs]
    agree = texts[0] == texts[1]
    print(f"  {label}: greedy 16 tokens agree: {agree} {texts[0][0]!r} / {texts[1][0]!r}", flush=True)
    return agree


async def single(url: str, model: str, prompt: list[int], max_tokens: int, llama: bool) -> dict:
    import httpx

    async with httpx.AsyncClient() as client:  # llama-server keeps a slot's prompt for reuse unless told
        return await one_request(client, url, model, prompt, max_tokens, {"cache_prompt": False} if llama else None)


def run_streams(server, cell, args, name, quant, threads, streams, prompts, work, ctx) -> dict:
    runs: dict[str, list[dict]] = {"llama": [], "tandem": []}
    procs = start_pair(server, cell, threads, streams, ctx, work)
    try:
        agree = greedy_check(procs, prompts, f"{name} {quant} t{threads}")
        for _, url, kind in procs:  # warm-up, not measured: first touches of KV memory and buffers
            if args.warmup_seconds > 0:
                asyncio.run(closed_loop(url, model_of(kind), prompts, streams, args.max_tokens, args.warmup_seconds))
        for r in range(args.rounds):
            for proc, url, kind in (procs if r % 2 == 0 else procs[::-1]):
                c0 = server_cpu_s(proc.pid)
                res = asyncio.run(closed_loop(url, model_of(kind), prompts, streams, args.max_tokens, args.seconds))
                res["server_cpu_s"] = server_cpu_s(proc.pid) - c0
                res["tok_per_cpu_s"] = res["tok_s"] * res["wall_s"] / max(res["server_cpu_s"], 1e-9)
                res["loadavg"] = os.getloadavg()[0]
                runs[kind].append(res)
                print(f"  {name} {quant} t{threads} streams={streams} round {r} {kind}: {res['tok_s']:.1f} tok/s "
                      f"TTFT p50 {res['ttft_p50_ms']:.1f} ms TPOT p50/p99 {res['tpot_p50_ms']:.2f}/"
                      f"{res['tpot_p99_ms']:.2f} ms load {res['loadavg']:.1f}", flush=True)
    finally:
        stop_all(procs)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    return {"cell": "streams", "model": name, "quant": quant, "threads": threads,
            "tandem_quant": cell["tandem_quant"] or "none", "gguf": cell["gguf_kind"], "streams": streams,
            "runs": runs, "median": med, "greedy_agree": agree,
            "ratio_tok_s": med["tandem"]["tok_s"] / med["llama"]["tok_s"],
            "ratio_tpot_p99": med["tandem"]["tpot_p99_ms"] / med["llama"]["tpot_p99_ms"]}


def run_decode(server, cell, args, name, quant, threads, prompts, work, ctx, bw: float, gguf) -> dict:
    """One stream, one request of --decode-tokens per server per round: decode tok/s = 1 / TPOT (the prompt's
    prefill is TTFT, outside), GB/s = the bytes a token reads / TPOT, and that over the streaming bandwidth. The
    bandwidth is read again right before each request (`ref_gb_s`, three passes): this VM's two-thread read
    moves between ~35 and ~68 GB/s from one minute to the next, so a share against one reading taken at the
    start is a share against another minute's machine. The cell's share is the median of the runs' own shares;
    `stream_gb_s` (`bw`, the run's first reading) is kept beside it."""
    wb = weight_bytes(cell["folder"], quant, cell["gguf"], gguf)
    runs: dict[str, list[dict]] = {"llama": [], "tandem": []}
    procs = start_pair(server, cell, threads, 1, ctx, work)
    try:
        agree = greedy_check(procs, prompts, f"{name} {quant} t{threads}")
        for r in range(args.rounds):
            for _proc, url, kind in (procs if r % 2 == 0 else procs[::-1]):
                ref = stream_bandwidth(threads, reps=3)
                res = asyncio.run(single(url, model_of(kind), prompts[r + 2], args.decode_tokens, kind == "llama"))
                res["tok_s"] = 1.0 / res["tpot"]
                res["gb_s"] = wb[f"{kind}_bytes"] / res["tpot"] / 1e9
                res["ref_gb_s"] = ref
                res["share"] = res["gb_s"] / ref
                res["loadavg"] = os.getloadavg()[0]
                runs[kind].append(res)
                print(f"  decode {name} {quant} t{threads} round {r} {kind}: {res['tok_s']:.2f} tok/s "
                      f"{res['gb_s']:.1f} GB/s ({res['share']:.2f} of {ref:.1f} read just before) load "
                      f"{res['loadavg']:.1f}", flush=True)
    finally:
        stop_all(procs)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("tok_s", "gb_s", "tpot", "ttft", "loadavg",
                                                                "ref_gb_s", "share")}
           for k, v in runs.items()}
    return {"cell": "decode", "model": name, "quant": quant, "threads": threads, "gguf": cell["gguf_kind"],
            "tandem_quant": cell["tandem_quant"] or "none", "bytes": wb, "stream_gb_s": bw, "runs": runs,
            "median": med, "greedy_agree": agree,
            "tandem_of_bandwidth": med["tandem"]["share"], "llama_of_bandwidth": med["llama"]["share"],
            "ratio_tok_s": med["tandem"]["tok_s"] / med["llama"]["tok_s"]}


def run_prefill(server, cell, args, name, quant, threads, work) -> dict:
    """Cold prefill: one request (max_tokens 1) of a fresh random prompt of each length per server per round;
    prompt tok/s = length / TTFT (tandem chunks at its default 512 tokens a step, llama-server its 512-token
    ubatches; its prompt cache off)."""
    ctx = max(args.prefill_lengths) + 16
    runs: dict[str, dict[int, list[dict]]] = {"llama": {}, "tandem": {}}
    procs = start_pair(server, cell, threads, 1, ctx, work)
    rng = np.random.default_rng(1234)
    try:
        for _, url, kind in procs:  # warm: buffers of the longest prompt
            asyncio.run(single(url, model_of(kind), rng.integers(5, 4000, max(args.prefill_lengths)).tolist(), 1,
                               kind == "llama"))
        for r in range(args.prefill_repeats):
            for n in args.prefill_lengths:
                prompt = rng.integers(5, 4000, n).tolist()  # the same fresh prompt for both servers
                for _proc, url, kind in (procs if r % 2 == 0 else procs[::-1]):
                    res = asyncio.run(single(url, model_of(kind), prompt, 1, kind == "llama"))
                    res["prompt_tok_s"] = n / res["ttft"]
                    res["loadavg"] = os.getloadavg()[0]
                    runs[kind].setdefault(n, []).append(res)
                    print(f"  prefill {name} {quant} t{threads} {n} tokens round {r} {kind}: "
                          f"{res['prompt_tok_s']:.0f} tok/s (TTFT {res['ttft'] * 1e3:.0f} ms) "
                          f"load {res['loadavg']:.1f}", flush=True)
    finally:
        stop_all(procs)
    med = {k: {str(n): statistics.median(x["prompt_tok_s"] for x in v) for n, v in d.items()}
           for k, d in runs.items()}
    return {"cell": "prefill", "model": name, "quant": quant, "threads": threads, "gguf": cell["gguf_kind"],
            "runs": {k: {str(n): v for n, v in d.items()} for k, d in runs.items()}, "median_prompt_tok_s": med,
            "ratio": {str(n): med["tandem"][str(n)] / med["llama"][str(n)] for n in args.prefill_lengths}}


def run_spec(server, args, threads, work, gguf) -> list[dict]:
    """Speculation on both servers: the widened pair (training/widen.py's tandem-tiny-l x5, memory-bound, and
    tandem-tiny-s drafting for it: k_max 4, tandem's draft w8a8, llama.cpp's Q8_0) on held-out code prompts,
    each server with and without its draft, all four up at once and measured in a rotating order by the same
    closed-loop greedy client at each of --spec-streams: tok/s, each server's speculative / plain, and tandem /
    llama.cpp with speculation on."""
    from bench.speculative import SMALL, prompts_from_heldout
    from engines.tokenizer import Tokenizer
    from training.widen import DEFAULT_FACTOR, cached_wide

    wide = cached_wide(DEFAULT_FACTOR)
    prompts = prompts_from_heldout(Tokenizer.from_pretrained(wide), 48, args.prompt_tokens, seed=7)
    target = to_gguf(gguf, wide, work / f"{wide.name}-f32.gguf", False)
    draft = to_gguf(gguf, SMALL, work / "tandem-tiny-s-q8_0-all.gguf", True, True)
    ctx = args.prompt_tokens + args.max_tokens + 16
    out = []
    for streams in args.spec_streams:
        starts = {
            "tandem": lambda: start_tandem(wide, threads, None, ctx, work / "tandem.log"),
            "tandem+draft": lambda: start_tandem(wide, threads, None, ctx, work / "tandem-draft.log", extra=(
                "--draft", str(SMALL), "--draft-quantization", "w8a8", "--num-speculative-tokens", "4")),
            "llama": lambda s=streams: start_llama(server, target, threads, s, ctx, work / "llama.log"),
            "llama+draft": lambda s=streams: start_llama(server, target, threads, s, ctx, work / "llama-draft.log", extra=(
                "-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", "4", "-td", str(threads),
                "-ngld", "0"))}
        procs: dict[str, tuple] = {}
        runs: dict[str, list[dict]] = {k: [] for k in starts}
        try:
            for name, fn in starts.items():
                procs[name] = fn()
            texts = {name: asyncio.run(greedy_text(url, model_of(kind), prompts[0], 32))
                     for name, (_, url, kind) in procs.items()}
            agree = {"tandem": texts["tandem"] == texts["tandem+draft"], "llama": texts["llama"] == texts["llama+draft"]}
            print(f"  spec t{threads} streams={streams}: greedy 32 tokens, speculative == plain: {agree}", flush=True)
            names = list(starts)
            for name in names:  # warm-up, not measured
                _, url, kind = procs[name]
                asyncio.run(closed_loop(url, model_of(kind), prompts, streams, args.max_tokens, args.warmup_seconds))
            for r in range(args.rounds):
                for name in names[r % 4:] + names[:r % 4]:  # the order rotated every round
                    proc, url, kind = procs[name]
                    c0 = server_cpu_s(proc.pid)
                    res = asyncio.run(closed_loop(url, model_of(kind), prompts, streams, args.max_tokens,
                                                  args.seconds))
                    res["server_cpu_s"] = server_cpu_s(proc.pid) - c0
                    res["loadavg"] = os.getloadavg()[0]
                    runs[name].append(res)
                    print(f"  spec t{threads} streams={streams} round {r} {name}: {res['tok_s']:.1f} tok/s TPOT p50/p99 "
                          f"{res['tpot_p50_ms']:.1f}/{res['tpot_p99_ms']:.1f} ms load {res['loadavg']:.1f}", flush=True)
        finally:
            stop_all(list(procs.values()))
        med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
        tok = {k: v["tok_s"] for k, v in med.items()}
        out.append({"cell": "spec", "model": f"{wide.name} + tandem-tiny-s", "threads": threads, "streams": streams,
                    "runs": runs, "median": med, "greedy_agree": agree,
                    "tandem_spec_over_plain": tok["tandem+draft"] / tok["tandem"],
                    "llama_spec_over_plain": tok["llama+draft"] / tok["llama"],
                    "ratio_spec_tok_s": tok["tandem+draft"] / tok["llama+draft"],
                    "ratio_plain_tok_s": tok["tandem"] / tok["llama"]})
    return out


def print_tables(cells: list[dict]) -> None:
    rows = [c for c in cells if c["cell"] == "streams"]
    if rows:
        print("| model | weights | threads | streams | tandem tok/s | llama.cpp tok/s | ratio | TTFT p50 ms t / l | "
              "TPOT p50 ms t / l | TPOT p99 ms t / l | tok per server CPU-s t / l |")
        print("|" + "---|" * 11)
    for c in rows:
        t, ll = c["median"]["tandem"], c["median"]["llama"]
        print(f"| {c['model']} | {c['quant']} | {c['threads']} | {c['streams']} | {t['tok_s']:.1f} | "
              f"{ll['tok_s']:.1f} | {c['ratio_tok_s']:.2f}x | {t['ttft_p50_ms']:.1f} / {ll['ttft_p50_ms']:.1f} | "
              f"{t['tpot_p50_ms']:.2f} / {ll['tpot_p50_ms']:.2f} | {t['tpot_p99_ms']:.2f} / {ll['tpot_p99_ms']:.2f} | "
              f"{t['tok_per_cpu_s']:.0f} / {ll['tok_per_cpu_s']:.0f} |")
    rows = [c for c in cells if c["cell"] == "decode"]
    if rows:
        print("| model | weights | threads | tandem tok/s | GB/s | of stream bw | llama.cpp tok/s | GB/s | of stream bw "
              "| ratio | stream GB/s before tandem |")
        print("|" + "---|" * 11)
    for c in rows:
        t, ll = c["median"]["tandem"], c["median"]["llama"]
        print(f"| {c['model']} | {c['quant']} | {c['threads']} | {t['tok_s']:.2f} | {t['gb_s']:.1f} | "
              f"{c['tandem_of_bandwidth']:.2f} | {ll['tok_s']:.2f} | {ll['gb_s']:.1f} | {c['llama_of_bandwidth']:.2f} | "
              f"{c['ratio_tok_s']:.2f}x | {c['median']['tandem']['ref_gb_s']:.1f} |")
    rows = [c for c in cells if c["cell"] == "spec"]
    if rows:
        print("| pair | threads | streams | tandem tok/s plain / spec | spec / plain | llama.cpp tok/s plain / spec "
              "| spec / plain | tandem / llama.cpp, spec |")
        print("|" + "---|" * 8)
    for c in rows:
        t = {k: v["tok_s"] for k, v in c["median"].items()}
        print(f"| {c['model']} | {c['threads']} | {c['streams']} | {t['tandem']:.1f} / {t['tandem+draft']:.1f} | "
              f"{c['tandem_spec_over_plain']:.2f}x | {t['llama']:.1f} / {t['llama+draft']:.1f} | "
              f"{c['llama_spec_over_plain']:.2f}x | {c['ratio_spec_tok_s']:.2f}x |")
    rows = [c for c in cells if c["cell"] == "prefill"]
    if rows:
        print("| model | weights | threads | prompt tokens | tandem prompt tok/s | llama.cpp prompt tok/s | ratio |")
        print("|" + "---|" * 7)
    for c in rows:
        for n, r in c["ratio"].items():
            print(f"| {c['model']} | {c['quant']} | {c['threads']} | {n} | {c['median_prompt_tok_s']['tandem'][n]:.0f} "
                  f"| {c['median_prompt_tok_s']['llama'][n]:.0f} | {r:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="build llama-server into the cache, then exit")
    ap.add_argument("--llama-server", default=None, help="the llama-server binary (else $LLAMA_SERVER, the cache, "
                    "PATH)")
    ap.add_argument("--cells", default="streams", help="comma list: streams (1/8/32-stream matrix), decode "
                    "(one-stream roofline: GB/s over the streaming bandwidth), prefill (cold prompt tok/s), spec "
                    "(the widened pair with and without its draft on both servers; --models does not apply)")
    ap.add_argument("--spec-streams", type=int, nargs="+", default=[1], help="spec cells: closed-loop streams")
    ap.add_argument("--models", default="tiny-l", help="comma list: tiny-l, " + ", ".join(RANDOM_LLAMAS))
    ap.add_argument("--quant", default="f32,8bit", help="comma list: f32, bf16, 8bit, int4")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=12.0, help="closed-loop seconds per run")
    ap.add_argument("--warmup-seconds", type=float, default=4.0,
                    help="an unmeasured closed-loop run per server and cell first (0: none)")
    ap.add_argument("--decode-tokens", type=int, default=24, help="decode cells: tokens per request")
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=[400, 2000])
    ap.add_argument("--prefill-repeats", type=int, default=2)
    ap.add_argument("--tandem-8bit", choices=["w8a8", "int8"], default="w8a8",
                    help="tandem's 8-bit mode (w8a8: against q8_0 everywhere; int8: against q8_0 with an f32 head)")
    ap.add_argument("--tandem-bf16", choices=["bf16", "f32"], default="bf16",
                    help="tandem's mode on the bf16 cells (bf16: quantization bf16, bfloat16 weights and "
                    "activations, llama.cpp's BF16 numerics; f32: float32 activations over the bf16 weight copy)")
    ap.add_argument("--adaptive-threads", action="store_true",
                    help="tandem's --threads is the most a kernel call takes (TANDEM_ADAPTIVE_THREADS=1: "
                    "kernels/thread_governor.py times each count up to it per kind of call and takes the "
                    "fastest); default: exactly --threads, as llama-server's -t")
    ap.add_argument("--tandem-kv", choices=["auto", "float16", "bfloat16"], default="auto",
                    help="tandem's KV cache dtype (auto: the model's, float32 here); llama-server keeps its "
                    "default float16 cache")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vs_llamacpp.json"))
    args = ap.parse_args(argv)
    global TANDEM_KV
    TANDEM_KV = args.tandem_kv
    if args.adaptive_threads:  # start_tandem's environment is this process's
        os.environ["TANDEM_ADAPTIVE_THREADS"] = "1"
    if args.build:
        print(build_llama_server())
        return 0
    server = find_llama_server(args.llama_server)
    if server is None:
        raise SystemExit("llama-server not found: pass --llama-server PATH, set LLAMA_SERVER, or run --build")
    gguf = gguf_module(server)
    work = CACHE / "vs_llamacpp"
    work.mkdir(parents=True, exist_ok=True)
    ctx = args.prompt_tokens + max(args.max_tokens, args.decode_tokens) + 16
    prompts = make_prompts(64, args.prompt_tokens, 0)
    kinds = args.cells.split(",")
    bw = {t: stream_bandwidth(t) for t in args.threads} if "decode" in kinds else {}
    if bw:
        print("  streaming read bandwidth: " + ", ".join(f"{t} thread(s) {b:.1f} GB/s" for t, b in bw.items()))
    cells = []
    load0 = os.getloadavg()
    if "spec" in kinds:
        for threads in args.threads:
            cells += run_spec(server, args, threads, work, gguf)
    for name in (args.models.split(",") if kinds != ["spec"] else []):
        for quant in args.quant.split(","):
            cell = prepare(gguf, work, name, quant, args.tandem_8bit, args.tandem_bf16)
            for threads in args.threads:
                if "decode" in kinds:
                    cells.append(run_decode(server, cell, args, name, quant, threads, prompts, work, ctx,
                                            bw[threads], gguf))
                if "prefill" in kinds and quant != "int4":
                    cells.append(run_prefill(server, cell, args, name, quant, threads, work))
                if "streams" in kinds:
                    for streams in args.streams:
                        cells.append(run_streams(server, cell, args, name, quant, threads, streams, prompts, work,
                                                 ctx))
    print_tables(cells)
    out = {"cells": cells, "args": vars(args), "llama_server": str(server), "stream_gb_s": bw,
           "cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_results(args.out, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
