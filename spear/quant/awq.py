"""AWQ (Lin et al., 2024): activation-aware per-input-channel scaling, then clipping.

Scaling: for linears sharing an input x, ``W x = (W·diag(s)) (diag(s)⁻¹ x)``; salient
input channels (large mean |x|) get s > 1 so their weights lose less to rounding.
``s = mean|x|^α`` (normalized by √(max·min)), α searched on a grid in [0, 1] to
minimize the paper's objective ``Σ ‖Q(W·diag(s))·diag(s)⁻¹ X − W X‖²``. That sum is
``Σ tr(Δ H Δᵀ)`` with ``Δ = W − Q(W s)/s`` and ``H = E[x xᵀ]``, so it is evaluated
exactly from the layer's input statistics with no extra forward passes (the
reference implementation instead runs the enclosing block per grid point, which
costs ~20 block forwards per group on a CPU). ``diag(s)⁻¹`` is folded into the
op that produces x (:mod:`spear.quant.fold`), so the model's function is unchanged before
quantization; with grouped KV heads AWQ leaves o_proj unscaled, as its reference implementation
does, unless ``AWQConfig.fold_kv_heads``.

A fold is applied only when every parameter it touches is used once in the model
(tied or shared weights would change elsewhere) and the producer runs once in the
layer; then the layer's output on a probe sequence is checked against the
unscaled output and the fold reverted if they differ (e.g. a norm computing
``x·(1 + w)``). Skipped groups are logged and listed in the report.

Clipping: per output row and group, the range is shrunk by the ratio in
[clip_min, 1] that minimizes that group's output error ``Δ_g H_gg Δ_gᵀ``.

Rounding (``AWQConfig.rounding``): to the nearest level (AWQ's own), or GPTQ's column sweep with
error feedback under the scaled inputs' Hessian ``diag(s)⁻¹ H diag(s)⁻¹`` and the searched
clipping ratios (``"gptq"``): AWQ decides which channels lose less, GPTQ spreads what each
rounding loses onto the columns not yet rounded.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from spear.config import QuantConfig
from spear.models.modules import set_module
from spear.quant.calib import (InputStats, LayerBatch, collect_input_stats, first_sequence, layer_forward, linear_groups,
                               run_layerwise)
from spear.quant.fold import SAME, FoldResult, Spread, find_producer, fold, producers, record, scaled_stats
from spear.quant.linear import QuantLinear
from spear.quant.primitives import compute_qparams, dequantize, n_groups, quantize

log = logging.getLogger(__name__)

def _rtn(w: torch.Tensor, cfg: QuantConfig, clip: torch.Tensor | float = 1.0):
    scales, zeros = compute_qparams(w, cfg.bits, cfg.group_size, cfg.symmetric, clip)
    scales = scales.to(torch.float16).float()  # the scales that are stored
    return quantize(w, scales, zeros, cfg.bits, cfg.group_size), scales, zeros


def _fake_quant(w: torch.Tensor, cfg: QuantConfig, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
    codes, scales, zeros = _rtn(w, cfg, clip)
    return dequantize(codes, scales, zeros, cfg.group_size)


def group_output_error(delta: torch.Tensor, hessian: torch.Tensor, group_size: int) -> torch.Tensor:
    """``Δ_g H_gg Δ_gᵀ`` per output row and group, (out, G): the output error of each group."""
    out_f, in_f = delta.shape
    g = n_groups(in_f, group_size)
    size = in_f // g
    dg = delta.reshape(out_f, g, size)
    blocks = torch.stack([hessian[i * size:(i + 1) * size, i * size:(i + 1) * size] for i in range(g)])
    return (torch.einsum("ogk,gkl->ogl", dg, blocks) * dg).sum(-1)


def _check(weights: list[torch.Tensor], hessian: torch.Tensor, mean_abs: torch.Tensor) -> None:
    in_f = hessian.shape[0]
    if tuple(hessian.shape) != (in_f, in_f) or tuple(mean_abs.shape) != (in_f,):
        raise ValueError(f"statistics must be H (in, in) and mean|x| (in,), got {tuple(hessian.shape)} and "
                         f"{tuple(mean_abs.shape)}")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != in_f:
            raise ValueError(f"weights must be (out, {in_f}) to match the statistics, got {tuple(w.shape)}")


@torch.no_grad()
def awq_search_scale(weights: list[torch.Tensor], hessian: torch.Tensor, mean_abs: torch.Tensor,
                     cfg: QuantConfig, spread: Spread = SAME) -> tuple[torch.Tensor, float]:
    """Best input-channel scales ``s`` (in,) for linears sharing one input, and the α chosen; with a
    ``spread`` the scales repeat over the attention heads that read one KV head."""
    _check(weights, hessian, mean_abs)
    h = hessian.float()
    base = spread.pool(mean_abs.float()).clamp(min=1e-4)  # a dead channel must not give s = 0
    best = (float("inf"), torch.ones_like(mean_abs, dtype=torch.float32), 0.0)
    for k in range(cfg.awq.grid + 1):
        alpha = k / cfg.awq.grid
        s = base.pow(alpha)
        s = spread.to_consumers(s / (s.max() * s.min()).sqrt())
        loss = 0.0
        for w in weights:
            w = w.float()
            delta = w - _fake_quant(w * s, cfg) / s
            loss += ((delta @ h) * delta).sum().item()
        if loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2]


@torch.no_grad()
def awq_search_clip(weight: torch.Tensor, hessian: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """Per (row, group) range ratio in [clip_min, 1] minimizing each group's output error, (out, G)."""
    w, h = weight.float(), hessian.float()
    best_err = best_ratio = None
    for ratio in torch.linspace(1.0, cfg.awq.clip_min, cfg.awq.clip_grid).tolist():
        err = group_output_error(w - _fake_quant(w, cfg, ratio), h, cfg.group_size)
        if best_err is None:
            best_err, best_ratio = err, torch.full_like(err, ratio)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio = torch.where(better, torch.full_like(err, ratio), best_ratio)
    return best_ratio


@torch.no_grad()
def awq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, cfg: QuantConfig
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipping search (when enabled) and rounding (``cfg.awq.rounding``) of an already-scaled weight, whose
    input Hessian is ``hessian``: (codes, scales, zeros)."""
    w = weight.float()
    clip = awq_search_clip(w, hessian, cfg) if cfg.awq.clip else 1.0
    if cfg.awq.rounding == "gptq":
        from spear.quant.gptq import gptq_quantize_weight

        return gptq_quantize_weight(w, hessian, cfg, clip)
    codes, scales, zeros = _rtn(w, cfg, clip)
    return codes, scales.to(torch.float16), zeros


@torch.no_grad()
def scale_layer(layer_name: str, layer: nn.Module, batches: list[LayerBatch], cfg: QuantConfig, uses: Counter,
                report: list, channel_scales: dict, method: str = "AWQ", spread_kv_heads: bool = False
                ) -> dict[str, InputStats]:
    """AWQ's scaling of one decoder layer in place: per group of linears sharing an input, the searched
    ``s`` folded into the consumers' columns and the producer (see the module's docstring), each fold
    checked on a probe sequence. ``uses``: how often each parameter (by id) is used in the model;
    ``report`` collects a :class:`FoldResult` per group and ``channel_scales`` a :class:`ChannelScales`
    per rescaled linear (keyed ``layer_name.linear``); ``method`` names the caller in the log;
    ``spread_kv_heads`` also folds o_proj into v_proj with grouped KV heads (:class:`Spread`). Returns
    every linear's input statistics on ``batches``, after the folds."""
    groups = linear_groups(layer, batches[0])
    names = [n for g in groups for n in g]
    stats = collect_input_stats(layer, batches, names, stop_after=False)
    fed_by, calls = producers(layer, batches[0])
    probe = LayerBatch(batches[0].hidden[:1], first_sequence(batches[0].kwargs, batches[0].hidden.shape[0]))
    reference = layer_forward(layer, probe)
    for group in groups:
        producer, why, spread = find_producer(layer, group, fed_by, spread_kv_heads)
        result = FoldResult(layer_name, producer, group, None, False, why, spread)
        report.append(result)
        if producer is None:
            log.warning("%s: no scaling for %s.%s: %s", method, layer_name, group, why)
            continue
        prod = layer.get_submodule(producer)
        consumers = [layer.get_submodule(n) for n in group]
        touched = [p for m in (prod, *consumers) for p in m.parameters(recurse=False)]
        if any(uses[id(p)] > 1 for p in touched) or calls[producer] != 1:
            result.reason = f"{producer} or a consumer shares its parameters or runs more than once"
            log.warning("%s: no scaling for %s.%s: %s", method, layer_name, group, result.reason)
            continue
        st = stats[group[0]]
        s, alpha = awq_search_scale([c.weight.data for c in consumers], st.hessian, st.mean_abs, cfg, spread)
        saved = [p.data.clone() for p in touched]
        fold(prod, consumers, s, spread)
        out = layer_forward(layer, probe)
        tol = 1e-4 * reference.abs().max().item() + 1e-6
        if (out - reference).abs().max().item() > tol:
            for p, old in zip(touched, saved):
                p.data.copy_(old)
            result.reason = "scaling changed the layer's output (the producer is not per-channel linear)"
            log.warning("%s: no scaling for %s.%s: %s", method, layer_name, group, result.reason)
            continue
        result.alpha, result.applied = alpha, True
        scaled = scaled_stats(st, s)
        for n in group:
            stats[n] = scaled
        record(channel_scales, layer_name, group, producer, type(prod) is nn.Linear, s, spread)
    return stats


@torch.no_grad()
def _process_layer(layer_name: str, layer: nn.Module, batches: list[LayerBatch], cfg: QuantConfig,
                   uses: Counter, report: list, scale_only: bool, channel_scales: dict) -> dict[str, nn.Module]:
    stats = scale_layer(layer_name, layer, batches, cfg, uses, report, channel_scales,
                        spread_kv_heads=cfg.awq.fold_kv_heads)
    if scale_only:
        return {}
    done = {}
    for name in stats:
        linear = layer.get_submodule(name)
        codes, scales, zeros = awq_quantize_weight(linear.weight.data, stats[name].hessian, cfg)
        q = QuantLinear.from_quantized(linear, codes, scales, zeros, cfg.bits, cfg.group_size, cfg.symmetric)
        set_module(layer, name, q)
        done[name] = q
    return done


@torch.no_grad()
def quantize_model_awq(model: nn.Module, cfg: QuantConfig, calib: torch.Tensor, progress: bool = True,
                       scale_only: bool = False, report: list | None = None,
                       channel_scales: dict | None = None) -> dict[str, QuantLinear]:
    """AWQ every quantizable linear of ``model`` in place, layer by layer, from ``calib`` (n, L) ids.

    ``scale_only`` applies the (function-preserving) scaling and leaves the weights
    unquantized; ``report`` collects a :class:`FoldResult` per group;
    ``channel_scales`` is filled with ``{module: ChannelScales}`` for every rescaled
    linear (consumers: weight ``W·diag(s)``, input ``x / s``; linear producers: rows
    ÷ s); see :func:`spear.quant.fold.rescale_reference`.
    Linears outside the decoder layers get RTN.
    """
    from spear.quant.rtn import rtn_quantize_linear

    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    report = [] if report is None else report
    channel_scales = {} if channel_scales is None else channel_scales

    def process(layer_name, layer, batches):
        return _process_layer(layer_name, layer, batches, cfg, uses, report, scale_only, channel_scales)

    done, rest = run_layerwise(model, calib, cfg.calib.batch_size, process, f"AWQ W{cfg.bits}",
                               cfg.include_lm_head, progress)
    if not scale_only:
        for name in rest:
            log.info("AWQ: %s is outside the decoder layers; quantized with RTN", name)
            q = rtn_quantize_linear(model.get_submodule(name), cfg)
            set_module(model, name, q)
            done[name] = q
    skipped = [r for r in report if not r.applied]
    if skipped:
        log.warning("AWQ: %d of %d groups were not scaled (see the warnings above)", len(skipped), len(report))
    return done
