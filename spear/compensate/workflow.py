"""End-to-end SPEAR calibration: self-samples → teacher → EC init → KL training.

    data = prepare_calibration(fp_model, tokenizer, cfg)      # before quantizing
    modules = quantize_model(fp_model, quant_cfg)               # in place
    attach_ecs(modules, data.fp_weights, plan, cfg, data.stats)
    report = calibrate(fp_model, data, cfg)

Everything the FP model must provide (samples, teacher log-probs, activation
statistics for the closed-form init, the original weights) is gathered first, so
the FP and quantized models never need to be in memory together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spear.compensate.calib_config import CalibrationConfig, model_vocab
from spear.compensate.calibrate import CalibrationReport, ec_modules, train_ecs
from spear.compensate.ec import GatedCompensator
from spear.compensate.registry import stored_checked
from spear.compensate.spec import check_plan_ranks, warn_off_kernel
from spear.compensate.stats import ActivationStats, collect_activation_stats
from spear.compensate.svd_init import ScalingCache, error_factors
from spear.compensate.teacher import TopKTeacher, sample_with_teacher, teacher_logprobs
from spear.data.selfsample import sample_sequences
from spear.models.modules import quantizable_linears
from spear.quant.linear import QuantLinear



@dataclass
class CalibrationData:
    train_ids: torch.Tensor
    val_ids: torch.Tensor
    train_teacher: torch.Tensor | TopKTeacher | None  # None when prepared for blockwise calibration
    val_teacher: torch.Tensor | TopKTeacher | None
    stats: dict[str, ActivationStats]
    fp_weights: dict[str, torch.Tensor]

    @property
    def sample_ids(self) -> torch.Tensor:
        """Every self-sample in sampling order (the training ones, then the validation ones): the
        sequences :func:`spear.select.plan.damage_ids` would draw for the same settings."""
        return torch.cat([self.train_ids, self.val_ids])


def prepare_calibration(model: nn.Module, tokenizer, cfg: CalibrationConfig, include_lm_head: bool = False,
                        progress: bool = True, teacher: bool = True) -> CalibrationData:
    """Everything calibration needs from the FP model (call before quantizing it).
    ``teacher=False`` skips the teacher log-probabilities (blockwise mode needs none). Settings that
    follow the model (``teacher_top_k=None``) are resolved with :meth:`CalibrationConfig.for_model`.

    A top-k teacher comes out of the sampling pass (or the cache beside the self-samples:
    :func:`spear.compensate.teacher.sample_with_teacher`); the full one from a forward pass. The
    validation self-samples get the full distribution whenever it fits ``full_teacher_max_bytes``,
    so early stopping and the state kept are judged on the real KL, not a top-k bound of it."""
    cfg = cfg.for_model(model)
    n = cfg.n_samples + cfg.val_samples
    sampling = cfg.self_samples(n, cfg.sample_len)
    lp = None
    if teacher and cfg.teacher_top_k:
        ids, lp = sample_with_teacher(model, tokenizer, sampling, cfg.teacher_top_k, progress=progress)
    else:
        ids = sample_sequences(model, tokenizer, sampling, progress=progress)
    # A held-out tail of the same sampling run: validation never sees training sequences.
    train_ids, val_ids = ids[: cfg.n_samples], ids[cfg.n_samples:]
    targets = quantizable_linears(model, include_lm_head)
    stats = collect_activation_stats(model, targets, train_ids[: cfg.stats_samples], outer=cfg.init == "qera-exact",
                                     progress=progress)
    val_lp = None
    if teacher:
        if lp is None:
            lp = teacher_logprobs(model, ids, batch_size=cfg.batch_size * 2, progress=progress)
        val_lp = lp[cfg.n_samples:]
        if cfg.teacher_top_k and 2 * val_ids.numel() * model_vocab(model) <= cfg.full_teacher_max_bytes:
            val_lp = teacher_logprobs(model, val_ids, batch_size=cfg.batch_size * 2, progress=progress)
    return CalibrationData(train_ids, val_ids, None if lp is None else lp[: cfg.n_samples], val_lp, stats,
                           {n: lin.weight.detach().clone() for n, lin in targets.items()})


@torch.no_grad()
def attach_ecs(modules: dict[str, QuantLinear], fp_weights: dict[str, torch.Tensor], plan: dict[str, int],
               cfg: CalibrationConfig, stats: dict[str, ActivationStats] | None) -> dict[str, int]:
    """Attach a :class:`GatedCompensator` (gated or not per ``cfg``) to every module with a planned rank.
    A rank above a module's min(in_features, out_features) raises a SpearError (the selection's plans
    never hold one: they are capped there)."""
    check_plan_ranks(plan, modules)  # before any module changes
    applied = {}
    scale = ScalingCache(cfg.init, stats)
    for i, (name, mod) in enumerate(modules.items()):
        rank = plan.get(name, 0)
        if rank == 0:
            mod.compensator = None
            continue
        a, b = error_factors(fp_weights[name], mod, rank, scale(name), name)
        dt = mod.compute_dtype
        a = stored_checked(a, dt, f"{name}: {cfg.init} factor A")
        b = stored_checked(b, dt, f"{name}: {cfg.init} factor B")
        mod.compensator = GatedCompensator(a, b, hidden=cfg.hidden,
                                           gated=cfg.gated, bound=cfg.bound, seed=cfg.seed * 7919 + i,
                                           per_rank=cfg.gate_per_rank).to(mod.codes.device)
        warn_off_kernel(name, mod.compensator)
        applied[name] = rank
    return applied


@torch.no_grad()
def set_gate_scales(model: nn.Module, ids: torch.Tensor) -> None:
    """Measure the RMS of u = A·x per rank on ``ids`` and normalise each gate's input by it."""
    ecs = {n: e for n, e in ec_modules(model).items() if getattr(e, "gated", False)}
    if not ecs:
        return
    sums = {n: torch.zeros(e.rank, dtype=torch.float64) for n, e in ecs.items()}
    counts = dict.fromkeys(ecs, 0)

    def hook(name):
        def fn(mod, args):
            u = nn.functional.linear(args[0].detach(), mod.A).reshape(-1, mod.rank).double()
            sums[name] += (u * u).sum(0).cpu()
            counts[name] += u.shape[0]
        return fn

    handles = [e.register_forward_pre_hook(hook(n)) for n, e in ecs.items()]
    device = next(model.parameters()).device
    try:
        for i in range(ids.shape[0]):
            model(input_ids=ids[i:i + 1].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    for n, e in ecs.items():
        e.set_input_scale((sums[n] / max(counts[n], 1)).sqrt())


def calibrate(model: nn.Module, data: CalibrationData, cfg: CalibrationConfig, progress: bool = True
              ) -> CalibrationReport:
    """Normalise the gates' inputs, then KL-train the attached ECs."""
    if data.train_teacher is None:
        raise ValueError("end-to-end calibration needs teacher log-probabilities: prepare_calibration(teacher=True)")
    set_gate_scales(model, data.train_ids[: min(8, data.train_ids.shape[0])])
    return train_ecs(model, data.train_ids, data.train_teacher, data.val_ids, data.val_teacher, cfg, progress)


def calibrate_layerwise(model: nn.Module, data: CalibrationData, cfg: CalibrationConfig,
                        steps_per_layer: int | None = None, progress: bool = True):
    """Normalise the gates' inputs, then train the ECs one decoder layer at a time
    (:mod:`spear.compensate.blockwise`; for models too large for end-to-end KL)."""
    from spear.compensate.blockwise import calibrate_blockwise

    set_gate_scales(model, data.train_ids[: min(8, data.train_ids.shape[0])])
    return calibrate_blockwise(model, data.train_ids, data.val_ids, data.fp_weights, cfg, steps_per_layer, progress)


def uniform_plan(modules, rank: int) -> dict[str, int]:
    return dict.fromkeys(modules, rank)
