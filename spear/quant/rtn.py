"""Round-to-nearest quantization of a whole model."""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.config import QuantConfig
from spear.models.modules import quantizable_linears, set_module
from spear.quant.linear import QuantLinear
from spear.quant.primitives import compute_qparams, quantize


def rtn_quantize_linear(linear: nn.Linear, cfg: QuantConfig) -> QuantLinear:
    w = linear.weight.data.float()
    scales, zeros = compute_qparams(w, cfg.bits, cfg.group_size, cfg.symmetric)
    scales = scales.to(torch.float16).float()  # quantize against the scales that are stored
    codes = quantize(w, scales, zeros, cfg.bits, cfg.group_size)
    return QuantLinear.from_quantized(linear, codes, scales, zeros, cfg.bits, cfg.group_size, cfg.symmetric)


@torch.no_grad()
def quantize_model_rtn(model: nn.Module, cfg: QuantConfig, progress: bool = True) -> dict[str, QuantLinear]:
    """Replace every quantizable linear of ``model`` in place by its RTN ``QuantLinear``."""
    targets = quantizable_linears(model, cfg.include_lm_head)
    out = {}
    for name, linear in tqdm(targets.items(), desc=f"RTN W{cfg.bits}", unit="mod", disable=not progress, leave=False):
        q = rtn_quantize_linear(linear, cfg)
        set_module(model, name, q)
        out[name] = q
    return out
