"""OmniQuant (Shao et al., ICLR 2024), weight-only: learnable weight clipping (LWC, §3.2) and the
learnable equivalent transformation (LET, §3.3, in :mod:`spear.quant.let`).

Each output row (and each group of a grouped layout) clips its range with two factors in (0, 1],
``γ = sigmoid(u)`` on the maximum and ``β = sigmoid(l)`` on the minimum:

    asymmetric:  h = (γ·max(W) − β·min(W)) / (2^b − 1),   z = round(−β·min(W) / h)
    symmetric:   h = max(γ·max(W), −β·min(W)) / (2^(b−1) − 1),   z = 2^(b−1)

(the range always holds 0, as :func:`spear.quant.primitives.compute_qparams` keeps it), and the
weight is fake-quantized as ``(clamp(round(W/h) + z, 0, 2^b − 1) − z)·h`` with the rounding's
gradient passed straight through (the scales rounded to the fp16 they are stored in, so the trained
function is the stored one). Only the logits u, l train (with LET, the channel scales too), one
decoder layer at a time (AdamW, MSE): the layer with fake-quantized linears takes the inputs the
already quantized layers before it produce, and is trained to give the output the FP layer gives
on those same inputs, the objective GPTQ and AWQ minimise per linear, here over the whole layer.
The paper's target is the FP layer on the FP model's own inputs, so that a layer also undoes the
error of the layers before it; with two factors per row and a CPU's budget of text that lowered the training
error and raised the perplexity (default model, W4 per channel, 2-core CPU, 2026-12-07: 35.1-37.5
against 34.5 at the same settings). A layer keeps its start when training does not lower its output
error on the calibration batches. Text: the calibration ids the other quantizers use (self-samples
of the FP model, data free). After training each linear is rounded with its learned clip into the
usual codes, scales and zero points, so the checkpoint, every kernel, tensor parallelism and the
vLLM op serve it as they serve RTN.

With LET (``OmniQuantConfig.let``; by default with groups only) the input channels of each group
of linears sharing an input are scaled as well, the inverse folded into the op producing that input
(OmniQuant's learnable equivalent transformation, §3.3; :mod:`spear.quant.let`), and trained with
the clip: the weights rounded are then the rescaled ones, recorded per linear as AWQ records them
(:func:`spear.quant.fold.rescale_reference`), so compensators are fitted against what was rounded.
Without it the weights rounded are the FP weights.

The factors start from ``OmniQuantConfig.init``: ``"search"`` takes each row's and group's best
ratio on AWQ's grid under the layer inputs' Hessian (:func:`spear.quant.awq.awq_search_clip`),
exactly (a full range where the search keeps it, whose factor then cannot move: at sigmoid(u) = 1
the logit's gradient vanishes), which a few epochs then refine, where the paper starts near the
full range (``"max"``: sigmoid(4) = 0.982) and trains for 20 epochs of 128 × 2048 tokens, too long
on a CPU.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.config import QuantConfig
from spear.errors import SpearError
from spear.models.modules import quantizable_linears, set_module
from spear.quant.calib import (LayerBatch, capture_layer_inputs, collect_input_stats, find_decoder_layers,
                               layer_forward, linear_groups)
from spear.quant.linear import QuantLinear
from spear.quant.primitives import n_groups, quantize

log = logging.getLogger(__name__)

# OmniQuant's own starting logit (init "max"): sigmoid(4) = 0.982.
MAX_INIT_LOGIT = 4.0
# The logit of a full range (a ratio of 1): sigmoid(20) rounds to 1.0 in float32.
FULL_RANGE_LOGIT = 20.0
# The smallest factor: a range clipped below 0.1% of itself holds nothing useful, and as sigmoid(u) -> 0 the
# scale underflows and the rounding's gradient becomes 0 · inf.
MIN_FACTOR = 1e-3


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` forward, the identity backward (straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out_f, in_f = w.shape
    g = n_groups(in_f, group_size)
    return w.reshape(out_f, g, in_f // g)


def lwc_qparams(w: torch.Tensor, up: torch.Tensor, low: torch.Tensor, bits: int, group_size: int,
                symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points (out, G), both float, of ``w`` (out, in) with its range's maximum
    scaled by ``up`` and its minimum by ``low`` (each (out, G) in (0, 1], or a float). Differentiable
    in ``up`` and ``low`` (the zero point's rounding straight through); with ``up = low = r`` the
    same as :func:`spear.quant.primitives.compute_qparams` with ``clip = r``."""
    wg = _grouped(w.float(), group_size)
    qmax = 2 ** bits - 1
    wmax = wg.amax(dim=-1).clamp(min=0) * up
    wmin = wg.amin(dim=-1).clamp(max=0) * low
    if symmetric:
        half = 2 ** (bits - 1)
        scales = torch.maximum(wmax, -wmin) / (half - 1)
        zeros = torch.full_like(scales, float(half))
    else:
        scales = (wmax - wmin) / qmax
        zeros = round_ste(-wmin / scales.clamp(min=torch.finfo(torch.float32).tiny)).clamp(0, qmax)
    # An all-zero group would give scale 0; any positive scale represents it exactly.
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return scales, zeros


def lwc_fake_quantize(w: torch.Tensor, up: torch.Tensor, low: torch.Tensor, bits: int, group_size: int,
                      symmetric: bool) -> torch.Tensor:
    """``w`` rounded to its clipped grid and back (float32), with straight-through gradients: what
    :func:`lwc_quantize_weight`'s codes, fp16 scales and zero points dequantize to."""
    scales, zeros = lwc_qparams(w, up, low, bits, group_size, symmetric)
    scales = scales + (scales.to(torch.float16).float() - scales).detach()  # the fp16 scales stored
    wg = _grouped(w.float(), group_size)
    s, z = scales.unsqueeze(-1), zeros.unsqueeze(-1)
    q = (round_ste(wg / s) + z).clamp(0, 2 ** bits - 1)
    return ((q - z) * s).reshape(w.shape)


@torch.no_grad()
def lwc_quantize_weight(w: torch.Tensor, up: torch.Tensor, low: torch.Tensor, bits: int, group_size: int,
                        symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 (out, in), scales fp16 (out, G), zeros uint8 (out, G))`` with the given clip, in the
    layout of :mod:`spear.quant.primitives`; the codes are rounded against the fp16 scales stored."""
    scales, zeros = lwc_qparams(w, up, low, bits, group_size, symmetric)
    scales = scales.to(torch.float16).float()
    zeros = zeros.to(torch.uint8)
    return quantize(w, scales, zeros, bits, group_size), scales.to(torch.float16), zeros


def logit(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p) - torch.log1p(-p)


class ClippedLinear(nn.Module):
    """A linear whose (frozen) weight is fake-quantized with learnable clipping: the training form of
    one layer's linear. ``up`` and ``low`` are the logits of the factors on the maximum and minimum."""

    def __init__(self, linear: nn.Linear, cfg: QuantConfig, start: torch.Tensor | float):
        super().__init__()
        self.linear = linear
        self.bits, self.group_size, self.symmetric = cfg.bits, cfg.group_size, cfg.symmetric
        g = n_groups(linear.in_features, cfg.group_size)
        w = linear.weight
        ratio = torch.as_tensor(start, dtype=torch.float32, device=w.device).expand(linear.out_features, g)
        # the start exactly: a full range (ratio 1) gets a logit whose sigmoid is 1.0 in float32
        u = torch.where(ratio >= 1, torch.full_like(ratio, FULL_RANGE_LOGIT), logit(ratio.clamp(1e-4, 1 - 1e-4)))
        self.up = nn.Parameter(u.clone())
        self.low = nn.Parameter(u.clone())

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(γ, β): the clip factors on the maximum and the minimum, (out, G), in [MIN_FACTOR, 1]."""
        return torch.sigmoid(self.up).clamp(min=MIN_FACTOR), torch.sigmoid(self.low).clamp(min=MIN_FACTOR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, low = self.factors()
        w = lwc_fake_quantize(self.linear.weight, up, low, self.bits, self.group_size, self.symmetric)
        bias = self.linear.bias
        return nn.functional.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @torch.no_grad()
    def to_quant_linear(self) -> QuantLinear:
        up, low = self.factors()
        codes, scales, zeros = lwc_quantize_weight(self.linear.weight, up, low, self.bits, self.group_size,
                                                   self.symmetric)
        return QuantLinear.from_quantized(self.linear, codes, scales, zeros, self.bits, self.group_size,
                                          self.symmetric)


@dataclass
class LayerReport:
    """One layer: its output MSE against the target over the training batches with the clip (and scales) it
    started from and with those it kept (``kept``: "trained", or "start" when training did not lower it),
    the kept clip factors' range, and LET's: how many groups were rescaled and the range of the learned
    factors on top of AWQ's start (1 where none)."""

    layer: str
    mse_start: float
    mse_end: float
    kept: str
    clip_min: float
    clip_max: float
    let_groups: int = 0
    let_start: str = ""
    let_min: float = 1.0
    let_max: float = 1.0


def _search_start(layer: nn.Module, batches: list[LayerBatch], names: list[str], cfg: QuantConfig,
                  stats: dict | None = None) -> dict:
    from spear.quant.awq import awq_search_clip

    if stats is None:
        stats = collect_input_stats(layer, batches, names, stop_after=False)
    return {n: awq_search_clip(layer.get_submodule(n).weight.data, stats[n].hessian, cfg) for n in names}


def block_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The layer's output error: the mean squared error."""
    return nn.functional.mse_loss(out.float(), target.float())


def _output_mse(layer: nn.Module, batches: list[LayerBatch], targets: list[torch.Tensor]
                ) -> tuple[list[torch.Tensor], float]:
    with torch.no_grad():
        outs = [layer_forward(layer, b) for b in batches]
    mse = sum(block_loss(o, t).item() for o, t in zip(outs, targets)) / len(outs)
    return outs, mse


def _install(layer: nn.Module, clipped: dict[str, ClippedLinear]) -> dict[str, QuantLinear]:
    done = {n: c.to_quant_linear() for n, c in clipped.items()}
    for n, q in done.items():
        set_module(layer, n, q)
    return done


def _train(layer_name: str, layer: nn.Module, clipped: dict[str, ClippedLinear], let_t: list[nn.Parameter],
           batches: list[LayerBatch], targets: list[torch.Tensor], opts, seed: int) -> None:
    """``opts.epochs`` passes of AdamW over ``batches`` on the clip logits and LET's log-factors ``let_t``
    (each at its own learning rate); every other parameter of the layer stays frozen."""
    clip = [p for c in clipped.values() for p in (c.up, c.low)]
    params = clip + let_t
    frozen = [p for p in layer.parameters() if p.requires_grad and not any(p is q for q in params)]
    for p in frozen:
        p.requires_grad_(False)
    groups = [{"params": clip, "lr": opts.lr}] + ([{"params": let_t, "lr": opts.let_lr}] if let_t else [])
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    try:
        with torch.enable_grad():
            for _ in range(opts.epochs):
                for i in torch.randperm(len(batches), generator=gen).tolist():
                    loss = block_loss(layer_forward(layer, batches[i]), targets[i])
                    if not torch.isfinite(loss):
                        raise SpearError(f"OmniQuant: the output error of {layer_name} is {loss.item()}; "
                                         "lower the learning rate (--omniquant-lr)")
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
    finally:
        for p in frozen:
            p.requires_grad_(True)


def _clip_start(layer: nn.Module, batches: list[LayerBatch], names: list[str], cfg: QuantConfig,
                stats: dict | None = None) -> dict:
    if cfg.omniquant.init == "search":
        return _search_start(layer, batches, names, cfg, stats)
    return dict.fromkeys(names, torch.sigmoid(torch.tensor(MAX_INIT_LOGIT)).item())


def _start_mse(layer: nn.Module, batches: list[LayerBatch], targets: list[torch.Tensor], start: dict,
               cfg: QuantConfig) -> float:
    """The layer's output error with each linear rounded at its start clip; the layer is left as it was."""
    wrapped = {n: ClippedLinear(layer.get_submodule(n), cfg, r) for n, r in start.items()}
    for n, c in wrapped.items():
        set_module(layer, n, c)
    try:
        return _output_mse(layer, batches, targets)[1]
    finally:
        for n, c in wrapped.items():
            set_module(layer, n, c.linear)


@torch.no_grad()
def _let_start(layer_name: str, layer: nn.Module, batches: list[LayerBatch], targets: list[torch.Tensor],
               names: list[str], cfg: QuantConfig, uses: Counter) -> tuple[list, dict, str]:
    """LET's groups, the clip start and which scales they start from: AWQ's searched scales folded in
    ("awq") when that start gives a lower output error than the unscaled weights with their own searched
    clip, else the unscaled weights, the groups then training from a scale of 1 ("one"; the layer left as
    it was). AWQ's scales minimise each linear's error without clipping, so the layer's own objective,
    with the clip, decides. (Per channel it still keeps AWQ's scales in 20 of 30 layers of the default
    model and ends at a higher perplexity than without LET, which is why LET is off there by default.)"""
    from spear.quant import let

    plain_clip = _clip_start(layer, batches, names, cfg)
    plain = _start_mse(layer, batches, targets, plain_clip, cfg)
    folded = let.fold_start(layer_name, layer, batches, cfg, uses)
    if not folded.groups:
        return [], plain_clip, "one"
    scaled_clip = _clip_start(layer, batches, names, cfg, folded.stats)
    if _start_mse(layer, batches, targets, scaled_clip, cfg) < plain:
        return folded.groups, scaled_clip, "awq"
    folded.undo()
    return folded.groups, plain_clip, "one"


def train_layer(layer_name: str, layer: nn.Module, q_batches: list[LayerBatch], targets: list[torch.Tensor],
                cfg: QuantConfig, seed: int = 0, uses: Counter | None = None, channel_scales: dict | None = None
                ) -> tuple[dict[str, QuantLinear], list[torch.Tensor], LayerReport]:
    """Learn the clipping of every linear of ``layer`` (and, where ``cfg.omniquant.let_on``, the scales of
    its input channels) so that, fed ``q_batches``, its output matches ``targets`` (one per batch); replace
    each linear by its :class:`QuantLinear` in place. Returns the QuantLinears, the quantized layer's
    outputs on ``q_batches`` and the report. The start is kept when training does not lower the output
    error on these batches (a few noisy straight-through steps can raise it), so a layer never ends worse
    than its start; with ``epochs`` 0 the start is rounded as it is. With LET the layer's producers (norm
    weights, v_proj/up_proj rows) are rescaled in place, the FP function unchanged; ``uses`` counts each
    parameter's uses in the whole model (by id; default: in ``layer``), so a shared one is never rescaled,
    and ``channel_scales`` collects how each linear was rescaled (see
    :func:`spear.quant.fold.rescale_reference`)."""
    from spear.quant import let

    opts = cfg.omniquant
    names = [n for g in linear_groups(layer, q_batches[0]) for n in g]
    if opts.let_on(cfg.group_size):
        if uses is None:
            uses = Counter(id(p) for _, p in layer.named_parameters(remove_duplicate=False))
        groups, start, let_start = _let_start(layer_name, layer, q_batches, targets, names, cfg, uses)
    else:
        groups, let_start = [], ""
        with torch.no_grad():
            start = _clip_start(layer, q_batches, names, cfg)
    clipped = {}
    for n in names:
        clipped[n] = ClippedLinear(layer.get_submodule(n), cfg, start[n])
        set_module(layer, n, clipped[n])
    # the modules whose weights LET rescales: the plain linear inside each wrapper, or the norm
    holders = {n: clipped[n].linear if n in clipped else layer.get_submodule(n)
               for g in groups for n in (*g.consumers, g.producer)}
    let.attach(groups, holders)
    kept, mse_start = "start", None
    if opts.epochs:
        _, mse_start = _output_mse(layer, q_batches, targets)
        start_logits = {n: (c.up.detach().clone(), c.low.detach().clone()) for n, c in clipped.items()}
        _train(layer_name, layer, clipped, [g.t for g in groups], q_batches, targets, opts, seed)
        kept = "trained"
    done = _install(layer, clipped)
    outs, mse_end = _output_mse(layer, q_batches, targets)
    if kept == "trained" and not mse_end <= mse_start:
        with torch.no_grad():
            for n, c in clipped.items():
                c.up.copy_(start_logits[n][0])
                c.low.copy_(start_logits[n][1])
        let.reset(groups)
        done = _install(layer, clipped)
        outs, mse_end = _output_mse(layer, q_batches, targets)
        kept = "start"
    let.bake(groups, holders, layer_name, {} if channel_scales is None else channel_scales)
    factors = [f for c in clipped.values() for f in c.factors()]
    learned = [torch.exp(g.t.detach()) for g in groups] or [torch.ones(1)]
    return done, outs, LayerReport(layer_name, mse_end if mse_start is None else mse_start, mse_end, kept,
                                   min(f.min().item() for f in factors), max(f.max().item() for f in factors),
                                   len(groups), let_start, min(f.min().item() for f in learned),
                                   max(f.max().item() for f in learned))


@torch.no_grad()
def quantize_model_omniquant(model: nn.Module, cfg: QuantConfig, calib: torch.Tensor, progress: bool = True,
                             report: list | None = None, channel_scales: dict | None = None) -> dict[str, QuantLinear]:
    """Quantize every quantizable linear of ``model`` in place with learned clipping (and, where
    ``cfg.omniquant.let_on``, learned input-channel scales), one decoder layer at a time, trained on the first
    ``cfg.omniquant.samples`` of ``calib`` (n, L) ids; ``report`` collects a :class:`LayerReport` per layer;
    ``channel_scales`` is filled with ``{module: ChannelScales}`` for every rescaled linear, as AWQ fills it
    (see :func:`spear.quant.fold.rescale_reference`). Linears outside the decoder layers (the head when
    included) get RTN."""
    from spear.quant.rtn import rtn_quantize_linear

    report = [] if report is None else report
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    ids = calib[: cfg.omniquant.samples]
    prefix, layers = find_decoder_layers(model)
    q_batches = capture_layer_inputs(model, layers[0], ids, cfg.calib.batch_size)
    done: dict[str, nn.Module] = {}
    bar = tqdm(layers, desc=f"OmniQuant W{cfg.bits}", unit="layer", disable=not progress, leave=False)
    for i, layer in enumerate(bar):
        layer_name = f"{prefix}.{i}" if prefix else str(i)
        targets = [layer_forward(layer, b) for b in q_batches]  # the FP layer on the quantized layer's inputs
        mods, outs, rep = train_layer(layer_name, layer, q_batches, targets, cfg, seed=cfg.calib.seed + i,
                                      uses=uses, channel_scales=channel_scales)
        report.append(rep)
        bar.set_postfix(mse=f"{rep.mse_end:.3g}")
        log.info("OmniQuant %s: output MSE %.4g (start) -> %.4g (%s), clip factors in [%.3f, %.3f], "
                 "LET on %d groups from scales %s, factors in [%.3f, %.3f]", layer_name, rep.mse_start, rep.mse_end,
                 rep.kept, rep.clip_min, rep.clip_max, rep.let_groups, rep.let_start or "-", rep.let_min, rep.let_max)
        for rel, mod in mods.items():
            done[f"{layer_name}.{rel}"] = mod
        q_batches = [LayerBatch(o, b.kwargs) for o, b in zip(outs, q_batches)]  # the next layer's inputs
    del q_batches, targets
    for name in quantizable_linears(model, cfg.include_lm_head):
        if name not in done:
            log.info("OmniQuant: %s is outside the decoder layers; quantized with RTN", name)
            q = rtn_quantize_linear(model.get_submodule(name), cfg)
            set_module(model, name, q)
            done[name] = q
    return done
