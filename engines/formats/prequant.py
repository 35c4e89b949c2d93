"""Checkpoints another tool quantised (config.json's `quantization_config`, or quantize_config.json): GPTQ
(4-bit, groups, symmetric or not, v1 / v2 zero points), AWQ (GEMM layout, 4-bit) and compressed-tensors
(pack-quantized int4 in groups or per channel, int-quantized int8 per channel, with W8A8's dynamic per-token
int8 input activations applied in the forward, FP8 dequantised; other activation schemes refused), loaded
straight into kernels/quant_matmul.py's QuantLinear (int4: q [N, K/2] packed, zero, scale; int8: q, scale[N])
without widening to float. Layouts that fit no kernel (GPTQ with desc_act's reordered groups, int8 in groups)
are dequantised at load, and the log says so.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.model_config import CheckpointError

log = logging.getLogger("tandem.prequant")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble p of a word holds column AWQ_ORDER[p]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def quantization_config(folder: Path, raw: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's quantisation config (config.json's, else quantize_config.json's), or None."""
    qc = raw.get("quantization_config")
    if qc is None and (folder / "quantize_config.json").exists():
        try:
            qc = json.loads((folder / "quantize_config.json").read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{folder / 'quantize_config.json'}: not valid JSON ({e})") from None
        qc.setdefault("quant_method", "gptq")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{folder / 'config.json'}: quantization_config must be an object")
    return qc


class Scheme:
    """How one checkpoint's quantised Linears are stored, checked against what tandem loads."""

    def __init__(self, qc: dict[str, Any], where: str):
        self.method = str(qc.get("quant_method", "")).lower()
        self.where = where
        if self.method == "gptq":
            self.bits = int(qc.get("bits", 4))
            self.group = int(qc.get("group_size", 128))
            self.desc_act = bool(qc.get("desc_act", False))
            self.v1 = str(qc.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
            if self.bits != 4:
                raise CheckpointError(f"{where}: GPTQ bits={self.bits} is not supported: tandem loads 4-bit GPTQ "
                                      "(onto its int4 kernels)")
        elif self.method == "awq":
            self.bits = int(qc.get("bits", qc.get("w_bit", 4)))
            self.group = int(qc.get("group_size", qc.get("q_group_size", 128)))
            version = str(qc.get("version", "gemm")).lower()
            if self.bits != 4:
                raise CheckpointError(f"{where}: AWQ bits={self.bits} is not supported: tandem loads 4-bit AWQ")
            if version != "gemm":
                raise CheckpointError(f"{where}: AWQ version {version!r} is not supported: tandem loads the GEMM "
                                      "layout (AutoAWQ's default)")
        elif self.method == "compressed-tensors":
            self.format = str(qc.get("format", "")).lower()
            groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
            weights = [g.get("weights") or {} for g in groups]
            if len(weights) != 1:
                raise CheckpointError(f"{where}: compressed-tensors with {len(weights)} config groups is not "
                                      "supported: tandem loads one scheme for every Linear")
            w = weights[0]
            self.bits = int(w.get("num_bits", 8))
            self.kind = str(w.get("type", "int"))
            self.strategy = str(w.get("strategy", "channel"))
            self.group = int(w.get("group_size") or 0)
            self.symmetric = bool(w.get("symmetric", True))
            ok = ((self.format == "pack-quantized" and self.kind == "int" and self.bits == 4
                   and self.strategy in ("group", "channel"))
                  or (self.format in ("int-quantized", "naive-quantized") and self.kind == "int" and self.bits == 8
                      and self.strategy in ("channel", "group", "tensor"))
                  or (self.format == "float-quantized" and self.kind == "float" and self.bits == 8))
            if not ok:
                raise CheckpointError(f"{where}: compressed-tensors format {self.format!r} with {self.bits}-bit "
                                      f"{self.kind} weights ({self.strategy}) is not supported; supported: "
                                      "pack-quantized int4 (group, channel), int-quantized int8, float-quantized "
                                      "fp8 (dequantised)")
            self.ignore = list(qc.get("ignore") or [])
            self.act_quant = _input_activations(groups[0].get("input_activations"), self, where)
        else:
            raise CheckpointError(f"{where}: quantization method {self.method!r} is not supported; supported: gptq, "
                                  "awq, compressed-tensors")

    @property
    def name(self) -> str:
        if self.method == "compressed-tensors":
            acts = " + int8 activations per token" if getattr(self, "act_quant", None) else ""
            return f"compressed-tensors {self.format} {self.kind}{self.bits} {self.strategy}{acts}"
        return f"{self.method} int{self.bits} g{self.group}"


def _input_activations(a: dict[str, Any] | None, scheme: Scheme, where: str) -> str | None:
    """What a compressed-tensors group declares for its input activations: None (weight-only) or "token"
    (dynamic symmetric int8 per token, W8A8: QuantLinear applies it in the forward, on int8 channel-wise
    weights). Anything else is refused: tandem would otherwise run float activations the checkpoint was not
    made for."""
    if not a:
        return None
    kind, bits, strategy = str(a.get("type", "int")), int(a.get("num_bits", 8)), str(a.get("strategy", "tensor"))
    dynamic, symmetric = a.get("dynamic") is True, bool(a.get("symmetric", True))
    if not (kind == "int" and bits == 8 and strategy == "token" and dynamic and symmetric):
        raise CheckpointError(
            f"{where}: compressed-tensors input activations {kind}{bits} {strategy} "
            f"({'dynamic' if dynamic else 'static'}, {'symmetric' if symmetric else 'asymmetric'}) are not "
            "supported: tandem applies dynamic symmetric int8 per token (W8A8) or none (weight-only)")
    if not (scheme.format in ("int-quantized", "naive-quantized") and scheme.bits == 8
            and scheme.strategy in ("channel", "tensor")):
        raise CheckpointError(f"{where}: compressed-tensors int8 per-token input activations are supported with "
                              f"int8 channel-wise weights only, not {scheme.format} {scheme.kind}{scheme.bits} "
                              f"{scheme.strategy}")
    return "token"


def build(prefix: str, linear: nn.Linear, get: Any, names: set[str], scheme: Scheme, device: torch.device,
          dtype: torch.dtype) -> tuple[nn.Module, str] | None:
    """The module for Linear `prefix` from its stored tensors (`get(name)`), and how it loaded; None when the
    checkpoint stores it as a plain float weight."""
    from kernels.quant_matmul import QuantLinear

    n, k = linear.out_features, linear.in_features
    bias = get(f"{prefix}.bias") if f"{prefix}.bias" in names else None

    def int4(q: torch.Tensor, zero: torch.Tensor | None, offset: int, scale: torch.Tensor, group: int) -> nn.Module:
        """q uint8 [N, K] in 0..15, zero [N, G] the file's nibbles (zero points minus `offset`; None: 8), scale
        [N, G] in its stored dtype: onto int4, exactly, the zeros packed two per byte as the files pack them."""
        m = QuantLinear(k, n, bias is not None, "int4", group_size=group, device="meta")
        m.weight = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous().to(device)
        m.set_zero_points(None if zero is None else zero.to(torch.int16) + offset, offset)
        m.scale = scale.contiguous().to(device)
        return _with_bias(m, bias, device)

    if scheme.method in ("gptq", "awq"):
        if f"{prefix}.qweight" not in names:
            return None
        group = k if scheme.group <= 0 else scheme.group
        _check(k % group == 0 and n % 8 == 0, scheme, prefix, f"in_features {k} / group {group}, out {n}")
        scales = get(f"{prefix}.scales")  # [K / group, N]
        if scheme.method == "gptq":
            q = _unpack_rows(get(f"{prefix}.qweight"), k).t()  # [N, K]
            zero = _unpack_cols(get(f"{prefix}.qzeros"), n).t().to(torch.int16)  # [N, G] nibbles
            offset = 1 if scheme.v1 else 0  # GPTQ v1 stores zero - 1
            g_idx = get(f"{prefix}.g_idx").long() if f"{prefix}.g_idx" in names else None
            if g_idx is not None and not torch.equal(g_idx, torch.arange(k) // group):
                # desc_act: input rows visit the groups out of order. With `group` rows per group, sorting
                # the rows by group makes them contiguous: the weight is stored in that order and the
                # activations are gathered into it (QuantLinear.input_perm); else floats
                perm = torch.argsort(g_idx, stable=True)
                if torch.equal(g_idx[perm], torch.arange(k) // group):
                    m = int4(q[:, perm].to(torch.uint8), zero, offset, scales.t(), group)
                    m.input_perm = perm.to(torch.int32).to(device)  # (the file's g_idx is int32 too)
                    return m, "int4 (act-order)"
                w = (q.float() - (zero + offset).float()[:, g_idx]) * scales.t().float()[:, g_idx]
                return _float(linear, w, bias, device, dtype), "dequantised (desc_act)"
        else:
            q = _unpack_cols(get(f"{prefix}.qweight"), n, AWQ_ORDER).t()
            zero, offset = _unpack_cols(get(f"{prefix}.qzeros"), n, AWQ_ORDER).t(), 0
        return int4(q.to(torch.uint8), zero, offset, scales.t(), group), "int4"

    # compressed-tensors
    if scheme.format == "pack-quantized":
        if f"{prefix}.weight_packed" not in names:
            return None
        scale = get(f"{prefix}.weight_scale")  # [N, G]
        groups = scale.shape[1]
        group = k // groups
        _check(group * groups == k, scheme, prefix, f"in_features {k} and {groups} scale groups")
        q = _unpack_cols(get(f"{prefix}.weight_packed"), k)  # [N, K], value + 8
        zero = None  # symmetric: 8 everywhere, nothing stored
        if not scheme.symmetric:
            zero = _unpack_cols(get(f"{prefix}.weight_zero_point").t().contiguous(), n).t()  # [N, G], zp + 8
        return int4(q.to(torch.uint8), zero, 0, scale, group), "int4"
    if f"{prefix}.weight_scale" not in names:
        return None
    w = get(f"{prefix}.weight")
    scale = get(f"{prefix}.weight_scale").float()
    if scheme.format == "float-quantized":  # FP8: no fp8 kernel here; dequantised at load
        wf = w.float() * (scale.reshape(-1, 1) if scale.numel() == n else scale)
        return _float(linear, wf, bias, device, dtype), "dequantised (fp8)"
    _check(w.dtype == torch.int8, scheme, prefix, f"weight dtype {w.dtype}")
    if scale.numel() in (1, n):  # per channel (or tensor): the int8 kernels' own format
        m = QuantLinear(k, n, bias is not None, "int8", device="meta")
        m.weight = w.contiguous().to(device)
        m.scale = scale.reshape(-1).expand(n).contiguous().to(device)
        m.act_quant = scheme.act_quant
        return _with_bias(m, bias, device), "int8 (w8a8 per token)" if m.act_quant else "int8"
    zp = get(f"{prefix}.weight_zero_point").float() if f"{prefix}.weight_zero_point" in names else 0.0
    wf = (w.float().view(n, scale.shape[1], -1) - (zp[..., None] if torch.is_tensor(zp) else zp)) * scale[..., None]
    return _float(linear, wf.view(n, k), bias, device, dtype), "dequantised (int8 groups)"


def skipped(scheme: Scheme, prefix: str) -> bool:
    """compressed-tensors' `ignore` list (names, or re: patterns) leaves those Linears in float."""
    import re

    for pattern in getattr(scheme, "ignore", []):
        if pattern.startswith("re:") and re.search(pattern[3:], prefix):
            return True
        if prefix == pattern or prefix.endswith("." + pattern) or prefix == pattern.removeprefix("model."):
            return True
    return False


def summary(kinds: Counter[str], scheme: Scheme) -> str:
    text = scheme.name + ": " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
    dequantised = [k for k in kinds if k.startswith("dequantised")]
    if dequantised:
        log.info("%s: %s layers dequantised at load (%s)", scheme.where, sum(kinds[k] for k in dequantised),
                 ", ".join(dequantised))
    return text


def _check(ok: bool, scheme: Scheme, prefix: str, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{scheme.where}: {prefix}: {what} do not fit {scheme.name}")


def _unpack_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [R / 8, C] with 8 4-bit values per word along the rows (low bits first) -> int32 [R, C]."""
    vals = (packed.to(torch.int32)[:, None, :] >> _SHIFTS[None, :, None]) & 0xF
    return vals.reshape(-1, packed.shape[1])[:rows]


def _unpack_cols(packed: torch.Tensor, cols: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C / 8] with 8 4-bit values per word along the columns -> int32 [R, C]; with `order`, nibble p
    of a word is column order[p] of its 8."""
    vals = (packed.to(torch.int32)[:, :, None] >> _SHIFTS[None, None, :]) & 0xF  # [R, C/8, 8] by nibble
    if order is not None:
        vals = vals[:, :, torch.argsort(torch.tensor(order))]
    return vals.reshape(packed.shape[0], -1)[:, :cols]


def _with_bias(m: nn.Module, bias: torch.Tensor | None, device: torch.device) -> nn.Module:
    if bias is not None:
        m.bias = nn.Parameter(bias.float().to(device), requires_grad=False)
    return m


def _float(linear: nn.Linear, w: torch.Tensor, bias: torch.Tensor | None, device: torch.device,
           dtype: torch.dtype) -> nn.Module:
    out = nn.Linear(linear.in_features, linear.out_features, bias=bias is not None, device="meta")
    out.weight = nn.Parameter(w.to(device=device, dtype=dtype), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
    return out


def load_prequantized(folder: Path, config: Any, qc: dict[str, Any], files: list[Path], dtype: torch.dtype,
                      device: torch.device) -> tuple[nn.Module, str]:
    """The Transformer of a pre-quantised checkpoint, its quantised Linears straight into QuantLinear."""
    from engines.formats.safetensors_io import assign_parameter, open_safetensors
    from engines.model import Transformer, rope_inv_freq

    where = str(folder / "config.json")
    scheme = Scheme(qc, where)
    with torch.device("meta"):
        model = Transformer(config)
    located: dict[str, Path] = {}
    handles = {}
    for file in files:
        handles[file] = open_safetensors(file, torch.device("cpu"))
        for name in handles[file].keys():
            located[name] = file

    def get(name: str) -> torch.Tensor:
        return handles[located[name]].get_tensor(name)

    names = set(located)
    used: set[str] = set()
    kinds: Counter[str] = Counter()
    for prefix, linear in list(model.named_modules()):
        if type(linear) is not nn.Linear or (prefix == "lm_head" and config.tie_word_embeddings):
            continue
        made = None if skipped(scheme, prefix) else build(prefix, linear, get, names, scheme, device, dtype)
        if made is None:
            continue
        module, how = made
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
        used.update(n for n in names if n.startswith(prefix + ".") and n.count(".") == prefix.count(".") + 1)
        kinds[how] += 1
    if not kinds:
        raise CheckpointError(f"{where}: quantization_config says {scheme.name} but no Linear has quantised "
                              "tensors in the weights files")
    expected = {n: tuple(p.shape) for n, p in model.named_parameters() if p.device.type == "meta"}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for name in sorted(names - used):
        if name not in expected:
            if name.endswith(("rotary_emb.inv_freq", ".g_idx", "weight_shape")) or (
                    config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            raise CheckpointError(f"{located[name]}: unexpected tensor {name!r} for {scheme.name}")
        t = get(name)
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(f"{located[name]}: tensor {name!r} has shape {list(t.shape)} but config.json "
                                  f"implies {list(expected[name])}")
        assign_parameter(model, name, t.to(device=device, dtype=dtype))
        expected.pop(name)
    if expected:
        raise CheckpointError(f"{folder}: missing tensor(s) {', '.join(sorted(expected)[:5])} for {scheme.name}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config).to(device)
    model.eval()
    return model, summary(kinds, scheme)
