"""compressed-tensors W8A8 (engines/formats/prequant.py): the dynamic per-token int8 input activations its config
declares are applied in tandem's forward. Reference: transformers loading the checkpoint itself, whose
compressed-tensors hooks quantise each token's activations as the config says; tandem's logits match it to float
rounding and differ measurably from the same weights with float activations. Activation schemes tandem does
not apply (static, float8, int8 on 4-bit weights) are refused in one line naming config.json."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from prequant_files import compressed_tensors  # conftest puts tests/ on the path

from engines import LLM
from engines.model_config import CheckpointError
from kernels.quant_matmul import QuantLinear, quantize_act_token

GEOMETRY = {"hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2}
PROMPT = [5, 17, 42, 99, 7, 200, 3, 64]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def w8a8(tiny_checkpoint, tmp_path_factory):
    return compressed_tensors(tiny_checkpoint("llama", **GEOMETRY), tmp_path_factory.mktemp("w8a8"), "W8A8")


def test_per_token_activations_match_the_library_and_differ_from_weight_only(w8a8):
    import transformers

    llm = LLM(w8a8, max_model_len=64)
    model = llm.engine.model
    lins = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(lins) == 14 and all(m.mode == "int8" and m.act_quant == "token" for m in lins)
    assert "int8 activations per token" in model.load_info["quantization"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(w8a8, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        theirs = ref(ids).logits[0]
        ours = model.dense_logits(ids)[0]
        for m in lins:
            m.act_quant = None
        weight_only = model.dense_logits(ids)[0]
        for m in lins:
            m.act_quant = "token"
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() < 1e-4
    assert (weight_only - theirs).abs().max().item() > 50 * max((ours - theirs).abs().max().item(), 1e-6)


def test_quantize_act_token_is_the_librarys_fake_quantisation():
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = preset_name_to_scheme("W8A8", ["Linear"]).input_activations
    x = torch.randn(6, 64) * torch.rand(6, 1) * 5
    x[2] = 0.0  # an all-zero row
    x[3, 0] = 127.5 * 0.01  # a tie at the range's end
    x[3, 1:] = 0.001
    q, s = quantize_act_token(x)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, args)
    theirs = fake_quantize(x, scale, zp, args)
    assert torch.equal(q.float() * s[:, None], theirs)
    assert q.dtype == torch.int8 and int(q.min()) >= -128 and not q[2].any()


def _with_activations(folder, tmp_path, acts):
    dst = shutil.copytree(folder, tmp_path / "changed")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(acts)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("acts,said", [
    ({"dynamic": False, "strategy": "tensor"}, "input activations int8 tensor (static, symmetric) are not supported"),
    ({"type": "float"}, "input activations float8 token (dynamic, symmetric) are not supported"),
    ({"symmetric": False}, "input activations int8 token (dynamic, asymmetric) are not supported"),
])
def test_activation_schemes_tandem_does_not_apply_are_refused(w8a8, tmp_path, acts, said):
    dst = _with_activations(w8a8, tmp_path, acts)
    with pytest.raises(CheckpointError) as err:
        LLM(dst)
    assert str(err.value).startswith(f"{dst / 'config.json'}: compressed-tensors {said}")
    assert "\n" not in str(err.value)


def test_fp8_with_static_activations_is_refused(tiny_checkpoint, tmp_path):
    folder = compressed_tensors(tiny_checkpoint("llama", **GEOMETRY), tmp_path / "fp8", "FP8")
    with pytest.raises(CheckpointError, match="input activations float8 tensor \\(static, symmetric\\) are not"):
        LLM(folder)
