"""Start-up cost that once crept in: building the model on the meta device must not import torch._dynamo (the
embedding's random init and the RoPE table's arithmetic on meta tensors went through torch._refs, 1-5 s), and
the CPU KV pool is zeroed anonymous memory (not written up front) that reads as zeros and takes writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from engines.kv_pool import _zeros

ROOT = Path(__file__).resolve().parents[2]


def test_loading_a_checkpoint_does_not_import_dynamo():
    code = ("import sys, torch; from engines.loader import load_checkpoint; "
            "m = load_checkpoint(sys.argv[1]).model; "
            "print('torch._dynamo' in sys.modules, m.model.embed_tokens.weight.device.type, "
            "float(m.model.embed_tokens.weight.abs().sum()) > 0, m.inv_freq.device.type)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "models" / "tandem-tiny-s")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == ["False", "cpu", "True", "cpu"]


def test_pool_buffer_is_zeros_and_writable():
    buf = _zeros(1 << 20, torch.device("cpu"))
    assert buf.dtype == torch.uint8 and buf.numel() == 1 << 20 and int(buf.sum()) == 0
    buf[123] = 7
    buf.view(torch.float32)[1000] = float("nan")
    assert int(buf[123]) == 7 and torch.isnan(buf.view(torch.float32)[1000])
    assert buf.data_ptr() % 64 == 0
