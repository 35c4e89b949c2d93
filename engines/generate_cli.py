"""`tandem generate`: one completion from a checkpoint folder, offline, with no server.

The generation loop is the simple contiguous-cache path (prefill, then one token at a time) kept in
`generate_tokens`, so the command can switch to the batched engine without touching its interface.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from engines.attention import ContiguousCache
from engines.loader import load_checkpoint
from engines.model import Transformer
from engines.model_config import CheckpointError
from engines.tokenizer import ChatTemplateError, Tokenizer

DEFAULT_MAX_TOKENS = 64


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                generator: torch.Generator | None) -> int:
    """One token from fp32 logits [V]: argmax when temperature is 0, else temperature/top-k/top-p sampling."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the most likely token always stays.
        drop = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate_tokens(model: Transformer, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                    eos_ids: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Generate up to `max_tokens` tokens after `prompt_ids`; stops after (and includes) the first EOS id."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: at least one prompt token is needed")
    cfg = model.config
    device = model.lm_head.weight.device
    cache = ContiguousCache(cfg.num_layers, 1, len(prompt_ids) + max_tokens, cfg.num_kv_heads, cfg.head_dim,
                            dtype=model.lm_head.weight.dtype, device=device)
    generator = None
    if seed is not None and temperature > 0:
        generator = torch.Generator(device=device).manual_seed(seed)
    step_ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    position = 0
    out: list[int] = []
    while len(out) < max_tokens:
        positions = torch.arange(position, position + len(step_ids), device=device)
        cache.begin([len(step_ids)])
        hidden = model(step_ids, positions, cache)
        cache.end()
        position += len(step_ids)
        token = sample_next(model.compute_logits(hidden[-1:])[0], temperature, top_p, top_k, generator)
        out.append(token)
        if token in eos_ids:
            break
        step_ids = torch.tensor([token], dtype=torch.long, device=device)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem generate", description="Generate a completion from a checkpoint folder.")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder (config.json, safetensors, tokenizer)")
    p.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens to generate (default: generation_config.json max_new_tokens, else {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: generation_config.json when it samples, else greedy)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens (default 0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (reproducible output)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--json", action="store_true", help="print prompt_token_ids, token_ids, text and finish_reason")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        ckpt = load_checkpoint(args.model, dtype=args.dtype, device=device)
        tokenizer = Tokenizer.from_pretrained(args.model)
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)  # the template already has BOS
        else:
            prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True)
    except (CheckpointError, ChatTemplateError, ValueError) as e:
        print(f"tandem generate: error: {e}", file=sys.stderr)
        return 1

    gen = ckpt.generation
    temperature = args.temperature
    if temperature is None:  # generation_config.json only samples when it says do_sample, as in transformers
        temperature = (gen.temperature if gen.temperature is not None else 1.0) if gen.do_sample else 0.0
    top_p = args.top_p if args.top_p is not None else (gen.top_p if gen.do_sample and gen.top_p else 1.0)
    top_k = args.top_k if args.top_k is not None else (gen.top_k if gen.do_sample and gen.top_k else 0)
    max_tokens = args.max_tokens if args.max_tokens is not None else (gen.max_new_tokens or DEFAULT_MAX_TOKENS)
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_tokens < 1:
        print("tandem generate: error: need temperature >= 0, 0 < top-p <= 1, top-k >= 0, max-tokens >= 1",
              file=sys.stderr)
        return 2
    context = ckpt.config.max_position_embeddings
    if not prompt_ids or len(prompt_ids) >= context:
        print(f"tandem generate: error: the prompt has {len(prompt_ids)} tokens; the model takes 1 to "
              f"{context - 1}", file=sys.stderr)
        return 2
    max_tokens = min(max_tokens, context - len(prompt_ids))

    eos_ids = tokenizer.eos_token_ids | set(ckpt.eos_token_ids)
    token_ids = generate_tokens(ckpt.model, prompt_ids, max_tokens, temperature, top_p, top_k, args.seed, eos_ids)
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    finish_reason = "stop" if token_ids and token_ids[-1] in eos_ids else "length"
    if args.json:
        print(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": token_ids, "text": text,
                          "finish_reason": finish_reason}, ensure_ascii=False))
    else:
        print(text)
    return 0
