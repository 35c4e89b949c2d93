"""Training code lives in `training/`, outside the serving packages: nothing in engines/, gateway/ or kernels/
imports it (router_model.labels, the labelling tool, imports the corpus lazily inside its build function)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVING = ("engines", "gateway", "kernels")


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_serving_packages_never_import_training():
    offenders = [f"{path.relative_to(ROOT)}: {mod}"
                 for pkg in SERVING for path in sorted((ROOT / pkg).rglob("*.py"))
                 for mod in imported_modules(path) if mod == "training" or mod.startswith("training.")]
    assert offenders == []


def test_router_labels_imports_the_corpus_only_when_building():
    code = "import sys, router_model.labels, gateway.app; print(sorted(m for m in sys.modules if m.startswith('training')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_training_cli_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "training.train", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "python -m training.train" in out.stdout


def test_training_writes_the_tools_aware_chat_template_the_shipped_models_carry():
    """Retraining the tiny models must not lose `tools`: train.py writes the template in
    training/chat_template.jinja, the one both shipped checkpoints carry, and it renders tools and tool turns."""
    import json

    import jinja2

    from training.train import CHATML_TEMPLATE

    for name in ("tandem-tiny-s", "tandem-tiny-l"):
        cfg = json.loads((ROOT / "models" / name / "tokenizer_config.json").read_text())
        assert cfg["chat_template"] == CHATML_TEMPLATE, name
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "12C"}]
    text = jinja2.Environment().from_string(CHATML_TEMPLATE).render(messages=messages, tools=[tool],
                                                                     add_generation_prompt=True)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n12C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_export_gives_config_and_tokenizer_the_same_context(tmp_path):
    """`--max-positions` reaches both places a loader reads the context from: config.json and the tokenizer's
    model_max_length (copied from the shipped 2,048-token tokenizer folder, as when continuing a shipped model,
    and exported at another length)."""
    import json

    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    from training.train import SIZES, build_model, export, hf_config, special_ids

    tok_dir = ROOT / "models" / "tandem-tiny-s"
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())["model_max_length"] == 2048
    cfg = hf_config(SIZES["s"], 4096, special_ids(tok_dir), max_positions=1024)
    model = build_model(cfg, seed=0)
    export(model, cfg, tok_dir, tmp_path / "out", {"test": True})
    assert AutoConfig.from_pretrained(tmp_path / "out").max_position_embeddings == 1024
    assert AutoTokenizer.from_pretrained(tmp_path / "out").model_max_length == 1024
    ref = LlamaForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
    x = torch.arange(1, 40).unsqueeze(0)
    with torch.no_grad():
        ours = model.to(torch.bfloat16).float().dense_logits(x)
        assert torch.allclose(ref(x).logits, ours, atol=1e-3)
