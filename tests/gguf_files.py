"""Tiny GGUF files written with the `gguf` package itself (GGUFWriter, gguf.quants) from a Hugging Face folder
of tests/tiny_checkpoints.py, as llama.cpp's converter lays them out (llama's q/k rows permuted, GGML's
reversed dimension order); Q4_K blocks are packed here to llama.cpp's layout (gguf.quants has no Q4_K
quantiser) and checked against gguf.quants' own dequantisation by the tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")  # model.layers.N.<module...>.<weight|bias>
    return f"blk.{parts[2]}.{LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (halves -> interleaved RoPE pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Float [N, K] (K % 256 == 0) -> Q4_K blocks [N, K / 256 * 144] as uint8: per 256 values an fp16 d and
    dmin, 8 sub-blocks of 32 with 6-bit scale and min (12 bytes), 4-bit q with y = d * sc * q - dmin * m."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)
    hi = x.max(-1)
    sub_scale = np.maximum(hi - lo, 1e-8) / 15.0
    sub_min = -lo
    d = (sub_scale.max(-1) / 63.0).astype(np.float16)
    dmin = (np.maximum(sub_min.max(-1), 1e-8) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(sub_scale / df), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(sub_min / dminf), 0, 63).astype(np.uint8)
    eff_s = (df * sc)[..., None]
    eff_m = (dminf * mn)[..., None]
    q = np.clip(np.round((x + eff_m) / eff_s), 0, 15).astype(np.uint8)  # [B, 8, 32]
    scales = np.zeros((x.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)  # chunk c: sub-block 2c low, 2c + 1 high
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], 1)
    return blocks.reshape(n, -1)


def spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary of `size` (tokens, scores, GGUF token types): <unk>, <s>, </s>, the 256
    byte-fallback tokens, then pieces (with U+2581 for spaces) of a BPE trained with the tokenizers library,
    scored by merge rank, as llama.cpp's converter writes a Llama 2 tokenizer."""
    from tiny_checkpoints import _CORPUS
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    ascii_text = ["".join(c for c in line if ord(c) < 128) for line in _CORPUS]
    trainer.train_from_iterator(ascii_text, vocab_size=size, min_frequency=1, show_progress=False)
    pieces = [t for t, _ in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [p for p in pieces if p not in tokens][:size - len(tokens)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    return tokens, scores, types


def write_gguf(folder: Path, out: Path, linear_type: str = "F32", embed_type: str = "F32",
               chat_template: str | None = None, name: str = "tiny", tokenizer: str = "gpt2") -> Path:
    """The checkpoint in `folder` as one GGUF file: 2-D weights in `linear_type` (F32, F16, Q8_0, Q4_0,
    Q4_K...), the embedding table in `embed_type`, norms and biases in F32; `tokenizer` gpt2 (the folder's
    byte-level BPE) or spm (`spm_vocab`, no merges: they come from the scores)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = ARCH[cfg["architectures"][0]]
    state = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    if tokenizer == "spm":
        tokens, scores, types = spm_vocab(cfg["vocab_size"])
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    else:
        tok = json.loads((folder / "tokenizer.json").read_text())
        vocab = dict(tok["model"]["vocab"])
        special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
        vocab.update(special)
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(cfg["bos_token_id"])
        w.add_eos_token_id(cfg["eos_token_id"])
        w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for hf, t in state.items():
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        t = t.astype(np.float32)
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            t = permute_rows(t, heads if ".q_proj." in hf else kv)
        kind = "F32" if t.ndim == 1 else (embed_type if hf == "model.embed_tokens.weight" else linear_type)
        add_tensor(w, gguf_name(hf), t, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def add_tensor(w, name: str, t: np.ndarray, kind: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        w.add_tensor(name, t)
    elif kind == "F16":
        w.add_tensor(name, t.astype(np.float16))
    elif kind == "Q4_K":
        w.add_tensor(name, quantize_q4_k(t), raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
