"""One entry point for every quantizer: ``quantize_model(model, cfg, calib)``."""

from __future__ import annotations

import torch
from torch import nn

from spear.config import QuantConfig
from spear.errors import SpearError
from spear.quant.linear import QuantLinear
from spear.quant.rtn import quantize_model_rtn


def quantize_model(model: nn.Module, cfg: QuantConfig, calib: torch.Tensor | None = None,
                   progress: bool = True) -> dict[str, QuantLinear]:
    """Quantize ``model`` in place with ``cfg.method``; ``calib`` (n, L) token windows feed GPTQ/AWQ."""
    if cfg.method == "rtn":
        return quantize_model_rtn(model, cfg, progress=progress)
    raise SpearError(f"quantization method {cfg.method!r} is not available in this build")
