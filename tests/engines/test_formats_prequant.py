"""Pre-quantised safetensors (engines/formats/prequant.py) through `LLM(folder)`: compressed-tensors checkpoints
made with the library's own qparams and compressors (W4A16 symmetric and asymmetric, pack-quantized; W8A8 int8
per channel with dynamic per-token int8 activations; FP8 per tensor weight-only, dequantised at load), GPTQ (4-bit, groups, symmetric and asymmetric, desc_act
false and true) and AWQ (GEMM) packed to their documented layouts. For each, the loaded weights equal the
format's dequantisation exactly (the library's own for compressed-tensors), the layers are tandem's QuantLinear
(never widened, except FP8, said so; desc_act's reordered groups with the activations gathered into the
stored order), and the logits are within 0.25 of
transformers' on the dequantised weights (transformers loads symmetric compressed-tensors itself on the CPU);
greedy tokens are compared where the CPU path runs float or W8A8's per-token activations (int8, the dequantised FP8). Bad configs (GPTQ bits, unknown method) fail with one line naming config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from prequant_files import (  # conftest puts tests/ on the path
    awq,
    awq_reference,
    compressed_tensors,
    compressed_tensors_reference,
    gptq,
    gptq_reference,
)
from safetensors.torch import load_file, save_file

from engines import LLM, SamplingParams
from engines.model_config import CheckpointError
from kernels.cpu_kernels import PackedLinear
from kernels.quant_matmul import QuantLinear

GEOMETRY = {"hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2}
PROMPT = [5, 17, 42, 99, 7, 200, 3, 64]
LAYERS = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj",
          "model.layers.1.mlp.gate_proj"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAKERS = {
    "ct-w4a16": (lambda s, d: compressed_tensors(s, d, "W4A16"), compressed_tensors_reference, "int4"),
    "ct-w4a16-asym": (lambda s, d: compressed_tensors(s, d, "W4A16_ASYM"), compressed_tensors_reference, "int4"),
    "ct-w8a8": (lambda s, d: compressed_tensors(s, d, "W8A8"), compressed_tensors_reference, "int8 (w8a8 per token)"),
    "ct-fp8": (lambda s, d: compressed_tensors(s, d, "FP8", activations=False), compressed_tensors_reference,
               "dequantised (fp8)"),
    "gptq-sym": (lambda s, d: gptq(s, d, group=64, sym=True), gptq_reference, "int4"),
    "gptq-asym-g128": (lambda s, d: gptq(s, d, group=128, sym=False), gptq_reference, "int4"),
    "gptq-desc-act": (lambda s, d: gptq(s, d, group=64, desc_act=True), gptq_reference, "int4 (act-order)"),
    "awq-gemm": (lambda s, d: awq(s, d, group=64), awq_reference, "int4"),
}


@pytest.fixture(scope="module")
def made(tiny_checkpoint, tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = MAKERS[kind][0](tiny_checkpoint("llama", **GEOMETRY), tmp_path_factory.mktemp(kind))
        return cache[kind]
    return get


def _dequantised_float_folder(folder: Path, reference, out: Path) -> Path:
    """The same model with every quantised Linear replaced by its format's dequantisation (transformers'
    input where it does not load the format on the CPU)."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config")
    shutil.copytree(folder, out)
    (out / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(folder / "model.safetensors"))
    prefixes = {n.rsplit(".", 1)[0] for n in state if n.endswith((".qweight", ".weight_packed", ".weight_scale"))}
    floats = {n: t for n, t in state.items() if n.rsplit(".", 1)[0] not in prefixes}
    floats.update({f"{p}.weight": reference(folder, p).contiguous() for p in prefixes})
    save_file(floats, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("kind", list(MAKERS))
def test_weights_equal_the_formats_dequantisation_and_logits_match(made, kind, tmp_path):
    import transformers

    folder = made(kind)
    llm = LLM(folder, max_model_len=128)
    model = llm.engine.model
    _, reference, loaded_as = MAKERS[kind]
    for prefix in LAYERS:
        module = model.get_submodule(prefix)
        if loaded_as.startswith("dequantised"):
            assert type(module) in (torch.nn.Linear, PackedLinear)  # (float32 in panels where the C stack runs)
            assert torch.equal(module.weight, reference(folder, prefix))
        else:
            assert isinstance(module, QuantLinear) and module.mode == loaded_as.split()[0]
            assert (module.input_perm is not None) == ("act-order" in loaded_as)
            assert torch.equal(module.dequantized_weight(), reference(folder, prefix))
    assert f"{loaded_as} x14" in model.load_info["quantization"]
    # transformers 5.24 loads compressed-tensors itself, except the asymmetric packed zero points (it expects
    # them unpacked: a load-report size mismatch), which take the dequantised folder as GPTQ and AWQ do
    native = kind in ("ct-w4a16", "ct-w8a8")
    ref_dir = folder if native else _dequantised_float_folder(folder, reference, tmp_path / "float")
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        theirs = ref(ids).logits[0]
        ours = model.dense_logits(ids)[0]
    assert theirs.abs().max() > 1.0 and (ours - theirs).abs().max().item() < 0.25
    if loaded_as.startswith(("int8", "dequantised")):
        # the greedy tokens of transformers: on the dequantised weights, or (W8A8) on the checkpoint itself,
        # whose activations compressed-tensors quantises per token as tandem does
        dense = ref if not native or kind == "ct-w8a8" else transformers.AutoModelForCausalLM.from_pretrained(
            _dequantised_float_folder(folder, reference, tmp_path / "float"), dtype=torch.float32).eval()
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        got = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids
        seq = list(PROMPT)
        with torch.no_grad():
            for _ in range(8):
                seq.append(int(dense(torch.tensor([seq])).logits[0, -1].argmax()))
        assert got == seq[len(PROMPT):]


@pytest.mark.parametrize("kind", ["gptq-sym", "gptq-asym-g128", "gptq-desc-act", "awq-gemm", "ct-w4a16",
                                  "ct-w4a16-asym"])
def test_4bit_weights_take_no_more_memory_than_the_file(made, kind, tiny_checkpoint):
    """Packed weights and scales as stored, never widened; the zero points packed two per byte (the files pack
    them 8 to an int32: the same bytes), none where they are all 8 (symmetric), act-order's permutation int32 as
    the file's g_idx: the loaded weights take no more bytes than the file."""
    folder = made(kind)
    model = LLM(folder, max_model_len=64).engine.model
    lins = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(lins) == 14 and all(m.mode == "int4" for m in lins)
    assert model.load_info["weight_bytes"] <= (folder / "model.safetensors").stat().st_size
    zeros = [m.zero for m in lins]
    if kind in ("gptq-sym", "gptq-desc-act", "ct-w4a16"):
        assert all(z is None for z in zeros)  # symmetric: no zero points kept
    else:
        # (random weights of a small projection may have every zero at 8: nothing stored for it either)
        assert any(z is not None for z in zeros)
        assert all(z.dtype == torch.uint8 and z.shape[1] == (m.scale.shape[1] + 1) // 2
                   for m, z in zip(lins, zeros) if z is not None)
    float_file = tiny_checkpoint("llama", **GEOMETRY) / "model.safetensors"
    assert model.load_info["weight_bytes"] < 0.35 * float_file.stat().st_size


def test_quantize_config_json_is_read_too(made, tmp_path):
    src = made("gptq-sym")
    dst = shutil.copytree(src, tmp_path / "legacy")
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    qc.pop("quant_method")
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "quantize_config.json").write_text(json.dumps(qc))
    assert "gptq int4 g64: int4 x14" in LLM(dst, max_model_len=64).engine.model.load_info["quantization"]


@pytest.mark.parametrize("change,message", [
    ({"bits": 3}, "GPTQ bits=3 is not supported: tandem loads 4-bit GPTQ (onto its int4 kernels)"),
    ({"bits": 8}, "GPTQ bits=8 is not supported: tandem loads 4-bit GPTQ (onto its int4 kernels)"),
    ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not supported; supported: gptq, "
                                       "awq, compressed-tensors"),
])
def test_unsupported_quantization_config_is_one_line(made, tmp_path, change, message):
    dst = shutil.copytree(made("gptq-sym"), tmp_path / "bad")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        LLM(dst)
    assert str(err.value) == f"{dst / 'config.json'}: {message}"


def test_serve_refuses_unsupported_gptq_bits_in_one_line(made, tmp_path):
    import os
    import subprocess
    import sys

    dst = shutil.copytree(made("gptq-sym"), tmp_path / "gptq3")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (dst / "config.json").write_text(json.dumps(cfg))
    env = {**os.environ}
    env.pop("TANDEM_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", str(dst), "--port", "1"],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"{dst / 'config.json'}: GPTQ bits=3 is not supported: tandem loads "
                                                 "4-bit GPTQ (onto its int4 kernels)")


def test_gptq_qwen2_keeps_its_qkv_biases(tiny_checkpoint, tmp_path):
    import transformers

    src = tiny_checkpoint("qwen2", **GEOMETRY)
    folder = gptq(src, tmp_path / "qwen2-gptq", group=64, sym=False)
    model = LLM(folder, max_model_len=64).engine.model
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantLinear) and q.bias is not None
    assert torch.equal(q.bias, load_file(str(src / "model.safetensors"))["model.layers.0.self_attn.q_proj.bias"])
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        _dequantised_float_folder(folder, gptq_reference, tmp_path / "float"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT])).logits[0]
        ours = model.dense_logits(torch.tensor([PROMPT]))[0]
    assert (ours - theirs).abs().max().item() < 0.25


@pytest.mark.parametrize("kind", ["gptq-sym", "gptq-asym-g128", "gptq-desc-act", "awq-gemm", "ct-w4a16"])
def test_engine_decoding_equals_the_models_own_forward(made, kind):
    """The engine's CPU decode path (the C decoder stack where it covers the model) gives the tokens of a
    greedy loop over the model's own forward: act-order weights, whose input must be gathered first, keep the
    module path."""
    llm = LLM(made(kind), max_model_len=64)
    model = llm.engine.model
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(model.dense_logits(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(PROMPT):]
