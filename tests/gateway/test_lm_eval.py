"""lm-evaluation-harness against a live tandem server: `lm_eval --model local-completions` runs a small
multiple-choice log-likelihood task from local files (tests/gateway/lm_eval_task: 30 items, 3 choices each) on
`tandem serve models/tandem-tiny-l`, offline (no Hugging Face download: the tokenizer is the checkpoint's own
folder), and every log-likelihood it reports equals the one tandem's offline API (engines/llm.py,
`SamplingParams(prompt_logprobs=...)`) gives the same tokens, within 1e-4.

The tokenizer is needed: with `tokenizer_backend=None` lm-eval cannot split context from continuation (its
`tok_encode` returns the whole string), so it would score the context too. With the checkpoint's tokenizer and
`tokenized_requests=True` it sends token ids, batches of prompts per request (the list form of `prompt`), echo,
logprobs=1 and max_tokens=1, and reads the prompt's token logprobs back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import start_serve, stop  # conftest puts tests/ on the path

from gateway.server import free_port

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[eval]')")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tandem-tiny-l"
TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASK = "tandem_tiny_choice"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _offline_env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp / "hf"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TANDEM_CONFIG", None)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    proc, url = start_serve([str(MODEL), "--served-model-name", "tiny", "--port", str(port), "--log-level",
                             "warning"], _offline_env(tmp_path_factory.mktemp("serve")), port)
    try:
        yield url
    finally:
        stop(proc)


def _samples(out_dir: Path) -> list[dict]:
    files = sorted(out_dir.rglob(f"samples_{TASK}_*.jsonl"))
    assert files, f"lm-eval wrote no samples under {out_dir}: {sorted(out_dir.rglob('*'))}"
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def test_lm_eval_log_likelihoods_equal_the_offline_api(server, tmp_path):
    out_dir = tmp_path / "results"
    model_args = ",".join([
        "model=tiny", f"base_url={server}/v1/completions", "tokenizer_backend=huggingface", f"tokenizer={MODEL}",
        "tokenized_requests=True", "num_concurrent=1", "max_retries=1", "timeout=120"])
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                          "--tasks", TASK, "--include_path", str(TASK_DIR), "--batch_size", "4",
                          "--output_path", str(out_dir), "--log_samples"],
                         cwd=TASK_DIR, env=_offline_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    samples = _samples(out_dir)
    assert len(samples) == 30

    from transformers import AutoTokenizer

    from engines import LLM, SamplingParams

    hf = AutoTokenizer.from_pretrained(str(MODEL))  # what lm-eval tokenised with
    llm = LLM(MODEL)
    pairs, reported = [], []
    for sample in samples:  # lm-eval logs arguments as {"gen_args_<i>": {"arg_0": context, "arg_1": ...}}
        arguments = [sample["arguments"][f"gen_args_{i}"] for i in range(len(sample["arguments"]))]
        assert len(arguments) == len(sample["resps"]) == 3
        for args, resp in zip(arguments, sample["resps"]):
            pairs.append((args["arg_0"], args["arg_1"]))
            reported.append(float(resp[0][0]))  # (loglikelihood, is_greedy), logged as strings
    token_pairs = []
    for context, continuation in pairs:  # lm-eval's own split (TemplateLM._encode_pair, causal)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = hf(context + continuation, add_special_tokens=False).input_ids
        ctx_len = len(hf(context, add_special_tokens=False).input_ids)
        token_pairs.append((whole, ctx_len))
    outs = llm.generate([{"prompt_token_ids": whole} for whole, _ in token_pairs],
                        SamplingParams(max_tokens=1, prompt_logprobs=0))
    offline = [sum(out.prompt_logprobs[j][whole[j]].logprob for j in range(ctx_len, len(whole)))
               for out, (whole, ctx_len) in zip(outs, token_pairs)]
    assert len(offline) == len(reported) == 90
    worst = max(abs(a - b) for a, b in zip(offline, reported))
    assert worst <= 1e-4, worst
    assert len({round(x, 3) for x in reported}) > 30  # real, distinct scores: not a constant answer
    results = json.loads(sorted(out_dir.rglob("results_*.json"))[-1].read_text())
    acc = results["results"][TASK]["acc,none"]
    expected_acc = sum(
        max(range(len(s["resps"])), key=lambda i: offline[k + i]) == int(s["target"])
        for k, s in zip(range(0, 90, 3), samples)) / 30
    assert acc == pytest.approx(expected_acc)
    print(f"lm-eval local-completions vs the offline API: {len(reported)} log-likelihoods, max |diff| {worst:.2e}, "
          f"acc {acc:.3f}")
