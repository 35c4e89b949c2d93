"""GGUF files (engines/formats/gguf.py) written in the tests with the gguf package (GGUFWriter, gguf.quants)
from tiny random checkpoints, loaded through `LLM(FILE.gguf)` and checked against transformers' own GGUF
loader (`from_pretrained(dir, gguf_file=...)`, which dequantises): greedy tokens equal for F32, F16 and Q8_0
(onto the int8 kernels with the file's int8 values and scale per 32, exactly: the loaded weights are int8),
logits within 0.25 for Q8_0 onto w8a8 (asked for with quantization=..., activations quantised per 32 too) and
for Q4_0 (onto int4 in groups of 32, exact weights; torch's packed CPU op rounds activations to bf16), within
1e-4 for Q4_K
(dequantised at load); the tokenizer and chat template from the metadata equal transformers'; a truncated
file, a type tandem cannot load and an unsupported architecture fail with one line naming the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import permute_rows, quantize_q4_k, write_gguf  # conftest puts tests/ on the path
from tiny_checkpoints import CHATML

from engines import LLM, SamplingParams
from engines.model_config import CheckpointError
from kernels.quant_matmul import QuantLinear

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 64, 12, 250, 31, 8]]
GEOMETRY = {"hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ggufs(tiny_checkpoint, tmp_path_factory):
    """(folder, {type: path}) per architecture; the .gguf files sit in one folder each for transformers."""
    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, kind: str) -> Path:
        if (arch, kind) not in made:
            src = tiny_checkpoint(arch, **GEOMETRY)
            out = tmp_path_factory.mktemp(f"gguf-{arch}-{kind}") / f"tiny-{kind}.gguf"
            made[arch, kind] = write_gguf(src, out, kind, chat_template=CHATML)
        return made[arch, kind]
    return get


def _reference(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def _ref_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding over the reference's full logits (EOS included, as ignore_eos does)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0"])
def test_greedy_tokens_equal_transformers(ggufs, arch, kind):
    path = ggufs(arch, kind)
    llm = LLM(path, max_model_len=256)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    ref = _reference(path)
    assert ours == [_ref_greedy(ref, p, 10) for p in PROMPTS]
    info = llm.engine.model.load_info
    assert info["format"] == "gguf" and info["source"] == str(path) and info["context_length"] == 512
    if kind == "Q8_0":  # onto the int8 kernel as stored: int8 values, the file's scale per block of 32
        assert "Q8_0->int8 x" in info["quantization"] and "dequantised" not in info["quantization"]
        for lin in (llm.engine.model.model.layers[0].self_attn.q_proj, llm.engine.model.model.layers[1].mlp.down_proj):
            assert isinstance(lin, QuantLinear) and lin.mode == "int8" and lin.int8_group == 32
            assert lin.weight.dtype == torch.int8 and lin.scale.shape == (lin.out_features, lin.in_features // 32)


@pytest.mark.parametrize("kind,quant,tol", [("Q8_0", "int8", 0.25), ("Q8_0", "w8a8", 0.25), ("Q4_0", "none", 0.25),
                                            ("Q4_K", "none", 1e-4)])
def test_quantised_logits_within_tolerance(ggufs, kind, quant, tol):
    path = ggufs("llama", kind)
    llm = LLM(path, max_model_len=256, quantization=quant)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        ours = llm.engine.model.dense_logits(ids)[0]
        theirs = _reference(path)(ids).logits[0]
    assert (ours - theirs).abs().max().item() < tol
    assert theirs.abs().max().item() > 1.0  # the logits are far from zero, so the bound means something
    text = llm.engine.model.load_info["quantization"]
    assert {"Q8_0": f"Q8_0->{quant} x15", "Q4_0": "Q4_0->int4 x15", "Q4_K": "Q4_K->float (dequantised) x15"}[kind] in text
    if kind != "Q4_K":
        assert isinstance(llm.engine.model.model.layers[0].mlp.down_proj, QuantLinear)


def test_loaded_weights_equal_the_format_librarys_dequantisation(ggufs):
    import gguf

    reader = gguf.GGUFReader(str(ggufs("llama", "Q4_0")), "r")
    tensors = {t.name: t for t in reader.tensors}
    model = LLM(ggufs("llama", "Q4_0"), max_model_len=64).engine.model
    for gguf_name, module, heads in [("blk.0.attn_q.weight", model.model.layers[0].self_attn.q_proj, 4),
                                     ("blk.1.ffn_down.weight", model.model.layers[1].mlp.down_proj, None)]:
        t = tensors[gguf_name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        if heads:  # undo the converter's permutation to compare in Hugging Face's row order
            ref = ref.reshape(heads, -1, 2, ref.shape[1]).swapaxes(1, 2).reshape(ref.shape)
        assert isinstance(module, QuantLinear) and module.mode == "int4" and module.group_size == 32
        assert torch.equal(module.dequantized_weight(), torch.from_numpy(ref))
    q8_model = LLM(ggufs("llama", "Q8_0"), max_model_len=64).engine.model
    q8_tensors = {t.name: t for t in gguf.GGUFReader(str(ggufs("llama", "Q8_0")), "r").tensors}
    for gguf_name, module, heads in [("blk.0.ffn_up.weight", q8_model.model.layers[0].mlp.up_proj, None),
                                     ("blk.1.attn_k.weight", q8_model.model.layers[1].self_attn.k_proj, 2)]:
        t = q8_tensors[gguf_name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        if heads:
            ref = ref.reshape(heads, -1, 2, ref.shape[1]).swapaxes(1, 2).reshape(ref.shape)
        assert module.weight.dtype == torch.int8 and module.int8_group == 32
        assert torch.equal(module.dequantized_weight(), torch.from_numpy(ref))  # exactly the file's values
        # the int8 values and the fp16 block scales as stored: no more bytes than the file's 34 per 32 weights
        assert module.scale.dtype == torch.float16
        assert module.weight.nbytes + module.scale.nbytes <= t.data.nbytes == module.weight.numel() * 34 // 32
    q8_lins = [m for m in q8_model.modules() if isinstance(m, QuantLinear)]
    q8_file = [t for n, t in q8_tensors.items() if t.tensor_type == gguf.GGMLQuantizationType.Q8_0
               and n != "token_embd.weight"]  # the 14 projections and the head
    assert len(q8_lins) == len(q8_file) == 15
    assert sum(m.weight.nbytes + m.scale.nbytes for m in q8_lins) <= sum(t.data.nbytes for t in q8_file)


def test_q4_k_packing_is_the_formats_own():
    import gguf

    w = np.random.default_rng(0).normal(0, 0.08, (4, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q4_k(w), gguf.GGMLQuantizationType.Q4_K)
    assert back.shape == w.shape and np.abs(back - w).max() < 0.08 * 4 / 15


def test_permutation_round_trips():
    from engines.formats.gguf import _unpermute_rows

    w = np.arange(32 * 3).reshape(32, 3)
    assert np.array_equal(permute_rows(w, 4)[_unpermute_rows(32, 4).numpy()], w)


def test_tokenizer_and_chat_template_from_metadata_equal_transformers(ggufs):
    import transformers

    path = ggufs("llama", "F32")
    tok = LLM(path, max_model_len=64).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["The quick brown fox", "def read_config(path):\n    return 1", "Ünïcödé 🙂 <|im_end|> x",
                 "  spaces\tand\nlines "]:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                          add_generation_prompt=True)
    assert tok.eos_token_ids == {1} and tok.bos_token_id == 0


def _one_line_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        LLM(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path))
    return message


def test_truncated_file_is_one_line(ggufs, tmp_path):
    data = ggufs("llama", "Q8_0").read_bytes()
    for cut in (len(data) // 2, 100):  # inside the tensors, inside the metadata
        bad = tmp_path / f"cut-{cut}.gguf"
        bad.write_bytes(data[:cut])
        assert "not a readable GGUF file, truncated or damaged" in _one_line_error(bad)


def test_unknown_quantisation_type_is_one_line(tiny_checkpoint, tmp_path, monkeypatch):
    import gguf_files

    real = gguf_files.add_tensor

    import gguf

    q8_1 = gguf.GGMLQuantizationType.Q8_1  # a type the gguf package cannot dequantise
    block, size = gguf.GGML_QUANT_SIZES[q8_1]

    def q8_1_for_ffn_up(w, name, t, kind):
        if name == "blk.0.ffn_up.weight":
            w.add_tensor(name, np.zeros((t.shape[0], t.shape[1] // block * size), dtype=np.uint8), raw_dtype=q8_1)
        else:
            real(w, name, t, kind)
    monkeypatch.setattr(gguf_files, "add_tensor", q8_1_for_ffn_up)
    bad = write_gguf(tiny_checkpoint("llama", **GEOMETRY), tmp_path / "q8_1.gguf", "F16")
    assert _one_line_error(bad) == (f"{bad}: tensor 'blk.0.ffn_up.weight' has quantisation type Q8_1, which "
                                    "tandem cannot load (no dequantisation for it in the gguf package)")


def test_serve_truncated_gguf_is_one_line_without_traceback(ggufs, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(ggufs("llama", "F16").read_bytes()[:5000])
    env = {**os.environ}
    env.pop("TANDEM_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", str(bad), "--port", "1"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"engines.{bad}.checkpoint: {bad}: not a readable GGUF file" in lines[0]


def test_unsupported_architecture_and_split_files_are_one_line(tmp_path):
    import gguf

    def header_only(name: str, arch: str, **extra) -> Path:
        w = gguf.GGUFWriter(str(tmp_path / name), arch)
        for key, value in extra.items():
            w.add_uint32(key, value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    assert _one_line_error(header_only("mamba.gguf", "mamba")) == (
        f"{tmp_path / 'mamba.gguf'}: GGUF architecture 'mamba' is not supported; supported: llama, qwen2, qwen3")
    assert "one part of a GGUF split into 3 files" in _one_line_error(
        header_only("part.gguf", "llama", **{"split.count": 3}))


def test_gguf_draft_drafts_for_a_gguf_target(ggufs):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    alone = LLM(ggufs("llama", "F16"), max_model_len=256).generate(prompts, params)
    llm = LLM(ggufs("llama", "F16"), draft_model=ggufs("qwen2", "Q4_0"), num_speculative_tokens=3,
              max_model_len=256)
    drafted = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in alone]
    assert llm.core.engines["default-draft"].model.load_info["format"] == "gguf"


def test_sentencepiece_tokenizer_from_scores_equals_transformers(tiny_checkpoint, tmp_path):
    import transformers

    path = write_gguf(tiny_checkpoint("llama", **GEOMETRY), tmp_path / "spm.gguf", "F16", tokenizer="spm")
    llm = LLM(path, max_model_len=64)
    tok = llm.tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["The quick brown fox jumps", "def read_config(path):\n    return json.load(f)",
                 "Ünïcödé 你好 🙂 bytes", "  two leading spaces", "print(i * 2, 'even')"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode("hi", add_special_tokens=True)[0] == 1 == tok.bos_token_id  # add_bos_token default
    assert tok.eos_token_ids == {2}
    out = llm.generate("The quick brown", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and isinstance(out.outputs[0].text, str)
