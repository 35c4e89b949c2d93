"""`tandem generate`: greedy output equals transformers' generate token for token; sampling is seeded."""

from __future__ import annotations

import json

import pytest
import torch

from engines.generate_cli import generate_tokens, sample_next
from engines.loader import load_checkpoint
from gateway.cli import main as tandem

PROMPT = "def read_config(path):"


def run_generate(capsys, *args: str) -> dict:
    assert tandem(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("arch,kwargs", [("llama", {"num_heads": 4, "num_kv_heads": 2}),
                                         ("qwen3", {"num_kv_heads": 1, "head_dim": 32})])
def test_greedy_tokens_equal_transformers_generate(tiny_checkpoint, capsys, arch, kwargs):
    import transformers

    folder = tiny_checkpoint(arch, **kwargs)
    out = run_generate(capsys, "--model", str(folder), "--prompt", PROMPT, "--max-tokens", "32",
                       "--temperature", "0")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt_ids = hf_tok(PROMPT, add_special_tokens=True)["input_ids"]
    assert out["prompt_token_ids"] == prompt_ids
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=32,
                                pad_token_id=0)[0, len(prompt_ids):].tolist()
    assert len(out["token_ids"]) == 32  # no early EOS: the comparison covers all 32 steps
    assert out["token_ids"] == expected
    assert out["text"] == hf_tok.decode(expected, skip_special_tokens=True)
    assert out["finish_reason"] == "length"


def test_chat_mode_uses_the_template_and_stops_on_eos(tiny_checkpoint, capsys, tmp_path):
    import shutil

    folder = shutil.copytree(tiny_checkpoint("llama", num_heads=4, num_kv_heads=2), tmp_path / "ckpt")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}<|im_start|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ckpt = load_checkpoint(folder)
    first = run_generate(capsys, "--model", str(folder), "--prompt", "hi", "--chat", "--max-tokens", "8")
    assert first["prompt_token_ids"][0] == 2 and first["prompt_token_ids"][-1] == 2  # <|im_start|> ids
    # Make the greedy token of step 3 an EOS id through generation_config.json: generation stops there.
    stop_id = first["token_ids"][2]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stop_id]}))
    stopped = run_generate(capsys, "--model", str(folder), "--prompt", "hi", "--chat", "--max-tokens", "8")
    assert stopped["token_ids"] == first["token_ids"][:first["token_ids"].index(stop_id) + 1]
    assert stopped["finish_reason"] == "stop"
    assert ckpt.config.eos_token_ids == (1,)


def test_sampling_is_reproducible_with_a_seed_and_plain_output_is_the_text(tiny_checkpoint, capsys):
    folder = str(tiny_checkpoint("llama", num_heads=4, num_kv_heads=2))
    args = ["--model", folder, "--prompt", PROMPT, "--max-tokens", "12", "--temperature", "1.0", "--top-p", "0.9",
            "--top-k", "50"]
    a = run_generate(capsys, *args, "--seed", "7")
    b = run_generate(capsys, *args, "--seed", "7")
    c = run_generate(capsys, *args, "--seed", "8")
    assert a["token_ids"] == b["token_ids"] != c["token_ids"]
    assert tandem(["generate", *args, "--seed", "7"]) == 0
    assert capsys.readouterr().out == a["text"] + "\n"


def test_sample_next_filters():
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0])
    assert sample_next(logits, 0.0, 1.0, 0, None) == 1
    gen = torch.Generator().manual_seed(0)
    assert {sample_next(logits, 1.0, 1.0, 2, gen) for _ in range(50)} == {1, 2}  # top-k 2
    assert {sample_next(logits, 1.0, 0.3, 0, gen) for _ in range(50)} == {1}  # p(1) ~ 0.5 > top_p
    assert {sample_next(logits, 5.0, 1.0, 0, gen) for _ in range(200)} == {0, 1, 2, 3}


def test_generate_tokens_matches_a_full_recompute(tiny_checkpoint):
    # The cached decode path must agree with re-running the whole sequence each step.
    model = load_checkpoint(tiny_checkpoint("qwen2", num_kv_heads=2, tie_word_embeddings=True)).model
    prompt = [5, 17, 99, 3, 250]
    cached = generate_tokens(model, prompt, 10)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(model.dense_logits(torch.tensor([seq]))[0, -1].argmax()))
    assert cached == seq[len(prompt):]


def test_errors_are_reported_without_a_traceback(tmp_path, capsys):
    assert tandem(["generate", "--model", str(tmp_path / "none"), "--prompt", "x"]) == 1
    assert "tandem generate: error:" in capsys.readouterr().err
