"""`tandem generate`: one completion from a checkpoint folder, offline, with no server.

It runs the batched engine (`engines.LLM`) on a single request; `generate_tokens` and `sample_next` are small
helpers over the same engine and sampler for callers holding a `Transformer` or a logits row.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from engines.llm import LLM
from engines.model import Transformer
from engines.model_config import CheckpointError
from engines.sampler import apply_top_k_top_p_min_p
from engines.sampling_params import SamplingParams
from engines.tokenizer import ChatTemplateError

DEFAULT_MAX_TOKENS = 64


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                generator: torch.Generator | None) -> int:
    """One token from fp32 logits [V]: argmax when temperature is 0, else temperature/top-k/top-p sampling
    with the engine sampler's filters."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    vocab = logits.shape[-1]
    x = (logits / temperature)[None]
    top_k_t = torch.tensor([top_k]) if 0 < top_k < vocab else None
    top_p_t = torch.tensor([top_p], dtype=x.dtype) if top_p < 1.0 else None
    probs = apply_top_k_top_p_min_p(x, top_k_t, top_p_t, None).softmax(-1)[0]
    return int(torch.multinomial(probs, 1, generator=generator))


def generate_tokens(model: Transformer, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                    eos_ids: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Generate up to `max_tokens` tokens after `prompt_ids` with the engine; stops after (and includes) the
    first EOS id."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: at least one prompt token is needed")
    llm = LLM(model, max_num_seqs=1, max_model_len=len(prompt_ids) + max_tokens,
              device=model.lm_head.weight.device)
    llm.engine.eos_token_ids = set(eos_ids)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens)
    return llm.generate({"prompt_token_ids": list(prompt_ids)}, params)[0].outputs[0].token_ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem generate", description="Generate a completion from a checkpoint folder.")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder (config.json, safetensors, "
                   "tokenizer), a .gguf file, or a Hub id ORG/NAME (docs/models.md)")
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
        llm = LLM(args.model, dtype=args.dtype, device=device, max_num_seqs=1)
        tokenizer = llm.tokenizer
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)  # the template already has BOS
        else:
            prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True)
    except (CheckpointError, ChatTemplateError, ValueError) as e:
        print(f"tandem generate: error: {e}", file=sys.stderr)
        return 1

    gen = llm.engine.generation_defaults
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
    context = llm.engine.max_model_len
    if not prompt_ids or len(prompt_ids) >= context:
        print(f"tandem generate: error: the prompt has {len(prompt_ids)} tokens; the model takes 1 to "
              f"{context - 1}", file=sys.stderr)
        return 2
    max_tokens = min(max_tokens, context - len(prompt_ids))

    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=args.seed,
                                max_tokens=max_tokens)
        out = llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0]
    except ValueError as e:  # invalid sampling values or a rejected request, worded for the user
        print(f"tandem generate: error: {e}", file=sys.stderr)
        return 2
    token_ids, text, finish_reason = out.token_ids, out.text, out.finish_reason
    if args.json:
        print(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": token_ids, "text": text,
                          "finish_reason": finish_reason}, ensure_ascii=False))
    else:
        print(text)
    return 0
