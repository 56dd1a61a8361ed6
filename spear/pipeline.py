"""The whole default job (``spear run``): FP, the quantized base, static baselines,
and SPEAR's KL-calibrated error compensators (gated and/or ungated).

Every row is evaluated on the same text windows and, except LoftQ (which
re-quantizes by design), on the same quantized weights.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import torch

from spear.compensate.calib_config import CalibrationConfig
from spear.compensate.scales import NormWeights, norm_modules
from spear.compensate.spec import check_plan_ranks
from spear.compensate.workflow import attach_ecs, calibrate, prepare_calibration, uniform_plan
from spear.compensate.static import attach_static, needs_stats, remove_compensators
from spear.compensate.stats import collect_activation_stats
from spear.config import DEFAULT_BASELINES, DEFAULT_SPEAR_VARIANTS, EvalConfig, QuantConfig, StaticCompensationConfig
from spear.data import TokenSplit, load_text, make_split
from spear.eval.memory import compensator_bytes, quantized_model_bytes
from spear.eval.perplexity import perplexity
from spear.eval.report import Row, fill_gap
from spear.models.loading import load_model
from spear.models.modules import quantizable_linears
from spear.quant.api import Reference, quantize_for_compensation

STATIC_LABELS = {"identity": "ZeroQuant-V2 / LQER-plain", "loftq": "LoftQ", "lqer": "LQER (L²QER)",
                 "qera-approx": "QERA-approx", "qera-exact": "QERA-exact"}


@dataclass
class JobResult:
    rows: list[Row]
    header: dict


def load_split(tokenizer, cfg: EvalConfig) -> TokenSplit:
    return make_split(load_text(cfg.text), tokenizer, cfg.seq_len, cfg.eval_windows, cfg.calib_windows)


def _snapshot(modules):
    return {n: (m.codes.clone(), m.scales.clone(), m.zeros.clone()) for n, m in modules.items()}


def _restore(modules, snap):
    for n, m in modules.items():
        m.set_quantized(*snap[n])


class StepClock:
    """Wall and CPU seconds (every thread of the process) spent in each named step of a job."""

    def __init__(self):
        self.steps: dict[str, list[float]] = {}
        self.start = time.perf_counter(), time.process_time()

    @contextlib.contextmanager
    def __call__(self, name: str):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            t = self.steps.setdefault(name, [0.0, 0.0])
            t[0] += time.perf_counter() - wall
            t[1] += time.process_time() - cpu

    def summary(self) -> tuple[dict, str]:
        """``({step: {"wall": s, "cpu": s}}, one line)``, the total first."""
        wall, cpu = time.perf_counter() - self.start[0], time.process_time() - self.start[1]
        table = {"total": {"wall": wall, "cpu": cpu}, **{k: {"wall": w, "cpu": c} for k, (w, c) in self.steps.items()}}
        line = f"{wall:.0f} s ({cpu:.0f} s CPU): " + ", ".join(f"{k} {w:.0f} s" for k, (w, _) in self.steps.items())
        return table, line


def run_job(model_name: str, quant: QuantConfig, eval_cfg: EvalConfig,
            static_methods: tuple[str, ...] | list[str] = DEFAULT_BASELINES,
            rank: int | None = None, plan: dict[str, int] | None = None, progress: bool = True, log=print,
            spear_variants: tuple[str, ...] = DEFAULT_SPEAR_VARIANTS, calib_cfg: CalibrationConfig | None = None,
            budget: str = "1%", placement: str = "cka", damage_samples: int = 8, tp: int = 1,
            device: str = "cpu") -> JobResult:
    """Evaluate FP, the quantized base, each static method and each SPEAR variant
    (``"nogate"``: the low-rank EC KL-calibrated with γ ≡ 1, SPEAR's default;
    ``"gate"``: the token-gated EC) with the same modules and ranks, so every row has
    the same memory, with the model on ``device``. Modules and ranks: ``plan`` if given, else ``rank`` on
    every module, else the selection's placement within ``budget``. Left at their defaults (``calib_cfg``
    None: ``CalibrationConfig()``, which tunes the scales and norms too), the arguments give the job
    ``spear run`` runs with no options (``quant=QuantConfig()``, ``eval_cfg=EvalConfig()``), up to ``device``."""
    clock = StepClock()
    with clock("load"):
        model, tokenizer = load_model(model_name, device=device)
        split = load_split(tokenizer, eval_cfg)
    log(f"text: {split.describe()}")

    def ppl(desc):
        with clock("perplexity"):
            return perplexity(model, split.eval, eval_cfg.batch_size, progress, desc)

    fp = ppl("FP")
    log(f"FP ppl {fp.ppl:.3f} ({fp.tokens} tokens)")
    where = "plan" if plan is not None else f"r{rank}" if rank is not None else f"{placement}@{budget}"
    targets = quantizable_linears(model, quant.include_lm_head)
    if plan is not None or rank is not None:
        # a rank no module can hold fails here, before the statistics, self-samples and quantization
        check_plan_ranks(plan if plan is not None else dict.fromkeys(targets, rank or 0), targets)
    calib_data = None
    if spear_variants:
        # first: the sampling pass also yields the teacher, and the selection scores damage on these samples
        calib_cfg = (calib_cfg or CalibrationConfig()).for_model(model)
        with clock("self-samples + teacher"):
            calib_data = prepare_calibration(model, tokenizer, calib_cfg, quant.include_lm_head, progress=progress)
    selection = None
    if plan is None and rank is None:
        from spear.select.plan import select

        cfg0 = (calib_cfg or CalibrationConfig()).for_model(model)
        with clock("selection"):
            selection = select(model, tokenizer, quant, budget, placement, hidden=cfg0.hidden,
                               gated="gate" in spear_variants, per_rank=cfg0.gate_per_rank, tp=tp,
                               damage_samples=damage_samples, progress=progress, calib=cfg0,
                               ids=None if calib_data is None else calib_data.sample_ids[:damage_samples])
        plan = selection.plan
        log(f"selection: {len(plan)} modules, {selection.allocation.bytes / 2**20:.2f} MiB "
            f"({100 * selection.allocation.bytes / selection.model_bytes:.2f}% of the quantized model)"
            + (f", damage from {selection.damage.tokens} tokens in {selection.damage.seconds:.0f} s"
               if selection.damage else ""))
    ref = Reference({n: lin.weight.detach().clone() for n, lin in targets.items()})
    if any(needs_stats(m) for m in static_methods):
        if split.calib.shape[0] == 0:
            raise ValueError("static methods with activation statistics need --calib-windows >= 1")
        with clock("text statistics"):
            ref.stats = collect_activation_stats(model, targets, split.calib, outer="qera-exact" in static_methods,
                                                 progress=progress)
    with clock("quantization"):
        modules = quantize_for_compensation(model, quant, [ref] + ([calib_data] if calib_data else []),
                                            calib=split.calib if quant.calib.source == "text" else None,
                                            progress=progress, tokenizer=tokenizer)
    fp_weights, stats = ref.fp_weights, ref.stats
    base = ppl(quant.label)
    log(f"{quant.label} ppl {base.ppl:.3f}")
    total = quantized_model_bytes(model)
    rows = [Row("FP", fp.ppl, details={"tokens": fp.tokens}), Row(quant.label, base.ppl)]
    snap = _snapshot(modules)
    norms = NormWeights(norm_modules(model))
    norm_snap = norms.state()
    for method in static_methods:
        cfg = StaticCompensationConfig(method=method, rank=rank or 0, plan=plan)
        with clock("static baselines"):
            applied = attach_static(modules, fp_weights, cfg, stats, progress=progress)
        extra = compensator_bytes(model)
        label = f"{STATIC_LABELS[method]} {where}"
        res = ppl(label)
        log(f"{label} ppl {res.ppl:.3f}, +{100 * extra / total:.2f}% memory")
        rows.append(Row(label, res.ppl, 100.0 * extra / total, extra,
                        details={"method": method, "modules": len(applied), "placement": where}))
        remove_compensators(model)
        if method == "loftq":
            _restore(modules, snap)
    ec_plan = plan if plan is not None else uniform_plan(modules, rank)
    for variant in spear_variants:
        cfg = replace(calib_cfg, gated=variant == "gate")
        with clock("KL calibration"):
            applied = attach_ecs(modules, calib_data.fp_weights, ec_plan, cfg, calib_data.stats)
            report = calibrate(model, calib_data, cfg, progress=progress)
        extra = compensator_bytes(model)
        label = ("SPEAR gated EC" if cfg.gated else "SPEAR EC (KL, no gate)") + f" {where}" + \
            (" + tuned scales" if cfg.tune_scales else "") + (" + tuned norms" if cfg.tune_norms else "")
        res = ppl(label)
        log(f"{label} ppl {res.ppl:.3f}, +{100 * extra / total:.2f}% memory, val KL "
            f"{report.initial_val_kl:.4f} (start) -> {report.best_val_kl:.4f}"
            + (" (the start is kept)" if report.kept == "init" else f" (step {report.best_step})")
            + f" in {report.seconds:.0f} s")
        rows.append(Row(label, res.ppl, 100.0 * extra / total, extra,
                        details={"variant": variant, "modules": len(applied), "val_kl": report.best_val_kl,
                                 "initial_val_kl": report.initial_val_kl, "kept": report.kept,
                                 "calibration_seconds": report.seconds, "steps": report.steps_run,
                                 "seed": cfg.seed, "tune_scales": cfg.tune_scales,
                                 "tune_norms": cfg.tune_norms}))
        remove_compensators(model)
        if cfg.tune_scales:  # the next variant starts from the same quantized weights
            _restore(modules, snap)
        if cfg.tune_norms:
            norms.load_state(norm_snap)
    fill_gap(rows, fp.ppl, base.ppl)
    header = {"placement": where, "model": model_name, "text": split.text_name, "text_split": split.describe(),
              "quant": quant.label, "seq_len": split.seq_len,
              "eval_windows": split.eval.shape[0], "tokens_scored": fp.tokens,
              "calib_windows": split.calib.shape[0], "quantized_model_bytes": total,
              "modules": len(modules), "device": str(device), "torch": torch.__version__}
    if spear_variants:
        teacher = f"top-{calib_cfg.teacher_top_k} teacher" if calib_cfg.teacher_top_k else "full teacher"
        header["calibration"] = (f"{calib_cfg.n_samples}+{calib_cfg.val_samples} self-samples x "
                                 f"{calib_cfg.sample_len} tokens, {teacher}, {calib_cfg.steps} steps, "
                                 f"seed {calib_cfg.seed}")
    header["step_seconds"], header["time"] = clock.summary()
    return JobResult(rows, header)
