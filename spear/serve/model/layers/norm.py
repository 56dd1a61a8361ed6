"""RMSNorm, with the residual add before it fused in.

``forward(x, ctx, residual)``: without ``residual`` the norm of ``x``; with it, ``s = residual + x``
(rounded to x's dtype, as transformers adds) and the norm of ``s``, returned as (norm, s) so the
next layer adds to ``s``. On CUDA one Triton launch (spear.kernels.fused); elsewhere the torch
reference, which is transformers' Llama RMSNorm.
"""

from __future__ import annotations

import torch
from torch import nn

from spear.kernels import reference


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor, ctx, residual: torch.Tensor | None = None):
        if x.is_cuda:
            from spear.kernels import fused

            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps, pdl=ctx.pdl)
            s, y = fused.add_rms_norm(x, residual, self.weight, self.eps, pdl=ctx.pdl)
            return y, s
        if residual is None:
            return reference.rms_norm(x, self.weight, self.eps)
        s = residual + x
        return reference.rms_norm(s, self.weight, self.eps), s
