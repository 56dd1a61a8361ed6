"""GPTQ (Frantar et al., 2022): quantize columns one at a time, feeding each column's
rounding error back into the not-yet-quantized columns through the inverse Hessian.

For a linear with inputs X, the layer-wise objective ``‖W X − Ŵ X‖²`` has Hessian
``H = 2 X Xᵀ`` (the factor 2 does not matter here; spear uses the mean of ``x xᵀ``).
With ``U`` the upper Cholesky factor of ``H⁻¹``, quantizing column ``j`` to ``q_j``
and updating the later columns by ``−(w_j − q_j)/U_jj · U_j,j:`` is the optimal
(OBS) correction. Updates are applied lazily in blocks of ``block_size`` columns,
which is the same arithmetic in a cache-friendlier order.

Options: dampening (``damp`` × mean diagonal added to H, for a stable Cholesky);
act-order (columns by decreasing ``diag(H)``, the most salient first). spear's
layout needs each group to be a contiguous run of input columns with one scale
and zero per row, so with act-order *and* groups the group parameters are fixed
from the original weights before the column sweep ("static groups") instead of
being recomputed as the sweep reaches each group; no ``g_idx`` is ever needed.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from spear.config import QuantConfig
from spear.errors import SpearError
from spear.quant.calib import collect_input_stats, linear_groups, run_layerwise
from spear.quant.linear import QuantLinear
from spear.quant.primitives import compute_qparams, n_groups
from spear.models.modules import set_module

log = logging.getLogger(__name__)


def _qparams(w: torch.Tensor, cfg: QuantConfig, group_size: int, clip: torch.Tensor | float = 1.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    scales, zeros = compute_qparams(w, cfg.bits, group_size, cfg.symmetric, clip)
    # Quantize against the fp16 scales that are stored, so codes and storage agree.
    return scales.to(torch.float16).float(), zeros.float()


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp·mean(diag H)·I)⁻¹`` (float64 for stability)."""
    h = h.double().clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    chol, info = torch.linalg.cholesky_ex(h)
    if info.item() != 0:
        raise ValueError(f"Hessian is not positive definite after damping {damp} (leading minor {info.item()} "
                         "failed); raise damp or use more calibration tokens")
    return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)


@torch.no_grad()
def gptq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, cfg: QuantConfig,
                         clip: torch.Tensor | float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ one weight (out, in) given its input Hessian (in, in).

    ``clip`` (a ratio, or one per row and group, (out, G)) shrinks each group's range before its
    scale is set, as AWQ's clipping search chooses it. Returns ``(codes uint8 (out, in), scales fp16 (out, G), zeros uint8 (out, G))``
    in the layout of :mod:`spear.quant.primitives`.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    if tuple(hessian.shape) != (in_f, in_f):
        raise ValueError(f"Hessian must be ({in_f}, {in_f}) for a weight of shape {tuple(weight.shape)}, "
                         f"got {tuple(hessian.shape)}")
    if not torch.isfinite(hessian).all() or not torch.isfinite(weight).all():
        raise ValueError("weight and Hessian must be finite")
    gs = cfg.group_size
    g_count = n_groups(in_f, gs)  # raises if the group size does not divide in_features
    if isinstance(clip, torch.Tensor) and tuple(clip.shape) != (out_f, g_count):
        raise ValueError(f"clip must be a ratio or ({out_f}, {g_count}) ratios, got shape {tuple(clip.shape)}")
    opts = cfg.gptq
    qmax = 2 ** cfg.bits - 1
    w = weight.detach().float().clone()
    h = hessian.detach().double().to(w.device).clone()

    # A column no token ever activated carries no information: its weight is
    # irrelevant to the objective, so it is zeroed and its Hessian row made benign.
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    static = gs == 0 or opts.act_order
    if static:  # per-channel, or act-order's static groups: parameters from the original weights
        scales, zeros = _qparams(w, cfg, gs, clip)
    else:
        scales = torch.empty(out_f, in_f // gs, device=w.device)
        zeros = torch.empty(out_f, in_f // gs, device=w.device)

    perm = torch.argsort(h.diagonal(), descending=True) if opts.act_order else torch.arange(in_f, device=w.device)
    w = w[:, perm]
    h = h[perm][:, perm]
    group_of = torch.zeros(in_f, dtype=torch.long, device=w.device) if gs == 0 else perm // gs
    u = _inverse_cholesky(h, opts.damp).float().to(w.device)

    codes = torch.empty(out_f, in_f, device=w.device)
    bs = opts.block_size
    for i1 in range(0, in_f, bs):
        i2 = min(i1 + bs, in_f)
        w1 = w[:, i1:i2].clone()
        err = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not static and col % gs == 0:
                # The group's current values: in-block columns are up to date in w1;
                # columns past the block still owe this block's pending updates.
                ahead = w[:, i2:col + gs] - err[:, :i] @ u[i1:col, i2:col + gs]
                g = col // gs
                s, z = _qparams(torch.cat([w1[:, i:i + gs], ahead], dim=1), cfg, 0,
                                clip[:, g:g + 1] if isinstance(clip, torch.Tensor) else clip)
                scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
            g = group_of[col]
            s, z = scales[:, g], zeros[:, g]
            q = torch.clamp(torch.round(w1[:, i] / s) + z, 0, qmax)
            codes[:, col] = q
            e = (w1[:, i] - (q - z) * s) / u1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err[:, i] = e
        w[:, i2:] -= err @ u[i1:i2, i2:]

    unperm = torch.empty_like(codes)
    unperm[:, perm] = codes
    return unperm.to(torch.uint8), scales.to(torch.float16), zeros.to(torch.uint8)


@torch.no_grad()
def quantize_model_gptq(model: nn.Module, cfg: QuantConfig, calib: torch.Tensor,
                        progress: bool = True) -> dict[str, QuantLinear]:
    """GPTQ every quantizable linear of ``model`` in place, layer by layer, from ``calib`` (n, L) ids.

    Within a layer, linears are quantized in call order, one shared-input group at
    a time, each group's Hessian taken with the layer's earlier groups already
    quantized ("true sequential"). Linears outside the decoder layers (the output
    head when included) get RTN.
    """
    from spear.quant.rtn import rtn_quantize_linear

    def process(layer_name, layer, batches):
        done = {}
        for group in linear_groups(layer, batches[0]):
            stats = collect_input_stats(layer, batches, group)
            for name in group:
                linear = layer.get_submodule(name)
                try:
                    codes, scales, zeros = gptq_quantize_weight(linear.weight.data, stats[name].hessian, cfg)
                except ValueError as exc:
                    raise SpearError(f"GPTQ of {layer_name}.{name}: {exc}") from exc
                q = QuantLinear.from_quantized(linear, codes, scales, zeros, cfg.bits, cfg.group_size, cfg.symmetric)
                set_module(layer, name, q)
                done[name] = q
        return done

    done, rest = run_layerwise(model, calib, cfg.calib.batch_size, process, f"GPTQ W{cfg.bits}",
                               cfg.include_lm_head, progress)
    for name in rest:
        log.info("GPTQ: %s is outside the decoder layers; quantized with RTN", name)
        q = rtn_quantize_linear(model.get_submodule(name), cfg)
        set_module(model, name, q)
        done[name] = q
    return done
