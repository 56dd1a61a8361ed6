"""Data-free KL calibration of error compensators (SPEAR.md §1).

Only EC parameters train (A, B, α and the gate); the quantized base, embeddings and
norms stay frozen. The objective is KL(p_FP ‖ p_quantized+EC) over every position
of sequences the FP model sampled itself. Teacher log-probabilities are computed
once, before the model is quantized, and kept in fp16 (64 x 128 samples of the default
model take ~0.8 GB), or, with ``teacher_top_k = k``, only the teacher's k most likely
tokens per position plus the probability left over (:class:`TopKTeacher`: 6k + 4 bytes
per position instead of 2 x vocab), for many samples or large vocabularies. A held-out set
of self-samples gives the validation KL used for early stopping. The starting state (the
closed-form init) is a candidate like any evaluated step: the best one is restored at the end,
balanced and rounded to the compensators' fp16 storage, and evaluated again; if the rounded
state is worse than the start, the start is handed back, so calibration never returns a
model worse than it received (on the held-out self-samples). A non-finite loss stops the run
with an error naming the step and the first module whose parameters, gradients or outputs
went non-finite, so no checkpoint is written from it.

How much text and how many steps follow the device (``for_device``: a GPU affords four times the
CPU's, which recovers more of the gap). ``tune_scales`` (on by default; off, only the ECs
train, which measures their own contribution) also
trains the quantization scales of every quantized linear under the same loss: a
log-factor per stored scale, folded into the fp16 scales at the end
(:mod:`spear.compensate.scales`; no extra memory). With it, a model without ECs can
be calibrated too (scales only). ``tune_norms`` likewise trains the elementwise weights of
every RMSNorm/LayerNorm in place (norm tweaking; they are stored in the checkpoint anyway).
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

from spear.compensate.calib_config import TRAIN_DTYPES, CalibrationConfig
from spear.compensate.scales import NormWeights, ScaleFactors, tunable_norms, tunable_scales
from spear.compensate.teacher import TopKTeacher
from spear.errors import SpearError
from spear.quant.linear import QuantLinear


@dataclass
class CalibrationReport:
    steps_run: int
    best_step: int
    best_val_kl: float
    initial_val_kl: float
    seconds: float
    history: list[dict] = field(default_factory=list)  # {"step", "train_kl", "val_kl"?}
    kept: str = "trained"  # "init": no trained state (rounded to storage) beat the starting one


class CalibrationDiverged(SpearError):
    """The KL loss became NaN/inf."""


def kl_loss(student_logits: torch.Tensor, teacher_lp: torch.Tensor | TopKTeacher) -> torch.Tensor:
    """Mean over positions of KL(p_teacher ‖ p_student) (coarsened to the teacher's top k + rest
    for a :class:`TopKTeacher`)."""
    s = F.log_softmax(student_logits.float(), dim=-1)
    if isinstance(teacher_lp, TopKTeacher):
        t, idx, tail = teacher_lp.logp.float(), teacher_lp.idx.long(), teacher_lp.tail.float()
        kl = (t.exp() * (t - s.gather(-1, idx))).sum(-1)
        if idx.shape[-1] < s.shape[-1]:  # k = vocab leaves no other tokens (and no tail term)
            # log of the student's mass outside the teacher's top k: logsumexp over the other tokens
            s_rest = s.scatter(-1, idx, float("-inf")).logsumexp(-1)
            kl = kl + tail.exp() * (tail - s_rest)
        return kl.mean()
    t = teacher_lp.float()
    return (t.exp() * (t - s)).sum(-1).mean()


def ec_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m.compensator for n, m in model.named_modules()
            if isinstance(m, QuantLinear) and m.compensator is not None}


@torch.no_grad()
def val_kl(model: nn.Module, ids: torch.Tensor, teacher: torch.Tensor, batch_size: int, check: bool = True) -> float:
    """Mean KL to ``teacher`` on ``ids``; with ``check``, a SpearError naming the first non-finite module
    if it is not finite."""
    device = next(model.parameters()).device
    total, n = 0.0, 0
    for i in range(0, ids.shape[0], batch_size):
        logits = model(input_ids=ids[i:i + batch_size].to(device), use_cache=False).logits
        k = ids[i:i + batch_size].shape[0]
        kl = kl_loss(logits, teacher[i:i + batch_size].to(device)).item()
        if check and not math.isfinite(kl):
            from spear.eval.finite import first_nonfinite_module

            where = first_nonfinite_module(model, ids[i:i + batch_size])
            raise CalibrationDiverged(f"the validation KL of self-samples {i}-{i + k - 1} is {kl}"
                                      + (f"; the first non-finite output is {where}'s" if where else ""))
        total += kl * k
        n += k
    return total / n


def _param_groups(ecs: dict[str, nn.Module], cfg: CalibrationConfig,
                  scales: ScaleFactors | None = None, norms: NormWeights | None = None) -> list[dict]:
    low, gate, alpha = [], [], []
    for ec in ecs.values():
        for name, p in ec.named_parameters():
            (alpha if name == "alpha" else low if name in ("A", "B") else gate).append(p)
    groups = [{"params": low, "lr": cfg.lr}, {"params": alpha, "lr": cfg.alpha_lr, "weight_decay": 0.0}]
    if gate:
        groups.append({"params": gate, "lr": cfg.gate_lr})
    if scales is not None:
        groups.append({"params": scales.parameters(), "lr": cfg.scale_lr, "weight_decay": 0.0})
    if norms is not None:
        groups.append({"params": norms.parameters(), "lr": cfg.norm_lr, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def _diagnose(ecs: dict[str, nn.Module], step: int, *tuners, model: nn.Module | None = None,
              ids: torch.Tensor | None = None) -> CalibrationDiverged:
    named = [(f"{name}.{pname}", p) for name, ec in ecs.items() for pname, p in ec.named_parameters()]
    for tuner in tuners:
        if tuner is not None:
            named += list(tuner.named_parameters())
    for name, p in named:
        if not torch.isfinite(p).all():
            return CalibrationDiverged(f"calibration diverged at step {step}: {name} is non-finite")
        if p.grad is not None and not torch.isfinite(p.grad).all():
            return CalibrationDiverged(f"calibration diverged at step {step}: gradient of {name} is non-finite")
    where = None
    if model is not None and ids is not None:
        from spear.eval.finite import first_nonfinite_module

        where = first_nonfinite_module(model, ids)
    return CalibrationDiverged(f"calibration diverged at step {step}: the KL loss is non-finite "
                               + (f"(the first non-finite output is {where}'s; " if where else "(")
                               + "every trained parameter is finite; try a lower --lr)")


@torch.no_grad()
def _to_storage(ecs: dict[str, nn.Module]) -> None:
    """Balance each EC's factors and round its tensors to the storage dtype, as a checkpoint keeps them."""
    from spear.compensate.registry import stored_checked

    for name, ec in ecs.items():
        if hasattr(ec, "balance_"):
            ec.balance_()
        for tname, t in list(ec.named_parameters()) + list(ec.named_buffers()):
            if t.is_floating_point():
                t.copy_(stored_checked(t, t.dtype, f"{name}.{tname}"))


def train_ecs(model: nn.Module, train_ids: torch.Tensor, train_teacher: torch.Tensor, val_ids: torch.Tensor,
              val_teacher: torch.Tensor, cfg: CalibrationConfig, progress: bool = True) -> CalibrationReport:
    """Minimise the KL to the teacher over EC parameters (and, with ``cfg.tune_scales``, the
    quantization scales; with ``cfg.tune_norms``, the norm weights); restores the best validation state."""
    cfg = cfg.for_device(next(model.parameters()).device)
    ecs = ec_modules(model)
    if not ecs and not cfg.tune_scales and not cfg.tune_norms:
        raise SpearError("the model has no error compensators to calibrate")
    for p in model.parameters():
        p.requires_grad_(False)
    for ec in ecs.values():
        for p in ec.parameters():
            p.requires_grad_(True)
    # With tune_scales the factors fold into the scales on success; an exception leaves them as they were.
    # tune_norms: trained in place, restored on an exception.
    try:
        with tunable_scales(model) if cfg.tune_scales else contextlib.nullcontext() as scales, \
                tunable_norms(model) if cfg.tune_norms else contextlib.nullcontext() as norms:
            return _optimise(model, ecs, scales, train_ids, train_teacher, val_ids, val_teacher, cfg, progress,
                             norms)
    finally:
        for ec in ecs.values():
            for p in ec.parameters():
                p.requires_grad_(False)


def _optimise(model: nn.Module, ecs: dict[str, nn.Module], scales: ScaleFactors | None, train_ids: torch.Tensor,
              train_teacher: torch.Tensor, val_ids: torch.Tensor, val_teacher: torch.Tensor,
              cfg: CalibrationConfig, progress: bool, norms: NormWeights | None = None) -> CalibrationReport:
    """The optimisation loop of :func:`train_ecs`; leaves the best validation state loaded."""
    opt = torch.optim.AdamW(_param_groups(ecs, cfg, scales, norms), weight_decay=cfg.weight_decay)
    warm = max(1, int(cfg.warmup * cfg.steps))

    def schedule(step):  # linear warm-up, then cosine to 10%
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, cfg.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    def snapshot():
        return ({n: {k: v.detach().clone() for k, v in ec.state_dict().items()} for n, ec in ecs.items()},
                None if scales is None else scales.state(), None if norms is None else norms.state())

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    device = next(model.parameters()).device
    dtype = TRAIN_DTYPES[cfg.train_dtype]
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    gen = torch.Generator().manual_seed(cfg.seed)
    start = time.perf_counter()
    # unchecked: a start that is already non-finite fails at step 1, where the parameter is named
    initial = val_kl(model, val_ids, val_teacher, cfg.batch_size, check=False)
    best, best_step, bad = initial, 0, 0
    best_state = initial_state = snapshot()
    history = [{"step": 0, "val_kl": initial}]
    order = torch.empty(0, dtype=torch.long)
    running = None
    bar = tqdm(range(1, cfg.steps + 1), desc="KL calibration", unit="step", disable=not progress, leave=False)
    step = 0
    model.train(False)  # no dropout: the student must match a deterministic teacher
    for step in bar:
        if order.numel() < cfg.batch_size:
            order = torch.randperm(train_ids.shape[0], generator=gen)
        idx, order = order[: cfg.batch_size], order[cfg.batch_size:]
        with autocast:
            logits = model(input_ids=train_ids[idx].to(device), use_cache=False).logits
        loss = kl_loss(logits, train_teacher[idx].to(device))
        if not torch.isfinite(loss):
            raise _diagnose(ecs, step, scales, norms, model=model, ids=train_ids[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in opt.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        if not torch.isfinite(norm):
            raise _diagnose(ecs, step, scales, norms)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        entry = {"step": step, "train_kl": loss.item()}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            v = val_kl(model, val_ids, val_teacher, cfg.batch_size)
            entry["val_kl"] = v
            if v < best or not math.isfinite(best):  # a non-finite start is never kept
                best, best_step, bad = v, step, 0
                best_state = snapshot()
            else:
                bad += 1
            bar.set_postfix(kl=f"{running:.4f}", val=f"{v:.4f}")
            if bad >= cfg.patience:
                history.append(entry)
                break
        else:
            bar.set_postfix(kl=f"{running:.4f}")
        history.append(entry)
    bar.close()

    def load(state):
        state_ecs, state_scales, state_norms = state
        with torch.no_grad():
            for n, ec in ecs.items():
                ec.load_state_dict(state_ecs[n])
        if scales is not None:
            scales.load_state(state_scales)
        if norms is not None:
            norms.load_state(state_norms)

    kept = "init"
    # attach_ecs stored the start's A and B in fp16 (its gate, W2 = 0, is the identity at any precision);
    # a trained state is balanced and rounded now, as a checkpoint will hold it
    if best_step > 0:
        load(best_state)
        _to_storage(ecs)
        best = val_kl(model, val_ids, val_teacher, cfg.batch_size)
        if best <= initial or not math.isfinite(initial):
            kept = "trained"
        else:  # the rounding cost more than the training gained
            load(initial_state)
            best, best_step = initial, 0
    else:
        load(initial_state)
    return CalibrationReport(steps_run=step, best_step=best_step, best_val_kl=best, initial_val_kl=initial,
                             seconds=time.perf_counter() - start, history=history, kept=kept)
