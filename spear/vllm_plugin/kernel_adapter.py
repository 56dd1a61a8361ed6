"""The one place the vLLM plugin builds and runs spear's linear method: :func:`prepare` once after
loading, :func:`forward` in every call. The method is the serving engine's own
(spear/serve/model/layers/quant_method.py), so both engines pack, merge compensators and compute
alike:

  CUDA, fp16/bf16   ``W4Method``: the packed W4 layout (the fragment layout where the share's shape
                    allows, N-major elsewhere) and the registered ``spear::w4a16_ec`` op, which
                    torch.compile and CUDA graphs capture, the kernel the planner picks;
  anywhere else     ``DenseMethod``: the weight dequantized once in the layer's dtype, the
                    compensator in torch.

A gated EC on a split input (row-parallel tensor parallelism) needs u = A·x all-reduced before γ,
which no fused kernel can do mid-GEMM: as in spear's own ``RowParallelLinear``, the method runs
without it and its second half (``spear.parallel.comm.RowPost``) runs after ``reduce_u``, on the
one rank that adds it (vLLM then sums the ranks' outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spear.errors import SpearError
from spear.kernels.policy import KernelPolicy
from spear.serve.model.layers.linear import Context

_CONTEXT = Context(KernelPolicy())  # the kernels' default policy; vLLM launches eagerly or in its own graphs


@dataclass
class SpearLayer:
    """One rank's share of a layer, ready to run."""

    method: object              # quant_method.W4Method or DenseMethod
    post: object | None = None  # spear.parallel.comm.RowPost of a gated EC whose u is all-reduced


def uses_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """spear's W4 kernels take fp16/bf16 activations on a CUDA device."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def prepare(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, symmetric: bool,
            ec, dtype: torch.dtype, reduces_u: bool = False) -> SpearLayer:
    """Build one rank's share once (``sharding.merged_layer``'s output): ``codes`` (N, K) uint8,
    ``scales`` (N, G) fp16, ``zeros`` (N, G) uint8, ``ec`` the merged ``ECFactors`` or None.
    ``reduces_u``: a gated EC's u is all-reduced first (``Partition.reduces_u``)."""
    from spear.kernels.reference import dequantize
    from spear.serve.model.layers.quant_method import DenseMethod, W4Method

    device = codes.device
    if uses_kernels(device, dtype):
        try:
            method = W4Method.create(codes, scales, zeros, group_size, symmetric, ec, dtype, device)
        except ValueError as e:  # a constraint of the kernel layouts, named by spear.kernels.layout
            raise SpearError(f"this layer's share does not fit spear's W4 kernels: {e}") from None
    else:
        method = DenseMethod.create(dequantize(codes, scales, zeros, group_size), ec, dtype, device)
    return SpearLayer(method, method.row_post(codes.shape[0], None) if reduces_u else None)


def forward(layer: SpearLayer, x: torch.Tensor, bias: torch.Tensor | None = None,
            reduce_u: Callable[[torch.Tensor], torch.Tensor] | None = None, add_ec: bool = True) -> torch.Tensor:
    """``x Ŵᵀ (+ bias) (+ α·B·(γ(A·x) ⊙ A·x))`` for x (..., K). ``reduce_u``: all-reduce of u = A·x
    across ranks before γ; ``add_ec`` False: this rank leaves that EC term to another (rank 0 adds it)."""
    y = layer.method.apply(x, bias, _CONTEXT)
    if layer.post is None or layer.post.ec is None:
        return y
    u = reduce_u(F.linear(x, layer.post.ec.a))  # every rank takes part in the collective
    if not add_ec:
        return y
    staging = torch.cat([y.reshape(-1, y.shape[-1]), u.reshape(-1, u.shape[-1])], dim=-1)
    return layer.post([staging]).reshape(y.shape)
