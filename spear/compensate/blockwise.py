"""Blockwise EC calibration: one decoder layer at a time, for models too large for end-to-end KL.

End-to-end KL (:mod:`spear.compensate.calibrate`) back-propagates through the whole
model and keeps the teacher's full distribution per token; a 7B-class model does not fit
that on one GPU with room to spare. Blockwise mode keeps one layer's activations:

1. the inputs of the first decoder layer are captured for the calibration ids
   (:func:`spear.quant.calib.capture_layer_inputs`);
2. for each layer l, its FP outputs Y_l are computed with the original weights
   (``fp_weights``; the layer's quantized linears run ``F.linear(x, W_fp)`` meanwhile);
3. the ECs of layer l train (AdamW, warm-up + cosine, clipping) to minimise the
   per-token relative error mean_t ‖layer_q(X_l)_t − Y_l,t‖² / ‖Y_l,t‖², where X_l are the
   outputs of the already calibrated quantized layers before it, so each layer also
   corrects the error it inherits. Per token, because a few tokens (the first, in Llama-
   like models) carry hidden states orders of magnitude larger than the rest, and a plain
   MSE would spend the whole EC on them;
4. X_{l+1} = layer_q(X_l) with the trained ECs, Y_l becomes the next FP input.

Held-out self-samples give each layer's validation error before and after; the state
with the lower validation error is kept (so a layer never ends worse than its closed-form
init). A non-finite loss raises :class:`CalibrationDiverged` naming the layer and step.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from spear.compensate.calib_config import CalibrationConfig
from spear.compensate.calibrate import CalibrationDiverged
from spear.errors import SpearError
from spear.quant.calib import LayerBatch, capture_layer_inputs, find_decoder_layers, layer_forward
from spear.quant.linear import QuantLinear


@dataclass
class BlockwiseReport:
    layers: list[dict] = field(default_factory=list)  # {"layer", "ecs", "val_before", "val_after", "steps"}
    seconds: float = 0.0


@contextlib.contextmanager
def _fp_weights(layer: nn.Module, prefix: str, fp_weights: dict[str, torch.Tensor]):
    """Inside: the layer's quantized linears compute with their original weights and no EC."""
    patched = []
    for name, mod in layer.named_modules():
        full = f"{prefix}.{name}" if name else prefix
        if isinstance(mod, QuantLinear) and full in fp_weights:
            w = fp_weights[full]

            def fwd(x, w=w, mod=mod):
                return F.linear(x, w.to(x.device, x.dtype), None if mod.bias is None else mod.bias.to(x.dtype))
            mod.forward = fwd
            patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            del mod.forward


def _token_rel_err(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ‖out_t − y_t‖² / ‖y_t‖²."""
    y = y.float()
    return ((out.float() - y).pow(2).sum(-1) / y.pow(2).sum(-1).clamp(min=1e-30)).mean()


def _rel_err(layer, batches: list[LayerBatch], targets: list[torch.Tensor]) -> float:
    with torch.no_grad():
        errs = [_token_rel_err(layer_forward(layer, b), y).item() for b, y in zip(batches, targets)]
    return sum(errs) / len(errs)


def calibrate_blockwise(model: nn.Module, train_ids: torch.Tensor, val_ids: torch.Tensor,
                        fp_weights: dict[str, torch.Tensor], cfg: CalibrationConfig,
                        steps_per_layer: int | None = None, progress: bool = True) -> BlockwiseReport:
    """Train the ECs already attached to ``model``'s quantized linears, layer by layer."""
    if cfg.tune_scales or cfg.tune_norms:
        raise SpearError("tune_scales and tune_norms need end-to-end KL calibration; blockwise calibration "
                         "trains the ECs only: pass tune_scales=False and tune_norms=False (got "
                         f"tune_scales={cfg.tune_scales}, tune_norms={cfg.tune_norms})")
    start = time.perf_counter()
    cfg = cfg.for_device(next(model.parameters()).device)
    steps = steps_per_layer or max(1, cfg.steps // 2)
    prefix, layers = find_decoder_layers(model)
    for p in model.parameters():
        p.requires_grad_(False)
    train = capture_layer_inputs(model, layers[0], train_ids, cfg.batch_size)
    val = capture_layer_inputs(model, layers[0], val_ids, cfg.batch_size)
    x_fp = [b.hidden for b in train]
    v_fp = [b.hidden for b in val]
    report = BlockwiseReport()
    gen = torch.Generator().manual_seed(cfg.seed)
    bar = tqdm(range(len(layers)), desc="blockwise calibration", unit="layer", disable=not progress, leave=False)
    for li in bar:
        layer = layers[li]
        lname = f"{prefix}.{li}"
        with torch.no_grad(), _fp_weights(layer, lname, fp_weights):
            y_fp = [layer_forward(layer, LayerBatch(h, b.kwargs)) for h, b in zip(x_fp, train)]
            vy_fp = [layer_forward(layer, LayerBatch(h, b.kwargs)) for h, b in zip(v_fp, val)]
        ecs = {n: m.compensator for n, m in layer.named_modules()
               if isinstance(m, QuantLinear) and m.compensator is not None}
        entry = {"layer": li, "ecs": len(ecs)}
        if ecs:
            entry["val_before"] = before = _rel_err(layer, val, vy_fp)
            best_state = {n: {k: t.clone() for k, t in e.state_dict().items()} for n, e in ecs.items()}
            _train_layer(layer, lname, ecs, train, y_fp, cfg, steps, gen)
            entry["val_after"] = after = _rel_err(layer, val, vy_fp)
            if not after <= before:  # keep the better of init and trained
                with torch.no_grad():
                    for n, e in ecs.items():
                        e.load_state_dict(best_state[n])
                entry["kept"] = "init"
            entry["steps"] = steps
            bar.set_postfix(layer=li, err=f"{before:.2e}->{min(before, after):.2e}")
        report.layers.append(entry)
        with torch.no_grad():  # the calibrated quantized layer feeds the next one
            for b in train + val:
                b.hidden = layer_forward(layer, b)
        x_fp, v_fp = y_fp, vy_fp
    bar.close()
    report.seconds = time.perf_counter() - start
    return report


def _train_layer(layer, lname, ecs, batches, targets, cfg: CalibrationConfig, steps: int, gen) -> None:
    params = {"low": [], "gate": [], "alpha": []}
    for ec in ecs.values():
        for name, p in ec.named_parameters():
            p.requires_grad_(True)
            params["alpha" if name == "alpha" else "low" if name in ("A", "B") else "gate"].append(p)
    groups = [{"params": params["low"], "lr": cfg.lr}, {"params": params["alpha"], "lr": cfg.alpha_lr}]
    if params["gate"]:
        groups.append({"params": params["gate"], "lr": cfg.gate_lr})
    opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    warm = max(1, int(cfg.warmup * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else
        0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    try:
        for step in range(1, steps + 1):
            i = int(torch.randint(len(batches), (1,), generator=gen))
            out = layer_forward(layer, batches[i])
            loss = _token_rel_err(out, targets[i])
            if not torch.isfinite(loss):
                raise CalibrationDiverged(f"blockwise calibration diverged in {lname} at step {step}: the loss is "
                                          "non-finite (try a lower --lr)")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], cfg.clip)
            opt.step()
            sched.step()
    finally:
        for ec in ecs.values():
            for p in ec.parameters():
                p.requires_grad_(False)
