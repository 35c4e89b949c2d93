"""Checkpoint loading: a Hugging Face folder (config.json, safetensors single or sharded, generation_config.json)
into a ready `Transformer`, built on the meta device and filled tensor by tensor so peak memory stays ~1x
the weights. Every failure is a `CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.formats.safetensors_io import assign_parameter, open_safetensors
from engines.model import Transformer, rope_inv_freq
from engines.model_config import CheckpointError, ModelConfig
from engines.weight_names import Target, weight_targets

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# Tensors some checkpoints carry that the model recomputes (rotary tables) or never uses.
_IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|\.attn\.masked_bias$|\.attn\.bias$")


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults a checkpoint ships in generation_config.json; None where the file says nothing."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    do_sample: bool | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_folder(cls, folder: str | Path) -> GenerationDefaults:
        path = Path(folder) / GENERATION_CONFIG_FILE
        if not path.exists():
            return cls()
        raw = _read_json(path)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object, found {type(raw).__name__}")

        def number(key: str, kind: type) -> Any:
            value = raw.get(key)
            if value is None:
                return None
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise CheckpointError(f"{path}: field {key!r} must be a {kind.__name__}, found {value!r}") from None

        return cls(
            temperature=number("temperature", float),
            top_p=number("top_p", float),
            top_k=number("top_k", int),
            min_p=number("min_p", float),
            repetition_penalty=number("repetition_penalty", float),
            max_new_tokens=number("max_new_tokens", int),
            do_sample=None if raw.get("do_sample") is None else bool(raw["do_sample"]),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), path),
        )


@dataclass
class LoadedCheckpoint:
    model: Transformer
    config: ModelConfig
    generation: GenerationDefaults
    path: Path
    quantization: str | None = None  # a pre-quantised checkpoint's scheme and what its layers became

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """config.json and generation_config.json EOS ids together (the tokenizer adds its own on top)."""
        return tuple(dict.fromkeys(self.config.eos_token_ids + self.generation.eos_token_ids))


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's dtype on an accelerator and float32 on the CPU (half matmuls are slow there)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported: use one of float32, bfloat16, float16")
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(config.torch_dtype.lower().removeprefix("torch."), torch.float32)
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: use auto, float32, bfloat16 or float16")
    return DTYPES[name]


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights, single or sharded; raises CheckpointError if absent."""
    index = folder / INDEX_FILE
    if index.exists():
        raw = _read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        shards = [folder / name for name in dict.fromkeys(weight_map.values())]
        for shard in shards:
            if not shard.exists():
                raise CheckpointError(f"{shard}: missing shard file listed in {INDEX_FILE}")
        return shards
    single = folder / SINGLE_FILE
    if single.exists():
        return [single]
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    hint = ""
    if found:
        hint = f"; found {', '.join(found[:4])} but no {INDEX_FILE} listing them"
    elif any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        hint = "; pickle weights (.bin/.pt) are not loaded: convert them to safetensors"
    raise CheckpointError(f"{folder}: missing weights file (expected {SINGLE_FILE} or {INDEX_FILE}){hint}")


def load_checkpoint(path: str | Path, dtype: str | torch.dtype = "auto",
                    device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Load a Hugging Face Llama-family folder into an eval-mode `Transformer` on `device` in `dtype`.

    On the CPU, tensors already stored in `dtype` stay views of the file's private (copy-on-write) memory
    map, as safetensors hands them out: zero-copy and paged in lazily. Do not overwrite the weights file in
    place while the model is in use.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder does not exist")
    config = ModelConfig.from_file(folder / "config.json")
    generation = GenerationDefaults.from_folder(folder)
    device = torch.device(device)
    target_dtype = resolve_dtype(dtype, config, device)
    files = weight_files(folder)
    from engines.formats.prequant import load_prequantized, quantization_config

    qc = quantization_config(folder, config.raw)
    if qc is not None:  # quantised by another tool (GPTQ, AWQ, compressed-tensors): into the quantised kernels
        model, quantization = load_prequantized(folder, config, qc, files, target_dtype, device)
        return LoadedCheckpoint(model=model, config=config, generation=generation, path=folder,
                                quantization=quantization)

    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)  # shares embed_tokens.weight; a stored copy is ignored

    loaded: set[str] = set()
    for file in files:
        with open_safetensors(file, device) as f:
            targets = {name: weight_targets(config, name) for name in f.keys()}
            _check_names_and_shapes(f, targets, expected, config, file)
            for name, outs in targets.items():
                outs = [(target, rows) for target, rows in outs if target in expected]
                if not outs:
                    continue
                # One tensor at a time: read, cast on the device, hand to the module (no second model copy).
                tensor = f.get_tensor(name).to(device=device, dtype=target_dtype)
                for target, rows in outs:  # a fused checkpoint tensor (Phi-3's qkv_proj) feeds several by rows
                    assign_parameter(model, target, tensor if rows is None else tensor[rows[0]:rows[1]])
                    loaded.add(target)

    missing = [name for name in expected if name not in loaded]
    if missing:
        where = files[0] if len(files) == 1 else folder / INDEX_FILE
        raise CheckpointError(f"{where}: missing tensor(s) {_name_list(missing)} required by config.json "
                              f"({config.architecture}, {config.num_layers} layers)")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers were created on meta; the rotary table stays fp32 whatever the weight dtype.
    model.inv_freq = rope_inv_freq(config).to(device)
    model.eval()
    return LoadedCheckpoint(model=model, config=config, generation=generation, path=folder)


def _check_names_and_shapes(f: Any, targets: dict[str, list[Target]], expected: dict[str, tuple[int, ...]],
                            config: ModelConfig, file: Path) -> None:
    unexpected = [n for n, outs in targets.items()
                  if not any(t in expected for t, _ in outs) and not _ignorable(n, config)]
    if unexpected:
        raise CheckpointError(
            f"{file}: unexpected tensor(s) {_name_list(unexpected)}: config.json ({config.architecture}) does not describe them; "
            "the config and the weights do not match")
    for name, outs in targets.items():
        shape = tuple(f.get_slice(name).get_shape())
        for target, rows in outs:
            if target not in expected:
                continue
            found = shape if rows is None else (min(rows[1], shape[0]) - rows[0], *shape[1:])
            if found != expected[target] or (rows is not None and rows == outs[-1][1] and rows[1] != shape[0]):
                implied = list(expected[target]) if rows is None else [outs[-1][1][1], *expected[target][1:]]
                raise CheckpointError(f"{file}: tensor {name!r} has shape {list(shape)} but config.json implies "
                                      f"{implied}")


def _name_list(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _ignorable(name: str, config: ModelConfig) -> bool:
    return bool(_IGNORED_TENSORS.search(name)) or (config.tie_word_embeddings and name == "lm_head.weight")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def _eos_ids(value: Any, source: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    try:
        return tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise CheckpointError(f"{source}: eos_token_id must be an int or a list of ints, found {value!r}") from None
