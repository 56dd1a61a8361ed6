"""Static low-rank error compensation of a quantized model (the baselines SPEAR beats).

identity (ZeroQuant-V2 LoRC / LQER-plain), LoftQ (alternating re-quantization and
SVD; note it changes the quantized codes, unlike the others), LQER (L²QER),
QERA-approx and QERA-exact. All share :func:`spear.compensate.svd_init.low_rank_factors`.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from spear.compensate.lowrank import LowRankCompensator
from spear.compensate.registry import stored_checked
from spear.compensate.spec import check_plan_ranks, warn_off_kernel
from spear.compensate.stats import ActivationStats
from spear.compensate.svd_init import ScalingCache, error_factors, low_rank_factors
from spear.errors import SpearError
from spear.config import StaticCompensationConfig
from spear.quant.linear import QuantLinear
from spear.quant.primitives import compute_qparams, quantize


@torch.no_grad()
def loftq(weight: torch.Tensor, module: QuantLinear, rank: int, iters: int):
    """LoftQ: Q_t = quant(W - B A), (A, B) = SVD_r(W - Q_t). Returns (codes, scales, zeros, A, B)."""
    w = weight.double()
    lowrank = torch.zeros_like(w)
    for _ in range(iters):
        target = (w - lowrank).float()
        scales, zeros = compute_qparams(target, module.bits, module.group_size, module.symmetric)
        scales = scales.to(torch.float16).float()
        codes = quantize(target, scales, zeros, module.bits, module.group_size)
        module.set_quantized(codes, scales, zeros)
        a, b = low_rank_factors(w - module.dequantized_weight(torch.float64), rank)
        lowrank = b @ a
    return a, b


@torch.no_grad()
def attach_static(modules: dict[str, QuantLinear], fp_weights: dict[str, torch.Tensor],
                  cfg: StaticCompensationConfig, stats: dict[str, ActivationStats] | None = None,
                  progress: bool = True) -> dict[str, int]:
    """Attach a static compensator to each module with a nonzero planned rank.

    ``fp_weights`` holds each module's original weight. Returns the applied plan. A rank above a
    module's min(in_features, out_features) raises a SpearError.
    """
    check_plan_ranks({name: cfg.rank_for(name) for name in modules}, modules)  # before any module changes
    applied = {}
    scale = None if cfg.method == "loftq" else ScalingCache(cfg.method, stats)
    for name, mod in tqdm(modules.items(), desc=f"static {cfg.method}", unit="mod", disable=not progress, leave=False):
        rank = cfg.rank_for(name)
        if rank == 0:
            mod.compensator = None
            continue
        w = fp_weights[name]
        if cfg.method == "loftq":
            try:
                a, b = loftq(w, mod, rank, cfg.loftq_iters)
            except FloatingPointError as exc:
                raise SpearError(f"{name}: {exc} (LoftQ)") from exc
        else:
            a, b = error_factors(w, mod, rank, scale(name), name)
        dtype = mod.compute_dtype
        mod.compensator = LowRankCompensator(stored_checked(a, dtype, f"{name}: {cfg.method} factor A"),
                                             stored_checked(b, dtype, f"{name}: {cfg.method} factor B")
                                             ).to(mod.codes.device)
        warn_off_kernel(name, mod.compensator)
        applied[name] = rank
    return applied


def needs_stats(method: str) -> bool:
    return method in ("lqer", "qera-approx", "qera-exact")


def remove_compensators(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.compensator = None
