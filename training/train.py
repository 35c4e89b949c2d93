"""Reproducible training of the embedded default models `tandem-tiny-s` and `tandem-tiny-l`.

Owns the shared byte-level BPE tokenizer (with a ChatML template), the token caches of the corpus splits,
the plain PyTorch training loop over `engines.model.Transformer.dense_logits`, and the Hugging Face export.

    python -m training.train tokenizer --out /tmp/tandem_tok
    python -m training.train model --size l --tokenizer /tmp/tandem_tok --out models/tandem-tiny-l ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
# ChatML with Hermes-style tools (a <tools> block in the system turn, <tool_call> JSON in assistant turns,
# <tool_response> for role "tool"): the template the shipped models carry, so `tools` work on `make serve`
CHATML_TEMPLATE = (Path(__file__).with_name("chat_template.jinja")).read_text()
MAX_POSITIONS = 2048


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


SIZES = {
    "s": Size(hidden=128, layers=4, heads=4, kv_heads=4, intermediate=352),
    "l": Size(hidden=256, layers=6, heads=8, kv_heads=4, intermediate=704),
}


# ---------------------------------------------------------------- tokenizer and token caches

def train_tokenizer(out_dir: Path, vocab_size: int = 4096) -> None:
    """Byte-level BPE on the train split only, so held-out modules stay unseen even by the merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from training.corpus import load_corpus_split

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((text for _, text in load_corpus_split("train")), trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def special_ids(tok_dir: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def token_cache(tok_dir: Path, split: str, cache_dir: Path = Path("/tmp/tandem_tokens")) -> np.ndarray:
    """The split as one uint16 array: each module's tokens followed by `<|end_of_text|>`; cached as .npy."""
    from tokenizers import Tokenizer

    from training.corpus import load_corpus_split

    tok_text = (tok_dir / "tokenizer.json").read_bytes()
    key = f"{split}-{_digest(tok_text)}"
    path = cache_dir / f"{key}.npy"
    if path.exists():
        return np.load(path, allow_pickle=False)
    tok = Tokenizer.from_str(tok_text.decode())
    eos = tok.token_to_id(EOS)
    docs = load_corpus_split(split)
    ids: list[int] = []
    for enc in tok.encode_batch([text for _, text in docs], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    arr = np.asarray(ids, dtype=np.uint16)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, arr, allow_pickle=False)
    os.replace(tmp, path)
    return arr


def _digest(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()[:16]


# ---------------------------------------------------------------- model and export

def hf_config(size: Size, vocab_size: int, ids: dict[str, int], dtype: str = "bfloat16",
              max_positions: int = MAX_POSITIONS) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.hidden // size.heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "pad_token_id": ids[EOS],
        "torch_dtype": dtype,
        "use_cache": True,
    }


def build_model(cfg: dict, seed: int):
    import torch

    from engines.model import Transformer
    from engines.model_config import ModelConfig

    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_dict(cfg))
    n_layers = cfg["num_hidden_layers"]
    for name, p in model.named_parameters():
        if p.dim() == 2:
            # residual-output projections scaled down with depth (GPT-2 style) keep early training stable
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, 0.0, std)
    return model


def export(model, cfg: dict, tok_dir: Path, out_dir: Path, meta: dict) -> None:
    """Write a complete HF folder atomically (temp dir then rename) so a reader never sees half a checkpoint."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, cfg["torch_dtype"])
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue  # tied to model.embed_tokens.weight; HF re-ties it on load
        state[k] = v.detach().to(dtype).contiguous()
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.95,
        "top_k": 50,
        "max_new_tokens": 128,
    }
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    shutil.copy(tok_dir / "tokenizer.json", tmp / "tokenizer.json")
    tok_cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tok_cfg["model_max_length"] = cfg["max_position_embeddings"]  # the tokenizer says the model's context
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (tmp / "training_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


# ---------------------------------------------------------------- training loop

def teacher_data(args: argparse.Namespace) -> None:
    """Sequence-level distillation data: train-split prompts (16..seq_len-64 tokens, cut at line starts)
    continued greedily by the teacher to `seq_len` tokens. A draft model trained on these trajectories learns
    what the teacher actually generates, which is what speculative decoding accepts (cf. DistillSpec)."""
    import torch

    from engines.llm import LLM
    from engines.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    train = token_cache(Path(args.tokenizer), "train")
    newline_ids = _newline_token_ids(Path(args.tokenizer))
    rng = np.random.default_rng(args.seed)
    seq = args.seq_len + 1  # rows hold inputs and the label of the last position
    llm = LLM(args.teacher, name="teacher", max_num_seqs=args.batch_size, max_model_len=seq + 8)
    rows = np.zeros((args.num, seq), dtype=np.uint16)
    prompt_lens = np.zeros(args.num, dtype=np.int32)
    start = time.monotonic()
    for lo in range(0, args.num, args.batch_size):
        prompts, params = [], []
        for _ in range(min(args.batch_size, args.num - lo)):
            plen = int(rng.integers(16, seq - 64 + 1))
            s = int(rng.integers(0, len(train) - seq - 1))
            # cut the prompt right after a newline token when one is close, like the held-out prompts
            while s < len(train) - seq - 1 and int(train[s + plen - 1]) not in newline_ids and plen > 16:
                s += 1
            prompts.append({"prompt_token_ids": train[s:s + plen].astype(np.int64).tolist()})
            params.append(SamplingParams(temperature=0.0, max_tokens=seq - plen, ignore_eos=True))
        outs = llm.generate(prompts, params)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            ids = p["prompt_token_ids"] + list(o.outputs[0].token_ids)
            rows[lo + i] = np.asarray(ids[:seq], dtype=np.uint16)
            prompt_lens[lo + i] = len(p["prompt_token_ids"])
        print(f"teacher-data {lo + len(prompts)}/{args.num} elapsed={time.monotonic() - start:.0f}s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, tokens=rows, prompt_lens=prompt_lens)
    print(f"wrote {out}: {rows.shape}", flush=True)


def _newline_token_ids(tok_dir: Path) -> set[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return {i for i in range(tok.get_vocab_size()) if (tok.decode([i]) or "").endswith("\n")}


def lr_at(progress: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from `peak` to `floor * peak` as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(max(progress, 0.0), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def eval_loss(model, data: np.ndarray, seq_len: int, n_windows: int, autocast: bool) -> float:
    """Mean next-token loss over `n_windows` evenly spaced windows: fixed positions, so evals are comparable."""
    import torch
    import torch.nn.functional as F

    starts = np.linspace(0, len(data) - seq_len - 2, n_windows).astype(np.int64)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for i in range(0, n_windows, 16):
            batch = np.stack([data[s:s + seq_len + 1] for s in starts[i:i + 16]]).astype(np.int64)
            x = torch.from_numpy(batch)
            logits = model.dense_logits(x[:, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
    model.train()
    return total / count


def fit(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    tok_dir = Path(args.tokenizer)
    size = SIZES[args.size]
    ids = special_ids(tok_dir)
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab_size = len(vocab["model"]["vocab"])
    vocab_size = max(vocab_size, max(ids.values()) + 1)
    cfg = hf_config(size, vocab_size, ids, max_positions=args.max_positions)
    longest = max(args.seq_len, args.long_seq_len if args.long_batch_size else 0)
    if longest > args.max_positions:
        raise SystemExit(f"training windows of {longest} tokens need --max-positions >= {longest}")
    model = build_model(cfg, args.seed)
    previous = _warm_start(model, Path(args.init_from)) if args.init_from else None
    teacher = None
    if args.teacher:
        from engines.loader import load_checkpoint

        teacher = load_checkpoint(args.teacher, dtype="float32").model.eval()
        print(f"distilling from {args.teacher} with weight {args.distill_weight}", flush=True)
    gen = None
    if args.teacher_data:
        if teacher is None:
            raise SystemExit("--teacher-data needs --teacher (the loss on those rows is the KL to it)")
        gen = np.load(args.teacher_data, allow_pickle=False)["tokens"]
        if gen.shape[1] != args.seq_len + 1:
            raise SystemExit(f"--teacher-data rows are {gen.shape[1]} tokens, need --seq-len + 1 = {args.seq_len + 1}")
        print(f"teacher data {args.teacher_data}: {gen.shape[0]} rows, {args.teacher_data_frac:.0%} of each batch",
              flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    train = token_cache(tok_dir, "train")
    val = token_cache(tok_dir, "validation")
    print(f"size={args.size} params={n_params} train_tokens={len(train)} val_tokens={len(val)} "
          f"threads={args.threads}", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(args.seed)
    out_dir = Path(args.out)
    seq, bsz = args.seq_len, args.batch_size
    start = time.monotonic()
    last_save = start
    step, tokens, loss_ema = 0, 0, None
    model.train()
    while True:
        elapsed = time.monotonic() - start
        progress = step / args.steps if args.steps else elapsed / args.time_budget
        if progress >= 1.0:
            break
        lr = lr_at(progress, step, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        if gen is not None:
            # a share of each batch from the teacher's own greedy trajectories (seq_len tokens each)
            n_gen = int(round(bsz * args.teacher_data_frac))
            rows = gen[rng.integers(0, len(gen), size=n_gen)]
            starts = rng.integers(0, len(train) - seq - 1, size=bsz - n_gen)
            windows = [train[s:s + seq + 1] for s in starts] + list(rows)
            batch = torch.from_numpy(np.stack(windows).astype(np.int64))
        else:
            starts = rng.integers(0, len(train) - seq - 1, size=bsz)
            batch = torch.from_numpy(np.stack([train[s:s + seq + 1] for s in starts]).astype(np.int64))
        batches = [batch]
        if args.long_batch_size:
            # mixed lengths: long windows teach the far positions, the short ones keep the short range as it was
            lstarts = rng.integers(0, len(train) - args.long_seq_len - 1, size=args.long_batch_size)
            batches.append(torch.from_numpy(
                np.stack([train[s:s + args.long_seq_len + 1] for s in lstarts]).astype(np.int64)))
        n_total = sum(b[:, 1:].numel() for b in batches)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for b in batches:
            # each part weighted by its share of the step's tokens: one mean over every predicted token
            part = _batch_loss(model, teacher, b, vocab_size, args) * (b[:, 1:].numel() / n_total)
            part.backward()
            step_loss += part.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += n_total
        loss_ema = step_loss if loss_ema is None else 0.98 * loss_ema + 0.02 * step_loss
        now = time.monotonic()
        if step % args.log_every == 0:
            print(f"step={step} progress={progress:.3f} lr={lr:.2e} loss={loss_ema:.4f} "
                  f"tok/s={tokens / (now - start):.0f} elapsed={now - start:.0f}s", flush=True)
        if now - last_save >= args.save_every:
            _save(model, cfg, tok_dir, out_dir, args, step, tokens, now - start, val, previous)
            last_save = time.monotonic()
    _save(model, cfg, tok_dir, out_dir, args, step, tokens, time.monotonic() - start, val, previous, final=True)


def _batch_loss(model, teacher, batch, vocab_size: int, args: argparse.Namespace):
    """Next-token cross-entropy of one batch, mixed with the KL to the teacher when distilling."""
    import torch
    import torch.nn.functional as F

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
        logits = model.dense_logits(batch[:, :-1])
    flat = logits.float().reshape(-1, vocab_size)
    loss = F.cross_entropy(flat, batch[:, 1:].reshape(-1))
    if teacher is not None:
        # logit distillation: match the teacher's next-token distribution so the student agrees with its
        # argmax (what a speculative draft needs), mixed with the plain data loss
        with torch.no_grad():
            target = F.log_softmax(teacher.dense_logits(batch[:, :-1]).float().reshape(-1, vocab_size), -1)
        kl = F.kl_div(F.log_softmax(flat, -1), target, log_target=True, reduction="batchmean")
        loss = (1 - args.distill_weight) * loss + args.distill_weight * kl
    return loss


def _warm_start(model, folder: Path) -> dict:
    """Start from an exported checkpoint's weights (fresh optimizer and schedule): a second training stage."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{folder}: weights do not match this size: missing {missing}, unexpected {unexpected}")
    meta = json.loads((folder / "training_meta.json").read_text())
    print(f"warm start from {folder}: {meta}", flush=True)
    return meta


def _save(model, cfg, tok_dir, out_dir, args, step, tokens, elapsed, val, previous, final=False) -> None:
    vloss = eval_loss(model, val, args.seq_len, 64, args.autocast)
    vlong = None
    if args.long_batch_size:
        vlong = round(eval_loss(model, val, args.long_seq_len, 8, args.autocast), 4)
    # steps/tokens count every stage so far; `previous` keeps the earlier stages' own records
    meta = {"size": args.size, "steps": step + (previous or {}).get("steps", 0),
            "tokens": tokens + (previous or {}).get("tokens", 0), "stage_steps": step, "stage_tokens": tokens,
            "elapsed_s": round(elapsed, 1), "val_loss": round(vloss, 4),
            "val_loss_long": vlong, "final": final, "argv": sys.argv[1:],
            "teacher": args.teacher, "previous": previous}
    export(model, cfg, tok_dir, out_dir, meta)
    print(f"saved step={step} tokens={tokens} val_loss={vloss:.4f} val_loss_long={vlong} final={final} "
          f"-> {out_dir}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer", help="train the shared BPE tokenizer and cache the token arrays")
    t.add_argument("--out", required=True)
    t.add_argument("--vocab-size", type=int, default=4096)
    m = sub.add_parser("model", help="train one model and export it in Hugging Face format")
    m.add_argument("--size", choices=sorted(SIZES), required=True)
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--steps", type=int, default=0, help="fixed step count (schedule by step)")
    m.add_argument("--time-budget", type=float, default=3600.0, help="seconds (schedule by time) if no --steps")
    m.add_argument("--lr", type=float, default=2e-3)
    m.add_argument("--warmup", type=int, default=50)
    m.add_argument("--weight-decay", type=float, default=0.1)
    m.add_argument("--batch-size", type=int, default=16)
    m.add_argument("--seq-len", type=int, default=256)
    m.add_argument("--long-seq-len", type=int, default=2048, help="window length of the --long-batch-size rows")
    m.add_argument("--long-batch-size", type=int, default=0,
                   help="rows of --long-seq-len tokens added to every step (mixed-length batches)")
    m.add_argument("--max-positions", type=int, default=MAX_POSITIONS,
                   help="max_position_embeddings (and model_max_length) of the exported model")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--autocast", action="store_true", help="bf16 autocast (fp32 master weights)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--init-from", default=None, help="checkpoint folder to continue from (fresh optimizer)")
    m.add_argument("--teacher", default=None, help="checkpoint folder to distil from (same tokenizer)")
    m.add_argument("--distill-weight", type=float, default=0.8, help="share of the KL term when distilling")
    m.add_argument("--teacher-data", default=None, help="npz from `teacher-data`: the teacher's greedy trajectories")
    m.add_argument("--teacher-data-frac", type=float, default=0.5, help="share of each batch from --teacher-data")
    m.add_argument("--log-every", type=int, default=20)
    m.add_argument("--save-every", type=float, default=300.0, help="seconds between checkpoint exports")
    g = sub.add_parser("teacher-data", help="greedy continuations of train-split prompts by a teacher model")
    g.add_argument("--teacher", required=True)
    g.add_argument("--tokenizer", required=True)
    g.add_argument("--out", required=True, help=".npz with tokens [num, seq_len + 1] and prompt_lens")
    g.add_argument("--num", type=int, default=2048)
    g.add_argument("--seq-len", type=int, default=256)
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cmd == "teacher-data":
        teacher_data(args)
        return 0
    if args.cmd == "tokenizer":
        out = Path(args.out)
        train_tokenizer(out, args.vocab_size)
        for split in ("train", "validation", "heldout"):
            print(split, len(token_cache(out, split)), "tokens", flush=True)
        return 0
    fit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
