"""Reading safetensors files into a model: open a file on the load device, set one parameter by its dotted name
(shared by the float loader and the pre-quantised and GGUF formats)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engines.model_config import CheckpointError


def assign_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    setattr(module, leaf, nn.Parameter(tensor))


def open_safetensors(file: Path, device: torch.device) -> Any:
    # Tensors are read straight onto the GPU when loading there: no host-side copy of the whole model.
    where = "cpu"
    if device.type == "cuda":
        where = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    try:
        return safe_open(str(file), framework="pt", device=where)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{file}: cannot be read as safetensors ({e})") from e
